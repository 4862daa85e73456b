"""Render docs/seg_overlay.png: a DICOM SEG drawn over the CT series it references, by our own
overlay code (:func:`hsmla_med.io.overlays.label_overlay`), from synthetic data only.

The synthetic BTCV generator makes one training phantom (image and label map); the image is
written as a CT DICOM series (one file per slice, :mod:`hsmla_med.data.synthetic.dicom_series`)
and its label map as a DICOM SEG referencing that series (:func:`hsmla_med.io.dicom_seg.write_seg`);
the picture is then drawn from what a viewer would load: the series' pixels as pydicom decodes
them and the SEG read back through highdicom (:func:`~hsmla_med.io.dicom_seg.read_seg`), on the
axial slice showing the most organs.

Usage: .venv/bin/python scripts/render_seg_overlay.py [--output docs/seg_overlay.png]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom

from hsmla_med.data.synthetic.btcv import generate_btcv
from hsmla_med.data.synthetic.dicom_series import write_ct_series
from hsmla_med.io.dicom import find_series, read_series
from hsmla_med.io.dicom_seg import read_seg, write_seg
from hsmla_med.io.overlays import label_overlay

WINDOW = (-175.0, 250.0)  # HU: the abdominal window of BTCV's preprocessing


def _radiological(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """A NIfTI volume as an (x, y, z) array whose x runs to the patient's left and y to the
    back (DICOM's LPS axes), with that grid's RAS affine: written as a series, its frames show
    the patient as radiologists view an axial slice (anterior up, the patient's right on the left)."""
    img = nib.as_closest_canonical(nib.load(str(path)))  # RAS: x to the right, y to the front
    data = np.asarray(img.dataobj)[::-1, ::-1, :]
    spacing = img.header.get_zooms()[:3]
    return data, np.diag([-spacing[0], -spacing[1], spacing[2], 1.0])


def render(output: Path, work: Path) -> Path:
    meta = json.loads(generate_btcv(work / "btcv", 1, 0, 1, seed=0).read_text())
    names = [meta["labels"][str(i)] for i in range(len(meta["labels"]))]
    case = meta["training"][0]
    image, affine = _radiological(work / "btcv" / case["image"])
    labels, _ = _radiological(work / "btcv" / case["label"])
    write_ct_series(work / "series", image.astype(np.int16), affine, np.random.default_rng(0), "SYNTH01", "synthetic CT abdomen")
    (series,) = find_series(work / "series")
    volume, _ = read_series(series)
    assert np.array_equal(volume, image), "the series does not read back as the phantom's grid"
    model = {"sha256": "none (the phantom's ground truth, not a model's prediction)"}
    seg = write_seg(labels.astype(np.uint8), series.files, names, work / "case.seg.dcm", model)
    back = read_seg(seg, series.files, names)
    assert np.array_equal(back, labels), "the SEG does not read back as the label map"

    z = int(np.argmax([len(np.unique(back[:, :, k])) for k in range(back.shape[2])]))
    source = pydicom.dcmread(series.files[z])
    hu = source.pixel_array * float(source.RescaleSlope) + float(source.RescaleIntercept)
    frame = back[:, :, z].T  # (x, y) -> rows x columns, as the SEG frame and the DICOM slice are
    title = f"DICOM SEG over its CT series (synthetic), slice {z + 1}/{back.shape[2]}"
    return label_overlay(output, np.clip(hu, *WINDOW), frame, names, title=title, alpha=0.45)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("docs/seg_overlay.png"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        path = render(args.output, Path(work))
    print(f"{path} ({path.stat().st_size / 1024:.0f} kB)")


if __name__ == "__main__":
    main()
