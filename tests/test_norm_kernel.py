"""The C instance norm + Hardswish of CPU inference (``hsmla_med.kernels.norm_cpu``) against a
float64 reference computed here, and inside ``ConvNormAct`` against the PyTorch modules it
replaces (:class:`hsmla_med.nn.blocks.InstanceNorm`, ``torch.nn.Hardswish``).

Inputs are fresh random numbers every run; outputs written into a given tensor start as NaN, so
a position or channel the kernel skips fails the comparison. The kernel has no backward: with
gradients the block runs the modules, which autograd differentiates (checked here too).
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from hsmla_med import kernels
from hsmla_med.kernels import instance_norm_act_cpu, norm_cpu
from hsmla_med.nn import blocks

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")

# (batch, channels, *spatial): odd sides, one channel, channels not a multiple of the 16 vector
# lanes, a single position, 3D
SHAPES = [(1, 16, 33, 47), (2, 17, 9, 11), (3, 1, 5, 4), (1, 64, 1, 1), (2, 5, 7, 9, 3), (1, 40, 16, 16)]


def _layout(dims: int) -> torch.memory_format:
    return torch.channels_last if dims == 4 else torch.channels_last_3d


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, hardswish: bool) -> torch.Tensor:
    """Instance norm with affine (biased variance) and Hardswish, in float64 from the definitions."""
    x = x.double()
    axes = tuple(range(2, x.dim()))
    mean = x.mean(axes, keepdim=True)
    var = ((x - mean) ** 2).mean(axes, keepdim=True)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    y = (x - mean) / torch.sqrt(var + eps) * weight.double().view(shape) + bias.double().view(shape)
    return y * (y + 3).clamp(0, 6) / 6 if hardswish else y


def _inputs(shape, mean: float = 0.0, std: float = 1.0):
    x = (torch.randn(shape) * std + mean).contiguous(memory_format=_layout(len(shape)))
    return x, torch.rand(shape[1]) * 1.5 + 0.25, torch.randn(shape[1])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("hardswish", [True, False])
@pytest.mark.parametrize("where", ["new", "given", "in place"])
def test_kernel_matches_the_float64_reference(shape, hardswish, where):
    x, weight, bias = _inputs(shape, mean=float(torch.randn(())) * 5, std=float(torch.rand(())) * 3 + 0.1)
    expected = _reference(x, weight, bias, 1e-5, hardswish)
    out = {"new": None, "given": torch.full_like(x, float("nan")), "in place": x.clone()}[where]
    source = out if where == "in place" else x
    got = instance_norm_act_cpu(source, weight, bias, 1e-5, hardswish, out=out)
    assert got is not None and got.shape == x.shape and got.is_contiguous(memory_format=_layout(len(shape)))
    if out is not None:
        assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=1e-5)


def test_a_channel_far_from_zero_and_a_constant_channel():
    """Mean 1000 and deviation 0.01: the kernel stays within float32 rounding of the float64
    result, while the module's x * scale + (bias - mean * scale) loses about 1e-2; a
    constant channel gives its bias (zero variance, the deviation is 0), as the reference."""
    x, weight, bias = _inputs((1, 8, 64, 64), mean=1000.0, std=0.01)
    x[:, 3] = 7.25
    expected = _reference(x, weight, bias, 1e-5, False)
    got = instance_norm_act_cpu(x, weight, bias, 1e-5, False)
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got[:, 3], bias[3].expand_as(got[:, 3]), atol=1e-6, rtol=0)
    norm = blocks.InstanceNorm(8)
    norm.weight.data, norm.bias.data = weight.clone(), bias.clone()
    with torch.no_grad():
        module_error = (norm(x).double() - expected).abs().max().item()
    assert module_error > (got.double() - expected).abs().max().item()


@pytest.mark.parametrize("why", ["channels-first", "float64", "gradients", "channels-first out", "1d map", "wrong weight"])
def test_inputs_it_does_not_take_return_none(why):
    x, weight, bias = _inputs((1, 4, 6, 6))
    out = None
    if why == "channels-first":
        x = x.contiguous()
    elif why == "float64":
        x = x.double()
    elif why == "gradients":
        weight.requires_grad_(True)
    elif why == "channels-first out":
        out = torch.empty(1, 4, 6, 6)  # channels-first
    elif why == "1d map":
        x = torch.randn(1, 4, 6)
    else:
        weight = torch.ones(5)
    with torch.enable_grad():
        assert instance_norm_act_cpu(x, weight, bias, 1e-5, True, out=out) is None


def _block(dims: int, act: bool = True) -> blocks.ConvNormAct:
    block = blocks.ConvNormAct(dims, 3, 12, 3, act=act, norm="instance")
    with torch.no_grad():
        block[1].weight.uniform_(0.5, 1.5)
        block[1].bias.normal_()
    return block.to(memory_format=_layout(dims + 2))


@pytest.mark.parametrize("dims, act", [(2, True), (2, False), (3, True)])
def test_block_uses_the_kernel_at_inference_and_matches_its_modules(dims, act, monkeypatch):
    block = _block(dims, act).eval()
    x = torch.randn((2, 3) + (9,) * dims).contiguous(memory_format=_layout(dims + 2))
    calls = []

    def counted(*args, **kwargs):
        result = norm_cpu.instance_norm_act(*args, **kwargs)
        calls.append(result is not None)
        return result

    monkeypatch.setattr(kernels, "instance_norm_act_cpu", counted)
    with torch.no_grad():
        got = block(x)
        expected = block[2](block[1](block[0](x)))
    assert calls == [True]
    torch.testing.assert_close(got, expected, atol=3e-5, rtol=1e-5)


def test_training_and_gradients_run_the_modules_which_autograd_differentiates(monkeypatch):
    """In training the block never asks the kernel (it has no backward); in eval mode with
    gradients it asks and the kernel declines; either way the gradient of the block's output
    passes gradcheck (float64, the modules' autograd)."""
    answers = []
    kernel = kernels.instance_norm_act_cpu

    def recorded(*args, **kwargs):
        answers.append(kernel(*args, **kwargs))
        return answers[-1]

    monkeypatch.setattr(kernels, "instance_norm_act_cpu", recorded)
    block = _block(2)
    x = torch.randn(2, 3, 7, 7, requires_grad=True)
    block.train()
    block(x).sum().backward()
    assert answers == [] and x.grad is not None
    block.eval()
    block(x)
    assert answers == [None]
    block64, x64 = block.double(), torch.randn(2, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    for mode in (True, False):
        block64.train(mode)
        assert torch.autograd.gradcheck(block64, (x64,), eps=1e-6, atol=1e-5)
