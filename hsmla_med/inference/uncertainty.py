"""Voxel-wise uncertainty of a prediction, and the review queue of ``infer --uncertainty``.

Two measures, both **normalised by log C** (C classes), so that they lie in [0, 1] whatever the
label set and one threshold means the same for every model:

* predictive entropy ``H(p) = -sum_c p_c log p_c / log C`` of the class probabilities (of an
  ensemble or of mirrored copies: of their mean): 0 where one class has all the mass, 1 where
  the classes are equally likely;
* mutual information (BALD, Houlsby et al. 2011): ``H(mean_m p_m) - mean_m H(p_m)`` over M
  predictions of the same voxel (the members of a checkpoint ensemble, the mirrored copies of
  test-time augmentation, or both): the part of the entropy that comes from the predictions
  disagreeing, 0 where they all agree however unsure each is. It needs only the mean
  probability and the mean of the members' entropies, so each member's entropy is accumulated
  as it predicts (:func:`~hsmla_med.inference.sliding.predict_volume` ``mean_entropy``, averaged
  over an ensemble like the probabilities: :data:`~hsmla_med.inference.ensemble.MEAN_KEYS`) and
  no member's class maps are kept.

``0 log 0`` is taken as 0 (``torch.special.xlogy``), so a probability of exactly 0 needs no
clamping. The review queue (:func:`case_row`, :func:`write_review_queue`) ranks cases by their
mean uncertainty over the predicted foreground. MONAI has no entropy or mutual-information
transform for class maps (its ``monai.metrics`` score predictions against labels), hence the
few lines here.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import torch

from hsmla_med.defaults import UNCERTAINTY_KINDS as KINDS
from hsmla_med.defaults import UNCERTAINTY_THRESHOLD as DEFAULT_THRESHOLD
from hsmla_med.io import atomic_path

__all__ = ["KINDS", "DEFAULT_THRESHOLD", "REVIEW_COLUMNS", "predictive_entropy", "mutual_information", "uncertainty_map", "case_row",
           "write_review_queue"]

#: the columns of ``uncertainty.csv``
REVIEW_COLUMNS = ("case", "mean_foreground_uncertainty", "uncertain_volume_ml", "foreground_volume_ml")


def predictive_entropy(probs: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Entropy of the class probabilities along ``dim`` (``(B, C, *spatial)`` -> ``(B,
    *spatial)`` for the default), divided by ``log C``: in [0, 1]. Accumulated one class at a
    time, so that a volume's class maps are not held a second time."""
    classes = probs.shape[dim]
    if classes < 2:
        raise ValueError(f"predictive_entropy needs at least 2 classes along dim {dim}, got {classes}")
    entropy = None
    for p in probs.unbind(dim):
        term = torch.special.xlogy(p, p)
        entropy = term.neg_() if entropy is None else entropy.sub_(term)
    return entropy.div_(math.log(classes))


def mutual_information(probs: torch.Tensor, mean_entropy: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Mutual information between the prediction and the member (BALD): the entropy of the
    members' mean probabilities ``probs`` minus ``mean_entropy``, the mean of the members' own
    :func:`predictive_entropy` (shaped as ``probs`` without ``dim``). Clamped at 0: it is >= 0
    by the concavity of entropy, and below only by float rounding where the members agree."""
    return predictive_entropy(probs, dim).sub_(mean_entropy).clamp_(min=0.0)


def uncertainty_map(kind: str, probs: torch.Tensor, mean_entropy: torch.Tensor | None = None) -> torch.Tensor:
    """The ``kind`` (:data:`KINDS`) map of one case's class probabilities ``(C, *spatial)``,
    ``(*spatial)``; ``mutual-information`` needs ``mean_entropy`` ``(*spatial)``."""
    if kind == "entropy":
        return predictive_entropy(probs, dim=0)
    if kind == "mutual-information":
        if mean_entropy is None:
            raise ValueError("mutual information needs the members' mean entropy (predict with several members or mirrored copies)")
        return mutual_information(probs, mean_entropy, dim=0)
    raise ValueError(f"unknown uncertainty {kind!r}; one of {', '.join(KINDS)}")


def case_row(case: str, uncertainty: np.ndarray, labels: np.ndarray, affine: np.ndarray, threshold: float = DEFAULT_THRESHOLD) -> dict:
    """One case's review-queue row (:data:`REVIEW_COLUMNS`) from its uncertainty map and label
    map on one grid (``affine``: that grid's voxel -> mm): the mean uncertainty over the voxels
    predicted foreground (label > 0; ``None`` where there are none), the volume in mL of the
    voxels whose uncertainty exceeds ``threshold`` (anywhere: a missed organ is uncertain
    background) and the predicted foreground's volume in mL."""
    if uncertainty.shape != labels.shape:
        raise ValueError(f"uncertainty map {uncertainty.shape} and label map {labels.shape} differ in shape")
    voxel_ml = abs(float(np.linalg.det(np.asarray(affine, dtype=np.float64)[:3, :3]))) / 1000.0
    foreground = labels > 0
    count = int(foreground.sum())
    mean = float(uncertainty[foreground].mean(dtype=np.float64)) if count else None
    return {"case": case, "mean_foreground_uncertainty": mean, "uncertain_volume_ml": int((uncertainty > threshold).sum()) * voxel_ml,
            "foreground_volume_ml": count * voxel_ml}


def write_review_queue(path: str | Path, rows: list[dict]) -> Path:
    """Write ``rows`` (:func:`case_row`) as a CSV, atomically, most uncertain first: by mean
    foreground uncertainty, descending, then by uncertain volume; cases without predicted
    foreground (an empty mean) last, by uncertain volume."""
    def order(row: dict):
        mean = row["mean_foreground_uncertainty"]
        return (mean is None, -(mean or 0.0), -row["uncertain_volume_ml"], row["case"])

    with atomic_path(path) as tmp, tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=REVIEW_COLUMNS)
        writer.writeheader()
        for row in sorted(rows, key=order):
            writer.writerow({k: "" if row[k] is None else row[k] if k == "case" else f"{row[k]:.6g}" for k in REVIEW_COLUMNS})
    return Path(path)
