"""LUNA16 nodule detection: candidates from a probability volume, the official hit rule, and
FROC / CPM.

The rules follow the LUNA16 evaluation script (noduleCADEvaluationLUNA16.py): a candidate hits a
nodule when its distance to the nodule's centre is below the nodule's radius; a nodule counts
once, with its most probable hit; a candidate that hits no nodule but an excluded finding
(``annotations_excluded.csv``; a negative diameter there stands for 10 mm, as in the script) is
ignored; any other candidate is a false positive. Sensitivity is read at 1/8 .. 8 false
positives per scan and CPM is the mean of those seven.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy import ndimage

from hsmla_med.metrics.froc import froc_summary

__all__ = ["FP_RATES", "IGNORED", "FALSE_POSITIVE", "affine_points", "extract_candidates", "match_candidates", "nodule_froc"]

FP_RATES = (0.125, 0.25, 0.5, 1, 2, 4, 8)
FALSE_POSITIVE, IGNORED = -1, -2  # match codes besides the index of the nodule hit
_EXCLUDED_DEFAULT_DIAMETER = 10.0


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


def match_candidates(candidates: np.ndarray, nodules: np.ndarray, excluded: np.ndarray | None = None) -> np.ndarray:
    """Match the candidates of one scan (world mm) to its nodules.

    Args:
        candidates: ``(n, 4)`` x, y, z (mm) and probability.
        nodules: ``(m, 4)`` x, y, z (mm) and diameter (mm) of the annotated nodules.
        excluded: ``(k, 4)`` likewise, the findings that count neither way.

    Returns:
        ``(n,)`` int: the index of the nodule hit (the closest, relative to its radius, when a
        candidate lies in several), :data:`IGNORED` or :data:`FALSE_POSITIVE`.
    """
    candidates = np.asarray(candidates, dtype=np.float64).reshape(-1, 4)
    codes = np.full(len(candidates), FALSE_POSITIVE, dtype=np.int64)
    nodules = np.asarray(nodules, dtype=np.float64).reshape(-1, 4)
    if len(nodules):
        dist = np.linalg.norm(candidates[:, None, :3] - nodules[None, :, :3], axis=-1) / (nodules[None, :, 3] / 2)
        inside = dist < 1
        closest = np.argmin(np.where(inside, dist, np.inf), axis=1)
        codes = np.where(inside.any(axis=1), closest, codes)
    if excluded is not None and len(excluded):
        excluded = np.asarray(excluded, dtype=np.float64).reshape(-1, 4)
        radius = np.where(excluded[:, 3] < 0, _EXCLUDED_DEFAULT_DIAMETER, excluded[:, 3]) / 2
        near = (np.linalg.norm(candidates[:, None, :3] - excluded[None, :, :3], axis=-1) < radius[None]).any(axis=1)
        codes = np.where((codes == FALSE_POSITIVE) & near, IGNORED, codes)
    return codes


def nodule_froc(scans: Sequence[tuple[np.ndarray, np.ndarray, int]], fp_rates: Sequence[float] = FP_RATES) -> dict:
    """LUNA16 FROC over scans.

    Args:
        scans: per scan, ``(probabilities (n,), match codes (n,) from :func:`match_candidates`,
            number of nodules)``.
        fp_rates: false positives per scan at which sensitivity is read.

    Returns:
        ``{"cpm": mean sensitivity over fp_rates, "sensitivity_at_4fp", "froc": {str(rate):
        sensitivity}, "nodules", "scans"}``; ``cpm`` and the sensitivities are ``None`` without
        any nodule.
    """
    fp_probs, tp_probs = [], []
    for probs, codes, num_nodules in scans:
        probs, codes = np.asarray(probs, dtype=np.float64), np.asarray(codes)
        fp_probs += probs[codes == FALSE_POSITIVE].tolist()
        best = np.zeros(num_nodules)
        for k in range(num_nodules):  # a nodule counts once, by its most probable hit
            if np.any(codes == k):
                best[k] = probs[codes == k].max()
        tp_probs += best.tolist()
    summary = froc_summary(fp_probs, tp_probs, len(scans), fp_rates)
    return {
        "cpm": summary["froc"],
        "sensitivity_at_4fp": summary["sensitivity"].get("4"),
        "froc": summary["sensitivity"],
        "nodules": summary["targets"],
        "scans": len(scans),
    }
