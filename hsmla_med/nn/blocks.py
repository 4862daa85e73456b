"""Building blocks shared by the HSMLA networks, for 2D and 3D maps ``(batch, C, *spatial)``."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from monai.networks.layers.factories import Norm
from torch.nn.utils.fusion import fuse_conv_bn_eval

from hsmla_med import kernels
from hsmla_med.nn.attention import HSMLA
from hsmla_med.nn.conv import conv_type
from hsmla_med.nn.functional import building_graph

__all__ = ["NORMS", "InstanceNorm", "ChannelLayerNorm", "ConvNormAct", "MBConv", "DSConv", "HSMLABlock"]

#: ``batch`` (EfficientViT's; folded into the convolution at inference) or ``instance`` (per image
#: and channel, as MONAI's UNet and SwinUNETR normalise: insensitive to an image's intensity scale).
NORMS = ("batch", "instance")


class InstanceNorm(nn.Module):
    """Instance normalisation with an affine, per image and channel over the spatial axes, in
    the input's memory layout.

    ``torch.nn.InstanceNorm2d/3d`` (``F.instance_norm``) copies a channels-last map to
    channels-first, normalises it as a batch norm of ``batch x C`` channels and returns it
    channels-first, so every following convolution and block converts back: at 512^2 that made
    HSMLA-B2 3x slower than with batch norm (docs/benchmarks.md). Here the statistics are two
    reductions (the mean, then the mean squared deviation) and the normalisation one fused
    multiply-add with per-image, per-channel scale and shift (the affine folded into them), both
    in the input's layout; autograd differentiates it. Values as ``F.instance_norm`` (biased variance, ``eps`` inside
    the root); parameter names ``weight`` and ``bias`` as torch's, so checkpoints load either way.

    Args:
        channels: ``C`` of the ``(batch, C, *spatial)`` maps it normalises.
        eps: added to the variance.
    """

    def __init__(self, channels: int, eps: float = 1e-5) -> None:
        super().__init__()
        if channels <= 0:
            raise ValueError(f"channels must be positive, got {channels}.")
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # two passes, the mean and then the mean squared deviation from it (as stable as
        # torch.var_mean's Welford pass, no E[x^2] - E[x]^2 cancellation): on the CPU
        # torch.var_mean over the spatial axes took 70% of a HSMLA-B0-UNet forward at 512^2, 14-25x
        # the time of these two reductions (docs/benchmarks.md, "The plan's norm")
        # Half-precision maps (autocast) get float32 statistics, as torch's own norms keep them:
        # a bfloat16 mean and variance moved the probabilities of a small MRI network by 0.08.
        spatial = tuple(range(2, x.dim()))
        half = x.dtype in (torch.float16, torch.bfloat16)
        mean = x.mean(dim=spatial, keepdim=True, dtype=torch.float32 if half else None)
        deviation = x - mean
        # squared in place where autograd does not need the deviation (inference): one map less
        var = (deviation.square() if deviation.requires_grad else deviation.square_()).mean(dim=spatial, keepdim=True)
        shape = (1, -1) + (1,) * (x.dim() - 2)
        scale = torch.rsqrt(var + self.eps) * self.weight.view(shape)
        return torch.addcmul(self.bias.view(shape) - mean * scale, x, scale).to(x.dtype)


class ChannelLayerNorm(nn.LayerNorm):
    """LayerNorm over the channel axis of a channel-first map ``(batch, C, *spatial)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.movedim(1, -1), self.normalized_shape, self.weight, self.bias, self.eps).movedim(-1, 1)


class ConvNormAct(nn.Sequential):
    """Convolution ('same' padding, so odd sizes give ``ceil(size / stride)``), BatchNorm, Hardswish.

    In eval mode the BatchNorm is folded into the convolution (its running statistics become a
    per-channel scale of the kernel and a bias): one pass over the map instead of two, the
    inference option docs/design.md §3.3 names for the convolutional stages. Without gradients the
    folded convolution (:func:`torch.nn.utils.fusion.fuse_conv_bn_eval`) is kept until a weight
    or statistic changes (version counter, storage, dtype or device of any of them: an
    optimizer step, loaded weights, a cast) or the block is put in a mode; with gradients the
    fold is computed in every call, differentiably. With ``norm="instance"``, which cannot fold,
    inference on the CPU (eval mode, no gradients, a float32 channels-last map) runs the norm and
    the Hardswish as one C kernel, in place on the convolution's output
    (:func:`hsmla_med.kernels.instance_norm_act_cpu`); elsewhere :class:`InstanceNorm` and the
    activation as modules.
    """

    def __init__(
        self,
        spatial_dims: int,
        in_channels: int,
        out_channels: int,
        kernel_size: int = 3,
        stride: int = 1,
        groups: int = 1,
        act: bool = True,
        norm: str = "batch",
    ) -> None:
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}.")
        super().__init__(
            conv_type(spatial_dims)(
                in_channels, out_channels, kernel_size, stride=stride, padding=kernel_size // 2, groups=groups, bias=False
            ),
            Norm[Norm.BATCH, spatial_dims](out_channels) if norm == "batch" else InstanceNorm(out_channels),
            nn.Hardswish(inplace=True) if act else nn.Identity(),
        )
        self._fused: tuple | None = None  # (key, folded convolution); not a submodule

    def train(self, mode: bool = True):
        self._fused = None
        return super().train(mode)

    def _folded(self) -> nn.Module:
        """The convolution with the BatchNorm folded in, built once per weights and statistics."""
        conv, norm, _ = self
        tensors = (conv.weight, conv.bias, norm.weight, norm.bias, norm.running_mean, norm.running_var)
        key = tuple(None if t is None else (t._version, t.data_ptr(), t.dtype, t.device) for t in tensors)
        key += (norm.eps,)
        kept = getattr(self, "_fused", None)  # (absent from blocks pickled before it existed)
        if kept is None or kept[0] != key:
            self._fused = (key, fuse_conv_bn_eval(conv, norm).requires_grad_(False))
        return self._fused[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv, norm, act = self
        if isinstance(norm, InstanceNorm):
            y = conv(x)
            # at inference on the CPU, norm and activation in one C kernel, in place on the fresh
            # convolution output (None where it does not take the map: the modules below)
            fused = None if self.training or building_graph() else kernels.instance_norm_act_cpu(
                y, norm.weight, norm.bias, norm.eps, hardswish=isinstance(act, nn.Hardswish), out=y
            )
            return fused if fused is not None else act(norm(y))
        if self.training or not isinstance(norm, nn.modules.batchnorm._BatchNorm):
            return act(norm(conv(x)))
        grad = torch.is_grad_enabled() and any(p.requires_grad for p in (conv.weight, norm.weight, norm.bias) if p is not None)
        # while a tracer records, the fold is built in the graph: the fake tensors of
        # torch.compile and torch.export have no storage for the cache's key, and torch.jit.trace
        # would store the folded convolution's weights as constants on the tracing device
        if not (grad or building_graph()):
            return act(self._folded()(x))
        scale = norm.weight * torch.rsqrt(norm.running_var + norm.eps)
        weight = conv.weight * scale.view(-1, *[1] * (conv.weight.dim() - 1))
        return act(conv._conv_forward(x, weight, norm.bias - norm.running_mean * scale))


class _Residual(nn.Module):
    """``x + body(x)`` when shapes allow it, else ``body(x)``.

    The sum is taken in place on the body's fresh output (no block's backward reads its output):
    at 512 x 512 that saves an allocation per block, 9% of HSMLA-B2 with the U-Net decoder
    together with the decoder's in-place sum (docs/benchmarks.md).
    """

    def __init__(self, body: nn.Module, residual: bool) -> None:
        super().__init__()
        self.body = body
        self.residual = residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).add_(x) if self.residual else self.body(x)


class MBConv(_Residual):
    """Inverted residual block: 1x1 expand, depthwise 3x3 (carries the stride), 1x1 project."""

    def __init__(
        self, spatial_dims: int, in_channels: int, out_channels: int, stride: int = 1, expand_ratio: int = 4, norm: str = "batch"
    ):
        mid = in_channels * expand_ratio
        super().__init__(
            nn.Sequential(
                ConvNormAct(spatial_dims, in_channels, mid, 1, norm=norm),
                ConvNormAct(spatial_dims, mid, mid, 3, stride=stride, groups=mid, norm=norm),
                ConvNormAct(spatial_dims, mid, out_channels, 1, act=False, norm=norm),
            ),
            residual=stride == 1 and in_channels == out_channels,
        )


class DSConv(_Residual):
    """Depthwise-separable block of the stem: depthwise 3x3 then 1x1."""

    def __init__(self, spatial_dims: int, channels: int, norm: str = "batch"):
        super().__init__(
            nn.Sequential(
                ConvNormAct(spatial_dims, channels, channels, 3, groups=channels, norm=norm),
                ConvNormAct(spatial_dims, channels, channels, 1, act=False, norm=norm),
            ),
            residual=True,
        )


class HSMLABlock(nn.Module):
    """Sandwich block (docs/design.md §2.9, the paper's block composition)::

        X1 = X + HSMLA(LN(X));  X2 = X1 + DWConv(LN(X1));  X3 = X2 + FFN(LN(X2))

    Args:
        spatial_dims: 2 or 3.
        channels: channels of the map, unchanged by the block.
        ffn_ratio: hidden width of the FFN as a multiple of ``channels``.
        **attention: keyword arguments of :class:`~hsmla_med.nn.HSMLA` (``head_dim``,
            ``window``, ``block``, ``tau``, ...).
    """

    def __init__(self, spatial_dims: int, channels: int, ffn_ratio: int = 4, **attention) -> None:
        super().__init__()
        conv = conv_type(spatial_dims)
        self.norm1 = ChannelLayerNorm(channels)
        self.attn = HSMLA(spatial_dims, channels, **attention)
        self.norm2 = ChannelLayerNorm(channels)
        self.dwconv = conv(channels, channels, 3, padding=1, groups=channels)
        self.norm3 = ChannelLayerNorm(channels)
        self.ffn = nn.Sequential(
            conv(channels, channels * ffn_ratio, 1), nn.GELU(), conv(channels * ffn_ratio, channels, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        x = x + self.dwconv(self.norm2(x))
        return x + self.ffn(self.norm3(x))
