"""The convolution classes of the HSMLA networks: PyTorch's, with a layout-keeping 3D 1x1x1 path."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Conv3d", "conv_type"]


class Conv3d(nn.Conv3d):
    """:class:`torch.nn.Conv3d` whose pointwise form keeps a channels-last map channels-last in
    training.

    PyTorch runs a 1x1x1 convolution of a batch under 16 on one thread with its own kernel
    (``slow_conv3d``), which returns a channels-first map from a channels-last one: every op
    after it then mixes layouts in the backward (batch norm's backward with a channels-first
    gradient of a channels-last input took 365 ms against 47 at 2 x 16 x 64^3), and one 3D
    training step of HSMLA-B0 took 2.4x UNet-3D's instead of 1.6x (docs/benchmarks.md, "3D
    training step"). A stride-1 pointwise convolution is a matrix product over the channels, so
    on a channels-last input in training it runs as :func:`torch.nn.functional.linear` on the
    ``(batch, *spatial, C)`` view: the same values, no copy, channels-last output and
    gradients. Inference (folded, exported) keeps the convolution.
    """

    def _pointwise(self, x: torch.Tensor) -> bool:
        return (
            self.training
            and self.groups == 1
            and self.kernel_size == (1, 1, 1)
            and self.stride == (1, 1, 1)
            and self.padding in ((0, 0, 0), "valid", "same")
            and x.dim() == 5
            and x.is_contiguous(memory_format=torch.channels_last_3d)
        )

    def _conv_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self._pointwise(x):
            return F.linear(x.movedim(1, -1), weight.flatten(1), bias).movedim(-1, 1)
        return super()._conv_forward(x, weight, bias)


def conv_type(spatial_dims: int) -> type[nn.Module]:
    """The convolution class of ``spatial_dims`` (2: :class:`torch.nn.Conv2d`, whose own
    kernels keep channels-last; 3: :class:`Conv3d`)."""
    return nn.Conv2d if spatial_dims == 2 else Conv3d
