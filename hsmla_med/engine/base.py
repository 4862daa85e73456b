"""What every task's LightningModule shares: the network from a config, the gate regularisers
in the loss, AdamW with warm-up and cosine decay, tau calibration before validation, and
gathering per-item validation rows across processes."""

from __future__ import annotations

from abc import ABCMeta, abstractmethod

import lightning as L
import torch
from monai.data import MetaTensor
from torch import nn

from hsmla_med.config import build_network
from hsmla_med.engine.schedule import WarmupCosine
from hsmla_med.nn import GatedNetwork, calibrate_tau

__all__ = ["GatedModule", "hparams", "plain"]


def plain(x: torch.Tensor) -> torch.Tensor:
    """The tensor without MONAI metadata: the network indexes its batch, and a batched
    MetaTensor refuses indexing when its items' metadata differ."""
    return x.as_tensor() if isinstance(x, MetaTensor) else x


def hparams(config: dict, model: dict, label_names, spatial_dims: int, in_channels: int, inference: dict, data: dict) -> dict:
    """The ``config`` of a :class:`GatedModule` from a task config: what every task saves in its
    checkpoints (task, network, dims, channels, labels, optimiser, loss) plus the task's own
    ``inference`` and ``data`` settings that inference needs to prepare inputs alike."""
    return {
        "task": config["task"],
        "network": model,
        "spatial_dims": spatial_dims,
        "in_channels": in_channels,
        "label_names": list(label_names),
        "optim": dict(config["optim"]),
        "loss": dict(config["loss"]),
        "inference": inference,
        "data": data,
    }


class GatedModule(L.LightningModule, metaclass=ABCMeta):
    """Base of the task modules.

    Args:
        config: hyper-parameters, saved so that a checkpoint rebuilds the module: ``network``
            (model config), ``spatial_dims``, ``in_channels``, ``label_names``, ``optim`` (``lr``,
            ``weight_decay``, ``warmup_steps``), ``loss`` (``lambda_budget``,
            ``lambda_smoothness``), ``inference`` (``target_alpha`` and task options).
        network: use this network instead of building one from ``config["network"]``.
        kind: ``"segmentation"`` or ``"classification"`` (which network the config builds).

    Subclasses implement ``task_loss(logits, batch)``, ``validation_step`` (appending rows whose
    first column is a unique item index to ``self.rows``) and ``summarize_rows(rows)``, and name
    in ``monitor`` the summary key that selects ``best.ckpt`` (higher is better).
    """

    monitor = "dice"

    def __init__(self, config: dict, network: nn.Module | None = None, kind: str = "segmentation") -> None:
        super().__init__()
        self.save_hyperparameters(config)
        self.config = config
        self.label_names = list(config["label_names"])
        self.network = network or build_network(
            config["network"], config["spatial_dims"], config["in_channels"], len(self.label_names), kind
        )
        self.rows: list[torch.Tensor] = []
        self._calibration_batch: torch.Tensor | None = None
        self.summary: dict | None = None  # the last validation's metrics
        self.validated_step = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)

    @abstractmethod
    def task_loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        """The task's loss of float32 ``logits`` against the batch's targets."""

    @abstractmethod
    def summarize_rows(self, rows: torch.Tensor) -> dict:
        """Metrics (JSON-friendly) from the gathered validation rows, one per item."""

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        image = plain(batch["image"])
        logits = self.network(image)
        loss = self.task_loss(logits.float(), batch)
        self.log("train/task_loss", loss, prog_bar=True, batch_size=image.shape[0])
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
        self.rows = []

    def on_validation_epoch_end(self) -> None:
        self.summary = self.summarize_rows(self.gather_rows())
        self.validated_step = self.global_step
        # every rank holds the same gathered summary, so logging needs no further reduction
        for key, value in self.summary.items():
            if key == self.monitor and value is None:
                value = float("nan")  # undefined (e.g. AUC with one class): never the best
            if isinstance(value, (int, float)) and key not in ("cases", "slides"):
                self.log(f"val/{key}", float(value), prog_bar=key == self.monitor)

    def gather_rows(self) -> torch.Tensor:
        """All processes' validation rows, one per item (CPU).

        Lightning's distributed sampler pads the validation set with repeated items so that every
        rank gets as many; the first column (the item's index) lets us keep each item once.
        """
        rows = torch.cat(self.rows) if self.rows else torch.zeros(0, 0)
        if self.trainer.world_size > 1:
            width = torch.tensor(rows.shape[1], device=self.device)
            width = int(self.all_gather(width).max())
            count = self.all_gather(torch.tensor(rows.shape[0], device=self.device))
            padded = torch.full((int(count.max()), width), -1.0, device=self.device)  # index -1: padding
            padded[: rows.shape[0], : rows.shape[1]] = rows.to(self.device)
            rows = self.all_gather(padded).reshape(-1, width)
            rows = rows[rows[:, 0] >= 0]
        rows = rows.cpu()
        if rows.numel() == 0:
            return rows
        rows = rows[torch.argsort(rows[:, 0], stable=True)]
        first = torch.ones(rows.shape[0], dtype=torch.bool)
        first[1:] = rows[1:, 0] != rows[:-1, 0]
        return rows[first]

    def configure_optimizers(self):
        optim = self.config["optim"]
        optimizer = torch.optim.AdamW(self.parameters(), lr=optim["lr"], weight_decay=optim["weight_decay"])
        total = max(1, int(self.trainer.estimated_stepping_batches))
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(optim["warmup_steps"], total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
