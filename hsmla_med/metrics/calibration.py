"""Calibration of class probabilities: expected calibration error over equal-mass bins (all
samples and the foreground), the multi-class Brier score and the negative log-likelihood.

A sample is one voxel (segmentation) or one patch (classification): its class probabilities
``(C,)`` and its label. Everything is computed in float64. Confidence is the largest class
probability, and a sample is correct when the argmax is its label (the first class on ties, as
``torch.argmax``). MONAI, scikit-learn and torchmetrics have no equal-mass multi-class ECE
(torchmetrics bins uniformly, scikit-learn's ``calibration_curve`` is binary and cuts at
quantiles, which keeps tied confidences together and leaves the bins unequal), so it is written
here.
"""

from __future__ import annotations

import torch

__all__ = ["BINS", "NLL_FLOOR", "brier_score", "calibration_metrics", "expected_calibration_error", "foreground", "flatten_maps",
           "negative_log_likelihood", "reliability"]

#: bins of the expected calibration error
BINS = 15
#: the least probability the NLL takes (float32's smallest normal number): float32 inference rounds
#: smaller probabilities to 0, whose log is -inf; one such sample would make the mean infinite
NLL_FLOOR = float(torch.finfo(torch.float32).tiny)


def _inputs(probs, labels) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.as_tensor(probs, dtype=torch.float64)
    labels = torch.as_tensor(labels).long().reshape(-1)
    if probs.dim() != 2 or probs.shape[0] != labels.shape[0]:
        raise ValueError(f"probabilities (N, C) and labels (N,) expected, got {tuple(probs.shape)} and {tuple(labels.shape)}")
    if labels.numel() and (labels.min() < 0 or labels.max() >= probs.shape[1]):
        raise ValueError(f"labels must lie in 0..{probs.shape[1] - 1}, got {labels.min().item()}..{labels.max().item()}")
    return probs, labels


def reliability(probs, labels, bins: int = BINS) -> dict[str, torch.Tensor]:
    """The equal-mass bins of the reliability diagram.

    Args:
        probs: ``(N, C)`` class probabilities.
        labels: ``(N,)`` class indices.
        bins: number of bins.

    The samples are sorted by confidence (a stable sort: tied confidences keep their input
    order) and cut into ``bins`` consecutive runs of equal size; when ``N`` is not a multiple of
    ``bins`` the first ``N % bins`` runs hold one sample more (``numpy.array_split``'s rule).
    With fewer samples than bins, the last bins are empty and left out.

    Returns:
        ``confidence`` and ``accuracy`` (float64, the mean confidence and the share correct of
        each non-empty bin) and ``count`` (int64, its samples).
    """
    probs, labels = _inputs(probs, labels)
    confidence, predicted = probs.max(1).values, probs.argmax(1)  # (max's indices need not be the first on ties)
    order = torch.sort(confidence, stable=True).indices
    correct = (predicted == labels).double()[order]
    confidence = confidence[order]
    n = len(confidence)
    sizes = torch.full((bins,), n // bins, dtype=torch.int64)
    sizes[: n % bins] += 1
    sizes = sizes[sizes > 0]
    edges = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
    mean = lambda v: torch.stack([v[a:b].mean() for a, b in zip(edges[:-1], edges[1:])]) if len(sizes) else v.new_zeros(0)  # noqa: E731
    return {"confidence": mean(confidence), "accuracy": mean(correct), "count": sizes}


def expected_calibration_error(probs, labels, bins: int = BINS) -> float | None:
    """``sum_b n_b / N * |accuracy_b - confidence_b|`` over the equal-mass bins of
    :func:`reliability`; ``None`` without samples."""
    table = reliability(probs, labels, bins)
    total = table["count"].sum()
    if total == 0:
        return None
    return float((table["count"].double() / total * (table["accuracy"] - table["confidence"]).abs()).sum())


def brier_score(probs, labels) -> float | None:
    """The multi-class Brier score: the mean over samples of ``sum_c (p_c - onehot_c)^2``
    (0: certain and right, 2: certain and wrong); ``None`` without samples."""
    probs, labels = _inputs(probs, labels)
    if not len(labels):
        return None
    onehot = torch.nn.functional.one_hot(labels, probs.shape[1]).double()
    return float(((probs - onehot) ** 2).sum(1).mean())


def negative_log_likelihood(probs, labels) -> float | None:
    """The mean of ``-log p_label``, the probability floored at :data:`NLL_FLOOR`; ``None``
    without samples."""
    probs, labels = _inputs(probs, labels)
    if not len(labels):
        return None
    return float(-probs.gather(1, labels[:, None]).clamp_min(NLL_FLOOR).log().mean())


def foreground(probs, labels) -> torch.Tensor:
    """``(N,)`` bool: the samples whose label or argmax is not class 0 (the background). Taking
    the union keeps both the missed foreground (label only) and the false positives (prediction
    only), so the foreground ECE sees the errors at organ boundaries, which the background's many
    easy voxels drown in the ECE over all samples."""
    probs, labels = _inputs(probs, labels)
    return (labels != 0) | (probs.argmax(1) != 0)


def calibration_metrics(probs, labels, bins: int = BINS) -> dict:
    """``ece``, ``ece_foreground`` (:func:`expected_calibration_error` over all samples and over
    :func:`foreground`), ``brier``, ``nll``, ``accuracy`` (share of argmax == label),
    ``samples`` and ``foreground_samples``; the scores ``None`` without samples."""
    probs, labels = _inputs(probs, labels)
    fg = foreground(probs, labels)
    return {
        "ece": expected_calibration_error(probs, labels, bins),
        "ece_foreground": expected_calibration_error(probs[fg], labels[fg], bins),
        "brier": brier_score(probs, labels),
        "nll": negative_log_likelihood(probs, labels),
        "accuracy": float((probs.argmax(1) == labels).double().mean()) if len(labels) else None,
        "samples": len(labels),
        "foreground_samples": int(fg.sum()),
    }


def flatten_maps(probs, labels, ignore_label: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Probability maps as samples.

    Args:
        probs: ``(B, C, *spatial)`` class probabilities.
        labels: ``(B, *spatial)`` or ``(B, 1, *spatial)`` label maps.
        ignore_label: label value whose voxels are left out (nnU-Net's ignore label).

    Returns:
        ``(N, C)`` probabilities and ``(N,)`` labels of the kept voxels, batch item by item in
        C order.
    """
    probs, labels = torch.as_tensor(probs), torch.as_tensor(labels)
    if labels.dim() == probs.dim():
        labels = labels[:, 0]
    if labels.shape != probs.shape[:1] + probs.shape[2:]:
        raise ValueError(f"label maps {tuple(labels.shape)} do not match probability maps {tuple(probs.shape)}")
    flat_probs = probs.movedim(1, -1).reshape(-1, probs.shape[1])
    flat_labels = labels.reshape(-1).long()
    if ignore_label is not None:
        keep = flat_labels != ignore_label
        flat_probs, flat_labels = flat_probs[keep], flat_labels[keep]
    return flat_probs, flat_labels
