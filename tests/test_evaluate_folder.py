"""``hsmla-med evaluate --predictions DIR --labels DIR``: label maps of any tool scored by file name
as nnU-Net's compute_metrics_on_folder scores them (counts, Dice, IoU), HD95 as MONAI computes it
at the label map's own spacing, the geometry checked first, bad folders refused in one line."""

from __future__ import annotations

import csv
import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from monai.metrics import compute_hausdorff_distance

from hsmla_med.cli import main
from hsmla_med.errors import DataError
from tests.conftest import cli_error, write_nifti
from tests.test_summary import nnunet_case

# LPS (x and y flipped relative to NIfTI's RAS), anisotropic, off the origin: as a CT from DICOM
AFFINE = np.array([[-0.7, 0, 0, 120.0], [0, -0.9, 0, 95.0], [0, 0, 3.0, -40.0], [0, 0, 0, 1]])
SPACING = (0.7, 0.9, 3.0)
SHAPE = (40, 36, 12)
NAMES = ["background", "liver", "spleen", "kidney"]


def _organs(rng, shift) -> np.ndarray:
    """Three balls (labels 1-3) whose position moves with ``shift`` voxels."""
    grid = np.meshgrid(*[np.arange(n) * s for n, s in zip(SHAPE, SPACING, strict=True)], indexing="ij")
    label = np.zeros(SHAPE, np.uint8)
    for value, (centre, radius) in enumerate((((10, 12, 15), 6.0), ((20, 22, 18), 5.0), ((14, 26, 20), 4.0)), start=1):
        c = np.asarray(centre) + np.asarray(shift) * SPACING + rng.normal(0, 0.5, 3)
        label[sum((g - x) ** 2 for g, x in zip(grid, c, strict=True)) <= radius**2] = value
    return label


def _folders(tmp_path, cases=4, seed=0):
    """``labels/`` and ``predictions/`` of the same file names, and the arrays written."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for i in range(cases):
        ref = _organs(rng, (0, 0, 0))
        pred = _organs(rng, rng.integers(-1, 2, 3))
        pred[rng.random(SHAPE) < 0.01] = 2  # scattered false positives
        if i == 1:
            pred[pred == 3] = 0  # kidney missed
        name = f"case_{i:03d}.nii.gz"
        write_nifti(tmp_path / "labels" / name, ref, AFFINE)
        write_nifti(tmp_path / "predictions" / name, pred, AFFINE)
        arrays[name] = (ref, pred)
    return tmp_path / "predictions", tmp_path / "labels", arrays


def _dataset_json(path, labels: dict, **lists):
    path.write_text(json.dumps({"labels": labels, **lists}))
    return path


def _monai_hd95(ref, pred) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = lambda a: torch.from_numpy(a).float()[None, None]  # noqa: E731
        return float(compute_hausdorff_distance(t(pred), t(ref), include_background=True, percentile=95, spacing=list(SPACING))[0, 0])


def test_full_run_matches_nnunet_counts_and_monai_hd95(tmp_path, capsys):
    predictions, labels, arrays = _folders(tmp_path)
    msd = _dataset_json(tmp_path / "dataset.json", {str(i): n for i, n in enumerate(NAMES)})
    out = tmp_path / "report"
    assert main(["evaluate", "--predictions", str(predictions), "--labels", str(labels), "--dataset-json", str(msd),
                 "--output", str(out), "--nsd-tolerance", "1.5"]) == 0
    assert "4 cases, foreground mean: Dice" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["labels"] == {"1": "liver", "2": "spleen", "3": "kidney"} and summary["nsd_tolerance_mm"] == 1.5
    assert len(summary["metric_per_case"]) == 4
    for case in summary["metric_per_case"]:
        ref, pred = arrays[case["prediction_file"].rsplit("/", 1)[-1]]
        expected = nnunet_case(ref, pred, [1, 2, 3])
        for c in (1, 2, 3):
            got = case["metrics"][str(c)]
            for key in ("TP", "FP", "FN", "TN", "n_pred", "n_ref"):
                assert got[key] == expected[c][key]
            for key in ("Dice", "IoU"):
                assert got[key] == pytest.approx(expected[c][key], abs=1e-6)
            if got["n_ref"] and got["n_pred"]:
                assert got["HD95"] == pytest.approx(_monai_hd95(ref == c, pred == c), abs=1e-4)
            assert 0 <= got["NSD"] <= 1
    assert summary["metric_per_case"][1]["metrics"]["3"]["Dice"] == 0  # the missed kidney
    rows = list(csv.DictReader((out / "metrics_per_case.csv").open()))
    assert len(rows) == 12 and {r["name"] for r in rows} == {"liver", "spleen", "kidney"}
    for key in ("Dice", "HD95", "NSD"):
        lo, hi = summary["ci95"]["foreground_mean"][key]
        assert lo <= summary["foreground_mean"][key] <= hi
    assert not list(predictions.glob("summary.json"))

    # nnU-Net v2's labels form names the same classes; the report goes beside the predictions
    v2 = _dataset_json(tmp_path / "v2.json", {n: i for i, n in enumerate(NAMES)})
    assert main(["evaluate", "--predictions", str(predictions), "--labels", str(labels), "--dataset-json", str(v2)]) == 0
    again = json.loads((predictions / "summary.json").read_text())
    assert again["labels"] == summary["labels"] and again["nsd_tolerance_mm"] == 2.0
    assert [c["metrics"]["2"]["Dice"] for c in again["metric_per_case"]] == [c["metrics"]["2"]["Dice"] for c in summary["metric_per_case"]]
    assert (predictions / "metrics_per_case.csv").is_file()


def test_classes_from_the_values_found(tmp_path):
    """Without a dataset JSON the classes are the values in either folder; a class in one case
    only is scored as absent (NaN, not counted) in the others, as nnU-Net scores it."""
    predictions, labels, arrays = _folders(tmp_path, cases=3)
    pred = arrays["case_002.nii.gz"][1]
    pred[:3, :3, :3] = 7  # a value only this prediction holds (changed in `arrays` too)
    write_nifti(predictions / "case_002.nii.gz", pred, AFFINE)
    assert main(["evaluate", "--predictions", str(predictions), "--labels", str(labels), "--output", str(tmp_path / "o")]) == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert list(summary["labels"]) == ["1", "2", "3", "7"]
    for case in summary["metric_per_case"]:
        expected = nnunet_case(*arrays[case["prediction_file"].rsplit("/", 1)[-1]], [1, 2, 3, 7])[7]
        got = case["metrics"]["7"]
        assert (got["TP"], got["FP"], got["FN"], got["TN"]) == (expected["TP"], expected["FP"], expected["FN"], expected["TN"])
        assert (got["Dice"] is None) == math.isnan(expected["Dice"])
    assert summary["mean"]["7"]["Dice"] == 0  # the one case that counts: a hallucinated class


def test_predictions_named_after_their_images(tmp_path):
    """``infer`` names its output after the image (img0000), BTCV its label label0000: the
    dataset JSON's image/label list pairs them."""
    rng = np.random.default_rng(2)
    ref = _organs(rng, (0, 0, 0))
    write_nifti(tmp_path / "labelsTr" / "label0000.nii.gz", ref, AFFINE)
    write_nifti(tmp_path / "preds" / "img0000.nii.gz", ref, AFFINE)
    meta = _dataset_json(tmp_path / "dataset_0.json", {str(i): n for i, n in enumerate(NAMES)},
                         training=[{"image": "imagesTr/img0000.nii.gz", "label": "labelsTr/label0000.nii.gz"}])
    assert main(["evaluate", "--predictions", str(tmp_path / "preds"), "--labels", str(tmp_path / "labelsTr"),
                 "--dataset-json", str(meta)]) == 0
    summary = json.loads((tmp_path / "preds" / "summary.json").read_text())
    assert summary["foreground_mean"]["Dice"] == 1.0 and summary["foreground_mean"]["HD95"] == 0.0
    assert summary["foreground_mean"]["NSD"] == 1.0


def test_shape_mismatch_one_line_exit_2(tmp_path, capsys):
    predictions, labels, arrays = _folders(tmp_path, cases=2)
    write_nifti(predictions / "case_001.nii.gz", np.zeros((40, 36, 11), np.uint8), AFFINE)
    line = cli_error(capsys, ["evaluate", "--predictions", str(predictions), "--labels", str(labels)])
    assert str(predictions / "case_001.nii.gz") in line and "shape (40, 36, 11)" in line and "(40, 36, 12)" in line
    assert not (predictions / "summary.json").exists()


def test_affine_mismatch_one_line_exit_2(tmp_path, capsys):
    predictions, labels, arrays = _folders(tmp_path, cases=2)
    ras = AFFINE.copy()
    ras[:2] *= -1  # the same voxels stored RAS: a tool that lost the orientation
    write_nifti(predictions / "case_000.nii.gz", arrays["case_000.nii.gz"][1], ras)
    line = cli_error(capsys, ["evaluate", "--predictions", str(predictions), "--labels", str(labels)])
    assert str(predictions / "case_000.nii.gz") in line and "affine" in line
    assert not (predictions / "summary.json").exists()


def test_the_pairs_there_are_are_scored_and_the_others_listed(tmp_path, capsys):
    """As nnU-Net's compute_metrics_on_folder: labels without a prediction (a model's validation
    fold against every label) and predictions without a label (test volumes) are left out, each
    kind listed in one warning; nothing paired is one line saying how files pair."""
    from hsmla_med.evaluation import pair_files

    predictions, labels, arrays = _folders(tmp_path, cases=3)
    (predictions / "case_001.nii.gz").unlink()
    (predictions / "case_002.nii.gz").unlink()
    write_nifti(predictions / "extra.nii.gz", arrays["case_000.nii.gz"][1], AFFINE)
    assert main(["evaluate", "--predictions", str(predictions), "--labels", str(labels)]) == 0
    err = capsys.readouterr().err
    assert "scoring 1 of the 3 label maps" in err and "case_001.nii.gz, case_002.nii.gz" in err
    assert "1 prediction(s)" in err and "extra.nii.gz" in err and "not scored" in err
    summary = json.loads((predictions / "summary.json").read_text())
    assert [Path(c["reference_file"]).name for c in summary["metric_per_case"]] == ["case_000.nii.gz"]
    # post-processing's choice pairs strictly: every file or nothing
    with pytest.raises(DataError, match="no prediction for 2 of 3 label maps"):
        pair_files(predictions, labels)
    (predictions / "case_000.nii.gz").rename(predictions / "img0000.nii.gz")
    line = cli_error(capsys, ["evaluate", "--predictions", str(predictions), "--labels", str(labels)])
    assert "none of its 2 prediction(s) pairs with a label map" in line and "--dataset-json" in line


def test_bad_options_and_values(tmp_path, capsys):
    predictions, labels, arrays = _folders(tmp_path, cases=1)
    two = _dataset_json(tmp_path / "dataset.json", {"0": "background", "1": "liver", "2": "spleen"})
    line = cli_error(capsys, ["evaluate", "--predictions", str(predictions), "--labels", str(labels), "--dataset-json", str(two)])
    assert "label values [3] are not in the labels of" in line and "case_000.nii.gz" in line
    assert "needs --labels" in cli_error(capsys, ["evaluate", "--predictions", str(predictions)])
    assert "--checkpoint with --predictions" in cli_error(capsys, ["evaluate", "--predictions", str(predictions), "--labels", str(labels),
                                                                   "--checkpoint", "x.ckpt"])
    assert "--nsd-tolerance -1.0" in cli_error(capsys, ["evaluate", "--predictions", str(predictions), "--labels", str(labels),
                                                        "--nsd-tolerance", "-1"])
    missing = tmp_path / "nowhere"
    assert f"--predictions {missing}: not found" in cli_error(capsys, ["evaluate", "--predictions", str(missing), "--labels", str(labels)])
    assert not missing.exists()
    # checkpoint mode keeps needing its options
    assert "evaluate needs --checkpoint, or --predictions" in cli_error(capsys, ["evaluate", "--task", "btcv"])
