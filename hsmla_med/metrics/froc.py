"""FROC from pooled detection probabilities, shared by the lesion-level (CAMELYON16) and the
nodule-level (LUNA16) evaluations: MONAI's ``compute_froc_curve_data`` and
``compute_froc_score`` fed in the layout of the official challenge scripts."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from monai.metrics import compute_froc_curve_data, compute_froc_score

__all__ = ["froc_summary"]


def froc_summary(fp_probs: Sequence[float], tp_probs: Sequence[float], num_images: int, fp_rates: Sequence[float]) -> dict:
    """Sensitivity at each mean false-positive rate per image, and their mean.

    Args:
        fp_probs: probabilities of all false-positive detections, pooled over the images.
        tp_probs: per target (lesion, nodule), the probability of its best detection; 0 when it
            was missed.
        num_images: images (slides, scans) the detections come from.
        fp_rates: false positives per image at which sensitivity is read (linear interpolation
            on the FROC curve, flat beyond its ends).

    Returns:
        ``{"froc": float | None, "sensitivity": {str(rate): float | None}, "targets": int}``;
        ``None`` when there is no target at all.

    Note:
        ``compute_froc_curve_data`` (like the official scripts) never uses the lowest probability
        in the pool as a threshold, because in the official layout that is the 0 recorded for a
        missed target. When every target is detected, no 0 is there and the least probable
        detection would silently never count; a 0.0 is therefore always added to the pool (as a
        false-positive probability, which no threshold above 0 counts).
    """
    tp = np.asarray(tp_probs, dtype=np.float64).reshape(-1)
    result = {"froc": None, "sensitivity": {str(r): None for r in fp_rates}, "targets": int(tp.size)}
    if tp.size == 0:
        return result
    fp = np.concatenate([[0.0], np.asarray(fp_probs, dtype=np.float64).reshape(-1)])
    fps_per_image, sensitivity = compute_froc_curve_data(fp, tp, num_targets=tp.size, num_images=num_images)
    result["froc"] = float(compute_froc_score(fps_per_image, sensitivity, eval_thresholds=tuple(fp_rates)))
    result["sensitivity"] = {str(r): float(compute_froc_score(fps_per_image, sensitivity, eval_thresholds=(r,))) for r in fp_rates}
    return result
