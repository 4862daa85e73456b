"""FROC from pooled detection probabilities, shared by the lesion-level (CAMELYON16) and the
nodule-level (LUNA16) evaluations: MONAI's ``compute_froc_curve_data`` and
``compute_froc_score`` fed in the layout of the official challenge scripts."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from monai.metrics import compute_froc_curve_data, compute_froc_score

__all__ = ["froc_summary"]


def froc_summary(
    fp_probs: Sequence[float], tp_probs: Sequence[float], num_images: int, fp_rates: Sequence[float], num_targets: int | None = None
) -> dict:
    """Sensitivity at each mean false-positive rate per image, and their mean.

    Args:
        fp_probs: probabilities of all false-positive detections, pooled over the images.
        tp_probs: without ``num_targets`` (the CAMELYON16 layout): per target (lesion), the
            probability of its best detection, 0 when it was missed; no probability <= 0 is then
            a threshold (a detection of probability 0 is a miss). With ``num_targets`` (the LUNA16
            layout): the best probability of each *detected* target only, and every probability
            given, however low, is a threshold (as in noduleCADEvaluationLUNA16.py, whose missed
            nodules stay out of the curve's points).
        num_images: images (slides, scans) the detections come from.
        fp_rates: false positives per image at which sensitivity is read (linear interpolation
            on the FROC curve, flat beyond its ends).
        num_targets: all targets, detected or missed (LUNA16 layout).

    Returns:
        ``{"froc": float | None, "sensitivity": {str(rate): float | None}, "targets": int}``;
        ``None`` when there is no target at all.

    Note:
        ``compute_froc_curve_data`` (like the official CAMELYON16 script) never uses the lowest
        probability in the pool as a threshold, because in that layout it is the 0 recorded
        for a missed target. A -inf false positive, which no threshold counts, is therefore
        always added to the pool, so that every probability that should be a threshold is one.
    """
    fp = np.asarray(fp_probs, dtype=np.float64).reshape(-1)
    tp = np.asarray(tp_probs, dtype=np.float64).reshape(-1)
    if num_targets is None:
        num_targets = int(tp.size)
        fp, tp = fp[fp > 0], tp[tp > 0]
    result = {"froc": None, "sensitivity": {str(r): None for r in fp_rates}, "targets": int(num_targets)}
    if num_targets == 0:
        return result
    fp = np.concatenate([[-np.inf], fp])
    fps_per_image, sensitivity = compute_froc_curve_data(fp, tp, num_targets=num_targets, num_images=num_images)
    result["froc"] = float(compute_froc_score(fps_per_image, sensitivity, eval_thresholds=tuple(fp_rates)))
    result["sensitivity"] = {str(r): float(compute_froc_score(fps_per_image, sensitivity, eval_thresholds=(r,))) for r in fp_rates}
    return result
