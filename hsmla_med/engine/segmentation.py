"""The segmentation ``LightningModule``: DiceCE plus the gate regularisers, and whole-volume
validation with Dice and HD95 (mm) gathered across processes; its 2D-frame variant validates
whole frames with Dice and IoU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from monai.losses import DiceCELoss
from torch import nn

from hsmla_med.engine.base import GatedModule, item_keys, plain
from hsmla_med.inference.sliding import accumulation_device, predict_volume
from hsmla_med.metrics import case_scores, frame_reference_scores, frame_scores, summarize, summarize_frames

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
    voxel spacing of HD95) and ``case`` (the item key that makes the gathered metrics exact when a
    distributed sampler pads the validation set with repeats). A validation record holds a
    volume's per-class (foreground) ``dice`` and ``hd95`` lists (NaN where undefined).
    """

    monitor = "dice"

    def __init__(self, config: dict, network: nn.Module | None = None) -> None:
        super().__init__(config, network, "segmentation")
        self.loss = DiceCELoss(to_onehot_y=True, softmax=True)

    def task_loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        return self.loss(logits, plain(batch["label"]))

    def predict_probabilities(self, image: torch.Tensor, inference: dict | None = None) -> torch.Tensor:
        """Class probabilities of whole volumes ``(B, C, H, W, D)`` by sliding windows, with the
        checkpoint's ``inference`` settings or the given ones; on the CPU where they would not
        fit the GPU (:func:`~hsmla_med.inference.sliding.accumulation_device`)."""
        inference = inference or self.config["inference"]
        return predict_volume(
            self.network,
            image,
            inference["roi_size"],
            self.config["spatial_dims"],
            overlap=inference["overlap"],
            sw_batch_size=inference["sw_batch_size"],
            tta=inference["tta"],
            slab=inference["slab"],
            device=accumulation_device(image, len(self.label_names)),
        )

    def predict_step(self, batch: dict, batch_idx: int = 0) -> dict:
        """One case of :class:`~hsmla_med.engine.prediction.PredictionDataModule`: ``image``
        ``(C, *spatial)`` and ``inference`` (the run's settings) -> the case with ``probs``
        ``(classes, *spatial)``, float32 on the CPU, where the task's writer maps them back."""
        probs = self.predict_probabilities(plain(batch["image"])[None], batch["inference"])[0]
        return {**batch, "probs": probs.float().cpu()}

    def validation_records(self, batch: dict) -> list[dict]:
        image, label = batch["image"], batch["label"]
        spacing = voxel_spacing(image.affine).tolist()
        pred = self.predict_probabilities(plain(image)).argmax(dim=1, keepdim=True)
        dice, hd95 = case_scores(pred.cpu(), plain(label).cpu(), len(self.label_names), spacing=spacing)
        return [{"key": k, "dice": d, "hd95": h} for k, d, h in zip(item_keys(batch), dice.tolist(), hd95.tolist())]

    def summarize_records(self, records: list[dict]) -> dict:
        dice, hd95 = _columns(records, ("dice", "hd95"), len(self.label_names) - 1)
        return summarize(dice, hd95, self.label_names[1:])


def _columns(records: list[dict], fields: tuple[str, ...], classes: int) -> list[torch.Tensor]:
    """Per-class score lists of the records as float32 tensors ``(items, classes)``."""
    return [torch.tensor([r[f] for r in records], dtype=torch.float32).reshape(len(records), classes) for f in fields]


class FrameSegmentationModule(SegmentationModule):
    """:class:`SegmentationModule` for 2D frames (video, endoscopy): the same loss and
    sliding-window prediction, validated per frame with Dice and IoU at the frame's original
    size, averaged as the EndoVis 2017 reference evaluation does
    (:func:`~hsmla_med.metrics.summarize_frames`), instead of per volume with HD95.

    Training batches are dicts with ``image`` ``(B, C, H, W)`` and ``label`` ``(B, 1, H, W)``.
    Validation batches hold ``image`` at the network's size, ``label`` ``(B, 1, H0, W0)`` the
    frames' original labels, ``box`` ``(B, 4)`` the ``(top, left, h, w)`` of each frame the
    image was made from (absent: the whole label) and ``case`` (the frame's key): the prediction
    goes back to the frame as ``infer`` puts it there (:meth:`labels_in_frame`) before scoring.
    A validation record holds a frame's per-class ``dice`` and ``iou`` lists (NaN where the class
    is absent from both) and its ``frame_dice`` and ``frame_iou`` by the reference rule
    (:func:`~hsmla_med.metrics.frame_reference_scores`). ``config["inference"]`` as for
    :class:`SegmentationModule`, with ``slab`` 1 (a frame is one slice).
    """

    def predict_probabilities(self, image: torch.Tensor, inference: dict | None = None) -> torch.Tensor:
        """Class probabilities ``(B, classes, H, W)`` of frames ``(B, C, H, W)``: a frame is a
        volume of one slice to :meth:`SegmentationModule.predict_probabilities`."""
        return super().predict_probabilities(image[..., None], inference)[..., 0]

    @staticmethod
    def labels_in_frame(probs: torch.Tensor, box, shape) -> torch.Tensor:
        """The label map ``(H0, W0)`` uint8 of a frame of ``shape`` from the class probabilities
        ``(classes, h, w)`` of its part ``box`` = ``(top, left, height, width)`` at the network's
        size: resized to the box (bilinear) before the argmax, background (0) outside the box.
        ``infer`` writes this, and validation scores it against the original label."""
        top, left, height, width = (int(v) for v in box)
        resized = F.interpolate(probs[None].float(), size=(height, width), mode="bilinear", align_corners=False)
        labels = torch.zeros(tuple(int(v) for v in shape), dtype=torch.uint8, device=probs.device)
        labels[top : top + height, left : left + width] = resized.argmax(1)[0].to(torch.uint8)
        return labels

    def validation_records(self, batch: dict) -> list[dict]:
        probs = self.predict_probabilities(plain(batch["image"]))
        truth = plain(batch["label"]).cpu()
        boxes = batch.get("box", torch.tensor([[0, 0, *truth.shape[-2:]]] * len(truth)))
        pred = torch.stack([self.labels_in_frame(p, b, truth.shape[-2:]) for p, b in zip(probs, boxes)])[:, None].cpu()
        dice, iou = frame_scores(pred, truth, len(self.label_names))
        frame_dice, frame_iou = frame_reference_scores(pred, truth, len(self.label_names))
        return [{"key": k, "dice": d, "iou": i, "frame_dice": fd, "frame_iou": fi}
                for k, d, i, fd, fi in zip(item_keys(batch), dice.tolist(), iou.tolist(), frame_dice.tolist(), frame_iou.tolist())]

    def summarize_records(self, records: list[dict]) -> dict:
        dice, iou = _columns(records, ("dice", "iou"), len(self.label_names) - 1)
        frame_dice, frame_iou = (torch.tensor([r[f] for r in records], dtype=torch.float64) for f in ("frame_dice", "frame_iou"))
        return summarize_frames(dice, iou, frame_dice, frame_iou, self.label_names[1:])
