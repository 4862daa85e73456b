"""CAMELYON16 metrics: slide-level ROC AUC and lesion-level FROC by the challenge's own rules.

A whole-slide model yields one tumour probability per patch; laid out on the patch grid this is
a probability map ``(H, W)`` with NaN where no patch was taken (background, outside tissue).
CAMELYON16 scores a submission twice:

* slide classification (tumour vs normal): :func:`slide_score` reduces each map to one number
  and :func:`auc` is the ROC AUC of those numbers over the slides;
* lesion detection: :func:`detect_lesions` turns a map into scored points, which are judged
  against the slide's *evaluation mask* (:func:`evaluation_mask`) and pooled into the FROC
  score, the mean sensitivity at 0.25, 0.5, 1, 2, 4 and 8 false positives per slide
  (:func:`slide_fp_tp`, :func:`lesion_froc`).

The lesion rules are those of the official ``Evaluation_FROC.py`` (Bejnordi et al., 2016):
the tumour annotation, rasterised at the evaluation level (level 5 of a 0.243 µm slide, 7.776 µm
pixels), is grown by a distance-transform threshold of 75 / (2 x pixel size) pixels (the
script's "75 µm"), holes are filled and 8-connected regions become lesions; a region whose
major axis (``regionprops``) is below 275 µm (200 µm plus the growth) is an isolated tumour
cell (ITC) cluster, on which a detection counts neither as true nor as false positive. A
detection at level-0 pixel (x, y) hits the label at ``[int(y / 2**level), int(x / 2**level)]``;
each lesion counts once, with its best detection's confidence; the rest are false positives
(every detection on a normal slide). MONAI carries the same rules (``monai.apps.pathology``:
``compute_multi_instance_mask``, ``compute_isolated_tumor_cells``; ``compute_froc_score``), and
they are used here; where not, the function says why. The script's number types are part of its
rules: confidences are Python floats (float64), but a lesion's best confidence is stored in a
float32 array, so a true and a false positive of the same decimal confidence can rank apart.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
import torch
from monai.apps.pathology.utils import compute_isolated_tumor_cells, compute_multi_instance_mask
from monai.metrics import compute_froc_score, compute_roc_auc
from monai.transforms import ProbNMS

# the slide score smooths as the tumour outlines do: one definition, below the metrics in io;
# named in __all__ as one of the metrics' functions too
from hsmla_med.io.smoothing import smooth_map

__all__ = ["FP_RATES", "OFFICIAL_MPP", "OFFICIAL_LEVEL", "auc", "auc_interval", "balanced_accuracy", "detect_lesions", "evaluation_geometry", "evaluation_mask", "lesion_froc",
           "slide_fp_tp", "slide_score", "smooth_map"]

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



def balanced_accuracy(scores, labels, threshold: float = 0.5) -> float | None:
    """The mean of sensitivity and specificity of ``scores > threshold``; ``None`` with one class."""
    scores, labels = np.asarray(scores, np.float64), np.asarray(labels, np.int64)
    if np.unique(labels).size < 2:
        return None
    predicted = scores > threshold
    return float((predicted[labels == 1].mean() + (~predicted[labels == 0]).mean()) / 2)


def auc_interval(scores, labels, draws: int = 1000, seed: int = 0, confidence: float = 0.95) -> list[float] | None:
    """Percentile bootstrap interval of the slide AUC (:func:`~hsmla_med.metrics.pathology.auc`):
    slides drawn with replacement ``draws`` times from a seeded generator, draws holding one class
    only (their AUC undefined) left out. ``None`` with fewer than two slides of either class.

    Written here rather than with :func:`~hsmla_med.metrics.summary.bootstrap_means`, whose
    statistic is a mean of per-case values: an AUC ranks the slides against each other.
    """
    scores, labels = np.asarray(scores, np.float64), np.asarray(labels, np.int64)
    if min((labels == 0).sum(), (labels == 1).sum()) < 2:
        return None
    picks = np.random.default_rng(seed).integers(0, len(scores), size=(draws, len(scores)))
    values = [auc(scores[p], labels[p]) for p in picks]
    values = [v for v in values if not math.isnan(v)]
    return [float(v) for v in np.percentile(values, [50 * (1 - confidence), 50 * (1 + confidence)])]


def slide_score(prob_map: np.ndarray, sigma: float = 1.0) -> float:
    """Slide-level tumour score: the maximum of the probability map after light Gaussian smoothing.

    This is the project's aggregation of patch probabilities into one slide score. Smoothing
    first damps an isolated false-positive patch while a lesion spanning several patches keeps
    its probability, so the maximum is less noisy than the raw maximum.

    Smoothing is :func:`smooth_map`'s (NaN-aware), so missing patches neither pull the score
    down nor count as evidence; a constant map keeps its value.

    Args:
        prob_map: ``(H, W)`` patch probabilities on the patch grid, NaN where there is no patch.
        sigma: Gaussian standard deviation in grid cells; 0 takes the raw maximum.

    Returns:
        The score in the range of the map's values; 0.0 for a map without any valid cell.
    """
    smoothed = smooth_map(prob_map, sigma)
    return float(np.nanmax(smoothed)) if not np.isnan(smoothed).all() else 0.0


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


OFFICIAL_MPP = 0.243  # µm per level-0 pixel, the official script's L0_RESOLUTION (for every slide)
OFFICIAL_LEVEL = 5  # its EVALUATION_MASK_LEVEL: the mask is made at downsample 2**5
GROW_UM = 75.0  # the official growth "75 µm": a distance threshold of GROW_UM / (2 x pixel size)
ITC_UM = 275.0  # 200 µm (an isolated tumour cell cluster) plus the 75 µm growth: the major-axis limit


def evaluation_geometry(mpp: float | None) -> tuple[float, int]:
    """The level-0 resolution and the evaluation level (mask downsample ``2**level``) for a slide
    of ``mpp`` µm per level-0 pixel.

    The official script takes 0.243 µm and level 5 for every slide (CAMELYON16's are 0.243 or
    0.226 µm). That is kept for every slide whose nearest power-of-two level to the official
    7.776 µm mask pixel is level 5 (level-0 pixels of about 0.17 to 0.34 µm, 40x scans) and
    when ``mpp`` is unknown, so that scores on CAMELYON16 are the official ones. Other
    resolutions (the synthetic 0.972 µm slides, 10x scans) get their own ``mpp`` at the level
    whose pixel is nearest 7.776 µm, where the official constants would grow lesions and size
    ITCs in the wrong units (by 4x at 0.972 µm).
    """
    if mpp is None:
        return OFFICIAL_MPP, OFFICIAL_LEVEL
    level = max(0, round(math.log2(OFFICIAL_MPP * 2**OFFICIAL_LEVEL / mpp)))
    return (OFFICIAL_MPP, OFFICIAL_LEVEL) if level == OFFICIAL_LEVEL else (float(mpp), level)


def evaluation_mask(tumour: np.ndarray, pixel_um: float) -> tuple[np.ndarray, int]:
    """The official evaluation mask of a tumour mask, with the ITC clusters numbered last.

    ``computeEvaluationMask`` and ``computeITCList`` of ``Evaluation_FROC.py``, by MONAI's
    transcriptions of them: grown by a Euclidean distance below ``75 / (2 * pixel_um)`` pixels,
    holes filled, 8-connected labels; regions whose ``major_axis_length`` is below
    ``275 / pixel_um`` pixels are ITCs. The labels are then renumbered so that the lesions to
    detect are ``1..n`` and the ITCs ``n+1..max``: a slide's truth is then the map and ``n``
    (:func:`slide_fp_tp`), and can travel as plain numbers (per patch, per slide) through a
    distributed validation. Which number a region gets does not change any count.

    Args:
        tumour: ``(H, W)`` boolean tumour mask at the evaluation level
            (:func:`~hsmla_med.data.asap.rasterise` at downsample ``2**level``).
        pixel_um: µm per pixel of that mask (``mpp * 2**level``).

    Returns:
        ``(labels, n)``: int64 ``(H, W)`` label map (0 = no lesion), and the number of lesions
        that are not ITCs.
    """
    tumour = np.asarray(tumour, dtype=bool)
    if tumour.ndim != 2:
        raise ValueError(f"tumour mask must be 2D (H, W), got shape {tumour.shape}")
    if not tumour.any():  # MONAI's distance transform of an image without tumour is meaningless
        return np.zeros(tumour.shape, np.int64), 0
    labels = compute_multi_instance_mask(tumour.astype(np.uint8), GROW_UM / (2 * pixel_um)).astype(np.int64)
    with warnings.catch_warnings():  # MONAI reads major_axis_length, skimage's deprecated name of axis_major_length
        warnings.simplefilter("ignore", FutureWarning)
        itc = set(compute_isolated_tumor_cells(labels, ITC_UM / pixel_um))
    order = [k for k in range(1, int(labels.max()) + 1) if k not in itc] + sorted(itc)
    renumber = np.zeros(int(labels.max()) + 1, np.int64)
    renumber[order] = np.arange(1, len(order) + 1)
    return renumber[labels], len(order) - len(itc)


def slide_fp_tp(probs, hits, lesions: int, labels: int) -> tuple[np.ndarray, np.ndarray]:
    """One slide's false-positive confidences and per-label best confidences, as the official
    ``compute_FP_TP_Probs``.

    Args:
        probs: ``(n,)`` detection confidences.
        hits: ``(n,)`` the evaluation-mask label each detection falls on (0 = none).
        lesions: labels ``1..lesions`` are lesions to detect; ``lesions+1..labels`` are ITCs
            (:func:`evaluation_mask`'s numbering). 0 and 0 for a normal slide.
        labels: the largest label of the slide's evaluation mask.

    Returns:
        ``(fp, tp)``: float64 confidences of detections on no label, and float32 per label
        ``1..labels`` the highest confidence above 0 of a detection on it, else 0 (missed
        lesions and every ITC: a detection on an ITC counts neither way). float32 because the
        official ``TP_probs`` is ``np.zeros((max_label,), dtype=np.float32)`` while its false
        positives stay Python floats: rounding the maximum once equals the script's rounding
        of each better confidence as it stores it, since rounding keeps order.

    Hand-written rather than MONAI's ``compute_fp_tp_probs_nd``, which takes a lesion's
    maximum even when it is not above 0, which the official script does not.
    """
    probs = np.asarray(probs, dtype=np.float64).reshape(-1)
    hits = np.asarray(hits, dtype=np.int64).reshape(-1)
    if probs.shape != hits.shape:
        raise ValueError(f"got {probs.size} confidences but {hits.size} hit labels")
    if not np.isfinite(probs).all():
        raise ValueError("detection confidences must be finite")
    if hits.size and (hits.min() < 0 or hits.max() > labels):
        raise ValueError(f"hit labels must be in 0..{labels}, got {hits.min()}..{hits.max()}")
    tp = np.zeros(labels, np.float64)
    on = (hits > 0) & (hits <= lesions)
    np.maximum.at(tp, hits[on] - 1, probs[on])
    return probs[hits == 0], tp.astype(np.float32)


def lesion_froc(slides: Sequence[tuple[np.ndarray, np.ndarray, int]], fp_rates: Sequence[float] = FP_RATES) -> dict:
    """CAMELYON16 lesion-level FROC over a set of slides, as ``Evaluation_FROC.py`` computes it.

    Args:
        slides: per slide ``(fp, tp, lesions)``: :func:`slide_fp_tp`'s two arrays and the
            slide's number of lesions to detect (ITCs not counted). Normal slides count too,
            for their false positives and in the mean per slide. ``tp`` is rounded to float32
            here (a no-op on :func:`slide_fp_tp`'s), as the official script stores it.
        fp_rates: mean false positives per slide at which sensitivity is read.

    Returns:
        ``{"froc": float | None, "sensitivity": {str(rate): float | None}, "lesions": int,
        "slides": int}``; None when there is no lesion to detect.

    The curve is the script's ``computeFROC``: every distinct confidence but the lowest of the
    pool is a threshold (the script takes the lowest for the 0 of a missed lesion or an ITC,
    which any real test set has), and at each the false positives and the true positives at or
    above it are counted; the sensitivity at each rate is ``np.interp`` on it
    (``compute_froc_score``). The script ran on NumPy < 1.24 (it uses ``np.object``), whose
    value-based casting compares its float32 array of true positives with a Python-float
    threshold in float32, and its false positives in float64: a true positive of 0.1 (float32
    0.10000000149) then ranks above a false positive of 0.1, and one of 0.7 (float32
    0.69999998808) ties with a false positive of 0.7 or 0.70000001. MONAI's
    ``compute_froc_curve_data`` runs the same loop but, under NumPy 2, compares the float32
    array with a float64 threshold in float64, so it is not used.
    """
    fp = np.concatenate([np.asarray(s[0], np.float64).reshape(-1) for s in slides]) if slides else np.zeros(0)
    tp = np.concatenate([np.asarray(s[1], np.float32).reshape(-1) for s in slides]) if slides else np.zeros(0, np.float32)
    lesions = int(sum(s[2] for s in slides))
    result = {"froc": None, "sensitivity": {str(r): None for r in fp_rates}, "lesions": lesions, "slides": len(slides)}
    if lesions == 0:
        return result
    # the script's sorted(set(FPs + TPs)) orders and tells apart its Python floats and float32
    # scalars in float64; np.unique does the same on the float64 values
    thresholds = np.unique(np.concatenate([fp, tp.astype(np.float64)]))[1:]
    # counts at or above each threshold: float64 for false positives, float32 for true positives
    fps = fp.size - np.searchsorted(np.sort(fp), thresholds, side="left")
    tps = tp.size - np.searchsorted(np.sort(tp), thresholds.astype(np.float32), side="left")
    fps_per_slide = np.append(fps, 0) / float(len(slides))
    sensitivity = np.append(tps, 0) / float(lesions)
    result["froc"] = float(compute_froc_score(fps_per_slide, sensitivity, eval_thresholds=tuple(fp_rates)))
    result["sensitivity"] = {str(r): float(compute_froc_score(fps_per_slide, sensitivity, eval_thresholds=(r,))) for r in fp_rates}
    return result
