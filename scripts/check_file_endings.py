"""The same real MRI as an nnU-Net v2 dataset in NIfTI and in MetaImage (``file_ending`` ``.mha``),
each trained, predicted and scored through the command line with the same seed: the two runs must
give the same scores and the same label map, the ``.mha`` one on its input's own grid.

The MNI152 grey/white-matter slabs of the learning benchmark (:func:`hsmla_med.data.mni.write_mni_dataset`):
five slabs in ``imagesTr``/``labelsTr`` (no lists: nnU-Net's layout, the plan and split derived
from the data), slab 3 held out.

    python scripts/check_file_endings.py --out /tmp/file-endings [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import SimpleITK as sitk

from hsmla_med.data.mni import write_mni_dataset

HELD_OUT = 3
LABELS = {"background": 0, "grey_matter": 1, "white_matter": 2}


def _write(img: nib.Nifti1Image, path: Path) -> None:
    """``img`` as NIfTI, or as MetaImage with its RAS affine turned into ITK's LPS geometry."""
    if path.name.endswith(".nii.gz"):
        nib.save(img, str(path))
        return
    lps = np.diag([-1.0, -1.0, 1.0]) @ img.affine[:3, :]
    spacing = np.linalg.norm(lps[:, :3], axis=0)
    image = sitk.GetImageFromArray(np.ascontiguousarray(np.asarray(img.dataobj).transpose(2, 1, 0)))
    image.SetSpacing(spacing.tolist())
    image.SetDirection((lps[:, :3] / spacing).ravel().tolist())
    image.SetOrigin(lps[:, 3].tolist())
    sitk.WriteImage(image, str(path), useCompression=True)


def write_dataset(source: Path, root: Path, ending: str) -> Path:
    """The slabs of ``source`` as an nnU-Net v2 dataset in ``ending`` under ``root``."""
    for folder in ("imagesTr", "labelsTr", "heldout", "heldout_labels"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    for path in sorted((source / "imagesTr").glob("slab*.nii.gz")):
        name = path.name.removesuffix(".nii.gz")
        images, labels = ("heldout", "heldout_labels") if name == f"slab{HELD_OUT}" else ("imagesTr", "labelsTr")
        _write(nib.load(str(path)), root / images / f"{name}_0000{ending}")
        _write(nib.load(str(source / "labelsTr" / path.name)), root / labels / f"{name}{ending}")
    cases = len(list((root / "labelsTr").iterdir()))
    (root / "dataset.json").write_text(json.dumps({"channel_names": {"0": "T1"}, "labels": LABELS, "numTraining": cases, "file_ending": ending}))
    return root


def _cli(*args) -> None:
    subprocess.run([sys.executable, "-m", "hsmla_med.cli", *map(str, args)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    source = write_mni_dataset(None, 24)
    scores, labels = {}, {}
    for ending in (".nii.gz", ".mha"):
        key = ending.strip(".").replace(".", "_")
        data = write_dataset(source, args.out / "data" / key, ending)
        run, pred, evaluation = (args.out / part / key for part in ("runs", "pred", "eval"))
        _cli("train", "--task", "btcv", "--data-dir", data, "--max-steps", args.steps, "--seed", 0, "--output", run)
        _cli("infer", "--checkpoint", run / "last.ckpt", "--input", data / "heldout", "--output", pred, "--overwrite")
        _cli("evaluate", "--task", "btcv", "--predictions", pred, "--labels", data / "heldout_labels", "--dataset-json", data / "dataset.json",
             "--output", evaluation)
        scores[ending] = json.loads((evaluation / "summary.json").read_text())["foreground_mean"]
        labels[ending] = sitk.GetArrayFromImage(sitk.ReadImage(str(pred / f"slab{HELD_OUT}{'.nii.gz' if ending == '.nii.gz' else '.mha'}")))
    source_grid = sitk.ReadImage(str(args.out / "data" / "mha" / "heldout" / f"slab{HELD_OUT}_0000.mha"))
    written = sitk.ReadImage(str(args.out / "pred" / "mha" / f"slab{HELD_OUT}.mha"))
    same_grid = all(getattr(written, g)() == getattr(source_grid, g)() for g in ("GetOrigin", "GetSpacing", "GetDirection", "GetSize"))
    for ending, score in scores.items():
        print(f"{ending:8s} Dice {score['Dice']:.4f}  HD95 {score['HD95']:.3f} mm  NSD {score['NSD']:.4f}")
    print(f"label maps equal in {np.mean(labels['.nii.gz'] == labels['.mha']):.6f} of voxels; the .mha on its input's grid: {same_grid}")


if __name__ == "__main__":
    main()
