"""Per-case reports (hsmla_med.metrics.summary): nnU-Net's counts, Dice and IoU against hand-computed
cases and against a transcription of nnU-Net's evaluator, HD95 against MONAI at the original
spacing, NSD on concentric spheres, the empty-mask rule, the bootstrap intervals and the files."""

from __future__ import annotations

import csv
import json
import math
import warnings

import numpy as np
import pytest
import torch
from monai.metrics import compute_hausdorff_distance, compute_surface_dice

from hsmla_med.metrics.summary import bootstrap_means, case_metrics, class_metrics, summarize_cases, write_reports

SPACING = (0.7, 0.9, 3.0)  # anisotropic, as CT: fine in-plane, thick slices


# --- reference: nnU-Net's evaluator (nnunetv2/evaluation/evaluate_predictions.py), rewritten here on
# arrays instead of files, rule for rule: compute_tp_fp_fn_tn, compute_metrics' Dice/IoU with NaN when
# tp + fp + fn == 0, compute_metrics_on_folder's np.nanmean per class and np.mean over the classes.

def nnunet_tp_fp_fn_tn(mask_ref, mask_pred, ignore_mask=None):
    use = np.ones_like(mask_ref, dtype=bool) if ignore_mask is None else ~ignore_mask
    return (np.sum((mask_ref & mask_pred) & use), np.sum(((~mask_ref) & mask_pred) & use),
            np.sum((mask_ref & (~mask_pred)) & use), np.sum(((~mask_ref) & (~mask_pred)) & use))


def nnunet_case(seg_ref, seg_pred, labels) -> dict:
    out = {}
    for r in labels:
        tp, fp, fn, tn = nnunet_tp_fp_fn_tn(seg_ref == r, seg_pred == r)
        empty = tp + fp + fn == 0
        out[r] = {"Dice": np.nan if empty else 2 * tp / (2 * tp + fp + fn), "IoU": np.nan if empty else tp / (tp + fp + fn),
                  "FP": fp, "TP": tp, "FN": fn, "TN": tn, "n_pred": fp + tp, "n_ref": fn + tp}
    return out


def nnunet_means(cases: list[dict], labels) -> tuple[dict, dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        means = {r: {m: np.nanmean([c[r][m] for c in cases]) for m in cases[0][labels[0]]} for r in labels}
    return means, {m: np.mean([means[r][m] for r in labels if r != 0]) for m in cases[0][labels[0]]}


# --- helpers

def _ball(shape, spacing, centre_mm, radius_mm) -> np.ndarray:
    grid = np.meshgrid(*[np.arange(n) * s for n, s in zip(shape, spacing, strict=True)], indexing="ij")
    return sum((g - c) ** 2 for g, c in zip(grid, centre_mm, strict=True)) <= radius_mm**2


def _as_case(metrics: dict, name: str = "c") -> dict:
    return {"reference_file": f"labels/{name}.nii.gz", "prediction_file": f"predictions/{name}.nii.gz", "metrics": metrics}


# --- hand-computed cases and the empty rule

def test_counts_dice_iou_by_hand():
    ref = np.zeros((4, 3, 2), bool)
    pred = np.zeros((4, 3, 2), bool)
    ref[0:2, 0, 0] = True  # 2 voxels
    ref[3, 2, 1] = True  # 1 voxel, missed
    pred[1:4, 0, 0] = True  # 3 voxels: 1 overlaps, 2 extra
    m = class_metrics(ref, pred, (1.0, 1.0, 1.0), 1.0)
    assert (m["TP"], m["FP"], m["FN"], m["TN"], m["n_pred"], m["n_ref"]) == (1, 2, 2, 19, 3, 3)
    assert m["Dice"] == pytest.approx(2 / 6) and m["IoU"] == pytest.approx(1 / 5)  # 2TP/(2TP+FP+FN), TP/(TP+FP+FN)


def test_empty_rule():
    shape = (10, 8, 4)
    empty, blob = np.zeros(shape, bool), np.zeros(shape, bool)
    blob[2:5, 2:5, 1:3] = True
    both = class_metrics(empty, empty, SPACING, 2.0)
    assert all(math.isnan(both[k]) for k in ("Dice", "IoU", "HD95", "NSD"))
    assert (both["TP"], both["FP"], both["FN"], both["TN"]) == (0, 0, 0, empty.size)
    diagonal = math.sqrt(sum((n * s) ** 2 for n, s in zip(shape, SPACING, strict=True)))
    for ref, pred in ((blob, empty), (empty, blob)):  # missed, and hallucinated
        one = class_metrics(ref, pred, SPACING, 2.0)
        assert one["Dice"] == one["IoU"] == one["NSD"] == 0
        assert one["HD95"] == pytest.approx(diagonal, rel=1e-6)
        # our NSD rule is MONAI's own where it gives a number: 0 with one mask empty
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = lambda a: torch.from_numpy(a).float()[None, None]  # noqa: E731
            assert float(compute_surface_dice(t(pred), t(ref), [2.0], include_background=True, spacing=list(SPACING),
                                              use_subvoxels=True)[0, 0]) == 0
    # NaN cases are left out of the class mean; a class with no value anywhere is null and
    # left out of the foreground mean
    cases = [_as_case({1: class_metrics(blob, blob, SPACING, 2.0), 2: class_metrics(empty, empty, SPACING, 2.0)}, "a"),
             _as_case({1: class_metrics(empty, empty, SPACING, 2.0), 2: class_metrics(empty, empty, SPACING, 2.0)}, "b")]
    summary = summarize_cases(cases, [1, 2], draws=50)
    assert summary["mean"]["1"]["Dice"] == 1.0 and summary["mean"]["2"]["Dice"] is None
    assert summary["foreground_mean"]["Dice"] == 1.0
    assert summary["metric_per_case"][1]["metrics"]["1"]["Dice"] is None


# --- against nnU-Net's evaluator

def test_counts_dice_iou_equal_nnunet_on_random_label_maps():
    rng = np.random.default_rng(3)
    labels = [1, 2, 3, 4]
    ours, theirs = [], []
    for case in range(6):
        ref = rng.integers(0, 4, (20, 18, 7))  # label 4 never in the reference
        pred = np.where(rng.random(ref.shape) < 0.3, rng.integers(0, 5, ref.shape), ref)
        if case == 0:
            pred[pred == 2] = 0  # a class missed entirely
        if case == 1:
            ref[ref == 3], pred[pred == 3] = 0, 0  # a class absent from both: NaN, not counted
        ours.append(_as_case(case_metrics(ref, pred, labels, SPACING, 2.0), str(case)))
        theirs.append(nnunet_case(ref, pred, labels))
    for mine, ref_case in zip(ours, theirs, strict=True):
        for r in labels:
            for key in ("TP", "FP", "FN", "TN", "n_pred", "n_ref"):
                assert mine["metrics"][r][key] == ref_case[r][key]
            for key in ("Dice", "IoU"):
                assert np.isclose(mine["metrics"][r][key], ref_case[r][key], atol=1e-6, equal_nan=True)
    summary = summarize_cases(ours, labels, draws=50)
    means, foreground = nnunet_means(theirs, labels)
    for r in labels:
        for key, value in means[r].items():
            assert summary["mean"][str(r)][key] == pytest.approx(value, abs=1e-9)
    for key, value in foreground.items():
        assert summary["foreground_mean"][key] == pytest.approx(value, abs=1e-9)


# --- distances

@pytest.mark.filterwarnings("ignore:.*always_return_as_numpy:FutureWarning")  # inside MONAI 1.5-1.6
@pytest.mark.parametrize("centre", [(16, 18, 20), (2, 30, 40)], ids=["inside", "at the image border"])
def test_distances_equal_monai_at_the_original_spacing(centre):
    """HD95 and NSD on the masks cropped around both equal MONAI's on the whole volume."""
    shape = (48, 40, 14)
    ref = _ball(shape, SPACING, centre, 9.0)
    pred = _ball(shape, SPACING, np.add(centre, (2, -1, 2)), 10.0) & ~_ball(shape, SPACING, np.add(centre, (-4, -4, 0)), 3.0)
    t = lambda a: torch.from_numpy(a).float()[None, None]  # noqa: E731
    hd95 = compute_hausdorff_distance(t(pred), t(ref), include_background=True, percentile=95, spacing=list(SPACING))
    nsd = compute_surface_dice(t(pred), t(ref), [2.0], include_background=True, spacing=list(SPACING), use_subvoxels=True)
    got = class_metrics(ref, pred, SPACING, 2.0)
    assert got["HD95"] == pytest.approx(float(hd95[0, 0]), abs=1e-4)
    assert got["NSD"] == pytest.approx(float(nsd[0, 0]), abs=1e-6)
    assert got["HD95"] != pytest.approx(class_metrics(ref, pred, (1.0, 1.0, 1.0), 2.0)["HD95"], abs=0.1)  # the spacing matters


@pytest.mark.parametrize("spacing", [(0.5, 0.5, 0.5), (0.5, 0.5, 1.0)])
def test_nsd_of_concentric_spheres(spacing):
    """Every point of either surface lies ``delta`` from the other: analytically NSD is 0 below
    the tolerance ``delta`` and 1 from it on; voxelisation blurs the step by about a voxel."""
    radius, delta = 10.0, 3.0
    shape = tuple(int(round(30 / s)) for s in spacing)
    centre = tuple(n * s / 2 for n, s in zip(shape, spacing, strict=True))
    inner, outer = _ball(shape, spacing, centre, radius), _ball(shape, spacing, centre, radius + delta)
    blur = 2 * max(spacing)
    for tolerance in (0.5, delta - blur):
        assert class_metrics(inner, outer, spacing, tolerance)["NSD"] < 0.01
    for tolerance in (delta + blur, 2 * delta):
        assert class_metrics(inner, outer, spacing, tolerance)["NSD"] == pytest.approx(1.0, abs=1e-6)
    assert class_metrics(outer, inner, spacing, delta + blur)["NSD"] == pytest.approx(1.0, abs=1e-6)  # symmetric


# --- bootstrap intervals

def test_bootstrap_interval_seeded_contains_mean_and_shrinks():
    rng = np.random.default_rng(0)
    small, large = rng.normal(0.8, 0.1, (10, 2)), rng.normal(0.8, 0.1, (400, 2))
    per_class, foreground = bootstrap_means(small, draws=1000, seed=1)
    again, _ = bootstrap_means(small, draws=1000, seed=1)
    other, _ = bootstrap_means(small, draws=1000, seed=2)
    assert np.array_equal(per_class, again) and not np.array_equal(per_class, other)
    means = small.mean(0)
    assert np.all(per_class[:, 0] <= means) and np.all(means <= per_class[:, 1])
    assert foreground[0] <= means.mean() <= foreground[1]
    wide = per_class[:, 1] - per_class[:, 0]
    narrow_ci, _ = bootstrap_means(large, draws=1000, seed=1)
    narrow = narrow_ci[:, 1] - narrow_ci[:, 0]
    assert np.all(narrow < wide / 2)
    # independent reference: the normal approximation, 2 x 1.96 x sd / sqrt(n), for many cases
    expected = 2 * 1.96 * large.std(0, ddof=1) / math.sqrt(len(large))
    assert narrow == pytest.approx(expected, rel=0.15)


def test_bootstrap_skips_nan_cases():
    values = np.array([[0.5, np.nan], [0.7, np.nan], [0.9, 1.0]])
    per_class, _ = bootstrap_means(values, draws=500, seed=0)
    assert 0.5 <= per_class[0, 0] <= per_class[0, 1] <= 0.9
    assert per_class[1].tolist() == [1.0, 1.0]  # only draws holding the one case that counts
    assert np.isnan(bootstrap_means(np.full((3, 1), np.nan), draws=10)[0]).all()


# --- the files

def test_reports_written_with_null_for_nan(tmp_path):
    rng = np.random.default_rng(1)
    cases = []
    for i in range(3):
        ref = rng.integers(0, 3, (8, 8, 4))
        pred = np.where(ref == 2, 0, ref) if i == 0 else ref
        cases.append(_as_case(case_metrics(ref, pred, [1, 2, 3], SPACING, 2.0), f"case{i}"))
    summary = summarize_cases(cases, [1, 2, 3], {1: "liver", 2: "spleen", 3: "kidney"}, draws=100, nsd_tolerance_mm=2.0)
    json_path, csv_path = write_reports(summary, tmp_path)
    def refuse(name):
        raise AssertionError(f"{name} in summary.json")
    loaded = json.loads(json_path.read_text(), parse_constant=refuse)
    assert loaded == json.loads(json.dumps(summary))
    assert set(loaded) >= {"metric_per_case", "mean", "foreground_mean", "ci95", "labels", "nsd_tolerance_mm"}
    assert loaded["mean"]["3"]["Dice"] is None and loaded["ci95"]["mean"]["3"]["Dice"] == [None, None]
    lo, hi = loaded["ci95"]["foreground_mean"]["Dice"]
    assert lo <= loaded["foreground_mean"]["Dice"] <= hi
    rows = list(csv.DictReader(csv_path.open()))
    assert len(rows) == 9 and rows[1]["name"] == "spleen" and rows[1]["case"] == "case0.nii.gz"
    assert float(rows[1]["Dice"]) == 0 and rows[2]["Dice"] == "nan"
    assert int(rows[0]["TP"]) == loaded["metric_per_case"][0]["metrics"]["1"]["TP"]


def test_one_case_has_no_interval_rather_than_one_of_zero_width():
    """A bootstrap of one case resamples that case every time: its zero-width interval would read
    as certainty, so the bounds are null and the summary says why; two cases get intervals."""
    rng = np.random.default_rng(0)
    ref = rng.integers(0, 3, (12, 12, 4))
    case = {"reference_file": "a", "prediction_file": "a", "metrics": case_metrics(ref, ref, [1, 2], [1.0, 1.0, 1.0], 2.0)}
    one = summarize_cases([case], [1, 2], draws=50)
    assert all(bounds == [None, None] for per_class in one["ci95"]["mean"].values() for bounds in per_class.values())
    assert all(bounds == [None, None] for bounds in one["ci95"]["foreground_mean"].values())
    assert "one case" in one["bootstrap"]["note"] and one["mean"]["1"]["Dice"] == 1.0
    two = summarize_cases([case, case], [1, 2], draws=50)
    assert two["ci95"]["mean"]["1"]["Dice"] == [1.0, 1.0] and "note" not in two["bootstrap"]
