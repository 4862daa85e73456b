"""The convolution classes of the HSMLA networks: PyTorch's, with faster 3D training forms of the
pointwise and depthwise cases."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Conv3d", "conv_type"]


class _DepthwiseSame(torch.autograd.Function):
    """Stride-1 depthwise convolution with 'same' zero padding (odd kernel), whose backward
    computes the input's gradient as the forward convolution of the gradient with the flipped
    kernel: oneDNN's channels-last depthwise 3D backward computing both gradients took about
    twice as long as that plus the weight gradient alone (465 against 270 ms at 2 x 16 x 64^3,
    one thread), the largest op of the 3D training step."""

    @staticmethod
    def forward(ctx, x, weight, bias, padding):
        # Under autocast (bf16-mixed / 16-mixed) the convolution runs on the autocast dtype's
        # copies of x and weight; the backward runs outside autocast, so it is given those copies
        # and casts its gradients back to the dtypes of the tensors they belong to.
        ctx.dtypes = x.dtype, weight.dtype, None if bias is None else bias.dtype
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        ctx.save_for_backward(x, weight)
        ctx.padding, ctx.has_bias = padding, bias is not None
        return F.conv3d(x, weight, bias, padding=padding, groups=weight.shape[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous(memory_format=torch.channels_last_3d)
        groups = weight.shape[0]
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = F.conv3d(grad, weight.flip(2, 3, 4), padding=ctx.padding, groups=groups)
        if ctx.needs_input_grad[1]:
            ones = [1] * 3
            # On the CPU the bfloat16 channels-last weight gradient of a depthwise 3D convolution
            # is garbage on small maps (2 x 2 x 1 and 2 x 2 x 2 at 64 channels: relative error
            # 1.3, sometimes NaN, which made every weight of a bf16-mixed run NaN through the
            # clipped gradient norm; float32 and channels-first bfloat16 are right): it is
            # computed in float32 there, and cast back below
            x_w, grad_w_in, weight_w = (x, grad, weight)
            if grad.device.type == "cpu" and grad.dtype in (torch.bfloat16, torch.float16):
                x_w, grad_w_in, weight_w = x.float(), grad.float(), weight.float()
            grad_w = torch.ops.aten.convolution_backward(
                grad_w_in, x_w, weight_w, None, ones, list(ctx.padding), ones, False, [0] * 3, groups, [False, True, False]
            )[1]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum(dim=(0, 2, 3, 4), dtype=ctx.dtypes[2])  # accumulated in the bias dtype, not bf16
        grads = [None if g is None else g.to(d) for g, d in zip((grad_x, grad_w, grad_b), ctx.dtypes)]
        return *grads, None


class Conv3d(nn.Conv3d):
    """:class:`torch.nn.Conv3d` with faster training forms of its pointwise and depthwise cases
    on channels-last maps (the same values; inference, folded or exported, keeps the plain
    convolution).

    Pointwise (1x1x1, stride 1): PyTorch runs it for a batch under 16 on one thread with its own
    kernel (``slow_conv3d``), which returns a channels-first map from a channels-last one: every
    op after it then mixes layouts in the backward (batch norm's backward with a channels-first
    gradient of a channels-last input took 365 ms against 47 at 2 x 16 x 64^3), and one 3D
    training step of HSMLA-B0 took 2.2x UNet-3D's instead of 1.3x (docs/benchmarks.md, "3D
    training step"). A pointwise convolution is a matrix product over the channels, so it runs
    as :func:`torch.nn.functional.linear` on the ``(batch, *spatial, C)`` view: no copy,
    channels-last output and gradients.

    Depthwise (stride 1, 'same' padding): :class:`_DepthwiseSame`'s backward.
    """

    def _training_form(self, x: torch.Tensor) -> str | None:
        """``"pointwise"``, ``"depthwise"`` or None (the plain convolution) for input ``x``."""
        if not (self.training and self.stride == (1, 1, 1) and self.dilation == (1, 1, 1) and self.padding_mode == "zeros"):
            return None
        if x.dim() != 5 or not x.is_contiguous(memory_format=torch.channels_last_3d):
            return None
        if self.groups == 1 and self.kernel_size == (1, 1, 1) and self.padding in ((0, 0, 0), "valid", "same"):
            return "pointwise"
        same = tuple(k // 2 for k in self.kernel_size)
        if self.groups == self.in_channels == self.out_channels and all(k % 2 for k in self.kernel_size) and self.padding in (same, "same"):
            return "depthwise"
        return None

    def _conv_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        form = self._training_form(x)
        if form == "pointwise":
            return F.linear(x.movedim(1, -1), weight.flatten(1), bias).movedim(-1, 1)
        if form == "depthwise":
            return _DepthwiseSame.apply(x, weight, bias, tuple(k // 2 for k in self.kernel_size))
        return super()._conv_forward(x, weight, bias)


def conv_type(spatial_dims: int) -> type[nn.Module]:
    """The convolution class of ``spatial_dims`` (2: :class:`torch.nn.Conv2d`, whose own
    kernels keep channels-last; 3: :class:`Conv3d`)."""
    return nn.Conv2d if spatial_dims == 2 else Conv3d
