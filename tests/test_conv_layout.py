"""hsmla_med.nn.conv.Conv3d: the pointwise and depthwise training forms equal the convolution,
values and gradients (float64), and keep a channels-last map channels-last forward and backward."""

import copy

import pytest
import torch
import torch.nn.functional as F

from hsmla_med.nn import HSMLASegNet
from hsmla_med.nn import conv as conv_module
from hsmla_med.nn.conv import Conv3d

CL = torch.channels_last_3d


@pytest.fixture
def one_thread():
    """One thread: where PyTorch's own 1x1x1 kernel (channels-first output) would run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "channels, kernel, groups, bias",
    [(5, 1, 1, True), (5, 1, 1, False), (6, 3, 6, False), (6, 3, 6, True), (4, (3, 5, 1), 4, True)],
)
def test_training_forms_equal_the_convolution(channels, kernel, groups, bias, one_thread):
    """Pointwise (5 -> 7 channels) and depthwise 'same' convolutions, float64: output and the
    gradients of the input, weight and bias equal F.conv3d's; the pointwise output and input
    gradient stay channels-last (float64 depthwise convolutions are PyTorch's channels-first
    kernel either way: the float32 network test checks their layout)."""
    g = torch.Generator().manual_seed(0)
    out_channels = 7 if groups == 1 else channels
    padding = "same" if isinstance(kernel, tuple) else kernel // 2
    conv = Conv3d(channels, out_channels, kernel, padding=padding, groups=groups, bias=bias).double().to(memory_format=CL).train()
    assert conv._training_form(torch.zeros(1, channels, 2, 2, 2).contiguous(memory_format=CL)) == ("pointwise" if groups == 1 else "depthwise")
    x = torch.randn(2, channels, 6, 5, 4, dtype=torch.float64, generator=g).contiguous(memory_format=CL).requires_grad_()
    out = conv(x)
    grad = torch.randn(out.shape, dtype=torch.float64, generator=g)
    out.backward(grad)
    if groups == 1:
        assert out.is_contiguous(memory_format=CL) and x.grad.is_contiguous(memory_format=CL)

    ref_x, ref_w = x.detach().clone().requires_grad_(), conv.weight.detach().clone().requires_grad_()
    ref_b = conv.bias.detach().clone().requires_grad_() if bias else None
    ref = F.conv3d(ref_x, ref_w, ref_b, padding=conv.padding, groups=groups)
    ref.backward(grad)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(conv.weight.grad, ref_w.grad, rtol=1e-12, atol=1e-12)
    if bias:
        torch.testing.assert_close(conv.bias.grad, ref_b.grad, rtol=1e-12, atol=1e-12)


def test_other_convolutions_and_inference_keep_the_convolution(monkeypatch):
    """Strided, grouped but not depthwise, unpadded depthwise, full 3x3x3, channel-first inputs
    and eval mode run nn.Conv3d's convolution."""
    calls = []
    monkeypatch.setattr(F, "linear", lambda *a: calls.append(a) or torch.zeros(()))
    monkeypatch.setattr(conv_module._DepthwiseSame, "apply", lambda *a: calls.append(a) or torch.zeros(()))
    x = torch.randn(1, 4, 4, 4, 4)
    for conv, inp in [
        (Conv3d(4, 4, 1, stride=2), x.contiguous(memory_format=CL)),
        (Conv3d(4, 4, 3, stride=2, padding=1, groups=4), x.contiguous(memory_format=CL)),
        (Conv3d(4, 4, 1, groups=2), x.contiguous(memory_format=CL)),
        (Conv3d(4, 4, 3, groups=4), x.contiguous(memory_format=CL)),
        (Conv3d(4, 4, 3, padding=1), x.contiguous(memory_format=CL)),
        (Conv3d(4, 4, 1), x),
        (Conv3d(4, 4, 3, padding=1, groups=4), x),
        (Conv3d(4, 4, 1).eval(), x.contiguous(memory_format=CL)),
        (Conv3d(4, 4, 3, padding=1, groups=4).eval(), x.contiguous(memory_format=CL)),
    ]:
        expected = F.conv3d(inp, conv.weight, conv.bias, conv.stride, conv.padding, 1, conv.groups)
        torch.testing.assert_close(conv(inp), expected)
    assert not calls


def test_3d_network_training_step_unchanged(monkeypatch):
    """HSMLA-B0 3D in training, float64: logits and every parameter's gradient equal those of the
    same network with nn.Conv3d's plain convolution everywhere."""
    torch.manual_seed(0)
    net = HSMLASegNet(3, 1, 3).double().train()
    ref = copy.deepcopy(net)
    x = torch.randn(2, 1, 16, 16, 16, dtype=torch.float64)
    target = torch.randint(0, 3, (2, 16, 16, 16))
    logits = net(x)
    F.cross_entropy(logits, target).backward()

    monkeypatch.setattr(Conv3d, "_training_form", lambda self, x: None)
    ref_logits = ref(x)
    F.cross_entropy(ref_logits, target).backward()
    torch.testing.assert_close(logits, ref_logits, rtol=1e-10, atol=1e-10)
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-10, msg=lambda m, name=name: f"{name}: {m}")


def test_3d_network_trains_channels_last(one_thread):
    """Every 5D map of the full-resolution levels of HSMLA-B0 3D in a training step, and its
    gradient, is channels-last (float32, one thread: there PyTorch's own 1x1x1 kernel returned
    channels-first maps, and the backward mixed layouts)."""
    torch.manual_seed(0)
    net = HSMLASegNet(3, 1, 3, full_res="refine").train()  # the refined level too
    layouts = []

    def record(name):
        def hook(module, args, out):
            layouts.append((name, out.is_contiguous(memory_format=CL)))
            out.register_hook(lambda g: layouts.append((f"{name} gradient", g.is_contiguous(memory_format=CL))))

        return hook

    for name, module in net.named_modules():
        if name.startswith(("decoder.refine.0.", "decoder.skip.0", "full_res")) and not list(module.children()):
            module.register_forward_hook(record(name))
    net(torch.randn(2, 1, 16, 16, 16)).sum().backward()
    assert len(layouts) > 10
    assert [name for name, channels_last in layouts if not channels_last] == []


@pytest.mark.parametrize("kernel, groups", [(1, 1), (3, 6)])
def test_training_forms_under_bfloat16_autocast(kernel, groups):
    """Under autocast (Lightning's ``bf16-mixed``; the first native GPU run of ``train
    --precision bf16-mixed`` failed in the depthwise backward with 'Input type BFloat16 and weight
    type Float'): the pointwise and depthwise forms give the output and gradients of nn.Conv3d's
    own convolution under the same autocast, in the parameters' and input's dtypes."""
    g = torch.Generator().manual_seed(1)
    out_channels = 7 if groups == 1 else 6
    conv = Conv3d(6, out_channels, kernel, padding=kernel // 2, groups=groups).to(memory_format=CL).train()
    reference = copy.deepcopy(conv)
    x = torch.randn(2, 6, 6, 5, 4, generator=g).contiguous(memory_format=CL)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = conv(xs[0])
        ref = F.conv3d(xs[1], reference.weight, reference.bias, padding=reference.padding, groups=groups)
    assert conv._training_form(xs[0]) == ("pointwise" if groups == 1 else "depthwise")
    assert out.dtype == ref.dtype == torch.bfloat16
    grad = torch.randn(out.shape, generator=g).to(torch.bfloat16)
    out.backward(grad)
    ref.backward(grad)
    assert xs[0].grad.dtype == x.dtype and conv.weight.grad.dtype == conv.bias.grad.dtype == torch.float32
    tol = {"rtol": 2e-2, "atol": 2e-2}  # bfloat16 operands (8 bits of mantissa)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    torch.testing.assert_close(xs[0].grad, xs[1].grad, **tol)
    torch.testing.assert_close(conv.weight.grad, reference.weight.grad, **tol)
    torch.testing.assert_close(conv.bias.grad, reference.bias.grad, **tol)


@pytest.mark.parametrize("size", [(2, 2, 1), (2, 2, 2), (5, 4, 3)])
def test_depthwise_weight_gradient_under_bfloat16_on_small_maps(size):
    """The depthwise form's weight gradient under bf16 autocast on the small maps of a 3D
    network's deep levels, against float64 from the bf16-rounded operands: PyTorch's CPU
    bfloat16 channels-last depthwise weight gradient was garbage at 2 x 2 x 1 and 2 x 2 x 2 (64
    channels; relative error 1.3, sometimes NaN), which turned every weight of a bf16-mixed 3D
    run NaN now and then."""
    g = torch.Generator().manual_seed(2)
    conv = Conv3d(64, 64, 3, padding=1, groups=64, bias=False).to(memory_format=CL).train()
    x = torch.randn(2, 64, *size, generator=g).contiguous(memory_format=CL).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = conv(x)
    assert conv._training_form(x) == "depthwise"
    grad = torch.randn(out.shape, generator=g).to(torch.bfloat16).contiguous(memory_format=CL)
    out.backward(grad)
    x64, w64 = x.detach().to(torch.bfloat16).double().requires_grad_(), conv.weight.detach().to(torch.bfloat16).double().requires_grad_()
    F.conv3d(x64, w64, padding=1, groups=64).backward(grad.double())
    assert torch.isfinite(conv.weight.grad).all()
    torch.testing.assert_close(conv.weight.grad.double(), w64.grad, rtol=2e-2, atol=2e-2 * float(w64.grad.abs().max()))
