"""The smoothing of a slide's patch probability map, one definition for the tumour outlines
drawn from the map (:func:`hsmla_med.io.annotations.tumour_regions`) and for the slide score
(:func:`hsmla_med.metrics.pathology.slide_score`).

It lives with the writers of the outlines rather than with the metrics, which build on
:mod:`hsmla_med.io` (and load MONAI: seconds, which the synthetic slides' ASAP writer does
without), so that the writers need nothing of the metrics.
"""

from __future__ import annotations

import numpy as np
from scipy.ndimage import gaussian_filter

__all__ = ["smooth_map"]


def smooth_map(prob_map: np.ndarray, sigma: float = 1.0) -> np.ndarray:
    """A probability map Gaussian-smoothed over its valid cells (normalised convolution).

    The zero-filled map and the validity mask are smoothed separately and divided, so each
    valid cell becomes a Gaussian-weighted mean over the valid cells around it: missing patches,
    inside the map or beyond its edge, count as neither tumour nor normal.

    Args:
        prob_map: ``(H, W)`` patch probabilities on the patch grid, NaN where there is no patch.
        sigma: Gaussian standard deviation in grid cells; 0 returns the map unchanged.

    Returns:
        ``(H, W)`` float64, NaN where ``prob_map`` is NaN.
    """
    prob_map = np.asarray(prob_map, dtype=np.float64)
    if prob_map.ndim != 2:
        raise ValueError(f"prob_map must be 2D (H, W), got shape {prob_map.shape}")
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    valid = ~np.isnan(prob_map)
    # mode="constant": cells beyond the map's edge are treated like missing patches
    values = gaussian_filter(np.where(valid, prob_map, 0.0), sigma, mode="constant")
    weights = gaussian_filter(valid.astype(np.float64), sigma, mode="constant")
    with np.errstate(invalid="ignore", divide="ignore"):  # divided everywhere; weights vanish only far from valid cells
        return np.where(valid, values / weights, np.nan)
