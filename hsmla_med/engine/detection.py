"""The nodule-detection ``LightningModule``: trained as a two-class segmentation of nodule
spheres, validated as a detector with the LUNA16 FROC and CPM. Candidates are placed in the
world frame of the image's affine; a task whose annotations use another convention overrides
:meth:`DetectionModule.world_points` (LUNA16's LPS millimetres: ``pipelines/luna16.py``)."""

from __future__ import annotations

import numpy as np
import torch

from hsmla_med.engine.base import item_keys, plain
from hsmla_med.engine.segmentation import SegmentationModule
from hsmla_med.metrics.detection import ScanMatch, affine_points, extract_candidates, match_candidates, nodule_froc

__all__ = ["DetectionModule", "scan_candidates"]


def scan_candidates(prob: np.ndarray, affine, inference: dict, world_points=affine_points) -> np.ndarray:
    """Candidates ``(n, 4)``: world x, y, z (mm, as ``world_points(index, affine)`` places them)
    and probability, of a nodule probability volume ``(X, Y, Z)``; ``inference`` holds
    ``candidate_threshold`` and ``max_candidates``."""
    found = extract_candidates(prob, inference["candidate_threshold"], inference["max_candidates"])
    return np.concatenate([world_points(found[:, :3], affine), found[:, 3:]], axis=1)


class DetectionModule(SegmentationModule):
    """:class:`SegmentationModule` (DiceCE on nodule masks, sliding-window prediction) validated
    as a nodule detector.

    Validation batches are single scans: ``image`` ``(1, 1, X, Y, Z)`` with its affine,
    ``nodules`` and ``excluded`` ``(1, n, 4)`` (centre in the frame of :meth:`world_points` and
    diameter, mm) and ``case``. Each
    scan gives one record: ``key`` (its ``case``) and its
    :func:`~hsmla_med.metrics.detection.match_candidates` as ``nodule_probs`` (per nodule its
    best hit's probability, NaN when missed), ``fp_probs`` and ``ignored`` (candidates on
    excluded findings): a few numbers per scan, not its candidates.
    ``config["inference"]`` also holds ``candidate_threshold`` and ``max_candidates``.
    """

    monitor = "cpm"

    @staticmethod
    def world_points(index: np.ndarray, affine) -> np.ndarray:
        """Where candidates are placed: the affine's own frame; subclasses follow their
        annotations' convention."""
        return affine_points(index, affine)

    def validation_records(self, batch: dict) -> list[dict]:
        image = batch["image"]
        inference = self.config["inference"]
        prob = self.predict_probabilities(plain(image))[0, 1].float().cpu().numpy()
        affine = image.affine[0] if image.affine.dim() == 3 else image.affine
        found = scan_candidates(prob, affine, inference, self.world_points)
        nodules, excluded = (torch.as_tensor(batch[k]).reshape(-1, 4).numpy() for k in ("nodules", "excluded"))
        match = match_candidates(found, nodules, excluded)
        [key] = item_keys(batch)
        return [{"key": key, "nodule_probs": match.nodule_probs.tolist(), "fp_probs": match.fp_probs.tolist(), "ignored": match.ignored}]

    def summarize_records(self, records: list[dict]) -> dict:
        summary = nodule_froc([ScanMatch(np.asarray(r["nodule_probs"], float), np.asarray(r["fp_probs"], float), r["ignored"]) for r in records])
        summary["cases"] = summary.pop("scans")
        return summary
