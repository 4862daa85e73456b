"""The segmentation ``LightningModule``: DiceCE plus the gate regularisers, and whole-volume
validation in each case's original geometry (Dice, HD95 in mm and NSD against the original label
file, at its spacing) gathered across processes; its 2D-frame variant validates
whole frames with Dice and IoU."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from monai.data import decollate_batch
from monai.losses import DiceCELoss, DiceLoss
from monai.transforms import Compose
from torch import nn

from hsmla_med.data.checks import source_file
from hsmla_med.engine.base import GatedModule, item_keys, plain
from hsmla_med.evaluation import DEFAULT_NSD_TOLERANCE, score_prediction
from hsmla_med.inference.geometry import labels_in_input_geometry, write_probabilities
from hsmla_med.inference.sliding import accumulation_device, predict_volume
from hsmla_med.io.overlays import sample_panels
from hsmla_med.io.volumes import case_name, prediction_path, write_labels
from hsmla_med.metrics import frame_reference_scores, frame_scores, summarize, summarize_frames
from hsmla_med.metrics.summary import summarize_cases

__all__ = ["SegmentationModule", "FrameSegmentationModule", "masked_dice_ce", "region_masks"]


def region_masks(label: torch.Tensor, regions: Sequence[Sequence[int]]) -> torch.Tensor:
    """The targets of a region-based network (nnU-Net v2's region labels) from a label map
    ``(B, 1, *spatial)``: float ``(B, 1 + regions, *spatial)``, channel 0 the background (label
    0; this project's networks keep a first output for it, trained as one more region and not
    used for the label map), channel ``i`` the voxels whose label is any of ``regions[i - 1]``."""
    masks = [label == 0] + [torch.isin(label, torch.as_tensor(list(values), device=label.device)) for values in regions]
    return torch.cat(masks, 1).float()


def masked_dice_ce(logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor, sigmoid: bool = False) -> torch.Tensor:
    """Dice + cross-entropy of ``logits`` ``(B, C, *spatial)`` against ``target`` ``(B, C,
    *spatial)`` over the voxels where ``valid`` ``(B, 1, *spatial)`` holds alone (nnU-Net v2's
    ignore label): MONAI's ``DiceCELoss(softmax=True)`` on a one-hot ``target``; with
    ``sigmoid``, on region masks, MONAI's ``DiceLoss(sigmoid=True)`` plus the binary
    cross-entropy of each output (nnU-Net's Dice + BCE of regions: MONAI's ``DiceCELoss`` takes a
    softmax cross-entropy whenever there is more than one channel, which overlapping regions do
    not fit). MONAI's losses have no ignore index, and its ``MaskedDiceLoss`` masks the logits
    before the activation, which leaves masked voxels a probability in the Dice sums; here the
    probabilities and targets are zeroed after it, so masked voxels add nothing to the Dice sums,
    and the cross-entropy is the mean over the valid voxels. For one item, equals those losses
    on the valid voxels alone."""
    mask = valid.to(logits.dtype)
    probs = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, 1)
    dice = _DICE(probs * mask, target * mask)
    if not bool(valid.any()):  # a crop of ignored voxels only: no cross-entropy term (0 / 0)
        return dice
    if sigmoid:
        ce = F.binary_cross_entropy_with_logits(logits, target, reduction="none").sum(1, keepdim=True)
    else:
        ce = -(target * torch.log_softmax(logits, 1)).sum(1, keepdim=True)
    per_voxel = logits.shape[1] if sigmoid else 1  # BCE: the mean over channels too, as MONAI's
    return dice + (ce * mask).sum() / (mask.sum() * per_voxel)


_DICE = DiceLoss()  # DiceCELoss's Dice term (same smoothing, per item and class, then the mean), on probabilities


class SegmentationModule(GatedModule):
    """Train and validate a segmentation network from :mod:`hsmla_med.nn`.

    Args:
        config: see :class:`~hsmla_med.engine.base.GatedModule`; ``inference`` also holds the
            sliding-window options ``roi_size``, ``overlap``, ``sw_batch_size``, ``tta``, ``slab``.
            Optional (nnU-Net v2's label kinds, :meth:`~hsmla_med.data.datalist.Datalist.label_config`):
            ``ignore_label``, the label value left out of loss and metrics; ``regions`` (each
            foreground output's label values) with ``regions_class_order``: sigmoid outputs
            trained on region masks (:func:`region_masks`, :func:`masked_dice_ce`), label maps
            built region by region.
        network: use this network instead of building one from ``config["network"]``.

    Batches are dicts with ``image`` ``(B, C, *spatial)`` and ``label`` ``(B, 1, *spatial)``;
    validation batches are whole volumes ``(1, C, H, W, D)``, MetaTensors made by the datamodule's
    ``val_transform`` from the image and label files, and ``case`` (the item key that makes the
    gathered metrics exact when a distributed sampler pads the validation set with repeats).

    Validation scores in the original geometry, as nnU-Net and the challenges do: each volume's
    probabilities go back through the inverse of ``val_transform`` to the image file's grid, as
    ``infer`` brings them back
    (:func:`~hsmla_med.inference.geometry.labels_in_input_geometry`), and the argmax is scored
    against the label file at the spacing of its own affine
    (:func:`~hsmla_med.evaluation.score_prediction`). A validation record holds a volume's
    per-class (foreground) ``dice``, ``hd95`` (mm) and ``nsd`` lists (at
    ``inference.nsd_tolerance`` mm; NaN where a class is in neither) and ``case``, its
    ``summary.json`` entry (:meth:`case_summary`).
    """

    monitor = "dice"
    #: its inputs are slices of RAS volumes, drawn as the report draws axial slices (x across, y up)
    volume_slices = True

    def __init__(self, config: dict, network: nn.Module | None = None) -> None:
        super().__init__(config, network, "segmentation")
        # nnU-Net v2's label kinds (older checkpoints: neither): the ignore label's voxels count
        # in neither loss nor metrics; regions get one sigmoid output each
        self.ignore_label = config.get("ignore_label")
        self.regions, self.regions_class_order = config.get("regions"), config.get("regions_class_order")
        self.loss = DiceCELoss(to_onehot_y=True, softmax=True)
        self.validation_output: Path | None = None  # where validation writes its label maps (save_validation)
        self.validation_probabilities = False

    def task_loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        label = plain(batch["label"])
        if self.ignore_label is None and not self.regions:
            return self.loss(logits, label)
        valid = label != self.ignore_label if self.ignore_label is not None else torch.ones_like(label, dtype=torch.bool)
        if self.regions:
            return masked_dice_ce(logits, region_masks(label, self.regions), valid, sigmoid=True)
        onehot = F.one_hot(torch.where(valid, label, 0)[:, 0].long(), logits.shape[1]).movedim(-1, 1).to(logits.dtype)
        return masked_dice_ce(logits, onehot, valid)

    def predict_probabilities(self, image: torch.Tensor, inference: dict | None = None, mean_entropy: bool = False):
        """Class probabilities of whole volumes ``(B, C, H, W, D)`` by sliding windows, with the
        checkpoint's ``inference`` settings or the given ones; on the CPU where they would not
        fit the GPU (:func:`~hsmla_med.inference.sliding.accumulation_device`). With
        ``mean_entropy``: ``(probabilities, the mirrored copies' mean entropy)``
        (:func:`~hsmla_med.inference.sliding.predict_volume`)."""
        inference = inference or self.config["inference"]
        return predict_volume(
            self.graphed(),
            image,
            inference["roi_size"],
            self.config["spatial_dims"],
            overlap=inference["overlap"],
            sw_batch_size=inference["sw_batch_size"],
            tta=inference["tta"],
            slab=inference["slab"],
            device=accumulation_device(image, len(self.label_names)),
            sigmoid=bool(self.regions),
            mean_entropy=mean_entropy,
        )

    def predict_step(self, batch: dict, batch_idx: int = 0) -> dict:
        """One case of :class:`~hsmla_med.engine.prediction.PredictionDataModule`: ``image``
        ``(C, *spatial)`` -> the case with ``probs`` ``(classes, *spatial)``, float32 on the
        CPU, where the task's writer maps them back, predicted with the run's settings
        (:meth:`inference_settings`); with their ``uncertainty`` ``mutual-information`` also
        ``mean_entropy`` ``(*spatial)``, the mean of the mirrored copies' entropies (an ensemble
        averages it over its members as it averages ``probs``)."""
        image = plain(batch["image"])[None]
        inference = self.inference_settings()
        if inference.get("uncertainty") == "mutual-information":
            probs, entropy = self.predict_probabilities(image, inference, mean_entropy=True)
            return {**batch, "probs": probs[0].float().cpu(), "mean_entropy": entropy[0].float().cpu()}
        probs = self.predict_probabilities(image, inference)[0]
        return {**batch, "probs": probs.float().cpu()}

    def save_validation(self, folder: str | Path | None, probabilities: bool = False) -> None:
        """Have validation write each case's label map in its original geometry, as ``infer``
        does, to ``folder/<case>.nii.gz`` (a MetaImage or NRRD image's: ``.mha`` / ``.nrrd``, as
        :func:`~hsmla_med.io.volumes.prediction_path` names it; ``None``: write nothing), and with
        ``probabilities`` its class probabilities as nnU-Net keeps them (``<case>.npz``, key
        ``probabilities``, float16, classes first)."""
        self.validation_output = None if folder is None else Path(folder)
        self.validation_probabilities = probabilities and folder is not None
        if self.validation_output is not None:
            self.validation_output.mkdir(parents=True, exist_ok=True)

    def validation_records(self, batch: dict) -> list[dict]:
        probs = self.predict_probabilities(plain(batch["image"])).float().cpu()
        if self.log_samples and self.validation_sample is None:  # on the network's grid, as it saw the volume
            self.validation_sample = sample_panels(plain(batch["image"])[0].cpu().numpy(), plain(batch["label"])[0, 0].cpu().numpy(),
                                                   probs[0].argmax(0).numpy())
        if self.calibration_sample is not None and not self.regions:  # softmax voxels on the network's grid, as the labels are
            self.calibration_sample.add_maps(probs, plain(batch["label"]).cpu(), item_keys(batch), self.ignore_label)
        transform = self._validation_transform()
        images, labels = decollate_batch(batch["image"]), decollate_batch(batch["label"])
        # The inverse transforms and the scores run on CPU tensors after the network: under a
        # mixed-precision run on the CPU, autocast would cast their resampling to bfloat16 and
        # MONAI's surface distances would fail ('Unexpected floating ScalarType').
        with torch.autocast("cpu", enabled=False):
            return [self._case_record(key, p, image, Path(source_file(label)), transform)
                    for key, p, image, label in zip(item_keys(batch), probs, images, labels, strict=True)]

    def _validation_transform(self) -> Compose:
        """The transform that made the validation batches, whose inverse brings predictions back."""
        transform = getattr(self.trainer.datamodule, "val_transform", None)
        if transform is None:
            raise RuntimeError("SegmentationModule validates with a datamodule whose val_transform made the batches")
        return transform

    def _case_record(self, key, probs: torch.Tensor, image, label_file: Path, transform: Compose) -> dict:
        """A volume's record: its prediction in the image file's grid (written when asked)
        scored against ``label_file``."""
        labels, probabilities = labels_in_input_geometry(probs, image, transform, self.validation_probabilities, self.regions_class_order)
        source = Path(source_file(image))
        prediction_file = str(source)  # the image predicted from, unless the label map is written
        if self.validation_output is not None:
            name = case_name(source)
            if probabilities is not None:
                write_probabilities(self.validation_output / f"{name}.npz", probabilities)
            prediction_file = str(write_labels(prediction_path(self.validation_output, source, name), labels, source))
        classes = range(1, len(self.label_names))
        scored = dict(zip(classes, self.regions, strict=True)) if self.regions else classes  # regions: scored as regions
        case = score_prediction(label_file, labels, scored, self._nsd_tolerance(), prediction_file, source, self.label_names,
                                self.ignore_label)
        scores = {field: [case["metrics"][c][metric] for c in classes] for field, metric in _FIELDS.items()}
        return {"key": key, **scores, "case": case}

    def _nsd_tolerance(self) -> float:
        return float(self.config["inference"].get("nsd_tolerance", DEFAULT_NSD_TOLERANCE))  # (older checkpoints: none)

    def summarize_records(self, records: list[dict]) -> dict:
        dice, hd95, nsd = _columns(records, tuple(_FIELDS), len(self.label_names) - 1)
        return summarize(dice, hd95, self.label_names[1:], nsd=nsd)

    def case_summary(self) -> dict:
        """The last validation as nnU-Net's ``summary.json`` document
        (:func:`~hsmla_med.metrics.summary.summarize_cases`): per case and class Dice, IoU, the
        voxel counts, HD95 and NSD, all in the original geometry, with the means and their
        bootstrap intervals."""
        classes = list(range(1, len(self.label_names)))
        return summarize_cases([r["case"] for r in self.records], classes, dict(zip(classes, self.label_names[1:], strict=True)),
                               nsd_tolerance_mm=self._nsd_tolerance(),
                               geometry="original: each prediction in its image file's grid, scored at its label file's spacing")


#: record field -> the metric of :func:`~hsmla_med.metrics.summary.class_metrics` it holds
_FIELDS = {"dice": "Dice", "hd95": "HD95", "nsd": "NSD"}


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

    volume_slices = False  # frames are pictures: drawn as they are

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
        if self.log_samples and self.validation_sample is None:  # on the frame's grid, as scored
            frame = torch.nn.functional.interpolate(plain(batch["image"])[:1].float().cpu(), size=truth.shape[-2:], mode="bilinear")
            self.validation_sample = sample_panels(frame[0].numpy(), truth[0, 0].numpy(), pred[0, 0].numpy())
        dice, iou = frame_scores(pred, truth, len(self.label_names))
        frame_dice, frame_iou = frame_reference_scores(pred, truth, len(self.label_names))
        return [{"key": k, "dice": d, "iou": i, "frame_dice": fd, "frame_iou": fi}
                for k, d, i, fd, fi in zip(item_keys(batch), dice.tolist(), iou.tolist(), frame_dice.tolist(), frame_iou.tolist())]

    def summarize_records(self, records: list[dict]) -> dict:
        dice, iou = _columns(records, ("dice", "iou"), len(self.label_names) - 1)
        frame_dice, frame_iou = (torch.tensor([r[f] for r in records], dtype=torch.float64) for f in ("frame_dice", "frame_iou"))
        return summarize_frames(dice, iou, frame_dice, frame_iou, self.label_names[1:])
