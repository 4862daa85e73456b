"""The segmentation ``LightningModule``: DiceCE plus the gate regularisers, AdamW with warm-up and
cosine decay, and whole-volume validation with Dice and HD95 (mm) gathered across processes."""

from __future__ import annotations

import lightning as L
import torch
from monai.data import MetaTensor
from monai.losses import DiceCELoss
from torch import nn

from hsmla_med.config import build_network
from hsmla_med.engine.schedule import WarmupCosine
from hsmla_med.inference.sliding import predict_volume
from hsmla_med.metrics import case_scores, summarize
from hsmla_med.nn import GatedNetwork, calibrate_tau

__all__ = ["SegmentationModule", "voxel_spacing"]


def voxel_spacing(affine: torch.Tensor) -> torch.Tensor:
    """Voxel sizes ``(..., 3)`` from affines ``(..., 4, 4)``: the norms of the first three columns."""
    return torch.linalg.vector_norm(torch.as_tensor(affine, dtype=torch.float64)[..., :3, :3], dim=-2)


def _plain(x: torch.Tensor) -> torch.Tensor:
    """The tensor without MONAI metadata: the network indexes its batch, and a batched
    MetaTensor refuses indexing when its items' metadata differ."""
    return x.as_tensor() if isinstance(x, MetaTensor) else x


class SegmentationModule(L.LightningModule):
    """Train and validate a segmentation network from :mod:`hsmla_med.nn`.

    Args:
        config: everything the module needs, saved as hyper-parameters so that a checkpoint
            rebuilds it: ``network`` (model config: ``variant``, ``attention``), ``spatial_dims``
            (2: slice-wise network, 3: volumetric), ``in_channels``, ``label_names`` (index =
            label value, background first), ``optim`` (``lr``, ``weight_decay``,
            ``warmup_steps``), ``loss`` (``lambda_budget``, ``lambda_smoothness``) and
            ``inference`` (``roi_size``, ``overlap``, ``sw_batch_size``, ``tta``, ``slab``,
            ``target_alpha``).
        network: use this network instead of building one from ``config["network"]``.

    Batches are dicts with ``image`` ``(B, C, *spatial)`` and ``label`` ``(B, 1, *spatial)``;
    validation batches are whole volumes ``(1, C, H, W, D)`` with their MetaTensor affine (for the
    voxel spacing of HD95) and ``case`` (an index that makes the gathered metrics exact when a
    distributed sampler pads the validation set with repeats).
    """

    def __init__(self, config: dict, network: nn.Module | None = None) -> None:
        super().__init__()
        self.save_hyperparameters(config)
        self.config = config
        self.label_names = list(config["label_names"])
        self.network = network or build_network(
            config["network"], config["spatial_dims"], config["in_channels"], len(self.label_names)
        )
        self.loss = DiceCELoss(to_onehot_y=True, softmax=True)
        self._rows: list[torch.Tensor] = []
        self._calibration_batch: torch.Tensor | None = None
        self.summary: dict | None = None  # the last validation's metrics (see summarize)
        self.validated_step = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        image, label = _plain(batch["image"]), _plain(batch["label"])
        logits = self.network(image)
        loss = self.loss(logits.float(), label)
        self.log("train/dice_ce", loss, prog_bar=True, batch_size=image.shape[0])
        if isinstance(self.network, GatedNetwork) and self.network.hsmla_layers():
            reg = self.network.gate_regularization()
            weights = self.config["loss"]
            loss = loss + weights["lambda_budget"] * reg["budget"] + weights["lambda_smoothness"] * reg["smoothness"]
            self.log_dict({f"train/gate_{k}": v for k, v in reg.items()}, batch_size=image.shape[0])
        self.log("train/loss", loss, batch_size=image.shape[0])
        self._calibration_batch = image[:4].detach()
        return loss

    def on_validation_epoch_start(self) -> None:
        # Inference routes hard with threshold tau; put it where the gate of the current weights
        # selects the target share of tiles (DESIGN.md §3.8), using recent training inputs.
        target = self.config["inference"].get("target_alpha")
        if target is not None and self._calibration_batch is not None and isinstance(self.network, GatedNetwork):
            calibrate_tau(self.network, self._calibration_batch, target)
        self._rows = []

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
        pred = self.predict_probabilities(_plain(image)).argmax(dim=1, keepdim=True)
        dice, hd95 = case_scores(pred.cpu(), _plain(label).cpu(), len(self.label_names), spacing=spacing)
        case = torch.as_tensor(batch["case"], dtype=torch.float32).reshape(-1, 1)
        self._rows.append(torch.cat([case, dice, hd95], dim=1).to(self.device))

    def on_validation_epoch_end(self) -> None:
        width = 1 + 2 * (len(self.label_names) - 1)
        rows = torch.cat(self._rows) if self._rows else torch.zeros(0, width, device=self.device)
        if self.trainer.world_size > 1:
            # all_gather needs equal shapes on every rank: pad to the longest with case -1 rows
            counts = self.all_gather(torch.tensor(rows.shape[0], device=self.device))
            padded = torch.full((int(counts.max()), width), -1.0, device=self.device)
            padded[: rows.shape[0]] = rows
            rows = self.all_gather(padded).reshape(-1, width)
            rows = rows[rows[:, 0] >= 0]
        # one row per case: the distributed sampler repeats cases to even out the ranks
        rows = rows.cpu()
        rows = rows[torch.argsort(rows[:, 0], stable=True)]
        first = torch.ones(rows.shape[0], dtype=torch.bool)
        first[1:] = rows[1:, 0] != rows[:-1, 0]
        rows = rows[first]
        n = len(self.label_names) - 1
        self.summary = summarize(rows[:, 1 : 1 + n], rows[:, 1 + n :], self.label_names[1:])
        self.validated_step = self.global_step
        # every rank holds the same gathered summary, so logging needs no further reduction
        self.log("val/dice", self.summary["dice"] if self.summary["dice"] is not None else float("nan"), prog_bar=True)
        self.log("val/hd95", self.summary["hd95"] if self.summary["hd95"] is not None else float("nan"))

    def configure_optimizers(self):
        optim = self.config["optim"]
        optimizer = torch.optim.AdamW(self.parameters(), lr=optim["lr"], weight_decay=optim["weight_decay"])
        total = max(1, int(self.trainer.estimated_stepping_batches))
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(optim["warmup_steps"], total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
