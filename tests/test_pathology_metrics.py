"""CAMELYON16 metrics against hand-computed cases and brute-force references.

Expected values are worked out by hand in comments (FROC) or by independent code (pairwise AUC,
the Gaussian kernel written out), so a change in MONAI's behaviour or in the glue shows up.
"""

import math

import numpy as np
import pytest

from hsmla_med.metrics.pathology import _slide_fp_tp, auc, detect_lesions, lesion_froc, lesion_labels, slide_score

RATES = ("0.25", "0.5", "1", "2", "4", "8")


def brute_auc(scores, labels) -> float:
    """Share of (positive, negative) pairs ranked correctly, ties counting one half."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    diff = pos[:, None] - neg[None, :]
    return ((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size


# ---------------------------------------------------------------------------------------- AUC


def test_auc_hand_computed():
    # positives 0.35 and 0.8 against negatives 0.1 and 0.4: 0.35 > 0.1, 0.35 < 0.4,
    # 0.8 beats both -> 3 of 4 pairs ranked correctly
    assert auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert auc([0.1, 0.4, 0.35, 0.8], [False, False, True, True]) == pytest.approx(0.75)


def test_auc_matches_pairwise_count_with_ties():
    rng = np.random.default_rng(0)
    for _ in range(5):
        labels = rng.integers(0, 2, 40)
        scores = np.round(rng.random(40) + 0.3 * labels, 1)  # rounding makes ties
        assert auc(scores, labels) == pytest.approx(brute_auc(scores, labels))


def test_auc_single_class_is_nan_without_warning(recwarn):
    assert math.isnan(auc([0.2, 0.9, 0.5], [1, 1, 1]))
    assert math.isnan(auc([], []))
    assert not recwarn.list


@pytest.mark.parametrize(
    "scores, labels",
    [([0.1, float("nan")], [0, 1]), ([0.1, 0.2], [0, 2]), ([0.1, 0.2, 0.3], [0, 1])],
)
def test_auc_rejects_bad_input(scores, labels):
    with pytest.raises(ValueError):
        auc(scores, labels)


# -------------------------------------------------------------------------------- slide score


def test_slide_score_single_hot_cell_is_gaussian_peak_weight():
    prob = np.zeros((11, 11))
    prob[5, 5] = 1.0
    # scipy truncates the kernel at 4 sigma: 1D weights exp(-x^2 / 2) for x = -4..4, normalised.
    # The cell's smoothed value is the product of the two central weights; the mask's smoothed
    # value is 1 (all cells valid and the kernel fits inside the map).
    w0 = 1.0 / sum(math.exp(-(x**2) / 2) for x in range(-4, 5))
    assert slide_score(prob, sigma=1.0) == pytest.approx(w0**2, rel=1e-9)  # ~0.159
    assert slide_score(prob, sigma=0.0) == 1.0


def test_slide_score_nan_is_ignored_not_zero():
    constant = np.full((7, 9), 0.7)
    constant[::2, ::3] = np.nan
    assert slide_score(constant) == pytest.approx(0.7)

    # a 2 x 2 lesion at 0.8 surrounded by missing patches keeps its value; surrounded by
    # tissue at 0 it is smoothed down
    island = np.full((8, 8), np.nan)
    island[3:5, 3:5] = 0.8
    assert slide_score(island) == pytest.approx(0.8)
    assert slide_score(np.nan_to_num(island)) < 0.5


def test_slide_score_all_nan_is_zero():
    assert slide_score(np.full((4, 5), np.nan)) == 0.0


# ---------------------------------------------------------------------------- lesion detection


def test_detect_lesions_peaks_and_plateau():
    prob = np.zeros((12, 12))
    prob[2, 2] = 0.9  # peak A
    prob[2, 4] = prob[0, 0] = 0.8  # 2 cells from A on either side: suppressed (radius 2)
    prob[5, 2] = 0.55  # 3 cells from A: a detection of its own
    prob[9, 9] = 0.7  # peak B
    prob[2:4, 8:10] = 0.6  # plateau: one detection, at its first cell in row-major order
    prob[9, 2] = 0.4  # below threshold
    prob[0, 11] = np.nan  # no patch
    before = prob.copy()
    found = detect_lesions(prob, threshold=0.5, radius=2)
    np.testing.assert_array_equal(found, [[0.9, 2, 2], [0.7, 9, 9], [0.6, 2, 8], [0.55, 5, 2]])
    np.testing.assert_array_equal(prob, before)  # the caller's map is not modified

    # with radius 0 nothing is suppressed: every cell above 0.5 is a detection
    assert len(detect_lesions(prob, threshold=0.5, radius=0)) == 4 + 1 + 4
    assert detect_lesions(prob, threshold=0.95).shape == (0, 3)


def test_lesion_labels_eight_connected():
    mask = np.zeros((6, 6), bool)
    mask[0, 0] = mask[1, 1] = True  # diagonal neighbours: one lesion
    mask[4:6, 3:6] = True  # a second lesion
    labels = lesion_labels(mask)
    assert labels.max() == 2
    assert labels[0, 0] == labels[1, 1] != labels[5, 5] > 0
    assert (labels[~mask] == 0).all()


# ---------------------------------------------------------------------------------------- FROC


def three_lesion_slide() -> np.ndarray:
    """8 x 8 slide with three square lesions: L1 top left, L2 top right, L3 bottom."""
    mask = np.zeros((8, 8), bool)
    mask[0:2, 0:2] = True  # L1
    mask[0:2, 5:7] = True  # L2
    mask[5:7, 2:4] = True  # L3
    return lesion_labels(mask)


def test_lesion_froc_hand_computed():
    tumour, normal = three_lesion_slide(), np.zeros((8, 8), int)
    detections = [
        np.array(
            [
                [0.9, 0, 0],  # L1: true positive
                [0.6, 1, 1],  # L1 again: ignored, neither TP nor FP
                [0.8, 0, 5],  # L2: true positive
                [0.35, 6, 3],  # L3: true positive
                [0.3, 4, 4],  # outside the lesions: false positive
            ]
        ),
        np.array([[0.8, 3, 3], [0.4, 7, 7]]),  # normal slide: two false positives
    ]
    # 2 slides, 3 lesions. Lowering the threshold through the probabilities gives the operating
    # points (false positives per slide = FPs / 2, sensitivity = lesions found / 3):
    #   >= 0.9:  L1             0 FP  -> (0.0, 1/3)
    #   >= 0.8:  + L2, FP 0.8   1 FP  -> (0.5, 2/3)   (tie: both enter together)
    #   >= 0.4:  + FP 0.4       2 FPs -> (1.0, 2/3)
    #   >= 0.35: + L3           2 FPs -> (1.0, 1)
    #   >= 0.3:  + FP 0.3       3 FPs -> (1.5, 1)
    # Sensitivity at a rate: the best point with that many FPs per slide, linear between
    # points, flat beyond the last:
    #   0.25 -> halfway from (0, 1/3) to (0.5, 2/3) = 1/2;  0.5 -> 2/3;  1 -> 1;  2, 4, 8 -> 1.
    # Had the double hit been a false positive (at 0.6), rate 1 would read 2/3 instead.
    expected = {"0.25": 1 / 2, "0.5": 2 / 3, "1": 1.0, "2": 1.0, "4": 1.0, "8": 1.0}
    result = lesion_froc(detections, [tumour, normal])
    assert result["lesions"] == 3 and result["slides"] == 2
    assert result["sensitivity"] == pytest.approx(expected)
    assert result["froc"] == pytest.approx((1 / 2 + 2 / 3 + 4) / 6)  # 31/36


def former_slide_fp_tp(detections, labels):
    """The hand-written counting that MONAI's compute_fp_tp_probs_nd replaced."""
    lesion_ids = np.unique(labels[labels > 0])
    tp, fp = np.zeros(lesion_ids.size), []
    for prob, row, col in detections:
        hit = labels[int(round(row)), int(round(col))]
        if hit == 0:
            fp.append(prob)
        else:
            k = np.searchsorted(lesion_ids, hit)
            tp[k] = max(tp[k], prob)
    return np.array(fp), tp


def test_slide_fp_tp_matches_the_former_counting():
    # the hand-computed slide above, then lesions numbered with gaps (2, 7: two lesions, not
    # seven) hit off-centre (rounding), twice, and missed
    tumour = three_lesion_slide()
    cases = [(np.array([[0.9, 0, 0], [0.6, 1, 1], [0.8, 0, 5], [0.35, 6, 3], [0.3, 4, 4]]), tumour)]
    gaps = np.where(tumour == 1, 2, np.where(tumour == 2, 7, 0))
    cases.append((np.array([[0.7, 0.6, 1.4], [0.75, 0.2, 0.3], [0.2, 3.6, 3.4]]), gaps))
    for detections, labels in cases:
        fp, tp = _slide_fp_tp(detections, labels, 0)
        old_fp, old_tp = former_slide_fp_tp(detections, labels)
        np.testing.assert_allclose(fp, old_fp, rtol=1e-7)
        np.testing.assert_allclose(tp, old_tp, rtol=1e-7)
    assert _slide_fp_tp(*cases[1], 0)[1].tolist() == pytest.approx([0.75, 0.0])


def test_lesion_froc_perfect_detector_is_one():
    # every lesion hit, no false positive: the least probable hit must count too
    detections = [np.array([[0.9, 0, 0], [0.8, 0, 5], [0.7, 5, 2]]), np.zeros((0, 3))]
    result = lesion_froc(detections, [three_lesion_slide(), np.zeros((8, 8), int)])
    assert result["froc"] == pytest.approx(1.0)
    assert all(result["sensitivity"][r] == pytest.approx(1.0) for r in RATES)


def test_lesion_froc_missed_lesion():
    # L1 found, L2 and L3 missed, no false positives: 1/3 at every rate
    result = lesion_froc([np.array([[0.9, 1, 1]])], [three_lesion_slide()])
    assert result["froc"] == pytest.approx(1 / 3)
    assert lesion_froc([np.zeros((0, 3))], [three_lesion_slide()])["froc"] == 0.0


def test_lesion_froc_without_lesions_is_none():
    normal = np.zeros((8, 8), int)
    result = lesion_froc([np.array([[0.9, 1, 1]]), np.zeros((0, 3))], [normal, normal])
    assert result == {"froc": None, "sensitivity": {r: None for r in RATES}, "lesions": 0, "slides": 2}


def test_lesion_froc_rejects_detection_outside_map():
    with pytest.raises(ValueError, match="outside"):
        lesion_froc([np.array([[0.9, 8, 0]])], [three_lesion_slide()])


def test_detect_then_froc_end_to_end():
    # a probability map that lights up L1 and L2 strongly and L3 weakly (below threshold)
    labels = three_lesion_slide()
    prob = np.where(labels == 1, 0.95, np.where(labels == 2, 0.85, np.where(labels == 3, 0.3, 0.05)))
    result = lesion_froc([detect_lesions(prob, threshold=0.5, radius=1)], [labels])
    assert result["froc"] == pytest.approx(2 / 3)
