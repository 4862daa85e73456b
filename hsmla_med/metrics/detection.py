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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
from scipy import ndimage

from hsmla_med.metrics.froc import froc_summary

__all__ = [
    "FP_RATES", "MAX_MARKS", "ScanMatch", "affine_points", "extract_candidates", "keep_most_probable", "match_candidates",
    "nodule_froc", "submission_froc",
]

FP_RATES = (0.125, 0.25, 0.5, 1, 2, 4, 8)
MAX_MARKS = 100  # candidates per scan that the official script scores (maxNumberOfCADMarks)
_UNKNOWN_DIAMETER = 10.0  # what the script takes for a negative diameter


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


def submission_froc(
    candidates: Mapping[str, np.ndarray],
    nodules: Mapping[str, np.ndarray],
    excluded: Mapping[str, np.ndarray],
    seriesuids: Sequence[str],
    max_marks: int = MAX_MARKS,
) -> dict:
    """:func:`nodule_froc` of a LUNA16 submission, as the official script scores it.

    Args:
        candidates: ``{seriesuid: (n, 4) x, y, z (mm), probability}`` of the submission.
        nodules, excluded: ``{seriesuid: (m, 4) x, y, z, diameter (mm)}``.
        seriesuids: the scans evaluated (``seriesuids.csv``); candidates of other scans are
            not scored, a scan without candidates counts with none.
        max_marks: candidates scored per scan (:func:`keep_most_probable`).
    """
    none = np.zeros((0, 4))
    return nodule_froc([
        match_candidates(keep_most_probable(candidates.get(uid, none), max_marks), nodules.get(uid, none), excluded.get(uid, none))
        for uid in seriesuids
    ])
