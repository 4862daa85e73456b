"""The patch-classification ``LightningModule`` (whole-slide pathology): cross-entropy plus the
gate regularisers; validation over every tissue patch of the validation slides, reporting patch
AUC, slide AUC and lesion-level FROC gathered across processes."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from hsmla_med.engine.base import GatedModule, item_keys, plain
from hsmla_med.nn import GatedNetwork
from hsmla_med.metrics.pathology import auc, detect_lesions, lesion_froc, slide_score

__all__ = ["ClassificationModule", "patch_images", "slide_maps"]

_FIELDS = ("slide", "row", "col", "prob", "label", "lesion", "slide_label")  # of a validation record, with "key"


def slide_maps(records: list[dict]) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """Per slide (in slide-index order) of patch records (see :class:`ClassificationModule`):
    the tumour-probability map on the patch grid (NaN where no patch), the lesion-id map on the
    same grid, and the slide label."""
    by_slide: dict[int, list[dict]] = {}
    for record in records:
        by_slide.setdefault(int(record["slide"]), []).append(record)
    maps = []
    for slide in sorted(by_slide):
        patches = by_slide[slide]
        rr = np.array([p["row"] for p in patches], dtype=np.int64)
        cc = np.array([p["col"] for p in patches], dtype=np.int64)
        prob = np.full((rr.max() + 1, cc.max() + 1), np.nan)
        lesion = np.zeros(prob.shape, dtype=np.int64)
        prob[rr, cc] = [p["prob"] for p in patches]
        lesion[rr, cc] = [p["lesion"] for p in patches]
        maps.append((prob, lesion, int(patches[0]["slide_label"])))
    return maps


class ClassificationModule(GatedModule):
    """Train :class:`~hsmla_med.nn.HSMLAClassifier` on patches; validate per slide.

    Args:
        config: see :class:`~hsmla_med.engine.base.GatedModule`; ``inference`` also holds
            ``slide_sigma`` (smoothing of the probability map before the slide score, in grid
            cells), ``lesion_threshold`` and ``lesion_radius`` (detections: local maxima above the
            threshold, at least that many cells apart).
        network: use this network instead of building one from ``config["network"]``.

    Training batches: ``image`` ``(B, C, h, w)`` float in 0..1, ``label`` ``(B,)`` (1 = tumour).
    Validation and prediction batches may carry ``image`` as uint8 0..255 (scaled on the
    module's device, :func:`patch_images`). Validation
    batches also carry ``case`` (patch index), ``slide_index``, ``row``/``col`` (the
    patch's cell on the slide's grid), ``lesion`` (id of the annotated lesion under the patch,
    0 = none) and ``slide_label``. A validation record is a patch: ``key`` (its ``case``),
    ``slide``, ``row``, ``col``, ``prob`` (tumour probability), ``label``, ``lesion``,
    ``slide_label``.
    """

    monitor = "auc"

    def __init__(self, config: dict, network: nn.Module | None = None) -> None:
        super().__init__(config, network, "classification")
        self.loss = nn.CrossEntropyLoss()

    def task_loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        return self.loss(logits, plain(batch["label"]).long().reshape(-1))

    def predict_step(self, batch: dict, batch_idx: int = 0) -> dict:
        """A batch of whole-slide patches (``image``, ``slide_index``, ``row``, ``col``) -> their
        tumour ``prob`` and ``alpha`` (share of gate tiles refined, ``None`` without gates), on
        the CPU with the patches' places."""
        prob = torch.softmax(self.network(patch_images(batch)).float(), dim=1)[:, 1]
        alpha = patch_alpha(self.network)
        place = {k: torch.as_tensor(batch[k]).reshape(-1).cpu() for k in ("slide_index", "row", "col")}
        return {**place, "prob": prob.cpu(), "alpha": None if alpha is None else alpha.float().cpu()}

    def validation_records(self, batch: dict) -> list[dict]:
        prob = torch.softmax(self.network(patch_images(batch)).float(), dim=1)[:, 1].cpu().tolist()
        ints = lambda k: torch.as_tensor(batch[k]).reshape(-1).long().tolist()  # noqa: E731
        columns = zip(ints("slide_index"), ints("row"), ints("col"), prob, ints("label"), ints("lesion"), ints("slide_label"))
        return [{"key": key, **dict(zip(_FIELDS, values))} for key, values in zip(item_keys(batch), columns)]

    def summarize_records(self, records: list[dict]) -> dict:
        inference = self.config["inference"]
        maps = slide_maps(records)
        scores = [slide_score(prob, inference["slide_sigma"]) for prob, _, _ in maps]
        slide_labels = [label for _, _, label in maps]
        detections = [detect_lesions(prob, inference["lesion_threshold"], inference["lesion_radius"]) for prob, _, _ in maps]
        froc = lesion_froc(detections, [lesion for _, lesion, _ in maps])
        finite = lambda v: None if v is None or not np.isfinite(v) else float(v)  # noqa: E731
        return {
            "auc": finite(auc(scores, slide_labels)),
            "patch_auc": finite(auc(np.array([r["prob"] for r in records]), np.array([r["label"] for r in records]))),
            "froc": finite(froc["froc"]),
            "froc_sensitivity": froc["sensitivity"],
            "slides": len(maps),
            "cases": len(records),
        }


def patch_images(batch: dict) -> torch.Tensor:
    """The batch's ``image`` as the network takes it: float in 0..1. Patches read as bytes
    (``ReadPatchd(uint8=True)``) are scaled here, on the module's device."""
    image = plain(batch["image"])
    return image.float().div_(255.0) if image.dtype == torch.uint8 else image


def patch_alpha(network: nn.Module) -> torch.Tensor | None:
    """Per sample of the last forward: the share of gate tiles above tau, over all HSMLA layers."""
    if not isinstance(network, GatedNetwork):
        return None
    shares = [
        (layer.last_gate > layer.tau).flatten(1).float().mean(1)
        for layer in network.hsmla_layers().values()
        if layer.last_gate is not None
    ]
    return torch.stack(shares).mean(0) if shares else None
