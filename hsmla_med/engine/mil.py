"""Slide-label training: attention multiple-instance learning (MIL) on bags of frozen patch
features, with MONAI's :class:`~monai.networks.nets.MILModel` (Ilse et al. 2018's attention
pooling, or with a transformer before it), as CLAM and ABMIL train on CAMELYON16 from slide
diagnoses alone. The module holds the step logic only; the bags, their splits and what a run
writes are :mod:`hsmla_med.pipelines.camelyon16.mil`'s."""

from __future__ import annotations

import math

import numpy as np
import torch
from monai.networks.nets import MILModel
from torch import nn
from torch.nn import functional as F

from hsmla_med.engine.base import GatedModule
from hsmla_med.errors import ConfigError
from hsmla_med.metrics.pathology import auc, balanced_accuracy

__all__ = ["MIL_MODES", "MILModule", "mil_network"]

#: the MILModel modes that pool with attention, whose weights the heatmaps draw (``mean`` and
#: ``max`` have none; ``att_trans_pyramid`` needs MILModel's own ResNet, not features)
MIL_MODES = ("att", "att_trans")


def mil_network(network: dict) -> MILModel:
    """MONAI's ``MILModel`` for feature bags, from a module's ``network`` entry: ``mil_mode``
    (:data:`MIL_MODES`), ``in_features`` (``D``), ``dropout`` (the transformer's, ``att_trans``)
    and ``trans_blocks``.

    ``MILModel.forward`` runs its ``net`` on ``(B, N, C, H, W)`` images; features are already
    ``net``'s output, so they go through ``calc_head`` alone. ``backbone`` is therefore an
    ``nn.Identity`` with ``backbone_num_features=D``, the custom backbone its docstring allows:
    without one it would build torchvision's ResNet50, which a feature bag never passes.
    """
    mode = network["mil_mode"]
    if mode not in MIL_MODES:
        raise ConfigError(f"mil.mil_mode must be one of {', '.join(MIL_MODES)}, got {mode!r}")
    if mode == "att_trans" and network["in_features"] % 8:
        raise ConfigError(f"mil.mil_mode att_trans: MILModel's transformer has 8 heads, so the feature width must be a multiple of 8, "
                          f"got {network['in_features']}")
    return MILModel(num_classes=1, mil_mode=mode, pretrained=False, backbone=nn.Identity(), backbone_num_features=network["in_features"],
                    trans_blocks=network["trans_blocks"], trans_dropout=network["dropout"])


class MILModule(GatedModule):
    """Attention MIL on bags of patch features, trained on slide labels (binary cross-entropy
    of one logit: the slide's tumour probability is its sigmoid).

    Args:
        config: the hyper-parameters of :func:`~hsmla_med.engine.base.hparams` (``task``,
            ``network``: :func:`mil_network`'s entry plus ``feature_dropout``, ``optim``,
            ``inference``, ``data``, ...).

    Features are standardised per dimension by the buffers ``feature_mean`` and ``feature_std``
    (``(D,)``, the training patches', set by the caller before training and saved in the
    checkpoint): a frozen encoder's features may have any scale (a randomly initialised
    ResNet18's vary by about 0.02 per dimension), and attention's ``tanh`` and AdamW's steps
    assume inputs of about unit scale.

    A batch is ``{"features": [(N_i, D) float tensors], "label": (B,) float, "slide": [names]}``:
    bags of any sizes, each pooled on its own (MILModel's softmax has no mask for padding).

    AdamW runs at the constant ``optim.lr`` (:meth:`configure_optimizers`), and a run validates
    once, after its last step, so ``best.ckpt`` holds the final weights (nnU-Net's fixed
    schedule): attention MIL sits on a plateau at chance for its first epochs (the training loss
    stays at log 2 for hundreds of one-bag steps, then falls), and a checkpoint chosen on a few
    validation slides, whose AUC ties at 1 early, picked a nearly constant model from before it.
    """

    monitor = "log_likelihood"

    def __init__(self, config: dict) -> None:
        super().__init__(config, network=mil_network(config["network"]), kind="classification")
        width = config["network"]["in_features"]
        self.register_buffer("feature_mean", torch.zeros(width))
        self.register_buffer("feature_std", torch.ones(width))
        self._attention: torch.Tensor | None = None
        # the attention logits (B, N, 1) of calc_head's own pass, so the weights are MILModel's
        # softmax of them and no code of calc_head is repeated
        self.network.attention.register_forward_hook(lambda _module, _inputs, output: setattr(self, "_attention", output))

    def set_standardisation(self, features: torch.Tensor) -> None:
        """The standardisation buffers from ``features`` (``(n, D)``, the training patches)."""
        self.feature_mean.copy_(features.mean(0))
        self.feature_std.copy_(features.std(0).clamp_min(1e-6))

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The slide logit and attention of one bag.

        Args:
            features: ``(N, D)`` the bag's patch features, N >= 1.

        Returns:
            ``(logit, attention)``: a scalar tensor and ``(N,)`` weights that sum to 1, the
            softmax over the bag that ``MILModel.calc_head`` pools with.
        """
        x = (features - self.feature_mean) / self.feature_std
        if self.training:
            x = F.dropout(x, self.config["network"]["feature_dropout"])
        logit = self.network.calc_head(x[None])[0, 0]
        attention = torch.softmax(self._attention, dim=1)[0, :, 0]
        return logit, attention

    def task_loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(logits, batch["label"].float())

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        logits = torch.stack([self(features)[0] for features in batch["features"]])
        loss = self.task_loss(logits.float(), batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(logits))
        return loss

    def validation_records(self, batch: dict) -> list[dict]:
        records = []
        for features, label, slide in zip(batch["features"], batch["label"].tolist(), batch["slide"]):
            logit, attention = self(features)
            loss = float(F.binary_cross_entropy_with_logits(logit.float(), torch.tensor(float(label), device=logit.device)))
            records.append({"key": slide, "score": float(torch.sigmoid(logit.float())), "label": int(label), "loss": loss,
                            "n_patches": len(features), "attention": attention.float().cpu().numpy()})
        return records

    def configure_optimizers(self):
        """AdamW at the constant ``optim.lr``, without the base's warm-up and cosine decay: the
        plateau at chance that MIL starts on lasts a number of steps, not a share of the run, and
        a decay from the first step lowers the rate while the model is still on it (the mean rate
        of the cosine is half the peak)."""
        optim = self.config["optim"]
        return torch.optim.AdamW(self.parameters(), lr=optim["lr"], weight_decay=optim["weight_decay"])

    def summarize_records(self, records: list[dict]) -> dict:
        """Slide AUC, balanced accuracy at 0.5 and the mean log-likelihood of the labels (the
        monitor, smooth where the AUC of a few slides ties at 1); the rows per slide stay in
        :attr:`records`."""
        scores, labels = [r["score"] for r in records], [r["label"] for r in records]
        value = auc(scores, labels) if records else math.nan
        return {
            "auc": None if math.isnan(value) else value,
            "balanced_accuracy": balanced_accuracy(scores, labels),
            "log_likelihood": -float(np.mean([r["loss"] for r in records])) if records else None,
            "slides": len(records),
        }
