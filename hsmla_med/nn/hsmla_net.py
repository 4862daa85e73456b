"""HSMLA networks: an EfficientViT-style backbone in B0/B1/B2 sizes with segmentation and
classification heads, usable as MONAI networks in 2D and 3D.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from hsmla_med.nn.attention import HSMLA, calibrate_tau
from hsmla_med.nn.threads import FreeCPUThreads
from hsmla_med.nn.blocks import ConvNormAct, DSConv, HSMLABlock, MBConv
from hsmla_med.nn.conv import conv_type

__all__ = ["VARIANTS", "DECODERS", "FULL_RES", "Variant", "HSMLABackbone", "UNetDecoder", "HSMLASegNet", "HSMLAClassifier", "gate_snapshot"]

STRIDES = (2, 4, 8, 16, 32)  # of the backbone's stages (the stem is the first)
_FREE_CPU_THREADS = FreeCPUThreads()  # one reading of the load per interval for every network of the process


@dataclass(frozen=True)
class Variant:
    """Widths/depths per stage (stem at stride 2, then strides 4, 8, 16, 32), the stride-8 head's
    sizes, and the U-shaped decoder's widths at strides 1, 2, 4, 8, 16."""

    widths: tuple[int, int, int, int, int]
    depths: tuple[int, int, int, int, int]
    head_dim: int
    head_width: int
    head_depth: int
    decoder_widths: tuple[int, int, int, int, int]


# EfficientViT's B-series (docs/design.md §3.1); HSMLA sandwich blocks fill the last two stages unless
# ``attention_strides`` says otherwise. Decoder widths follow the encoder's, at least 16 (the
# width of MONAI UNet's full-resolution level).
VARIANTS: dict[str, Variant] = {
    "b0": Variant((8, 16, 32, 64, 128), (1, 2, 2, 2, 2), 16, 32, 1, decoder_widths=(16, 16, 16, 32, 64)),
    "b1": Variant((16, 32, 64, 128, 256), (1, 2, 3, 3, 4), 16, 64, 3, decoder_widths=(16, 16, 32, 64, 128)),
    "b2": Variant((24, 48, 96, 192, 384), (1, 3, 4, 4, 6), 32, 96, 3, decoder_widths=(16, 16, 48, 96, 192)),
}
#: ``unet``: skip connections from every stage and a full-resolution level; ``fpn``: the paper's
#: head, stage outputs fused at stride 8 (or 4) and the logits upsampled.
DECODERS = ("unet", "fpn")
#: the ``unet`` decoder's full-resolution level: ``refine``, a 3x3 ConvNormAct and a DSConv as at
#: every other level; ``light``, the DSConv alone; ``sum``, the two projections' sum alone.
FULL_RES = ("refine", "light", "sum")


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


def gate_snapshot(module: nn.Module):
    """A function that sets the gate state of every HSMLA layer in ``module`` (``last_gate`` and
    what ``last_alpha`` reads) back to what it is now: a CUDA graph's replay refills the gate
    tensors its capture left on the layers but runs no Python to put them there
    (:class:`~hsmla_med.inference.cuda_graph.GraphedCallable`'s ``state``)."""
    kept = [(layer, layer.last_gate, layer._gate_tau, layer._alpha) for layer in module.modules() if isinstance(layer, HSMLA)]

    def restore() -> None:
        for layer, gate, tau, alpha in kept:
            layer.last_gate, layer._gate_tau, layer._alpha = gate, tau, alpha

    return restore


class GatedNetwork(nn.Module):
    """Access to the HSMLA layers of a network: regularisers, gate statistics and switches.

    A CPU inference forward runs on the CPUs other processes leave free
    (:class:`~hsmla_med.nn.threads.FreeCPUThreads`, hooks registered here): an HSMLA forward is
    hundreds of short parallel regions, each a barrier that a descheduled thread holds up, so
    beside a busy neighbour fewer threads finish sooner; the caller's thread count is put back
    after the forward.
    """

    def __init__(self) -> None:
        super().__init__()
        _FREE_CPU_THREADS.install(self)

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
        """``"auto"``, ``"reference"``, ``"cpu"``, ``"triton"`` or ``"dense"`` (static shapes, for
        export) for every HSMLA layer (see :func:`~hsmla_med.nn.dispatch.select_backend`)."""
        for layer in self.hsmla_layers().values():
            layer.backend = name

    def calibrate_tau(self, samples: torch.Tensor | Sequence[torch.Tensor], target_alpha: float = 0.3) -> dict[str, float]:
        """Set every gated layer's ``tau`` so that about ``target_alpha`` of its tiles refine, in
        one inference pass over ``samples``: :func:`~hsmla_med.nn.attention.calibrate_tau`.

        Returns:
            ``{layer name: tau}``.
        """
        return calibrate_tau(self, samples, target_alpha)

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


def _attention_strides(strides: Sequence[int]) -> tuple[int, ...]:
    strides = tuple(sorted(set(strides)))
    if any(s not in STRIDES[1:] for s in strides):
        raise ValueError(f"attention_strides must be a subset of {STRIDES[1:]}, got {strides!r}.")
    return strides


class HSMLABackbone(nn.Module):
    """EfficientViT-style backbone: a conv stem at stride 2, then one stage per stride 4, 8, 16,
    32. A stage at one of ``attention_strides`` (default 16 and 32, EfficientViT's layout) is a
    stride-2 MBConv followed by ``depth`` HSMLA sandwich blocks; the others are ``depth`` MBConvs,
    the first strided.

    ``forward`` maps ``(batch, in_channels, *spatial)`` to the five stage outputs, the i-th of
    shape ``(batch, widths[i], *ceil(spatial / 2**(i+1)))``.
    """

    def __init__(
        self,
        spatial_dims: int,
        in_channels: int,
        variant: Variant,
        attention_strides: Sequence[int] = (16, 32),
        norm: str = "batch",
        **attention,
    ) -> None:
        super().__init__()
        w, d = variant.widths, variant.depths
        self.attention_strides = _attention_strides(attention_strides)
        attention.setdefault("head_dim", variant.head_dim)
        stem = [ConvNormAct(spatial_dims, in_channels, w[0], 3, stride=2, norm=norm)]
        stem += [DSConv(spatial_dims, w[0], norm) for _ in range(d[0])]
        stages = [nn.Sequential(*stem)]
        for i in range(1, 5):
            if STRIDES[i] in self.attention_strides:
                blocks = [MBConv(spatial_dims, w[i - 1], w[i], stride=2, norm=norm)]
                blocks += [HSMLABlock(spatial_dims, w[i], **attention) for _ in range(d[i])]
            else:
                blocks = [
                    MBConv(spatial_dims, w[i - 1] if j == 0 else w[i], w[i], 2 if j == 0 else 1, norm=norm) for j in range(d[i])
                ]
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.ModuleList(stages)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        features = []
        for stage in self.stages:
            x = stage(x)
            features.append(x)
        return features


class UNetDecoder(nn.Module):
    """U-shaped decoder from the stride-32 map up to full resolution.

    At each level, from stride 16 down to stride 1, the coarser map is projected (1x1, at its own
    resolution, which is cheaper than after upsampling) to the level's width, upsampled to the
    skip's size (so odd sizes work) and added to the skip's own 1x1 projection; a 3x3
    :class:`ConvNormAct` and a residual :class:`DSConv` then refine the sum. Adding two
    projections is a concatenation followed by a 1x1 convolution, without the copy.

    Args:
        spatial_dims: 2 or 3.
        skip_widths: channels of the skips at strides 1, 2, 4, 8, 16.
        deep_width: channels of the stride-32 map.
        widths: decoder channels at strides 1, 2, 4, 8, 16.
        norm: one of :data:`~hsmla_med.nn.blocks.NORMS`.
        full_res: the full-resolution level, one of :data:`FULL_RES` (default ``refine``).

    ``forward(skips, deep)``: the five skips (finest first) and the stride-32 map -> the
    full-resolution map ``(batch, widths[0], *skips[0].shape[2:])``.
    """

    def __init__(
        self,
        spatial_dims: int,
        skip_widths: Sequence[int],
        deep_width: int,
        widths: Sequence[int],
        norm: str = "batch",
        full_res: str = "refine",
    ) -> None:
        super().__init__()
        if len(skip_widths) != len(widths):
            raise ValueError(f"skip_widths and widths must have the same length, got {len(skip_widths)} and {len(widths)}.")
        coarser = [*widths[1:], deep_width]
        self.up = nn.ModuleList(ConvNormAct(spatial_dims, c, w, 1, act=False, norm=norm) for c, w in zip(coarser, widths))
        self.skip = nn.ModuleList(ConvNormAct(spatial_dims, c, w, 1, act=False, norm=norm) for c, w in zip(skip_widths, widths))
        if full_res not in FULL_RES:
            raise ValueError(f"full_res must be one of {FULL_RES}, got {full_res!r}.")
        def level(i: int, w: int) -> nn.Module:  # built in order: a network's initial weights follow one random stream
            if i == 0 and full_res == "light":
                return nn.Sequential(DSConv(spatial_dims, w, norm))
            if i == 0 and full_res == "sum":
                return nn.Identity()
            return nn.Sequential(ConvNormAct(spatial_dims, w, w, 3, norm=norm), DSConv(spatial_dims, w, norm))

        self.refine = nn.ModuleList(level(i, w) for i, w in enumerate(widths))
        self._mode = "bilinear" if spatial_dims == 2 else "trilinear"

    def forward(self, skips: Sequence[torch.Tensor], deep: torch.Tensor) -> torch.Tensor:
        x = deep
        for level in reversed(range(len(skips))):
            skip = skips[level]
            up = F.interpolate(self.up[level](x), size=skip.shape[2:], mode=self._mode, align_corners=False)
            x = self.refine[level](up.add_(self.skip[level](skip)))  # in place: see _Residual
        return x


_HEAD_STAGES = {4: 1, 8: 2}  # head stride of the fpn decoder -> first backbone stage it fuses


class HSMLASegNet(GatedNetwork):
    """HSMLA segmentation network (MONAI-style, 2D or 3D).

    ``decoder="unet"`` (default): a U-shaped decoder (:class:`UNetDecoder`) with skips from a
    full-resolution 3x3 convolution of the input, the stem and every stage (strides 1 to 16),
    so thin structures (cortex, vessels, adrenal glands) keep their boundaries.

    ``decoder="fpn"``: the paper's head, kept for its ablation: the stride-8/16/32 stage outputs
    are projected to a common width, upsampled to the stride-8 map, summed, refined with MBConv
    blocks, and the class logits upsampled to the input size. ``head_stride=4`` also fuses the
    stride-4 stage (an extension of the paper's head).

    Any input size works.

    Args:
        spatial_dims: 2 or 3.
        in_channels: input channels.
        out_channels: output channels (classes, including background).
        variant: ``"b0"``, ``"b1"`` or ``"b2"`` (see :data:`VARIANTS`).
        decoder: one of :data:`DECODERS`.
        head_stride: stride of the fused map of the ``fpn`` decoder, 8 (the paper, the default)
            or 4; refused with the ``unet`` decoder.
        attention_strides: backbone strides whose stages hold HSMLA blocks (default 16 and 32).
        norm: normalisation of the convolutions, ``"batch"`` (default, folded into the
            convolutions at inference) or ``"instance"`` (see :data:`~hsmla_med.nn.blocks.NORMS`;
            the stride-32 map must then hold more than one element: inputs over 32 along an axis).
        full_res: the ``unet`` decoder's full-resolution level, one of :data:`FULL_RES`;
            default ``refine`` in 2D, ``sum`` in 3D: there the refined level held 45% of a
            training step (64 x 96 x 32 patches), and without it the network trained at 1.4x
            UNet-3D's time to a better Dice on real MRI (docs/benchmarks.md, "3D at UNet-3D's cost").
            Refused with the ``fpn`` decoder.
        **attention: keyword arguments for every :class:`~hsmla_med.nn.HSMLA` layer
            (``window``, ``block``, ``tau``, ``rho``, ``scales``, ``routing``, ``backend``...).

    ``forward``: ``(batch, in_channels, *spatial)`` -> logits ``(batch, out_channels, *spatial)``.
    """

    def __init__(
        self,
        spatial_dims: int,
        in_channels: int,
        out_channels: int,
        variant: str = "b0",
        decoder: str = "unet",
        head_stride: int | None = None,
        attention_strides: Sequence[int] = (16, 32),
        norm: str = "batch",
        full_res: str | None = None,
        **attention,
    ) -> None:
        super().__init__()
        _check_dims_channels(spatial_dims, in_channels=in_channels, out_channels=out_channels)
        if decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {DECODERS}, got {decoder!r}.")
        if decoder == "unet" and head_stride is not None:
            raise ValueError("head_stride belongs to the fpn decoder; the unet decoder reaches full resolution.")
        if decoder == "fpn" and full_res is not None:
            raise ValueError("full_res belongs to the unet decoder; the fpn decoder stops at stride 8 or 4.")
        head_stride = 8 if head_stride is None else head_stride
        if head_stride not in _HEAD_STAGES:
            raise ValueError(f"head_stride must be one of {sorted(_HEAD_STAGES)}, got {head_stride}")
        cfg = _variant(variant)
        self.spatial_dims, self.in_channels, self.out_channels, self.variant = spatial_dims, in_channels, out_channels, variant
        self.decoder_kind = decoder
        self.backbone = HSMLABackbone(spatial_dims, in_channels, cfg, attention_strides, norm, **attention)
        conv = conv_type(spatial_dims)
        self._mode = "bilinear" if spatial_dims == 2 else "trilinear"
        if decoder == "unet":
            width = cfg.decoder_widths[0]
            self.full_res = ConvNormAct(spatial_dims, in_channels, width, 3, norm=norm)
            full_res = full_res or ("refine" if spatial_dims == 2 else "sum")
            self.decoder = UNetDecoder(spatial_dims, (width, *cfg.widths[:4]), cfg.widths[4], cfg.decoder_widths, norm, full_res)
            self.classify = conv(width, out_channels, 1)
        else:
            self._first = _HEAD_STAGES[head_stride]
            self.lateral = nn.ModuleList(
                ConvNormAct(spatial_dims, width, cfg.head_width, 1, act=False, norm=norm) for width in cfg.widths[self._first :]
            )
            self.fuse = nn.Sequential(
                *(MBConv(spatial_dims, cfg.head_width, cfg.head_width, norm=norm) for _ in range(cfg.head_depth))
            )
            self.classify = conv(cfg.head_width, out_channels, 1)
        self._channels_last()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._check_input(x)
        features = self.backbone(x)
        if self.decoder_kind == "unet":
            return self.classify(self.decoder([self.full_res(x), *features[:4]], features[4]))
        features = features[self._first :]
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

    ``forward``: ``(batch, in_channels, *spatial)`` -> logits ``(batch, out_channels)``, which
    is ``forward_head(forward_features(x))`` (timm's split): ``forward_features`` gives the
    penultimate activations ``(batch, hidden)``, the input of the last linear layer (the patch
    features ``wsi-features`` writes), ``forward_head`` that layer.
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

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self._check_input(x)
        pooled = self.backbone(x)[-1].flatten(2).mean(dim=2)
        for layer in self.head[:-1]:
            pooled = layer(pooled)
        return pooled

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        return self.head[-1](features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))
