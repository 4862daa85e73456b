"""Per-case Dice and HD95 (mm) of segmentations with MONAI, and their JSON-friendly summary
(with NSD where given);
per-frame Dice and IoU of 2D frames (EndoVis), per class and by the EndoVis 2017 reference
evaluation's per-frame rule (:func:`frame_reference_scores`), and theirs.

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
from monai.metrics import compute_dice, compute_hausdorff_distance
from monai.networks.utils import one_hot

__all__ = ["case_scores", "summarize", "frame_confusion", "frame_scores", "frame_reference_scores", "summarize_frames"]


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


def summarize(dice: torch.Tensor, hd95: torch.Tensor, label_names: Sequence[str], nsd: torch.Tensor | None = None) -> dict:
    """Dataset summary of per-case scores, JSON-serialisable (plain floats, None, no NaN).

    Args:
        dice, hd95: ``(cases, classes)`` rows stacked from :func:`case_scores` (or from
            :func:`~hsmla_med.metrics.summary.case_metrics`).
        label_names: names of the foreground classes, in column order.
        nsd: optional ``(cases, classes)`` normalised surface Dice, summarized alike.

    Returns:
        ``{"dice", "hd95", "dice_per_class", "hd95_per_class", "cases"}`` (and ``"nsd"``,
        ``"nsd_per_class"`` with ``nsd``): the per-class values are each class's mean over the
        cases, the overall values the mean of the per-class values, and ``cases`` the number of
        rows. Non-finite entries (the NaN of classes absent from a case) are skipped in every
        mean; a class with no finite value anywhere gets None and is left out of the overall
        mean, which is None when no class has a value.
    """
    scores = {"dice": dice, "hd95": hd95, **({"nsd": nsd} if nsd is not None else {})}
    for name, values in scores.items():
        if values.ndim != 2 or values.shape != dice.shape or dice.shape[1] != len(label_names):
            raise ValueError(f"{name} {tuple(values.shape)} must be (cases, {len(label_names)}) like dice {tuple(dice.shape)}")
    means = {name: _class_means(values, label_names) for name, values in scores.items()}
    return {
        **{name: overall for name, (overall, _) in means.items()},
        **{f"{name}_per_class": per_class for name, (_, per_class) in means.items()},
        "cases": int(dice.shape[0]),
    }


def frame_confusion(pred: torch.Tensor, truth: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Confusion matrices of label-map frames: ``(B, num_classes, num_classes)`` int64 pixel
    counts, ``[b, t, p]`` = pixels of class ``t`` in the truth and ``p`` in the prediction.

    Args:
        pred, truth: ``(B, 1, H, W)`` (or ``(B, H, W)``) integer label maps with values in
            ``[0, num_classes)``, the same shape.
        num_classes: number of classes including the background.

    One ``bincount`` per batch rather than MONAI's one-hot metrics: every score of a frame, both
    averaging rules and the TP/FP/FN counts of a report come from these counts, and a one-hot of
    eight classes at the frame's original 1920 x 1080 would hold 16 million floats per mask.
    """
    if num_classes < 2:
        raise ValueError(f"num_classes counts the background and must be at least 2, got {num_classes}")
    if pred.shape != truth.shape:
        raise ValueError(f"pred and truth differ in shape: {tuple(pred.shape)}, {tuple(truth.shape)}")
    pred, truth = (x.as_subclass(torch.Tensor).reshape(x.shape[0], -1).long() for x in (pred, truth))
    for name, seg in (("pred", pred), ("truth", truth)):
        if seg.numel() and (seg.min() < 0 or seg.max() >= num_classes):
            raise ValueError(f"{name} labels must lie in [0, {num_classes}), got [{seg.min().item()}, {seg.max().item()}]")
    frame = torch.arange(pred.shape[0], device=pred.device)[:, None]
    index = (frame * num_classes + truth) * num_classes + pred
    counts = torch.bincount(index.flatten(), minlength=pred.shape[0] * num_classes**2)
    return counts.reshape(pred.shape[0], num_classes, num_classes)


def _overlaps(confusion: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per frame and foreground class: true positives, reference and predicted pixel counts (float64)."""
    confusion = confusion.double()
    tp = confusion.diagonal(dim1=1, dim2=2)
    return tp[:, 1:], confusion.sum(2)[:, 1:], confusion.sum(1)[:, 1:]


def frame_scores(pred: torch.Tensor, truth: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dice and IoU of every frame and foreground class, from :func:`frame_confusion`.

    Args:
        pred, truth: ``(B, 1, H, W)`` label maps, as for :func:`frame_confusion`.
        num_classes: number of classes including the background.

    Returns:
        ``(dice, iou)``, float32 ``(B, num_classes - 1)``: NaN where the class is in neither
        prediction nor truth of the frame (not counted; nnU-Net's rule), 0 where it is in
        exactly one. These fill the per-class tables; :func:`frame_reference_scores` averages a
        frame's classes.
    """
    tp, n_ref, n_pred = _overlaps(frame_confusion(pred, truth, num_classes))
    union = n_ref + n_pred - tp
    dice = torch.where(union > 0, 2 * tp / (n_ref + n_pred), math.nan)
    iou = torch.where(union > 0, tp / union, math.nan)
    return dice.float(), iou.float()


def frame_reference_scores(pred: torch.Tensor, truth: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The score of each frame by the EndoVis 2017 reference evaluation, ``general_dice`` and
    ``general_jaccard`` of ``evaluate.py`` in ternaus/robot-surgery-segmentation (the
    challenge winners' public code, used by later work to compare with them):

    * truth with foreground: the mean, over the foreground classes **in the truth**, of their
      Dice (IoU); a class predicted but absent from the truth is ignored (its false positives
      count only where they cover another class's truth pixels, as that class's misses);
    * truth all background: 1 if the prediction is all background too, else 0.

    The binary problem is the one-class case (the reference's plain ``dice``/``jaccard`` with
    its 1e-15 smoothing gives the same values). Computed exactly, without that smoothing.

    Args:
        pred, truth: ``(B, 1, H, W)`` label maps, as for :func:`frame_confusion`.
        num_classes: number of classes including the background.

    Returns:
        ``(dice, iou)``, float64 ``(B,)``, each in [0, 1], never NaN.
    """
    tp, n_ref, n_pred = _overlaps(frame_confusion(pred, truth, num_classes))
    in_truth = n_ref > 0
    classes = in_truth.sum(1)
    empty = torch.where(n_pred.sum(1) > 0, 0.0, 1.0).double()  # (an empty truth has no union of zero here)
    scores = []
    for per_class in (2 * tp / (n_ref + n_pred).clamp(min=1), tp / (n_ref + n_pred - tp).clamp(min=1)):
        mean = torch.where(in_truth, per_class, 0.0).sum(1) / classes.clamp(min=1)
        scores.append(torch.where(classes > 0, mean, empty))
    return scores[0], scores[1]


def summarize_frames(dice: torch.Tensor, iou: torch.Tensor, frame_dice: torch.Tensor, frame_iou: torch.Tensor,
                     label_names: Sequence[str]) -> dict:
    """Dataset summary of per-frame scores, averaged as the EndoVis 2017 reference evaluation
    averages them: ``dice``/``iou`` are the means over **all** frames of each frame's
    :func:`frame_reference_scores`; the per-class tables are each class's mean over the frames
    where it is in the truth or the prediction (:func:`frame_scores`).

    Args:
        dice, iou: ``(frames, classes)`` rows stacked from :func:`frame_scores`.
        frame_dice, frame_iou: ``(frames,)`` from :func:`frame_reference_scores`.
        label_names: names of the foreground classes, in column order.

    Returns:
        ``{"dice", "iou", "dice_per_class", "iou_per_class", "cases"}``: per-class values None
        where no frame counts the class, ``dice``/``iou`` None without frames; ``cases`` the
        number of frames. JSON-serialisable.
    """
    if dice.shape != iou.shape or dice.ndim != 2 or dice.shape[1] != len(label_names):
        raise ValueError(f"dice {tuple(dice.shape)} and iou {tuple(iou.shape)} must be (frames, {len(label_names)})")
    if frame_dice.shape != (dice.shape[0],) or frame_iou.shape != (dice.shape[0],):
        raise ValueError(f"frame_dice {tuple(frame_dice.shape)} and frame_iou {tuple(frame_iou.shape)} must be ({dice.shape[0]},)")
    mean = lambda scores: float(scores.double().mean()) if scores.numel() else None  # noqa: E731
    return {
        "dice": mean(frame_dice),
        "iou": mean(frame_iou),
        "dice_per_class": _class_means(dice, label_names)[1],
        "iou_per_class": _class_means(iou, label_names)[1],
        "cases": int(dice.shape[0]),
    }
