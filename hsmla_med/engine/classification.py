"""The patch-classification ``LightningModule`` (whole-slide pathology): cross-entropy plus the
gate regularisers; validation over every tissue patch of the validation slides, reporting patch
AUC, slide AUC and lesion-level FROC gathered across processes."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from hsmla_med.engine.base import GatedModule, plain
from hsmla_med.metrics.pathology import auc, detect_lesions, lesion_froc, slide_score

__all__ = ["ClassificationModule", "slide_maps"]

# columns of a validation row
_INDEX, _SLIDE, _ROW, _COL, _PROB, _LABEL, _LESION, _SLIDE_LABEL = range(8)


def slide_maps(rows: torch.Tensor) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """Per slide (in slide-index order): the tumour-probability map on the patch grid (NaN where
    no patch), the lesion-id map on the same grid, and the slide label."""
    maps = []
    for slide in torch.unique(rows[:, _SLIDE]).tolist():
        r = rows[rows[:, _SLIDE] == slide].numpy()
        rr, cc = r[:, _ROW].astype(int), r[:, _COL].astype(int)
        prob = np.full((rr.max() + 1, cc.max() + 1), np.nan)
        lesion = np.zeros(prob.shape, dtype=np.int64)
        prob[rr, cc] = r[:, _PROB]
        lesion[rr, cc] = r[:, _LESION].astype(np.int64)
        maps.append((prob, lesion, int(r[0, _SLIDE_LABEL])))
    return maps


class ClassificationModule(GatedModule):
    """Train :class:`~hsmla_med.nn.HSMLAClassifier` on patches; validate per slide.

    Args:
        config: see :class:`~hsmla_med.engine.base.GatedModule`; ``inference`` also holds
            ``slide_sigma`` (smoothing of the probability map before the slide score, in grid
            cells), ``lesion_threshold`` and ``lesion_radius`` (detections: local maxima above the
            threshold, at least that many cells apart).
        network: use this network instead of building one from ``config["network"]``.

    Training batches: ``image`` ``(B, C, h, w)``, ``label`` ``(B,)`` (1 = tumour). Validation
    batches also carry ``case`` (patch index), ``slide_index``, ``row``/``col`` (the
    patch's cell on the slide's grid), ``lesion`` (id of the annotated lesion under the patch,
    0 = none) and ``slide_label``.
    """

    monitor = "auc"

    def __init__(self, config: dict, network: nn.Module | None = None) -> None:
        super().__init__(config, network, "classification")
        self.loss = nn.CrossEntropyLoss()

    def task_loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        return self.loss(logits, plain(batch["label"]).long().reshape(-1))

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        prob = torch.softmax(self.network(plain(batch["image"])).float(), dim=1)[:, 1]
        keys = ("case", "slide_index", "row", "col")
        columns = [torch.as_tensor(batch[k]).reshape(-1).float().cpu() for k in keys]
        columns += [prob.cpu()] + [torch.as_tensor(batch[k]).reshape(-1).float().cpu() for k in ("label", "lesion", "slide_label")]
        self.rows.append(torch.stack(columns, dim=1))

    def summarize_rows(self, rows: torch.Tensor) -> dict:
        inference = self.config["inference"]
        maps = slide_maps(rows)
        scores = [slide_score(prob, inference["slide_sigma"]) for prob, _, _ in maps]
        slide_labels = [label for _, _, label in maps]
        detections = [detect_lesions(prob, inference["lesion_threshold"], inference["lesion_radius"]) for prob, _, _ in maps]
        froc = lesion_froc(detections, [lesion for _, lesion, _ in maps])
        finite = lambda v: None if v is None or not np.isfinite(v) else float(v)  # noqa: E731
        return {
            "auc": finite(auc(scores, slide_labels)),
            "patch_auc": finite(auc(rows[:, _PROB].numpy(), rows[:, _LABEL].numpy())),
            "froc": finite(froc["froc"]),
            "froc_sensitivity": froc["sensitivity"],
            "slides": len(maps),
            "cases": int(rows.shape[0]),
        }
