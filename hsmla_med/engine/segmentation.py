"""The segmentation ``LightningModule``: DiceCE plus the gate regularisers, and whole-volume
validation with Dice and HD95 (mm) gathered across processes; its 2D-frame variant validates
whole frames with Dice and IoU."""

from __future__ import annotations

import torch
from monai.losses import DiceCELoss
from torch import nn

from hsmla_med.engine.base import GatedModule, plain
from hsmla_med.inference.sliding import predict_volume
from hsmla_med.metrics import case_scores, frame_scores, summarize, summarize_frames

__all__ = ["SegmentationModule", "FrameSegmentationModule", "voxel_spacing"]


def voxel_spacing(affine: torch.Tensor) -> torch.Tensor:
    """Voxel sizes ``(..., 3)`` from affines ``(..., 4, 4)``: the norms of the first three columns."""
    return torch.linalg.vector_norm(torch.as_tensor(affine, dtype=torch.float64)[..., :3, :3], dim=-2)


class SegmentationModule(GatedModule):
    """Train and validate a segmentation network from :mod:`hsmla_med.nn`.

    Args:
        config: see :class:`~hsmla_med.engine.base.GatedModule`; ``inference`` also holds the
            sliding-window options ``roi_size``, ``overlap``, ``sw_batch_size``, ``tta``, ``slab``.
        network: use this network instead of building one from ``config["network"]``.

    Batches are dicts with ``image`` ``(B, C, *spatial)`` and ``label`` ``(B, 1, *spatial)``;
    validation batches are whole volumes ``(1, C, H, W, D)`` with their MetaTensor affine (for the
    voxel spacing of HD95) and ``case`` (an index that makes the gathered metrics exact when a
    distributed sampler pads the validation set with repeats).
    """

    monitor = "dice"

    def __init__(self, config: dict, network: nn.Module | None = None) -> None:
        super().__init__(config, network, "segmentation")
        self.loss = DiceCELoss(to_onehot_y=True, softmax=True)

    def task_loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        return self.loss(logits, plain(batch["label"]))

    def predict_probabilities(self, image: torch.Tensor) -> torch.Tensor:
        """Class probabilities of whole volumes ``(B, C, H, W, D)`` by sliding windows."""
        inference = self.config["inference"]
        return predict_volume(
            self.network,
            image,
            inference["roi_size"],
            self.config["spatial_dims"],
            overlap=inference["overlap"],
            sw_batch_size=inference["sw_batch_size"],
            tta=inference["tta"],
            slab=inference["slab"],
        )

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        image, label = batch["image"], batch["label"]
        spacing = voxel_spacing(image.affine).tolist()
        pred = self.predict_probabilities(plain(image)).argmax(dim=1, keepdim=True)
        dice, hd95 = case_scores(pred.cpu(), plain(label).cpu(), len(self.label_names), spacing=spacing)
        case = torch.as_tensor(batch["case"], dtype=torch.float32).reshape(-1, 1)
        self.rows.append(torch.cat([case, dice, hd95], dim=1))

    def summarize_rows(self, rows: torch.Tensor) -> dict:
        n = len(self.label_names) - 1
        return summarize(rows[:, 1 : 1 + n], rows[:, 1 + n :], self.label_names[1:])


class FrameSegmentationModule(SegmentationModule):
    """:class:`SegmentationModule` for 2D frames (video, endoscopy): the same loss and
    sliding-window prediction, validated per frame with Dice and IoU (mean over the classes
    present, :func:`~hsmla_med.metrics.summarize_frames`) instead of per volume with HD95.

    Batches are dicts with ``image`` ``(B, C, H, W)`` and ``label`` ``(B, 1, H, W)``; validation
    batches also carry ``case`` (the frame's index). ``config["inference"]`` as for
    :class:`SegmentationModule`, with ``slab`` 1 (a frame is one slice).
    """

    def predict_probabilities(self, image: torch.Tensor) -> torch.Tensor:
        """Class probabilities ``(B, classes, H, W)`` of frames ``(B, C, H, W)``: a frame is a
        volume of one slice to :meth:`SegmentationModule.predict_probabilities`."""
        return super().predict_probabilities(image[..., None])[..., 0]

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        pred = self.predict_probabilities(plain(batch["image"])).argmax(dim=1, keepdim=True)
        dice, iou = frame_scores(pred.cpu(), plain(batch["label"]).cpu(), len(self.label_names))
        case = torch.as_tensor(batch["case"], dtype=torch.float32).reshape(-1, 1)
        self.rows.append(torch.cat([case, dice, iou], dim=1))

    def summarize_rows(self, rows: torch.Tensor) -> dict:
        n = len(self.label_names) - 1
        return summarize_frames(rows[:, 1 : 1 + n], rows[:, 1 + n :], self.label_names[1:])
