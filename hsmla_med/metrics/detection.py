"""LUNA16 nodule detection: candidates from a probability volume, the official hit rule, and
FROC / CPM.

The rules are those of the LUNA16 evaluation script (noduleCADEvaluationLUNA16.py), followed
step for step: a candidate hits a finding when its squared distance to the finding's centre is
below the squared radius, a negative diameter standing for 10 mm (LUNA16's
``annotations_excluded.csv`` marks irrelevant findings of unknown size with -1). A candidate
inside an annotated nodule hits it, and every nodule it lies in (the script counts a candidate
in two overlapping nodules for both); a nodule counts once, with its most probable hit, and its
other hits are neither true nor false positives. A candidate that hits no nodule but an excluded
finding is ignored; any other candidate is a false positive. Before matching, a scan keeps at
most 100 candidates, those more probable than its 101st (ties at the cut go, as in the script).
Sensitivity is read at 1/8 .. 8 false positives per scan (linear interpolation of the FROC
curve, whose points are every distinct probability of a detected nodule or a false positive)
and CPM is the mean of those seven.

The confidence band is the script's ``computeFROC_bootstrap``: the scans are drawn with
replacement (as many as there are, each draw with all its nodules and false positives, the
number of scans staying the divisor of the false positives), the FROC of each draw is read at
the same false-positive rates, and the band is the mean and the ``floor(0.025 n)``-th and
``floor(0.975 n)``-th of the ``n`` sorted draws (the script's indices). The draws come from
NumPy's legacy ``RandomState(seed).randint``, the generator behind the script's
``np.random.randint``, so a seeded run of the script draws the same scans. Where the script
interpolates each draw on a grid of 10 000 rates and averages in float32, the draws here are
read at the rates themselves in float64 (the same values at rates on its grid, to float32
precision). Two degenerate draws, which the script turns into NaN (or a crash), are settled:
a draw without any nodule has no sensitivity and is left out (``draws_used`` counts the
others), and a draw whose nodules are all missed has sensitivity 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
from scipy import ndimage

from hsmla_med.metrics.froc import froc_summary

__all__ = [
    "FP_RATES", "MAX_MARKS", "ScanMatch", "affine_points", "extract_candidates", "keep_most_probable", "match_candidates",
    "nodule_froc", "froc_band", "froc_curve", "submission_matches", "submission_froc",
]

FP_RATES = (0.125, 0.25, 0.5, 1, 2, 4, 8)
MAX_MARKS = 100  # candidates per scan that the official script scores (maxNumberOfCADMarks)
_UNKNOWN_DIAMETER = 10.0  # what the script takes for a negative diameter
DRAWS = 1000  # the script's numberOfBootstrapSamples
CONFIDENCE = 0.95  # and its confidence


def affine_points(index: np.ndarray, affine) -> np.ndarray:
    """World millimetres ``(n, 3)`` of continuous voxel indices ``(n, 3)`` in the frame of
    ``affine`` ``(4, 4)`` (for MONAI's readers: RAS)."""
    affine = np.asarray(affine, dtype=np.float64)
    return np.asarray(index, dtype=np.float64).reshape(-1, 3) @ affine[:3, :3].T + affine[:3, 3]


def extract_candidates(prob: np.ndarray, threshold: float = 0.2, max_candidates: int = 100) -> np.ndarray:
    """Nodule candidates of a probability volume: one per 26-connected component above
    ``threshold``, at the component's probability-weighted centroid, scored by its maximum.

    Args:
        prob: ``(H, W, D)`` nodule probability.
        threshold: components are taken from ``prob > threshold``.
        max_candidates: how many of the most probable are kept (100 per scan is the usual
            limit of a LUNA16 submission).

    Returns:
        ``(n, 4)``: voxel ``(i, j, k)`` centroid and probability, most probable first.
    """
    prob = np.asarray(prob, dtype=np.float64)
    components, count = ndimage.label(prob > threshold, structure=np.ones((3,) * prob.ndim))
    if count == 0:
        return np.zeros((0, prob.ndim + 1))
    index = np.arange(1, count + 1)
    centres = np.asarray(ndimage.center_of_mass(prob, components, index)).reshape(count, prob.ndim)
    peaks = np.asarray(ndimage.maximum(prob, components, index)).reshape(count, 1)
    found = np.concatenate([centres, peaks], axis=1)
    return found[np.argsort(-found[:, -1], kind="stable")][:max_candidates]


class ScanMatch(NamedTuple):
    """The candidates of one scan matched to its findings.

    Attributes:
        nodule_probs: ``(m,)`` per annotated nodule, the probability of its most probable hit;
            NaN for a nodule no candidate hits.
        fp_probs: ``(k,)`` the probabilities of the false positives.
        ignored: candidates that hit an excluded finding and no nodule.
    """

    nodule_probs: np.ndarray
    fp_probs: np.ndarray
    ignored: int


def _inside(candidates: np.ndarray, findings: np.ndarray) -> np.ndarray:
    """``(n, m)`` bool: candidate i lies within finding j's radius. Squared distances against
    the squared radius, a negative diameter standing for 10 mm, as the official script has it."""
    diameter = np.where(findings[:, 3] < 0, _UNKNOWN_DIAMETER, findings[:, 3])
    squared = ((candidates[:, None, :3] - findings[None, :, :3]) ** 2).sum(axis=-1)
    return squared < (diameter[None] / 2.0) ** 2


def keep_most_probable(candidates: np.ndarray, max_marks: int = MAX_MARKS) -> np.ndarray:
    """The candidates ``(n, 4)`` of one scan that the official script scores: all when there are
    at most ``max_marks``, otherwise those strictly more probable than the ``max_marks + 1``-th
    most probable (so ties at the cut are all dropped, as there)."""
    candidates = np.asarray(candidates, dtype=np.float64).reshape(-1, 4)
    if len(candidates) <= max_marks:
        return candidates
    cut = np.sort(candidates[:, 3])[::-1][max_marks]
    return candidates[candidates[:, 3] > cut]


def match_candidates(candidates: np.ndarray, nodules: np.ndarray, excluded: np.ndarray | None = None) -> ScanMatch:
    """Match the candidates of one scan (world mm) to its nodules and excluded findings by the
    official rules (module docstring).

    Args:
        candidates: ``(n, 4)`` x, y, z (mm) and probability.
        nodules: ``(m, 4)`` x, y, z (mm) and diameter (mm) of the annotated nodules.
        excluded: ``(k, 4)`` likewise, the irrelevant findings (``annotations_excluded.csv``;
            a negative diameter is 10 mm).
    """
    candidates = np.asarray(candidates, dtype=np.float64).reshape(-1, 4)
    nodules = np.asarray(nodules, dtype=np.float64).reshape(-1, 4)
    excluded = np.zeros((0, 4)) if excluded is None else np.asarray(excluded, dtype=np.float64).reshape(-1, 4)
    hits = _inside(candidates, nodules)
    scored = np.where(hits, candidates[:, 3:], -np.inf)
    nodule_probs = np.where(hits.any(axis=0), scored.max(axis=0, initial=-np.inf), np.nan)
    on_nodule = hits.any(axis=1)
    ignored = ~on_nodule & _inside(candidates, excluded).any(axis=1)
    return ScanMatch(nodule_probs, candidates[~on_nodule & ~ignored, 3], int(ignored.sum()))


def nodule_froc(scans: Sequence[ScanMatch], fp_rates: Sequence[float] = FP_RATES) -> dict:
    """LUNA16 FROC over scans (a scan without candidates still counts in the false positives
    per scan).

    Args:
        scans: per scan, its :func:`match_candidates`.
        fp_rates: false positives per scan at which sensitivity is read.

    Returns:
        ``{"cpm": mean sensitivity over fp_rates, "sensitivity_at_4fp", "froc": {str(rate):
        sensitivity}, "nodules", "detected", "false_positives", "ignored", "scans"}``;
        ``cpm`` and the sensitivities are ``None`` without any nodule. ``ignored`` counts the
        candidates on excluded findings (neither true nor false positives).
    """
    nodule_probs = np.concatenate([np.zeros(0), *(np.asarray(s.nodule_probs, dtype=np.float64) for s in scans)])
    fp_probs = np.concatenate([np.zeros(0), *(np.asarray(s.fp_probs, dtype=np.float64) for s in scans)])
    detected = nodule_probs[~np.isnan(nodule_probs)]
    summary = froc_summary(fp_probs, detected, len(scans), fp_rates, num_targets=len(nodule_probs))
    return {
        "cpm": summary["froc"],
        "sensitivity_at_4fp": summary["sensitivity"].get("4"),
        "froc": summary["sensitivity"],
        "nodules": summary["targets"],
        "detected": int(detected.size),
        "false_positives": int(fp_probs.size),
        "ignored": sum(int(s.ignored) for s in scans),
        "scans": len(scans),
    }


def submission_matches(
    candidates: Mapping[str, np.ndarray],
    nodules: Mapping[str, np.ndarray],
    excluded: Mapping[str, np.ndarray],
    seriesuids: Sequence[str],
    max_marks: int = MAX_MARKS,
) -> list[ScanMatch]:
    """Per scan of ``seriesuids``, its :func:`match_candidates` as the official script scores a
    submission.

    Args:
        candidates: ``{seriesuid: (n, 4) x, y, z (mm), probability}`` of the submission.
        nodules, excluded: ``{seriesuid: (m, 4) x, y, z, diameter (mm)}``.
        seriesuids: the scans evaluated (``seriesuids.csv``); candidates of other scans are
            not scored, a scan without candidates counts with none.
        max_marks: candidates scored per scan (:func:`keep_most_probable`).
    """
    none = np.zeros((0, 4))
    return [
        match_candidates(keep_most_probable(candidates.get(uid, none), max_marks), nodules.get(uid, none), excluded.get(uid, none))
        for uid in seriesuids
    ]


def submission_froc(
    candidates: Mapping[str, np.ndarray],
    nodules: Mapping[str, np.ndarray],
    excluded: Mapping[str, np.ndarray],
    seriesuids: Sequence[str],
    max_marks: int = MAX_MARKS,
) -> dict:
    """:func:`nodule_froc` of a LUNA16 submission, as the official script scores it (arguments
    of :func:`submission_matches`)."""
    return nodule_froc(submission_matches(candidates, nodules, excluded, seriesuids, max_marks))


class _Pool:
    """The FROC entries of all scans (detected nodules and false positives), sorted once by
    falling probability, so that a bootstrap draw is a reweighting of the scans: the curve of a
    draw is two cumulative sums of the entries weighted by how often their scan was drawn.
    Hand-written because MONAI's ``compute_froc_curve_data`` counts the entries once per
    distinct probability (quadratic: about 10 s for one full LUNA16 submission, hours for
    1000 draws)."""

    def __init__(self, scans: Sequence[ScanMatch]) -> None:
        probs, scan, positive = [], [], []
        for k, match in enumerate(scans):
            detected = np.asarray(match.nodule_probs, dtype=np.float64)
            detected = detected[~np.isnan(detected)]
            fp = np.asarray(match.fp_probs, dtype=np.float64)
            probs += [detected, fp]
            scan.append(np.full(detected.size + fp.size, k))
            positive += [np.ones(detected.size, bool), np.zeros(fp.size, bool)]
        probs = np.concatenate([np.zeros(0), *probs])
        order = np.argsort(-probs, kind="stable")
        self.scan = np.concatenate([np.zeros(0, int), *scan])[order]
        self.positive = np.concatenate([np.zeros(0, bool), *positive])[order]
        # a threshold takes in every entry of its probability: the curve's points are at the
        # last entry of each run of equal probabilities
        self.ends = np.flatnonzero(np.r_[probs[order][1:] != probs[order][:-1], True]) if probs.size else np.zeros(0, int)
        self.nodules = np.array([len(match.nodule_probs) for match in scans], dtype=np.int64)

    def curve(self, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """The FROC curve, false positives per scan and sensitivity at each threshold from the
        highest, when scan k is taken ``counts[k]`` times (the divisor of the false positives
        staying the number of scans); ``None`` without any nodule."""
        total = int(counts @ self.nodules)
        if total == 0:
            return None
        weight = counts[self.scan]
        fps = np.r_[0, np.cumsum(np.where(self.positive, 0, weight))[self.ends]] / len(counts)
        return fps, np.r_[0, np.cumsum(np.where(self.positive, weight, 0))[self.ends]] / total

    def sensitivity(self, counts: np.ndarray, fp_rates: Sequence[float]) -> np.ndarray | None:
        """:meth:`curve` read at ``fp_rates``."""
        curve = self.curve(counts)
        return None if curve is None else np.interp(fp_rates, *curve)


def froc_curve(scans: Sequence[ScanMatch]) -> tuple[np.ndarray, np.ndarray] | None:
    """The points of the FROC curve of :func:`nodule_froc` (false positives per scan,
    sensitivity; from the highest threshold), for plotting; ``None`` without any nodule."""
    return _Pool(scans).curve(np.ones(len(scans), dtype=np.int64))


def froc_band(
    scans: Sequence[ScanMatch], draws: int = DRAWS, seed: int = 0, confidence: float = CONFIDENCE, fp_rates: Sequence[float] = FP_RATES
) -> dict:
    """The bootstrap confidence band of :func:`nodule_froc`, as the official script's
    ``computeFROC_bootstrap`` (module docstring): scans drawn with replacement ``draws`` times.

    Returns:
        ``{"froc": {str(rate): {"mean", "low", "high"}}, "cpm": {"mean", "low", "high"},
        "draws", "draws_used", "seed", "confidence", "method"}``; the values are ``None`` when
        no draw holds a nodule. ``cpm``: the same statistics of each draw's mean sensitivity
        over ``fp_rates`` (the script has no interval for CPM).
    """
    pool = _Pool(scans)
    rng = np.random.RandomState(seed)  # the legacy generator of the script's np.random.randint
    n = len(scans)
    curves = [pool.sensitivity(np.bincount(rng.randint(n, size=n), minlength=n), fp_rates) for _ in range(draws if n else 0)]
    curves = np.array([c for c in curves if c is not None]).reshape(-1, len(fp_rates))
    stats = _band(np.column_stack([curves, curves.mean(axis=1)]), confidence)
    return {
        "froc": {str(rate): stat for rate, stat in zip(fp_rates, stats)},
        "cpm": stats[-1],
        "draws": int(draws),
        "draws_used": len(curves),
        "seed": int(seed),
        "confidence": float(confidence),
        "method": "noduleCADEvaluationLUNA16.py computeFROC_bootstrap: scans resampled with replacement, "
                  "mean and percentile band of the draws",
    }


def _band(values: np.ndarray, confidence: float) -> list[dict]:
    """Per column of ``values`` (draws x statistics): the mean, and the script's lower and
    upper bounds: the ``floor(p n)``-th and ``floor((1 - p) n)``-th sorted draws, p = (1 -
    confidence) / 2 (``compute_mean_ci``)."""
    n = len(values)
    if n == 0:
        return [dict.fromkeys(("mean", "low", "high")) for _ in range(values.shape[1])]
    tail = (1.0 - confidence) / 2.0
    ordered = np.sort(values, axis=0)
    low, high = ordered[math.floor(tail * n)], ordered[math.floor((1.0 - tail) * n)]
    return [{"mean": float(m), "low": float(lo), "high": float(hi)} for m, lo, hi in zip(values.mean(axis=0), low, high)]
