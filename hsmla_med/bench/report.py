"""The size, writing time and browser render time of the HTML report of a large evaluation: 250
cases of 13 classes as summary.json and metrics_per_case.csv, without and with 15 large noise
overlays (the worst case for compression), and 250 real volume pairs scored by
``evaluate_folder`` (whose page holds the four worst cases as pictures); 3 runs each. The report
is meant to stay under 10 MB and to open quickly, whatever the evaluation's size.

Render time: the page's ``load`` event in headless Chromium (navigation timing's
``loadEventStart``: parsing, layout, every inlined image decoded), read by the harness of
:mod:`hsmla_med.report.browser`, which also checks that no error was logged and every image
decoded; without a Chromium that starts, the render time is left out.

The evaluation folders are made by this module's generators, which the report's tests use too:
:func:`write_evaluation`, :func:`write_png`, :func:`write_volume_pairs` (:func:`write_nifti`).

    hsmla-med bench --only report [--cases 250] [--runs 3]
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from pathlib import Path

import nibabel as nib
import numpy as np
from PIL import Image

from hsmla_med.bench.common import own_parser, positive_int
from hsmla_med.evaluation import evaluate_folder
from hsmla_med.io import atomic_path
from hsmla_med.metrics.summary import summarize_cases, write_reports
from hsmla_med.report import write_report
from hsmla_med.report.browser import chromium, load_page

__all__ = ["main", "write_evaluation", "write_nifti", "write_png", "write_volume_pairs"]

CLASSES = {1: "liver", 2: "spleen"}


def write_png(path: Path, size=(24, 16), noise: bool = False) -> Path:
    """An RGB picture of ``size`` (width, height): flat grey, or uniform noise (which PNG
    cannot compress)."""
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8) if noise else np.full((size[1], size[0], 3), 200, np.uint8)
    with atomic_path(path) as tmp:
        Image.fromarray(pixels).save(tmp)
    return path


def _case_metrics(rng: np.random.Generator, classes: dict, absent: bool = False) -> dict:
    """A case's per-class metrics as :func:`~hsmla_med.metrics.summary.case_metrics` gives them;
    ``absent``: the last class in neither the reference nor the prediction (NaN scores)."""
    out = {}
    for k in classes:
        dice = math.nan if absent and k == max(classes) else float(rng.uniform(0.4, 0.95))
        out[k] = {"Dice": dice, "IoU": dice / (2 - dice), "HD95": math.nan if math.isnan(dice) else float(rng.uniform(1, 30)),
                  "NSD": math.nan if math.isnan(dice) else float(rng.uniform(0.3, 1)), "TP": 10, "FP": 2, "FN": 3, "TN": 100,
                  "n_pred": 12, "n_ref": 13}
    return out


def write_evaluation(folder: Path, cases: int = 3, classes: dict = CLASSES) -> dict:
    """``summary.json`` and ``metrics_per_case.csv`` as ``evaluate`` writes them (the real
    writer), the second case missing the last class (null scores), plus ``metrics.json``.
    Returns the summary as read back."""
    rng = np.random.default_rng(1)
    scored = [{"reference_file": f"/data/labelsTr/case{i:03d}.nii.gz", "prediction_file": f"/out/validation/case{i:03d}.nii.gz",
               "metrics": _case_metrics(rng, classes, absent=i == 1)} for i in range(cases)]
    summary = summarize_cases(scored, list(classes), classes, draws=200, nsd_tolerance_mm=2.0)
    write_reports(summary, folder)
    with atomic_path(folder / "metrics.json") as tmp:
        tmp.write_text(json.dumps({"dice": 0.75, "dice_per_class": {"liver": 0.8, "spleen": 0.7}, "cases": cases,
                                   "checkpoint": "/runs/btcv/best.ckpt", "routing": "gate"}))
    return json.loads((folder / "summary.json").read_text())


def write_nifti(path: Path, data, affine=None) -> Path:
    """``data`` as a NIfTI file; the affine by default 1.5 x 1.5 x 3 mm voxels."""
    with atomic_path(path) as tmp:
        nib.save(nib.Nifti1Image(np.asarray(data), np.diag([1.5, 1.5, 3.0, 1.0]) if affine is None else affine), str(tmp))
    return path


def write_volume_pairs(root: Path, errors: dict[str, int]) -> None:
    """nnU-Net-style references and images under ``root`` (``labelsTr``, ``imagesTr``), and
    ``predictions`` with ``errors[case]`` voxels of the organ's block wrong: more errors, lower
    Dice."""
    rng = np.random.default_rng(0)
    for case, wrong in errors.items():
        labels = np.zeros((20, 18, 10), np.uint8)
        labels[4:14, 3:13, 2:8] = 1
        labels[15:18, 14:17, 3:6] = 2
        write_nifti(root / "labelsTr" / f"{case}.nii.gz", labels)
        write_nifti(root / "imagesTr" / f"{case}_0000.nii.gz", rng.normal(0, 1, labels.shape).astype(np.float32) + 3 * labels)
        predicted = labels.copy()
        predicted.reshape(-1)[np.flatnonzero(labels == 1)[:wrong]] = 0
        write_nifti(root / "predictions" / f"{case}.nii.gz", predicted)


def _tables(folder: Path, cases: int, pictures: int) -> None:
    write_evaluation(folder, cases=cases, classes={k: f"organ_{k}" for k in range(1, 14)})
    for i in range(pictures):
        write_png(folder / "heatmaps" / f"slide_{i:02d}_overlay.png", size=(1500, 1000), noise=True)


def _volumes(folder: Path, cases: int) -> None:
    write_volume_pairs(folder / "data", {f"case{i:03d}": (37 * i) % 500 for i in range(cases)})
    evaluate_folder(folder / "data" / "predictions", folder / "data" / "labelsTr", None, folder, 2.0)


def main(argv: list[str]) -> int:
    parser = own_parser("report", __doc__)
    parser.add_argument("--cases", type=positive_int, default=250, help="cases of each evaluation (default 250)")
    parser.add_argument("--runs", type=positive_int, default=3, help="reports written (and rendered) of each evaluation (default 3)")
    args = parser.parse_args(argv)
    n = args.cases
    kinds = {f"{n} cases x 13 classes (summary.json, metrics_per_case.csv)": lambda d: _tables(d, n, 0),
             "the same + 15 overlays of 1500 x 1000 noise": lambda d: _tables(d, n, 15),
             f"{n} volume pairs scored by evaluate_folder (4 worst-case pictures)": lambda d: _volumes(d, n)}
    browser = chromium()
    for name, make in kinds.items():
        writes, renders, size, images = [], [], 0, 0
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as d:
                folder = Path(d) / "eval"
                folder.mkdir()
                make(folder)
                start = time.perf_counter()
                page = write_report(folder)
                writes.append(time.perf_counter() - start)
                size = page.stat().st_size
                if browser is not None:
                    found = load_page(page, Path(d) / "browser")
                    if found["errors"] or found["broken"]:
                        raise RuntimeError(f"{name}: the page logged errors {found['errors']} or has broken images {found['broken']}")
                    renders.append(found["load_ms"] / 1000)
                    images = found["images"]
        render = ", ".join(f"{t:.2f}" for t in renders) + " s" if renders else "no browser"
        print(f"{name}: {size / 1e6:.2f} MB, {images} images; write {', '.join(f'{t:.2f}' for t in writes)} s; render {render}", flush=True)
    return 0
