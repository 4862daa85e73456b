"""CAMELYON16 metrics against hand-computed cases and brute-force references.

Expected values are worked out by hand in comments (FROC) or by independent code (pairwise AUC,
the Gaussian kernel written out), so a change in MONAI's behaviour or in the glue shows up.
"""

import math

import numpy as np
import pytest

from hsmla_med.metrics.pathology import auc, detect_lesions, evaluation_mask, lesion_froc, slide_fp_tp, slide_score

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


def test_evaluation_mask_eight_connected_without_growth():
    """With 90 µm pixels the official growth (distance < 75 / 180 pixels) adds nothing: the
    regions are the 8-connected pieces of the mask; the diagonal pair is an ITC (major axis 2.83
    pixels, under 275 / 90 = 3.06) and is numbered after the 3 x 3 lesion (3.27 pixels)."""
    mask = np.zeros((6, 6), bool)
    mask[0, 0] = mask[1, 1] = True  # diagonal neighbours: one region
    mask[3:6, 3:6] = True  # a second region
    labels, lesions = evaluation_mask(mask, 90.0)
    assert labels.max() == 2 and lesions == 1
    assert labels[0, 0] == labels[1, 1] == 2 and labels[5, 5] == 1
    assert (labels[~mask] == 0).all()


# ---------------------------------------------------------------------------------------- FROC
# slide_fp_tp counts detections by the evaluation-mask label they fall on (0 = none); lesions
# 1..lesions, ITCs above. Hand-computed cases of the official counting and curve.


def test_lesion_froc_hand_computed():
    # a tumour slide with lesions L1, L2, L3 and a normal slide
    tumour = slide_fp_tp([0.9, 0.6, 0.8, 0.35, 0.3], [1, 1, 2, 3, 0], lesions=3, labels=3)
    normal = slide_fp_tp([0.8, 0.4], [0, 0], lesions=0, labels=0)
    # L1's second hit (0.6): neither; lesions keep their best confidence in float32, as the official TP_probs
    assert tumour[0].tolist() == [0.3] and tumour[1].tolist() == [np.float32(0.9), np.float32(0.8), np.float32(0.35)]
    # 2 slides, 3 lesions. The pool: false positives 0.3, 0.4, 0.8 and lesions at float32 0.9
    # (0.89999998), 0.8 (0.80000001), 0.35 (0.34999999); as in the official script its lowest
    # value is not a threshold. Thresholds give (false positives per slide, sensitivity):
    #   >= 0.89999998: L1        -> (0.0, 1/3)
    #   >= 0.80000001: + L2      -> (0.0, 2/3)   (L2's float32 0.8 lies above the false positive's 0.8)
    #   >= 0.8:  + FP 0.8        -> (0.5, 2/3)
    #   >= 0.4:  + FP 0.4        -> (1.0, 2/3)
    #   >= 0.34999999: + L3      -> (1.0, 1)
    # Sensitivity at a rate: linear between points, flat beyond the last:
    #   0.25 -> 2/3 (in float64 the two 0.8s would enter together: 1/2);  0.5 -> 2/3;  1, 2, 4, 8 -> 1.
    # Had the double hit been a false positive (at 0.6), rate 1 would read 2/3 instead.
    expected = {"0.25": 2 / 3, "0.5": 2 / 3, "1": 1.0, "2": 1.0, "4": 1.0, "8": 1.0}
    result = lesion_froc([(*tumour, 3), (*normal, 0)])
    assert result["lesions"] == 3 and result["slides"] == 2
    assert result["sensitivity"] == pytest.approx(expected)
    assert result["froc"] == pytest.approx((2 / 3 + 2 / 3 + 4) / 6)  # 8/9


def test_slide_fp_tp_itc_hits_count_neither_way():
    # labels 1, 2 are lesions, 3 an ITC: its hit (0.95) is in neither list; L2's best hit counts;
    # a hit at confidence 0 leaves a lesion at 0, as the official "Probs[i] > TP_probs" does
    fp, tp = slide_fp_tp([0.95, 0.7, 0.2, 0.4, 0.0], [3, 2, 2, 0, 1], lesions=2, labels=3)
    assert fp.tolist() == [0.4] and tp.tolist() == [0.0, np.float32(0.7), 0.0]
    with pytest.raises(ValueError, match="0..3"):
        slide_fp_tp([0.9], [4], lesions=2, labels=3)


def test_lesion_froc_the_official_lowest_confidence_quirk():
    # Every lesion hit, no false positive, no ITC: the pool's lowest confidence (0.7) is never a
    # threshold in the official script (it takes it for a missed lesion's 0), so the perfect
    # detector reads 2/3. Kept, so that scores equal the official ones; a real test set has
    # missed lesions or ITCs (a 0 in the pool), and then every confidence counts.
    perfect = slide_fp_tp([0.9, 0.8, 0.7], [1, 2, 3], lesions=3, labels=3)
    assert lesion_froc([(*perfect, 3), (np.zeros(0), np.zeros(0), 0)])["froc"] == pytest.approx(2 / 3)
    with_itc = slide_fp_tp([0.9, 0.8, 0.7], [1, 2, 3], lesions=3, labels=4)
    assert lesion_froc([(*with_itc, 3)])["froc"] == pytest.approx(1.0)


def test_lesion_froc_missed_lesion():
    # L1 found, L2 and L3 missed, no false positives: 1/3 at every rate
    found = slide_fp_tp([0.9], [1], lesions=3, labels=3)
    assert lesion_froc([(*found, 3)])["froc"] == pytest.approx(1 / 3)
    assert lesion_froc([(*slide_fp_tp([], [], 3, 3), 3)])["froc"] == 0.0


def test_lesion_froc_without_lesions_is_none():
    normal = slide_fp_tp([0.9], [0], 0, 0)
    result = lesion_froc([(*normal, 0), (np.zeros(0), np.zeros(0), 0)])
    assert result == {"froc": None, "sensitivity": {r: None for r in RATES}, "lesions": 0, "slides": 2}


def test_detect_then_froc_end_to_end():
    # a probability map that lights up L1 and L2 strongly and L3 weakly (below threshold)
    labels = np.zeros((8, 8), int)
    labels[0:2, 0:2], labels[0:2, 5:7], labels[5:7, 2:4] = 1, 2, 3
    prob = np.where(labels == 1, 0.95, np.where(labels == 2, 0.85, np.where(labels == 3, 0.3, 0.05)))
    found = detect_lesions(prob, threshold=0.5, radius=1)
    cells = found[:, 1:].astype(int)
    fp, tp = slide_fp_tp(found[:, 0], labels[cells[:, 0], cells[:, 1]], 3, 3)
    assert lesion_froc([(fp, tp, 3)])["froc"] == pytest.approx(2 / 3)
