"""The nodule-detection ``LightningModule`` (LUNA16): trained as a two-class segmentation of
nodule spheres, validated as a detector with the LUNA16 FROC and CPM."""

from __future__ import annotations

import numpy as np
import torch

from hsmla_med.data.luna16 import voxel_to_lps
from hsmla_med.engine.base import plain
from hsmla_med.engine.segmentation import SegmentationModule
from hsmla_med.metrics.detection import extract_candidates, match_candidates, nodule_froc

__all__ = ["DetectionModule", "scan_candidates"]

_PADDING = -3  # match code of unused candidate slots in a validation row


def scan_candidates(prob: np.ndarray, affine, inference: dict) -> np.ndarray:
    """Candidates ``(n, 4)``: LPS x, y, z (mm) and probability, of a nodule probability volume
    ``(X, Y, Z)`` with its MONAI (RAS) affine; ``inference`` holds ``candidate_threshold`` and
    ``max_candidates``."""
    found = extract_candidates(prob, inference["candidate_threshold"], inference["max_candidates"])
    return np.concatenate([voxel_to_lps(found[:, :3], affine), found[:, 3:]], axis=1)


class DetectionModule(SegmentationModule):
    """:class:`SegmentationModule` (DiceCE on nodule masks, sliding-window prediction) validated
    as a nodule detector.

    Validation batches are single scans: ``image`` ``(1, 1, X, Y, Z)`` with its RAS affine,
    ``nodules`` and ``excluded`` ``(1, n, 4)`` (LPS centre and diameter, mm) and ``case``. Each
    scan gives one row: its index, its nodule count, then ``max_candidates`` pairs of
    (probability, match code) — fixed width, so rows gather across processes like any other.
    ``config["inference"]`` also holds ``candidate_threshold`` and ``max_candidates``.
    """

    monitor = "cpm"

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        image = batch["image"]
        inference = self.config["inference"]
        prob = self.predict_probabilities(plain(image))[0, 1].float().cpu().numpy()
        affine = image.affine[0] if image.affine.dim() == 3 else image.affine
        found = scan_candidates(prob, affine, inference)
        nodules = torch.as_tensor(batch["nodules"]).reshape(-1, 4).numpy()
        codes = match_candidates(found, nodules, torch.as_tensor(batch["excluded"]).reshape(-1, 4).numpy())
        pairs = np.full((inference["max_candidates"], 2), _PADDING, dtype=np.float64)
        pairs[: len(found)] = np.stack([found[:, 3], codes], axis=1)
        row = np.concatenate([[float(torch.as_tensor(batch["case"]).reshape(-1)[0]), len(nodules)], pairs.reshape(-1)])
        self.rows.append(torch.as_tensor(row, dtype=torch.float64)[None])

    def summarize_rows(self, rows: torch.Tensor) -> dict:
        scans = []
        for row in rows.numpy():
            pairs = row[2:].reshape(-1, 2)
            pairs = pairs[pairs[:, 1] != _PADDING]
            scans.append((pairs[:, 0], pairs[:, 1].astype(np.int64), int(row[1])))
        summary = nodule_froc(scans)
        summary["cases"] = summary.pop("scans")
        return summary
