"""Per-case Dice and HD95 (mm) of segmentations with MONAI, and their JSON-friendly summary;
per-frame Dice and IoU of 2D frames (EndoVis) and theirs.

Conventions for a (case, foreground class) pair:

* class absent from both prediction and truth: not counted, Dice = HD95 = NaN, and
  :func:`summarize` skips it (scoring it 1 would reward empty classes, 0 would punish them);
* class present in exactly one of them: Dice = 0 and HD95 = the diagonal of the image extent in
  mm, the largest distance possible in the image, instead of MONAI's inf/NaN. This is how
  nnU-Net-style evaluations penalise a missed or hallucinated organ with a finite number, so
  that means stay finite and comparable.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
from monai.metrics import compute_dice, compute_hausdorff_distance, compute_iou
from monai.networks.utils import one_hot

__all__ = ["case_scores", "summarize", "frame_scores", "summarize_frames"]


def _one_hot(seg: torch.Tensor, num_classes: int, name: str) -> torch.Tensor:
    """``(B, 1, *spatial)`` label map or ``(B, num_classes, *spatial)`` 0/1 one-hot -> float one-hot."""
    if seg.shape[1] == 1:
        if seg.min() < 0 or seg.max() >= num_classes:
            raise ValueError(
                f"{name} labels must lie in [0, {num_classes}), got [{seg.min().item()}, {seg.max().item()}]"
            )
        return one_hot(seg, num_classes, dim=1)
    if seg.shape[1] == num_classes:
        # probabilities or logits would silently give wrong scores: demand a binarised one-hot
        if not ((seg == 0) | (seg == 1)).all():
            raise ValueError(f"one-hot {name} must hold only 0 and 1")
        return seg.float()
    raise ValueError(f"{name} must have 1 (label map) or {num_classes} (one-hot) channels, got {tuple(seg.shape)}")


def _spacing(spacing, batch: int, dims: int) -> torch.Tensor:
    """Voxel sizes ``(batch, dims)`` in float64 from None, a number, ``(dims,)`` or ``(batch, dims)``."""
    s = torch.as_tensor(1.0 if spacing is None else spacing, dtype=torch.float64).cpu()
    shared = s.ndim == 0 or (s.ndim == 1 and len(s) == dims)
    if not (shared or tuple(s.shape) == (batch, dims)):
        raise ValueError(f"spacing must be a number, {dims} numbers or {batch} x {dims} numbers, got {spacing}")
    return s.expand(batch, dims) if shared else s


def _one_hot_pair(pred: torch.Tensor, truth: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked one-hot plain tensors of a prediction and its truth (label maps or one-hot)."""
    if num_classes < 2:
        raise ValueError(f"num_classes counts the background and must be at least 2, got {num_classes}")
    if pred.shape[0] != truth.shape[0] or pred.shape[2:] != truth.shape[2:]:
        raise ValueError(f"pred and truth differ in batch or spatial shape: {tuple(pred.shape)}, {tuple(truth.shape)}")
    # MetaTensor inputs would make MetaTensor outputs, whose metadata only gets in the way of
    # concatenating and gathering the rows; the scores need none of it
    return (_one_hot(pred.as_subclass(torch.Tensor), num_classes, "pred"),
            _one_hot(truth.as_subclass(torch.Tensor), num_classes, "truth"))


def case_scores(
    pred: torch.Tensor,
    truth: torch.Tensor,
    num_classes: int,
    spacing=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dice and HD95 (mm) of every case and foreground class.

    Args:
        pred: prediction, ``(B, 1, *spatial)`` integer label map with values in
            ``[0, num_classes)``, or ``(B, num_classes, *spatial)`` binarised (0/1) one-hot;
            2D or 3D.
        truth: ground truth, the same spatial shape, in either of the two formats (independently
            of ``pred``).
        num_classes: number of classes including the background (label 0 / channel 0).
        spacing: voxel size in mm: None (1 mm), a number (isotropic), ``len(spatial)`` numbers
            shared by the batch, or ``B`` such sequences, one per case.

    Returns:
        ``(dice, hd95)``, float32 ``(B, num_classes - 1)`` plain tensors (also for MetaTensor
        inputs) on ``pred``'s device, foreground classes only. A class absent from both
        prediction and truth of a case gets NaN in both; a class present in exactly one gets
        Dice 0 and HD95 = the image diagonal ``sqrt(sum((size_i * spacing_i) ** 2))`` in mm (see
        the module docstring). HD95 is MONAI's symmetric one: the larger of the two directed 95th
        percentiles of the distances between the boundary voxels of the two masks.
    """
    pred_oh, truth_oh = _one_hot_pair(pred, truth, num_classes)
    batch, spatial = pred.shape[0], pred.shape[2:]
    spacing = _spacing(spacing, batch, len(spatial))

    # ignore_empty=False: Dice 0 when exactly one mask is empty (the default would give NaN
    # whenever the truth is empty, even for a hallucinated class); both empty is set to NaN below.
    dice = compute_dice(pred_oh, truth_oh, include_background=False, ignore_empty=False)
    with warnings.catch_warnings():
        # MONAI warns for every empty mask that its distance may be inf/NaN, which is expected for
        # absent classes and replaced below; and (1.5-1.6) about a deprecated argument that its own
        # get_edge_surface_distance passes to get_mask_edges, which no caller can act on.
        warnings.filterwarnings("ignore", message=r"the (ground truth|prediction) of class .* is all 0")
        warnings.filterwarnings("ignore", message=r".*always_return_as_numpy", category=FutureWarning)
        hd95 = compute_hausdorff_distance(
            pred_oh, truth_oh, include_background=False, percentile=95, spacing=spacing.tolist()
        )

    in_pred = pred_oh[:, 1:].flatten(2).any(-1)
    in_truth = truth_oh[:, 1:].flatten(2).any(-1)
    extent = spacing * torch.tensor(spatial, dtype=torch.float64)
    diagonal = torch.linalg.vector_norm(extent, dim=1).to(hd95)[:, None].expand_as(hd95)
    hd95 = torch.where(in_pred ^ in_truth, diagonal, hd95)
    absent = ~(in_pred | in_truth)
    nan = torch.tensor(float("nan"), device=pred.device)
    return torch.where(absent, nan, dice).float(), torch.where(absent, nan, hd95).float()


def _class_means(scores: torch.Tensor, label_names: Sequence[str]) -> tuple[float | None, dict[str, float | None]]:
    """Mean over the classes of each class's mean over the cases, skipping non-finite entries."""
    scores = scores.detach().double().cpu()
    finite = torch.isfinite(scores)
    counts = finite.sum(0)
    sums = torch.where(finite, scores, 0.0).sum(0)
    per_class = {
        name: (float(total / n) if n > 0 else None) for name, total, n in zip(label_names, sums, counts, strict=True)
    }
    present = [v for v in per_class.values() if v is not None]
    return (math.fsum(present) / len(present) if present else None), per_class


def summarize(dice: torch.Tensor, hd95: torch.Tensor, label_names: Sequence[str]) -> dict:
    """Dataset summary of per-case scores, JSON-serialisable (plain floats, None, no NaN).

    Args:
        dice, hd95: ``(cases, classes)`` rows stacked from :func:`case_scores`.
        label_names: names of the foreground classes, in column order.

    Returns:
        ``{"dice", "hd95", "dice_per_class", "hd95_per_class", "cases"}``: the per-class values
        are each class's mean over the cases, the overall values the mean of the per-class
        values, and ``cases`` the number of rows. Non-finite entries (the NaN of classes absent
        from a case) are skipped in every mean; a class with no finite value anywhere gets None
        and is left out of the overall mean, which is None when no class has a value.
    """
    if dice.shape != hd95.shape or dice.ndim != 2 or dice.shape[1] != len(label_names):
        raise ValueError(
            f"dice {tuple(dice.shape)} and hd95 {tuple(hd95.shape)} must be (cases, {len(label_names)})"
        )
    dice_mean, dice_per_class = _class_means(dice, label_names)
    hd95_mean, hd95_per_class = _class_means(hd95, label_names)
    return {
        "dice": dice_mean,
        "hd95": hd95_mean,
        "dice_per_class": dice_per_class,
        "hd95_per_class": hd95_per_class,
        "cases": int(dice.shape[0]),
    }


def frame_scores(pred: torch.Tensor, truth: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dice and IoU of every frame and foreground class (MONAI ``compute_dice``/``compute_iou``).

    Args:
        pred, truth: ``(B, 1, H, W)`` label maps or ``(B, num_classes, H, W)`` 0/1 one-hot, as
            for :func:`case_scores`.
        num_classes: number of classes including the background.

    Returns:
        ``(dice, iou)``, float32 ``(B, num_classes - 1)``: NaN where the class is in neither
        prediction nor truth of the frame (not counted), 0 where it is in exactly one.
    """
    pred_oh, truth_oh = _one_hot_pair(pred, truth, num_classes)
    dice = compute_dice(pred_oh, truth_oh, include_background=False, ignore_empty=False)
    iou = compute_iou(pred_oh, truth_oh, include_background=False, ignore_empty=False)
    absent = ~(pred_oh[:, 1:].flatten(2).any(-1) | truth_oh[:, 1:].flatten(2).any(-1))
    nan = torch.tensor(float("nan"), device=pred.device)
    return torch.where(absent, nan, dice).float(), torch.where(absent, nan, iou).float()


def summarize_frames(dice: torch.Tensor, iou: torch.Tensor, label_names: Sequence[str]) -> dict:
    """Dataset summary of per-frame scores, the EndoVis 2017 way: each frame's score is the mean
    over the classes present in its truth or prediction, and ``dice``/``iou`` are the means of
    those over the frames (frames with no class present in either are skipped).

    Args:
        dice, iou: ``(frames, classes)`` rows stacked from :func:`frame_scores`.
        label_names: names of the foreground classes, in column order.

    Returns:
        ``{"dice", "iou", "dice_per_class", "iou_per_class", "cases"}``: per-class values are
        each class's mean over the frames that count it (None if none does), ``cases`` the number
        of frames. JSON-serialisable.
    """
    if dice.shape != iou.shape or dice.ndim != 2 or dice.shape[1] != len(label_names):
        raise ValueError(f"dice {tuple(dice.shape)} and iou {tuple(iou.shape)} must be (frames, {len(label_names)})")
    summary = {}
    for name, scores in (("dice", dice), ("iou", iou)):
        per_frame = scores.double().nanmean(1)
        per_frame = per_frame[torch.isfinite(per_frame)]
        summary[name] = float(per_frame.mean()) if per_frame.numel() else None
    summary["dice_per_class"] = _class_means(dice, label_names)[1]
    summary["iou_per_class"] = _class_means(iou, label_names)[1]
    summary["cases"] = int(dice.shape[0])
    return summary
