"""EndoVis 2017 scoring: frames scored at their original size (validation and ``evaluate``), the
per-frame rule of the reference evaluation (TernausNet's ``evaluate.py``), and ``evaluate --task
endovis --predictions DIR --labels DATA_DIR``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from hsmla_med.cli import main
from hsmla_med.config import merge_config, task_config
from hsmla_med.engine.segmentation import FrameSegmentationModule
from hsmla_med.pipelines import endovis
from hsmla_med.pipelines.task import InferenceOptions
from tests.conftest import cli_error


# --- a transcription of general_dice / general_jaccard / dice / jaccard of evaluate.py in
# ternaus/robot-surgery-segmentation (the reference the rule is checked against)
def _dice(y_true, y_pred):
    return (2 * (y_true * y_pred).sum() + 1e-15) / (y_true.sum() + y_pred.sum() + 1e-15)


def _jaccard(y_true, y_pred):
    intersection = (y_true * y_pred).sum()
    union = y_true.sum() + y_pred.sum() - intersection
    return (intersection + 1e-15) / (union + 1e-15)


def _general(metric, y_true, y_pred):
    if y_true.sum() == 0:
        return 1 if y_pred.sum() == 0 else 0
    return np.mean([metric(y_true == i, y_pred == i) for i in set(y_true.flatten()) if i != 0])


def _png(path, array):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)
    return path


# frames (truth, prediction) with the reference's scores worked out by hand
HAND = [
    # empty truth, empty prediction: 1 (we used to skip the frame)
    (np.zeros((2, 4)), np.zeros((2, 4)), 1.0, 1.0),
    # empty truth, something predicted: 0
    (np.zeros((2, 4)), np.array([[0, 0, 0, 0], [0, 3, 0, 0]]), 0.0, 0.0),
    # class 2 predicted but absent from the truth: ignored, the frame scores 1 (we used to give 0.5)
    (np.array([[1, 1, 0, 0], [0, 0, 0, 0]]), np.array([[1, 1, 0, 0], [0, 0, 2, 2]]), 1.0, 1.0),
    # classes 1 and 2 in the truth, each 1 shared pixel of 2 + 1: Dice 2/3, IoU 1/2; class 3 ignored
    (np.array([[1, 1, 2, 0], [0, 0, 0, 0]]), np.array([[1, 0, 2, 2], [3, 0, 0, 0]]), 2 / 3, 1 / 2),
    # a missed class counts 0 in the mean: (1 + 0) / 2
    (np.array([[1, 0, 0, 0], [0, 0, 0, 2]]), np.array([[1, 0, 0, 0], [0, 0, 0, 0]]), 0.5, 0.5),
]


def test_reference_rule_on_hand_computed_frames():
    from hsmla_med.metrics import frame_reference_scores, frame_scores, summarize_frames

    truth = torch.tensor(np.stack([t for t, _, _, _ in HAND]))[:, None].long()
    pred = torch.tensor(np.stack([p for _, p, _, _ in HAND]))[:, None].long()
    dice, iou = frame_reference_scores(pred, truth, 4)
    np.testing.assert_allclose(dice.numpy(), [d for _, _, d, _ in HAND], atol=1e-12)
    np.testing.assert_allclose(iou.numpy(), [i for _, _, _, i in HAND], atol=1e-12)
    for (t, p, _, _), d, i in zip(HAND, dice.tolist(), iou.tolist()):  # and the reference code agrees
        assert d == pytest.approx(_general(_dice, t, p), abs=1e-12) and i == pytest.approx(_general(_jaccard, t, p), abs=1e-12)
    # the per-class tables keep nnU-Net's rule: NaN where a class is in neither, 0 where in one
    class_dice, class_iou = frame_scores(pred, truth, 4)
    nan = float("nan")
    torch.testing.assert_close(class_dice[2], torch.tensor([1.0, 0.0, nan]), equal_nan=True)
    torch.testing.assert_close(class_dice[3], torch.tensor([2 / 3, 2 / 3, 0.0]), equal_nan=True)
    summary = summarize_frames(class_dice, class_iou, dice, iou, ["a", "b", "c"])
    # every frame counts, the empty one as 1: (1 + 0 + 1 + 2/3 + 1/2) / 5
    assert summary["dice"] == pytest.approx((1 + 0 + 1 + 2 / 3 + 0.5) / 5) and summary["cases"] == 5
    assert summary["iou"] == pytest.approx((1 + 0 + 1 + 0.5 + 0.5) / 5)
    assert summary["dice_per_class"] == pytest.approx({"a": (1 + 2 / 3 + 1) / 3, "b": (0 + 2 / 3 + 0) / 3, "c": 0.0})


@pytest.mark.parametrize("classes", [2, 4, 8])
def test_reference_rule_equals_the_reference_code_on_random_frames(classes):
    from hsmla_med.metrics import frame_reference_scores

    rng = np.random.default_rng(classes)
    truth = rng.integers(0, classes, (40, 1, 6, 7))
    pred = np.where(rng.random(truth.shape) < 0.7, truth, rng.integers(0, classes, truth.shape))
    truth[::5] = 0  # empty truths, some with empty predictions
    pred[::10] = 0
    truth[1::5] = np.where(truth[1::5] == 1, 0, truth[1::5])  # classes missing from the truth but predicted
    dice, iou = frame_reference_scores(torch.from_numpy(pred), torch.from_numpy(truth), classes)
    expected_dice = [_general(_dice, t[0], p[0]) for t, p in zip(truth, pred)]
    expected_iou = [_general(_jaccard, t[0], p[0]) for t, p in zip(truth, pred)]
    np.testing.assert_allclose(dice.numpy(), expected_dice, atol=1e-12)
    np.testing.assert_allclose(iou.numpy(), expected_iou, atol=1e-12)


class _RedIsInstrument(nn.Module):
    """Logits (background 0, instrument 20 * (red - 0.5)): instrument wherever red > 0.5."""

    def forward(self, x):
        return torch.stack([torch.zeros_like(x[:, 0]), 20 * (x[:, 0] - 0.5)], 1)


ODD = (41, 61)  # H, W of a frame that is neither the network's size nor a multiple of it
CROP = [3, 5, 31, 47]  # top, left, height, width inside it


@pytest.fixture
def odd_frame(tmp_path):
    """A dataset with one odd-sized frame whose label is exactly what ``infer`` segments in it
    (a red disc, cropped, down to 16 x 20 and back), and the module that segments it."""
    config = merge_config(task_config("endovis"), {"data": {"size": [16, 20], "crop": CROP}})
    module = FrameSegmentationModule(endovis.module_config(config, {"variant": "b0"}, endovis.PROBLEMS["binary"]), network=_RedIsInstrument())
    rows, cols = np.mgrid[: ODD[0], : ODD[1]]
    frame = np.full((*ODD, 3), 60, np.uint8)
    frame[(rows - 19) ** 2 + (cols - 27) ** 2 < 11**2] = (230, 60, 60)
    video = tmp_path / "data" / "instrument_dataset_1"
    image = _png(video / "left_frames" / "frame000.png", frame)
    (mask_path,) = endovis.infer(module, image, tmp_path / "preds", InferenceOptions(progress=lambda line: None))
    mask = np.asarray(Image.open(mask_path))
    label = _png(video / "ground_truth" / "Prograsp_Forceps_labels" / "frame000.png", (mask * 10).astype(np.uint8))
    return config, module, {"image": str(image), "labels": [str(label)], "case": 0}, mask


def test_validation_scores_the_frame_at_its_original_size(odd_frame):
    """The prediction that ``infer`` writes is the truth: validation must score 1, as it puts the
    prediction back into the frame (crop box, bilinear, argmax) before comparing. Scoring at the
    network's size against the label resized there (the old way) does not give 1."""
    config, module, case, mask = odd_frame
    assert 0 < mask.sum() < mask.size and mask[: CROP[0]].max() == 0
    item = endovis.transforms(config)[1](case)
    records = module.validation_records(torch.utils.data.default_collate([item]))
    summary = module.summarize_records(records)
    assert summary["dice"] == 1.0 and summary["iou"] == 1.0 and summary["dice_per_class"] == {"instrument": 1.0}


def test_evaluate_scores_infer_masks_at_the_frames_size(odd_frame, tmp_path, capsys):
    config, module, case, mask = odd_frame
    assert main(["evaluate", "--task", "endovis", "--predictions", str(tmp_path / "preds"), "--labels", str(tmp_path / "data")]) == 0
    assert "1 frames (binary): Dice 1.0000" in capsys.readouterr().out
    summary = json.loads((tmp_path / "preds" / "summary.json").read_text())
    (row,) = summary["metric_per_case"]
    assert row["metrics"]["1"]["TP"] == mask.sum() and row["metrics"]["1"]["FP"] == row["metrics"]["1"]["FN"] == 0
    assert row["frame_score"] == {"Dice": 1.0, "IoU": 1.0} and summary["reference_rule"]["Dice"] == 1.0


def test_validation_and_evaluate_of_infer_masks_give_the_same_scores(odd_frame, tmp_path):
    """Validation and ``evaluate --predictions`` on ``infer``'s masks score the same prediction
    against the same original label: the same numbers, here where the prediction is not exact."""
    config, module, case, mask = odd_frame
    _png(Path(case["labels"][0]), (np.roll(mask, 3, axis=1) * 10).astype(np.uint8))  # the truth moved 3 columns right
    item = endovis.transforms(config)[1](case)
    validation = module.summarize_records(module.validation_records(torch.utils.data.default_collate([item])))
    assert 0.5 < validation["dice"] < 1
    assert main(["evaluate", "--task", "endovis", "--predictions", str(tmp_path / "preds"), "--labels", str(tmp_path / "data")]) == 0
    summary = json.loads((tmp_path / "preds" / "summary.json").read_text())
    assert (summary["reference_rule"]["Dice"], summary["reference_rule"]["IoU"]) == pytest.approx((validation["dice"], validation["iou"]), abs=1e-12)
    assert summary["mean"]["1"]["Dice"] == pytest.approx(validation["dice_per_class"]["instrument"], abs=1e-6)


def _two_videos(root, truths):
    """Videos 1 and 2 of an EndoVis-layout dataset, frames 5 x 6, parts labels from label maps."""
    for (k, name), parts in truths.items():
        _png(root / f"instrument_dataset_{k}" / "left_frames" / name, np.full((*parts.shape, 3), 90, np.uint8))
        _png(root / f"instrument_dataset_{k}" / "ground_truth" / "Left_Prograsp_Forceps_labels" / name, (parts * 10).astype(np.uint8))
    return root


def test_evaluate_parts_round_trip_by_the_reference_rule(tmp_path, capsys):
    rng = np.random.default_rng(0)
    truths = {(k, f"frame{j:03d}.png"): rng.integers(0, 4, (5, 6)) for k in (1, 2) for j in range(3)}
    truths[(2, "frame002.png")][:] = 0  # an empty frame
    data = _two_videos(tmp_path / "data", truths)
    preds = {key: np.where(rng.random(t.shape) < 0.6, t, rng.integers(0, 4, t.shape)) for key, t in truths.items()}
    preds[(2, "frame002.png")][:] = 0  # predicted empty too: 1 by the reference rule
    preds[(1, "frame000.png")][truths[(1, "frame000.png")] == 0] = 0
    for (k, name), p in preds.items():
        _png(tmp_path / "ours" / f"instrument_dataset_{k}" / name, p.astype(np.uint8))
        _png(tmp_path / "ternausnet" / f"instrument_dataset_{k}" / name, (p * 85).astype(np.uint8))  # generate_masks.py's grey values
    summaries = []
    for folder in ("ours", "ternausnet"):
        argv = ["evaluate", "--task", "endovis", "--problem", "parts", "--predictions", str(tmp_path / folder), "--labels", str(data),
                "--output", str(tmp_path / f"eval-{folder}")]
        assert main(argv) == 0
        summaries.append(json.loads((tmp_path / f"eval-{folder}" / "summary.json").read_text()))
    ours, theirs = summaries
    assert [r["frame_score"] for r in ours["metric_per_case"]] == [r["frame_score"] for r in theirs["metric_per_case"]]
    keys = sorted(truths)
    assert [(r["video"], r["prediction_file"].rsplit("/", 1)[1]) for r in ours["metric_per_case"]] == keys
    expected = [_general(_dice, truths[k], preds[k]) for k in keys]
    assert [r["frame_score"]["Dice"] for r in ours["metric_per_case"]] == pytest.approx(expected, abs=1e-12)
    assert ours["reference_rule"]["Dice"] == pytest.approx(np.mean(expected), abs=1e-12)
    assert ours["reference_rule"]["IoU"] == pytest.approx(np.mean([_general(_jaccard, truths[k], preds[k]) for k in keys]), abs=1e-12)
    # per-class tables with nnU-Net's counts
    shaft = [(truths[k] == 1) & (preds[k] == 1) for k in keys]
    assert [r["metrics"]["1"]["TP"] for r in ours["metric_per_case"]] == [int(s.sum()) for s in shaft]
    assert ours["labels"] == {"1": "shaft", "2": "wrist", "3": "claspers"} and ours["problem"] == "parts"
    lo, hi = ours["ci95"]["reference_rule"]["Dice"]
    assert lo <= ours["reference_rule"]["Dice"] <= hi


def test_evaluate_refuses_a_mask_of_another_size_in_one_line(tmp_path, capsys):
    data = _two_videos(tmp_path / "data", {(1, "frame000.png"): np.ones((5, 6), int), (2, "frame000.png"): np.ones((5, 6), int)})
    wrong = _png(tmp_path / "preds" / "instrument_dataset_2" / "frame000.png", np.ones((6, 5), np.uint8))
    line = cli_error(capsys, ["evaluate", "--task", "endovis", "--predictions", str(tmp_path / "preds"), "--labels", str(data)])
    assert str(wrong) in line and "mask is 5 x 6 (W x H)" in line and "6 x 5" in line
    wrong.unlink()
    _png(tmp_path / "preds" / "instrument_dataset_3" / "frame000.png", np.ones((5, 6), np.uint8))
    line = cli_error(capsys, ["evaluate", "--task", "endovis", "--predictions", str(tmp_path / "preds"), "--labels", str(data)])
    assert "no labelled frame instrument_dataset_3/left_frames/frame000.png" in line


def test_evaluate_binary_probability_maps_as_ternausnet_reads_them(tmp_path, capsys):
    """TernausNet's binary masks are ``sigmoid * 255``, instrument above 127.5, scored by its
    plain ``dice``/``jaccard``; read that way for the whole folder, also a mask whose values are
    all 0 or 1 (a frame where every probability is below 2/255), which alone would look like
    class indices."""
    rng = np.random.default_rng(1)
    truths = {(k, f"frame{j:03d}.png"): (rng.random((5, 6)) < 0.4).astype(int) for k in (1, 2) for j in range(2)}
    data = _two_videos(tmp_path / "data", truths)
    maps = {key: rng.integers(0, 256, (5, 6)).astype(np.uint8) for key in truths}
    maps[(2, "frame001.png")] = rng.integers(0, 2, (5, 6)).astype(np.uint8)
    for (k, name), m in maps.items():
        _png(tmp_path / "preds" / f"instrument_dataset_{k}" / name, m)
    assert main(["evaluate", "--task", "endovis", "--predictions", str(tmp_path / "preds"), "--labels", str(data)]) == 0
    summary = json.loads((tmp_path / "preds" / "summary.json").read_text())
    keys = sorted(truths)
    expected = [(_dice(truths[k] > 0, maps[k] > 255 * 0.5), _jaccard(truths[k] > 0, maps[k] > 255 * 0.5)) for k in keys]
    got = [(r["frame_score"]["Dice"], r["frame_score"]["IoU"]) for r in summary["metric_per_case"]]
    np.testing.assert_allclose(got, expected, atol=1e-12)
    assert summary["metric_per_case"][-1]["metrics"]["1"]["n_pred"] == 0


def test_evaluate_refuses_masks_mixing_class_indices_and_grey_values(tmp_path, capsys):
    data = _two_videos(tmp_path / "data", {(1, "frame000.png"): np.ones((5, 6), int), (2, "frame000.png"): np.ones((5, 6), int)})
    _png(tmp_path / "preds" / "instrument_dataset_1" / "frame000.png", np.full((5, 6), 85, np.uint8))
    mixed = _png(tmp_path / "preds" / "instrument_dataset_2" / "frame000.png", np.full((5, 6), 2, np.uint8))
    argv = ["evaluate", "--task", "endovis", "--problem", "parts", "--predictions", str(tmp_path / "preds"), "--labels", str(data)]
    line = cli_error(capsys, argv)
    assert str(mixed) in line and "neither parts class indices 0..3 nor TernausNet's class x 85" in line
