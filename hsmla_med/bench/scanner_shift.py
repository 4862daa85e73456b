"""Which part of the "other scanner" costs a network its Dice.

The learning benchmark's perturbed copy of the held-out MNI slab changes four things at once
(``hsmla_med.data.mni.perturb``): orientation and voxel size (LIA, 1.2 x 1.2 x 1.5 mm), a bias
field and Rician noise. This benchmark writes the held-out slab with the geometry change alone, with
the bias field or the noise added, and with both (the benchmark's copy), segments each with
``hsmla-med infer`` for every checkpoint given, and scores them as the learning benchmark does
(``hsmla_med.bench.learning.scores``: Dice, HD95, NSD in the labels' geometry). Writes
``scanner_shift.csv`` into ``--out``.

    hsmla-med bench --only scanner-shift --data-dir /tmp/mni --out /tmp/shift \\
        --checkpoint hsmla=/tmp/bl/hsmla-b0-unet/seed0/train/last.ckpt --checkpoint unet=/tmp/bl/unet/seed0/train/last.ckpt
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import nibabel as nib

from hsmla_med.bench.common import markdown, out_folder, own_parser, write_csv
from hsmla_med.bench.learning import scores
from hsmla_med.data.mni import PERTURBED, perturb, save_nifti, write_mni_dataset

# variant -> (bias amplitude, noise fraction) given to perturb(); the geometry changes in all
VARIANTS = {"geometry": (0.0, 0.0), "bias": (PERTURBED["bias"], 0.0), "noise": (0.0, PERTURBED["noise"]),
            "all": (PERTURBED["bias"], PERTURBED["noise"])}


def write_variants(data: Path, out: Path) -> list[dict]:
    """The held-out case, as stored and in each variant, under ``out`` (MSD-like entries)."""
    meta = json.loads((data / "dataset.json").read_text())
    held = meta["validation"][0]
    image, label = nib.load(str(data / held["image"])), nib.load(str(data / held["label"]))
    entries = [{"name": "clean", "image": str((data / held["image"]).resolve()), "label": str((data / held["label"]).resolve())}]
    for name, (bias, noise) in VARIANTS.items():
        img, lab = perturb(image, label, bias=bias, noise=noise)
        entry = {"name": name, "image": str(out / "images" / f"{name}.nii.gz"), "label": str(out / "labels" / f"{name}.nii.gz")}
        save_nifti(img, Path(entry["image"]))
        save_nifti(lab, Path(entry["label"]))
        entries.append(entry)
    return entries


def _checkpoint(text: str) -> tuple[str, str]:
    """argparse type: ``NAME=PATH`` of an existing checkpoint file."""
    name, sep, path = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"not NAME=PATH: {text!r}")
    if not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"{path}: no such checkpoint file")
    return name, path


def main(argv: list[str]) -> int:
    parser = own_parser("scanner-shift", __doc__)
    parser.add_argument("--data-dir", type=Path, required=True, help="the learning benchmark's MNI dataset (written if absent)")
    parser.add_argument("--out", type=out_folder, required=True, help="folder for the variants, the predictions and scanner_shift.csv")
    parser.add_argument("--checkpoint", type=_checkpoint, action="append", required=True, metavar="NAME=PATH",
                        help="a checkpoint to score, under NAME (repeat the option for more)")
    args = parser.parse_args(argv)
    data = write_mni_dataset(args.data_dir)
    entries = write_variants(data, args.out)
    rows = []
    for name, checkpoint in args.checkpoint:
        for entry in entries:
            inputs = args.out / "inputs" / entry["name"]
            inputs.mkdir(parents=True, exist_ok=True)
            link = inputs / Path(entry["image"]).name
            if not link.exists():
                link.symlink_to(entry["image"])
            predictions = args.out / "predictions" / name / entry["name"]
            subprocess.run([sys.executable, "-m", "hsmla_med.cli", "infer", "--checkpoint", checkpoint, "--input", str(inputs),
                            "--output", str(predictions), "--device", "cpu"], check=True, capture_output=True)
            summary = scores(Path("/"), [entry], predictions)  # (the entries hold absolute paths)
            rows.append({"network": name, "variant": entry["name"], "dice": round(summary["dice"], 4),
                         "hd95": round(summary["hd95"], 2), "nsd": round(summary["nsd"], 4)})
            print(f"{name} {entry['name']}: Dice {rows[-1]['dice']:.3f}, HD95 {rows[-1]['hd95']:.2f}", flush=True)
    write_csv(args.out / "scanner_shift.csv", rows)
    print("\n" + markdown(rows))
    return 0
