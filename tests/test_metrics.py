"""Segmentation metrics against hand-computed cases and brute-force numpy/scipy references."""

import json
import math

import numpy as np
import pytest
import torch
from monai.data import MetaTensor
from scipy.ndimage import binary_erosion, gaussian_filter
from scipy.spatial.distance import cdist

from hsmla_med.metrics import case_scores, summarize


def brute_dice(pred: np.ndarray, truth: np.ndarray) -> float:
    """2|A n B| / (|A| + |B|) of two boolean masks; NaN when both are empty."""
    total = pred.sum() + truth.sum()
    return 2.0 * (pred & truth).sum() / total if total else math.nan


def brute_hd95(pred: np.ndarray, truth: np.ndarray, spacing) -> float:
    """Symmetric HD95 between the boundary voxels (mask minus its erosion) of two non-empty masks."""
    points = [np.argwhere(m & ~binary_erosion(m)) * np.asarray(spacing, dtype=float) for m in (pred, truth)]
    d = cdist(*points)
    return max(np.percentile(d.min(1), 95), np.percentile(d.min(0), 95))


def smooth_labels(rng, shape, num_classes) -> np.ndarray:
    """Blobby label map: a smoothed noise field cut into num_classes bands, so masks have real
    boundaries and interiors rather than salt-and-pepper voxels."""
    field = gaussian_filter(rng.standard_normal(shape), sigma=2.0)
    return np.digitize(field, np.quantile(field, np.linspace(0, 1, num_classes + 1)[1:-1]))


def test_dice_two_overlapping_squares():
    pred = torch.zeros(1, 1, 10, 10, dtype=torch.long)
    truth = torch.zeros_like(pred)
    pred[..., 2:6, 2:6] = 1  # 16 pixels
    truth[..., 3:7, 3:7] = 1  # 16 pixels, 3 x 3 = 9 shared
    dice, _ = case_scores(pred, truth, num_classes=2)
    assert dice.shape == (1, 1) and dice.dtype == torch.float32
    assert dice.item() == pytest.approx(2 * 9 / (16 + 16))


def test_dice_matches_numpy_on_random_label_maps():
    rng = np.random.default_rng(0)
    pred = rng.integers(0, 4, size=(2, 1, 9, 8, 7))
    truth = rng.integers(0, 4, size=(2, 1, 9, 8, 7))
    # case 1: class 3 in neither map, class 2 in the prediction only
    pred[1][pred[1] == 3] = 0
    truth[1][truth[1] >= 2] = 1
    dice, _ = case_scores(torch.from_numpy(pred), torch.from_numpy(truth), num_classes=4)
    expected = [[brute_dice(pred[b, 0] == c, truth[b, 0] == c) for c in (1, 2, 3)] for b in range(2)]
    np.testing.assert_allclose(dice.numpy(), expected, rtol=1e-6)
    assert dice[1, 1] == 0 and dice[1, 2].isnan()


@pytest.mark.parametrize(
    "shape, spacing",
    [((20, 18), [(0.7, 1.3), (2.0, 0.5)]), ((14, 12, 10), [(0.8, 1.0, 2.5), (1.5, 0.6, 1.0)])],
    ids=["2d", "3d"],
)
def test_hd95_matches_brute_force_with_per_case_spacing(shape, spacing):
    rng = np.random.default_rng(1)
    pred = np.stack([smooth_labels(rng, shape, 3) for _ in range(2)])[:, None]
    truth = np.stack([smooth_labels(rng, shape, 3) for _ in range(2)])[:, None]
    _, hd95 = case_scores(torch.from_numpy(pred), torch.from_numpy(truth), num_classes=3, spacing=spacing)
    expected = [[brute_hd95(pred[b, 0] == c, truth[b, 0] == c, spacing[b]) for c in (1, 2)] for b in range(2)]
    assert hd95.shape == (2, 2) and hd95.dtype == torch.float32
    np.testing.assert_allclose(hd95.numpy(), expected, rtol=1e-5)
    # the spacings differ enough that swapping them must change the answer
    _, swapped = case_scores(torch.from_numpy(pred), torch.from_numpy(truth), 3, spacing=spacing[::-1])
    assert not torch.allclose(swapped, hd95)


def parallel_planes(axis: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One-voxel-thick planes across a (10, 10, 10) volume, normal to ``axis``, ``offset`` apart."""
    pred = torch.zeros(1, 1, 10, 10, 10, dtype=torch.long)
    truth = torch.zeros_like(pred)
    pred.select(2 + axis, 2).fill_(1)
    truth.select(2 + axis, 2 + offset).fill_(1)
    return pred, truth


def test_hd95_of_parallel_planes_scales_with_spacing_along_the_offset_axis():
    # every voxel of either plane is exactly `offset` voxels from the other plane
    along_last = parallel_planes(axis=2, offset=3)
    along_first = parallel_planes(axis=0, offset=3)
    for spacing, last, first in [((1.0, 1.0, 1.0), 3.0, 3.0), ((1.0, 1.0, 3.0), 9.0, 3.0)]:
        assert case_scores(*along_last, 2, spacing=spacing)[1].item() == pytest.approx(last)
        assert case_scores(*along_first, 2, spacing=spacing)[1].item() == pytest.approx(first)


@pytest.mark.filterwarnings("error")  # MONAI's empty-class warnings must be silenced
def test_absent_and_one_sided_classes():
    pred = torch.zeros(2, 1, 6, 10, dtype=torch.long)
    truth = torch.zeros_like(pred)
    pred[:, :, 1:3, 1:4] = 1
    truth[:, :, 1:3, 2:5] = 1  # class 1 in both maps of both cases
    truth[0, :, 4:, 6:] = 2  # class 2 missed in case 0 ...
    pred[1, :, 4:, 6:] = 2  # ... and hallucinated in case 1; class 3 nowhere
    spacing = [(0.5, 2.0), (1.0, 1.0)]
    dice, hd95 = case_scores(pred, truth, num_classes=4, spacing=spacing)
    diagonals = [math.hypot(6 * 0.5, 10 * 2.0), math.hypot(6, 10)]
    assert dice[:, 1].tolist() == [0.0, 0.0]
    assert hd95[:, 1].tolist() == pytest.approx(diagonals)
    assert dice[:, 2].isnan().all() and hd95[:, 2].isnan().all()
    assert torch.isfinite(dice[:, :2]).all() and torch.isfinite(hd95[:, :2]).all()

    summary = summarize(dice, hd95, ["a", "b", "c"])
    assert summary["dice_per_class"]["c"] is None and summary["hd95_per_class"]["c"] is None
    assert summary["dice"] == pytest.approx((dice[:, 0].double().mean().item() + 0.0) / 2)
    assert summary["hd95_per_class"]["b"] == pytest.approx(sum(diagonals) / 2)


def test_one_hot_inputs_match_label_maps():
    rng = np.random.default_rng(2)
    pred = torch.from_numpy(smooth_labels(rng, (2, 12, 12, 8), 3))[:, None]
    truth = torch.from_numpy(smooth_labels(rng, (2, 12, 12, 8), 3))[:, None]
    as_one_hot = lambda x: torch.nn.functional.one_hot(x[:, 0], 3).movedim(-1, 1)  # noqa: E731
    reference = case_scores(pred, truth, 3, spacing=(1.0, 1.0, 2.0))
    for p, t in [(as_one_hot(pred), truth), (pred, as_one_hot(truth)), (as_one_hot(pred), as_one_hot(truth))]:
        for got, want in zip(case_scores(p, t, 3, spacing=(1.0, 1.0, 2.0)), reference):
            torch.testing.assert_close(got, want, equal_nan=True)


def test_meta_tensor_inputs_give_plain_tensors():
    label = MetaTensor(torch.randint(0, 3, (1, 1, 6, 6, 6)).float(), affine=torch.diag(torch.tensor([2.0, 2, 2, 1])))
    assert all(type(scores) is torch.Tensor for scores in case_scores(label, label, 3))


@pytest.mark.parametrize(
    "pred, truth, spacing",
    [
        (torch.zeros(1, 2, 4, 4), torch.zeros(1, 1, 4, 4), None),  # 2 channels, 3 classes
        (torch.full((1, 1, 4, 4), 3), torch.zeros(1, 1, 4, 4), None),  # label out of range
        (torch.full((1, 3, 4, 4), 0.5), torch.zeros(1, 1, 4, 4), None),  # probabilities
        (torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 4, 5), None),  # spatial mismatch
        (torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 4, 4), (1.0, 1.0, 1.0)),  # 3 spacings in 2D
    ],
)
def test_rejects_malformed_inputs(pred, truth, spacing):
    with pytest.raises(ValueError):
        case_scores(pred, truth, num_classes=3, spacing=spacing)


def test_summarize_skips_nan_and_is_json_serialisable():
    nan = math.nan
    dice = torch.tensor([[0.5, nan, nan], [1.0, 0.25, nan], [nan, nan, nan]])
    hd95 = torch.tensor([[2.0, nan, nan], [4.0, 8.0, nan], [nan, nan, nan]])
    summary = summarize(dice, hd95, ["liver", "spleen", "kidney"])
    assert summary == {
        "dice": (0.75 + 0.25) / 2,
        "hd95": (3.0 + 8.0) / 2,
        "dice_per_class": {"liver": 0.75, "spleen": 0.25, "kidney": None},
        "hd95_per_class": {"liver": 3.0, "spleen": 8.0, "kidney": None},
        "cases": 3,
    }
    assert all(type(v) is float for v in (summary["dice"], summary["hd95"], summary["dice_per_class"]["liver"]))
    assert json.loads(json.dumps(summary, allow_nan=False)) == summary


def test_summarize_without_any_finite_value():
    empty = torch.full((2, 1), math.nan)
    summary = summarize(empty, empty, ["tumour"])
    assert summary["dice"] is None and summary["hd95"] is None and summary["cases"] == 2
    json.dumps(summary, allow_nan=False)
