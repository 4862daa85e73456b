"""HSMLA networks: an EfficientViT-style backbone in B0/B1/B2 sizes with segmentation and
classification heads, usable as MONAI networks in 2D and 3D.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from monai.networks.layers.factories import Conv

from hsmla_med.nn.attention import HSMLA
from hsmla_med.nn.blocks import ChannelLayerNorm, ConvNormAct, DSConv, HSMLABlock, MBConv

__all__ = ["VARIANTS", "Variant", "HSMLABackbone", "HSMLASegNet", "HSMLAClassifier"]


@dataclass(frozen=True)
class Variant:
    """Widths/depths per stage (stem at stride 2, then strides 4, 8, 16, 32) and head sizes."""

    widths: tuple[int, int, int, int, int]
    depths: tuple[int, int, int, int, int]
    head_dim: int
    head_width: int
    head_depth: int


# EfficientViT's B-series (DESIGN.md §3); HSMLA sandwich blocks fill the last two stages.
VARIANTS: dict[str, Variant] = {
    "b0": Variant((8, 16, 32, 64, 128), (1, 2, 2, 2, 2), head_dim=16, head_width=32, head_depth=1),
    "b1": Variant((16, 32, 64, 128, 256), (1, 2, 3, 3, 4), head_dim=16, head_width=64, head_depth=3),
    "b2": Variant((24, 48, 96, 192, 384), (1, 3, 4, 4, 6), head_dim=32, head_width=96, head_depth=3),
}


def _variant(name: str) -> Variant:
    if name not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {name!r}.")
    return VARIANTS[name]


def _check_dims_channels(spatial_dims: int, **channels: int) -> None:
    if spatial_dims not in (2, 3):
        raise ValueError(f"spatial_dims must be 2 or 3, got {spatial_dims!r}.")
    for name, value in channels.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")


class GatedNetwork(nn.Module):
    """Access to the HSMLA layers of a network: regularisers, gate statistics and switches."""

    def hsmla_layers(self) -> dict[str, HSMLA]:
        return {name: m for name, m in self.named_modules() if isinstance(m, HSMLA)}

    def gate_regularization(self) -> dict[str, torch.Tensor]:
        """Budget and smoothness terms of the last forward, summed over the HSMLA layers.

        Unweighted: the training module applies ``lambda1``/``lambda2``.
        """
        terms = [layer.regularizers() for layer in self.hsmla_layers().values()]
        return {"budget": sum(t[0] for t in terms), "smoothness": sum(t[1] for t in terms)}

    def gate_stats(self) -> dict[str, dict]:
        """Per layer: ``alpha`` (fraction of tiles refined), ``tau`` and the ``gate`` map of the
        last forward (``(batch, *tiles)``, detached; ``None`` unless routing is ``"gate"``)."""
        return {
            name: {
                "alpha": layer.last_alpha,
                "tau": float(layer.tau),
                "gate": None if layer.last_gate is None else layer.last_gate.detach(),
            }
            for name, layer in self.hsmla_layers().items()
        }

    def set_routing(self, mode: str) -> None:
        """``"gate"`` (learned), ``"off"`` (linear attention only) or ``"all"`` (alpha = 1)."""
        for layer in self.hsmla_layers().values():
            layer.routing = mode

    def set_backend(self, name: str) -> None:
        """``"auto"``, ``"reference"`` or ``"triton"`` for every HSMLA layer."""
        for layer in self.hsmla_layers().values():
            layer.backend = name

    def _channels_last(self) -> None:
        """Hold the convolution weights channels-last (called at the end of ``__init__``).

        oneDNN's CPU convolutions run about 15% faster on this network in that layout (measured
        on HSMLA-B2 at 512 x 512, docs/benchmarks.md); ``forward`` puts its input in the same
        layout. Values and shapes are unchanged; only the strides differ.
        """
        self._memory_format = torch.channels_last if self.spatial_dims == 2 else torch.channels_last_3d
        self.to(memory_format=self._memory_format)

    def _check_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` checked against ``spatial_dims``/``in_channels``, in the weights' layout."""
        if x.dim() != self.spatial_dims + 2:
            raise ValueError(
                f"{type(self).__name__} with spatial_dims={self.spatial_dims} expects input of "
                f"{self.spatial_dims + 2} dims (batch, channels, *spatial), got shape {tuple(x.shape)}."
            )
        if x.shape[1] != self.in_channels:
            raise ValueError(
                f"{type(self).__name__} expects in_channels={self.in_channels}, got input with {x.shape[1]} channels."
            )
        return x.contiguous(memory_format=self._memory_format)


class HSMLABackbone(nn.Module):
    """EfficientViT-style backbone: conv stem and MBConv stages at strides 2-8, HSMLA sandwich
    blocks after a stride-2 MBConv at strides 16 and 32.

    ``forward`` maps ``(batch, in_channels, *spatial)`` to the five stage outputs, the i-th of
    shape ``(batch, widths[i], *ceil(spatial / 2**(i+1)))``.
    """

    def __init__(self, spatial_dims: int, in_channels: int, variant: Variant, **attention) -> None:
        super().__init__()
        w, d = variant.widths, variant.depths
        attention.setdefault("head_dim", variant.head_dim)
        stem = [ConvNormAct(spatial_dims, in_channels, w[0], 3, stride=2)]
        stem += [DSConv(spatial_dims, w[0]) for _ in range(d[0])]
        stages = [nn.Sequential(*stem)]
        for i in (1, 2):
            stages.append(
                nn.Sequential(*(MBConv(spatial_dims, w[i - 1] if j == 0 else w[i], w[i], 2 if j == 0 else 1) for j in range(d[i])))
            )
        for i in (3, 4):
            blocks = [MBConv(spatial_dims, w[i - 1], w[i], stride=2)]
            blocks += [HSMLABlock(spatial_dims, w[i], **attention) for _ in range(d[i])]
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.ModuleList(stages)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        features = []
        for stage in self.stages:
            x = stage(x)
            features.append(x)
        return features


_HEAD_STAGES = {4: 1, 8: 2}  # head stride -> first backbone stage fused by the head


class HSMLASegNet(GatedNetwork):
    """HSMLA segmentation network (MONAI-style, 2D or 3D).

    The head projects the stride-8/16/32 stage outputs to a common width, upsamples them to the
    stride-8 map, sums them, refines with MBConv blocks and upsamples the class logits to the
    input size. Any input size works. ``head_stride=4`` also fuses the stride-4 stage and runs
    the head at stride 4 (an extension of the paper's head: small organs, a few voxels across
    at CT resolution, lose their boundaries in a stride-8 map).

    Args:
        spatial_dims: 2 or 3.
        in_channels: input channels.
        out_channels: output channels (classes, including background).
        variant: ``"b0"``, ``"b1"`` or ``"b2"`` (see :data:`VARIANTS`).
        head_stride: stride of the fused head map, 8 (the paper) or 4.
        **attention: keyword arguments for every :class:`~hsmla_med.nn.HSMLA` layer
            (``window``, ``block``, ``tau``, ``rho``, ``scales``, ``routing``, ``backend``...).

    ``forward``: ``(batch, in_channels, *spatial)`` -> logits ``(batch, out_channels, *spatial)``.
    """

    def __init__(
        self, spatial_dims: int, in_channels: int, out_channels: int, variant: str = "b0", head_stride: int = 8, **attention
    ) -> None:
        super().__init__()
        _check_dims_channels(spatial_dims, in_channels=in_channels, out_channels=out_channels)
        if head_stride not in _HEAD_STAGES:
            raise ValueError(f"head_stride must be one of {sorted(_HEAD_STAGES)}, got {head_stride}")
        cfg = _variant(variant)
        self.spatial_dims, self.in_channels, self.out_channels, self.variant = spatial_dims, in_channels, out_channels, variant
        self.backbone = HSMLABackbone(spatial_dims, in_channels, cfg, **attention)
        self._first = _HEAD_STAGES[head_stride]
        self.lateral = nn.ModuleList(
            ConvNormAct(spatial_dims, width, cfg.head_width, 1, act=False) for width in cfg.widths[self._first :]
        )
        self.fuse = nn.Sequential(*(MBConv(spatial_dims, cfg.head_width, cfg.head_width) for _ in range(cfg.head_depth)))
        self.classify = Conv[Conv.CONV, spatial_dims](cfg.head_width, out_channels, 1)
        self._mode = "bilinear" if spatial_dims == 2 else "trilinear"
        self._channels_last()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._check_input(x)
        features = self.backbone(x)[self._first :]
        size = features[0].shape[2:]
        fused = self.lateral[0](features[0])
        for lateral, feature in zip(self.lateral[1:], features[1:]):
            fused = fused + F.interpolate(lateral(feature), size=size, mode=self._mode, align_corners=False)
        logits = self.classify(self.fuse(fused))
        return F.interpolate(logits, size=x.shape[2:], mode=self._mode, align_corners=False)


class HSMLAClassifier(GatedNetwork):
    """HSMLA classification network (patch classification), 2D or 3D.

    Args:
        spatial_dims: 2 or 3.
        in_channels: input channels.
        out_channels: number of classes (logits).
        variant: ``"b0"``, ``"b1"`` or ``"b2"``.
        hidden: width of the hidden layer of the head (default ``4 * last width``, at most 1024).
        dropout: dropout before the last linear layer.
        **attention: keyword arguments for every HSMLA layer.

    ``forward``: ``(batch, in_channels, *spatial)`` -> logits ``(batch, out_channels)``.
    """

    def __init__(
        self,
        spatial_dims: int,
        in_channels: int,
        out_channels: int,
        variant: str = "b0",
        hidden: int | None = None,
        dropout: float = 0.0,
        **attention,
    ) -> None:
        super().__init__()
        _check_dims_channels(spatial_dims, in_channels=in_channels, out_channels=out_channels)
        cfg = _variant(variant)
        self.spatial_dims, self.in_channels, self.out_channels, self.variant = spatial_dims, in_channels, out_channels, variant
        width = cfg.widths[-1]
        hidden = hidden or min(4 * width, 1024)
        self.backbone = HSMLABackbone(spatial_dims, in_channels, cfg, **attention)
        self.head = nn.Sequential(
            nn.LayerNorm(width), nn.Linear(width, hidden), nn.Hardswish(), nn.Dropout(dropout), nn.Linear(hidden, out_channels)
        )
        self._channels_last()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._check_input(x)
        features = self.backbone(x)[-1]
        return self.head(features.flatten(2).mean(dim=2))
