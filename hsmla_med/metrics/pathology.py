"""CAMELYON16 metrics: slide-level ROC AUC and lesion-level FROC, from patch-probability maps.

A whole-slide model yields one tumour probability per patch; laid out on the patch grid this is
a probability map ``(H, W)`` with NaN where no patch was taken (background, outside tissue).
CAMELYON16 scores such maps twice:

* slide classification (tumour vs normal): :func:`slide_score` reduces each map to one number
  and :func:`auc` is the ROC AUC of those numbers over the slides;
* lesion detection: :func:`detect_lesions` turns a map into scored points, and
  :func:`lesion_froc` matches them against the lesions of the tumour masks
  (:func:`lesion_labels`) and reports the FROC score, the mean sensitivity at
  0.25, 0.5, 1, 2, 4 and 8 false positives per slide.

The counting and the curve are MONAI's (``compute_roc_auc``, ``ProbNMS``,
``compute_fp_tp_probs_nd``, ``compute_froc_curve_data``, ``compute_froc_score``); this module
feeds them in the layout they expect and guards their edge cases (see each function).

Everything works on the patch grid. The official evaluation additionally dilates lesion masks
by 75 µm and ignores isolated tumour cells (lesions under 200 µm, where hits count neither as
true nor as false positives); at patch-grid resolution (one cell is tens of µm or more) those
rules are not applied here, so scores are close to, but not identical with, the official ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from monai.metrics import compute_fp_tp_probs_nd, compute_roc_auc
from monai.transforms import ProbNMS
from scipy.ndimage import gaussian_filter
from skimage.measure import label as connected_components
from skimage.segmentation import relabel_sequential

from hsmla_med.metrics.froc import froc_summary

__all__ = ["auc", "detect_lesions", "lesion_froc", "lesion_labels", "slide_score"]

FP_RATES = (0.25, 0.5, 1, 2, 4, 8)


def auc(scores, labels) -> float:
    """ROC AUC of binary labels ranked by scores (ties count one half), with MONAI.

    Args:
        scores: ``(n,)`` finite scores, higher meaning "more likely positive" (e.g. slide scores).
        labels: ``(n,)`` labels, 0/1 or bool (1 = tumour slide).

    Returns:
        The AUC in [0, 1]; ``float('nan')`` when fewer than two classes are present, since the
        AUC is then undefined (callers record it as None). MONAI would return NaN with a
        warning for that case and also, silently apart from a warning, for labels other than
        0/1; here the single-class case is answered quietly and other labels raise.

    Raises:
        ValueError: shapes differ, scores are not finite, or labels are not 0/1.
    """
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    labels = np.asarray(labels).reshape(-1)
    if scores.shape != labels.shape:
        raise ValueError(f"scores and labels must have the same length, got {scores.size} and {labels.size}")
    if not np.isfinite(scores).all():
        raise ValueError("scores must be finite (no NaN or inf)")
    if not np.isin(labels, (0, 1)).all():
        raise ValueError(f"labels must be 0 or 1, got values {np.unique(labels).tolist()}")
    if np.unique(labels).size < 2:
        return math.nan
    return float(compute_roc_auc(torch.from_numpy(scores), torch.from_numpy(labels.astype(np.float64))))


def slide_score(prob_map: np.ndarray, sigma: float = 1.0) -> float:
    """Slide-level tumour score: the maximum of the probability map after light Gaussian smoothing.

    This is the project's aggregation of patch probabilities into one slide score. Smoothing
    first damps an isolated false-positive patch while a lesion spanning several patches keeps
    its probability, so the maximum is less noisy than the raw maximum.

    Smoothing is NaN-aware (normalised convolution): the zero-filled map and the validity mask
    are smoothed separately and divided, so each valid cell becomes a Gaussian-weighted mean
    over the valid cells around it. Missing patches, inside the map or beyond its edge, thus
    neither pull the score down nor count as evidence; a constant map keeps its value.

    Args:
        prob_map: ``(H, W)`` patch probabilities on the patch grid, NaN where there is no patch.
        sigma: Gaussian standard deviation in grid cells; 0 takes the raw maximum.

    Returns:
        The score in the range of the map's values; 0.0 for a map without any valid cell.
    """
    prob_map = np.asarray(prob_map, dtype=np.float64)
    if prob_map.ndim != 2:
        raise ValueError(f"prob_map must be 2D (H, W), got shape {prob_map.shape}")
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    valid = ~np.isnan(prob_map)
    if not valid.any():
        return 0.0
    # mode="constant": cells beyond the map's edge are treated like missing patches
    values = gaussian_filter(np.where(valid, prob_map, 0.0), sigma, mode="constant")
    weights = gaussian_filter(valid.astype(np.float64), sigma, mode="constant")
    return float((values[valid] / weights[valid]).max())


def detect_lesions(prob_map: np.ndarray, threshold: float = 0.5, radius: int = 2) -> np.ndarray:
    """Candidate lesion detections: greedy non-maximum suppression of a probability map.

    MONAI's ``ProbNMS`` (the grid-level core of ``PathologyProbNMS``) repeatedly takes the most
    probable cell and clears the square of ``radius`` cells around it, until no value exceeds
    ``threshold``. Of equal values (a plateau) the first in row-major order is kept.

    Args:
        prob_map: ``(H, W)`` patch probabilities, NaN where there is no patch (treated as 0;
            left as NaN it would stop MONAI's search at once, as NaN comparisons are false).
        threshold: only probabilities strictly above it are detected (>= 0).
        radius: suppression half-width in grid cells; the cleared box is ``2 * radius + 1`` wide.

    Returns:
        ``(n, 3)`` float array of ``(prob, row, col)``, sorted by probability, highest first.
    """
    prob_map = np.asarray(prob_map, dtype=np.float64)
    if prob_map.ndim != 2:
        raise ValueError(f"prob_map must be 2D (H, W), got shape {prob_map.shape}")
    if radius < 0:
        raise ValueError(f"radius must be >= 0, got {radius}")
    # nan_to_num copies: ProbNMS zeroes the array it is given in place
    nms = ProbNMS(spatial_dims=2, prob_threshold=threshold, box_size=2 * radius + 1)
    found = nms(np.nan_to_num(prob_map, nan=0.0))
    return np.asarray(found, dtype=np.float64).reshape(-1, 3)


def lesion_labels(tumour_mask: np.ndarray) -> np.ndarray:
    """Lesions of a tumour mask: its 8-connected components.

    Args:
        tumour_mask: ``(H, W)`` boolean (or 0/1) tumour mask on the patch grid.

    Returns:
        ``(H, W)`` int label map: 0 = no lesion, 1..k = lesion number.
    """
    tumour_mask = np.asarray(tumour_mask, dtype=bool)
    if tumour_mask.ndim != 2:
        raise ValueError(f"tumour_mask must be 2D (H, W), got shape {tumour_mask.shape}")
    return connected_components(tumour_mask, connectivity=2).astype(np.int64)


def _slide_fp_tp(detections: np.ndarray, labels: np.ndarray, slide: int) -> tuple[np.ndarray, np.ndarray]:
    """False-positive probabilities and per-lesion best probabilities (0 = missed) of one slide,
    by MONAI's ``compute_fp_tp_probs_nd`` (the official script's counting).

    Around it: detections are rounded to grid cells and must lie on the map (MONAI would wrap
    negative indices); lesion numbers are made consecutive (MONAI counts every number up to the
    largest as a lesion); and probabilities are float32 on both sides, since MONAI returns the
    true positives' in float32: a float64 false positive would otherwise break a tie with a
    true positive of the same probability (0.8 as float32 is above 0.8 as float64).
    """
    cells = np.rint(detections[:, 1:]).astype(np.int64)
    outside = ((cells < 0) | (cells >= labels.shape)).any(axis=1)
    if outside.any():
        row, col = detections[outside][0, 1:]
        raise ValueError(f"slide {slide}: detection at ({row}, {col}) lies outside the {labels.shape} label map")
    lesions = relabel_sequential(labels.astype(np.int64))[0]
    fp, tp, _ = compute_fp_tp_probs_nd(detections[:, 0].astype(np.float32), cells, lesions)
    return fp, tp


def lesion_froc(
    detections: Sequence[np.ndarray],
    lesion_labels: Sequence[np.ndarray],
    fp_rates: Sequence[float] = FP_RATES,
) -> dict:
    """CAMELYON16 lesion-level FROC over a set of slides.

    A detection inside lesion k is a true positive for k, and each lesion counts once, with the
    probability of its best detection; further hits on the same lesion are neither true nor
    false positives, as in the official evaluation. A detection outside every lesion is a false
    positive. Sweeping the probability threshold gives sensitivity against mean false positives
    per slide; the sensitivity at each FP rate is read off that curve by linear interpolation
    (flat beyond its ends), and the FROC score is their mean.

    Args:
        detections: per slide, ``(n_i, 3)`` array of ``(prob, row, col)`` on the grid of the
            slide's label map (e.g. from :func:`detect_lesions`). Probabilities must be finite;
            those <= 0 are dropped, being indistinguishable from "not detected".
        lesion_labels: per slide, ``(H_i, W_i)`` int lesion map (:func:`lesion_labels`):
            0 = no lesion, k > 0 = lesion k; all zeros for a normal slide.
        fp_rates: mean false positives per slide at which sensitivity is measured.

    Returns:
        ``{"froc": float | None, "sensitivity": {str(rate): float | None}, "lesions": int,
        "slides": int}``; froc and sensitivities are None when there is no lesion at all.

    The curve and its reading are :func:`~hsmla_med.metrics.froc.froc_summary`'s.
    """
    if len(detections) != len(lesion_labels):
        raise ValueError(f"got detections for {len(detections)} slides but labels for {len(lesion_labels)}")
    fp_probs, tp_probs = [], []
    for i, (found, labels) in enumerate(zip(detections, lesion_labels)):
        found = np.asarray(found, dtype=np.float64).reshape(-1, 3)
        labels = np.asarray(labels)
        if labels.ndim != 2:
            raise ValueError(f"slide {i}: lesion labels must be 2D (H, W), got shape {labels.shape}")
        if not np.isfinite(found).all():
            raise ValueError(f"slide {i}: detections must be finite")
        fp, tp = _slide_fp_tp(found[found[:, 0] > 0], labels, i)
        fp_probs.append(fp)
        tp_probs.append(tp)
    summary = froc_summary(
        np.concatenate(fp_probs) if fp_probs else [], np.concatenate(tp_probs) if tp_probs else [], len(detections), fp_rates
    )
    return {"froc": summary["froc"], "sensitivity": summary["sensitivity"], "lesions": summary["targets"], "slides": len(detections)}
