"""The HSMLA layer: routing, gate, regularisers, calibration, precision and bad arguments."""

import pytest
import torch

from hsmla_med.nn import HSMLA, calibrate_tau
from hsmla_med.nn import functional as HF


def _layer(spatial_dims=2, channels=16, **kw):
    kw.setdefault("head_dim", 8)
    kw.setdefault("window", 3)
    kw.setdefault("block", 4)
    return HSMLA(spatial_dims, channels, **kw)


def _binarised_gate(layer, monkeypatch):
    """Make ``layer.gate`` return ``M * [M > tau]``: the gate kept on active tiles only."""
    original = layer.gate

    def hard(ms):
        m = original(ms)
        return m * (m > layer.tau).float()

    monkeypatch.setattr(layer, "gate", hard)


@pytest.mark.parametrize("spatial", [(13, 10), (9, 6, 7)])
def test_hard_inference_equals_soft_path_fed_the_gate_on_active_tiles(spatial, monkeypatch):
    layer = _layer(len(spatial), channels=16)
    x = torch.randn(2, 16, *spatial)
    with torch.no_grad():
        layer.eval()
        gate = layer.gate(layer._multiscale(layer.qkv(x)))
        layer.tau.fill_(gate.median().item())  # about half of the tiles active
        hard = layer(x)
        assert 0.0 < layer.last_alpha < 1.0
        _binarised_gate(layer, monkeypatch)
        layer.train()
        soft = layer(x)
    torch.testing.assert_close(hard, soft, rtol=1e-5, atol=1e-5)


def test_inference_refines_only_active_tiles(monkeypatch):
    layer = _layer(channels=16, backend="reference").eval()
    calls = []
    original = HF.local_refine
    monkeypatch.setattr(HF, "local_refine", lambda *a, **k: calls.append((a[6], a[7])) or original(*a, **k))
    x = torch.randn(1, 16, 16, 16)
    with torch.no_grad():
        layer.tau.fill_(2.0)  # sigmoid < 1: nothing active
        layer(x)
    (gate, tau), = calls
    assert gate.shape == (1, 4, 4) and tau == 2.0 and layer.last_alpha == 0.0


def test_routing_off_is_linear_attention_only():
    layer = _layer(channels=16).eval()
    x = torch.randn(1, 16, 11, 7)
    layer.routing = "off"
    with torch.no_grad():
        out = layer(x)
        ms = layer._multiscale(layer.qkv(x))
        qh, kh, vh = layer._split_heads(ms)
        lin = HF.linear_attention(qh, kh, vh, layer.eps)
        expected = layer.proj(lin.movedim(-1, 2).reshape(1, 16, 11, 7))
    torch.testing.assert_close(out, expected)
    assert layer.last_alpha == 0.0 and layer.last_gate is None


def test_routing_all_refines_every_tile(monkeypatch):
    layer = _layer(channels=16).eval()
    x = torch.randn(1, 16, 11, 7)
    with torch.no_grad():
        layer.routing = "all"
        everywhere = layer(x)
        assert layer.last_alpha == 1.0
        layer.routing = "gate"
        original = layer.gate
        monkeypatch.setattr(layer, "gate", lambda ms: torch.ones_like(original(ms)))
        layer.tau.fill_(0.5)  # every tile active, at gate weight 1
        gated = layer(x)
    torch.testing.assert_close(everywhere, gated)


def test_multiscale_sum_equals_separate_convolutions():
    layer = _layer(channels=16, scales=(1, 3, 7))
    qkv = torch.randn(2, 48, 9, 12)
    separate = sum(conv(qkv) for conv in layer.multiscale)
    torch.testing.assert_close(layer._multiscale(qkv), separate, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spatial", [(1, 2, 3), (4, 1, 9), (2, 3)])
def test_multiscale_on_maps_smaller_than_the_kernel(spatial):
    """Maps of fewer tokens than the kernel's reach (the deep stages of 3D patches): the same
    values and gradients as the separate full-size convolutions, in float64."""
    layer = _layer(channels=16, scales=(3, 5, 7), spatial_dims=len(spatial)).double()
    qkv = torch.randn(2, 48, *spatial, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 48, *spatial, dtype=torch.float64)
    separate = sum(conv(qkv) for conv in layer.multiscale)
    expected = torch.autograd.grad(separate, [qkv, *layer.multiscale.parameters()], grad)
    fused = layer._multiscale(qkv)
    torch.testing.assert_close(fused, separate)
    for got, want in zip(torch.autograd.grad(fused, [qkv, *layer.multiscale.parameters()], grad), expected):
        torch.testing.assert_close(got, want)


def test_gate_is_head_mean_of_sigmoid_scores_over_tiles():
    layer = _layer(channels=16, block=3)
    ms = torch.randn(1, 48, 7, 5)
    g = layer.gate_conv(ms)
    gate = layer.gate(ms)
    assert gate.shape == (1, 3, 2)
    # tile (2, 1): rows 6..6, columns 3..4 (partial in both axes)
    pooled = g[0, :, 6:7, 3:5].mean(dim=(1, 2)).view(3, layer.heads, layer.head_dim)
    scores = torch.sigmoid((pooled * layer.gate_weight).sum(dim=(0, 2)) + layer.gate_bias)
    torch.testing.assert_close(gate[0, 2, 1], scores.mean())


@pytest.mark.parametrize("spatial", [(8, 12), (4, 8, 12)])
def test_fused_gate_pooling_equals_conv_then_tile_average(spatial):
    """On maps of whole tiles the gate pools with one strided convolution; it must equal the
    3x3 depthwise conv followed by the tile average (float64, fresh weights)."""
    layer = _layer(spatial_dims=len(spatial), channels=16, block=4).double()
    torch.nn.init.normal_(layer.gate_conv.weight)
    torch.nn.init.normal_(layer.gate_conv.bias)
    ms = torch.randn(2, 48, *spatial, dtype=torch.float64)
    expected = HF.tile_average(layer.gate_conv(ms), 4)
    torch.testing.assert_close(layer._gate_pool(ms), expected, rtol=1e-10, atol=1e-10)


def test_fused_gate_kernel_follows_weight_updates():
    """Without gradients the fused kernel is kept; an optimizer step (in place) or loaded
    weights must replace it."""
    layer = _layer(channels=16, block=4).eval()
    ms = torch.randn(1, 48, 8, 8)
    with torch.no_grad():
        first = layer._gate_pool(ms)
        layer.gate_conv.weight.mul_(-2.0)  # as an optimizer step does
        torch.testing.assert_close(layer._gate_pool(ms), HF.tile_average(layer.gate_conv(ms), 4))
        other = _layer(channels=16, block=4).state_dict()
        layer.load_state_dict(other)
        torch.testing.assert_close(layer._gate_pool(ms), HF.tile_average(layer.gate_conv(ms), 4))
    assert not torch.allclose(first, layer._gate_pool(ms))


def test_gradients_reach_the_gate():
    layer = _layer(channels=16).train()
    x = torch.randn(2, 16, 10, 9)
    out = layer(x)
    budget, smooth = layer.regularizers()
    (out.square().mean() + 0.01 * budget + 0.005 * smooth).backward()
    for p in (layer.gate_weight, layer.gate_bias, layer.gate_conv.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_task_loss_alone_trains_the_gate():
    layer = _layer(channels=16).train()
    layer(torch.randn(1, 16, 8, 8)).sum().backward()
    assert layer.gate_weight.grad.abs().sum() > 0


def test_regularizers_follow_the_last_gate():
    layer = _layer(channels=16, rho=0.2)
    layer(torch.randn(2, 16, 12, 12))
    budget, smooth = layer.regularizers()
    expected = HF.gate_regularizers(layer.last_gate, 0.2)
    assert budget.item() == pytest.approx(expected[0].item())
    assert smooth.item() == pytest.approx(expected[1].item())
    layer.routing = "off"
    layer(torch.randn(2, 16, 12, 12))
    assert [t.item() for t in layer.regularizers()] == [0.0, 0.0]


@pytest.mark.parametrize("target", [0.25, 0.5])
def test_calibrate_tau_hits_target_alpha(target):
    net = torch.nn.Sequential(_layer(channels=16, block=2), _layer(channels=16, block=2))
    for layer in net:
        torch.nn.init.normal_(layer.gate_weight, std=2.0)  # spread gates out
    samples = torch.randn(4, 16, 16, 16)
    taus = calibrate_tau(net, samples, target)
    assert set(taus) == {"0", "1"}
    with torch.no_grad():
        net.eval()
        net(samples)
    for layer in net:
        assert layer.last_alpha == pytest.approx(target, abs=0.02)
    assert net.training is False


def test_tau_is_saved_in_the_state_dict():
    layer = _layer()
    layer.tau.fill_(0.42)
    other = _layer()
    other.load_state_dict(layer.state_dict())
    assert float(other.tau) == pytest.approx(0.42)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_with_many_tokens_and_large_activations_stays_finite(dtype):
    # 128x128 tokens with activations ~50: float16 sums over the map would overflow.
    layer = _layer(channels=16, head_dim=8, window=3, block=8)
    x = torch.randn(1, 16, 128, 128) * 50
    with torch.no_grad():
        for training in (True, False):
            layer.train(training)
            with torch.autocast("cpu", dtype=dtype):
                assert torch.isfinite(layer(x)).all()
        # accuracy without hard routing, whose threshold may flip tiles under rounding
        layer.routing = "all"
        ref = layer(x)
        with torch.autocast("cpu", dtype=dtype):
            out = layer(x).float()
    assert (out - ref).abs().mean() < 0.05 * ref.abs().mean()


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(spatial_dims=1), "spatial_dims"),
        (dict(in_channels=0), "in_channels"),
        (dict(in_channels=12, head_dim=8), "head_dim"),
        (dict(window=4), "window"),
        (dict(window=0), "window"),
        (dict(block=0), "block"),
        (dict(block=-2), "block"),
        (dict(scales=(3, 4)), "scales"),
        (dict(routing="sometimes"), "routing"),
        (dict(backend="cuda"), "backend"),
        (dict(rho=1.5), "rho"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    args = dict(spatial_dims=2, in_channels=16, head_dim=8)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        HSMLA(**args)


def test_bad_input_shape():
    layer = _layer(channels=16)
    with pytest.raises(ValueError, match="spatial_dims=2"):
        layer(torch.zeros(1, 16, 4, 4, 4))
    with pytest.raises(ValueError, match="in_channels"):
        layer(torch.zeros(1, 8, 4, 4))


def test_forward_follows_the_dispatch(monkeypatch):
    """The layer runs the ops of the backend that ``select_backend`` names: in training the
    reference (dense R on small maps), at CPU inference on float64 the reference as well (the C
    kernel takes float32), and a forced ``cpu`` that cannot run raises instead of falling back."""
    from hsmla_med.nn import attention

    seen = []
    real = attention.select_backend
    monkeypatch.setattr(attention, "select_backend", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    layer = _layer(channels=16).double()
    x = torch.randn(1, 16, 8, 8, dtype=torch.float64)
    layer(x).sum().backward()
    assert {c.backend for c in seen} == {"reference"} and seen[-1].dense
    seen.clear()
    with torch.no_grad():
        layer.eval()(x)
    assert {c.backend for c in seen} == {"reference"} and "float32" in seen[-1].reason
    layer.backend = "cpu"
    with torch.no_grad(), pytest.raises(RuntimeError, match="'cpu'.*float64"):
        layer(x)


def _spread_gates(net):
    for m in net.modules():
        if isinstance(m, HSMLA):
            torch.nn.init.normal_(m.gate_weight, std=2.0)


def test_calibrate_sets_tau_to_the_gate_quantile_and_nothing_else():
    """``HSMLA.calibrate``: tau is the (1 - alpha) quantile of the gate of the given input (an
    independent evaluation through the reference backend), the outputs of a later forward are
    those of a fresh layer loaded with that tau, and no hook or flag is left behind."""
    layer = _layer(channels=16, block=2)
    _spread_gates(layer)
    x = torch.randn(3, 16, 12, 10)
    tau = layer.calibrate(x, 0.3)
    assert layer.training and float(layer.tau) == tau
    with torch.no_grad():
        reference = _layer(channels=16, block=2, backend="reference")
        reference.load_state_dict(layer.state_dict())
        gate = reference.gate(reference._multiscale(reference.qkv(x)))
    assert tau == pytest.approx(torch.quantile(gate.flatten(), 0.7).item(), abs=1e-6)
    with torch.no_grad():
        first, second = layer.eval()(x), layer(x)
        fresh = _layer(channels=16, block=2).eval()
        fresh.load_state_dict(layer.state_dict())
        torch.testing.assert_close(first, second, rtol=0, atol=0)
        torch.testing.assert_close(first, fresh(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="target_alpha"):
        layer.calibrate(x, 1.5)


def test_calibrate_tau_follows_execution_order_and_leaves_no_state():
    """Each layer is calibrated on the output of the already calibrated layers before it: the
    second layer's tau is the quantile of its gate on what the first layer gives *with its new
    tau* (not with the old one). Afterwards no hook remains, modes are restored, and a second
    forward equals that of a fresh copy."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(_layer(channels=16, block=2, tau=0.0), _layer(channels=16, block=2))
    _spread_gates(net)
    fresh = torch.nn.Sequential(_layer(channels=16, block=2), _layer(channels=16, block=2))
    fresh.load_state_dict(net.state_dict())
    samples = [torch.randn(2, 16, 16, 16), torch.randn(2, 16, 16, 16)]
    x = torch.cat(samples)
    net[1].eval()  # one module in another mode than its parent: restored as it was
    taus = calibrate_tau(net, samples, 0.4)
    assert net.training and net[0].training and not net[1].training
    assert all(not layer._forward_pre_hooks for layer in net)

    def quantile_of_second(first_tau):
        with torch.no_grad():
            first = _layer(channels=16, block=2).eval()
            first.load_state_dict(net[0].state_dict())
            first.tau.fill_(first_tau)
            second = net[1]
            gate = second.gate(second._multiscale(second.qkv(first(x))))
        return torch.quantile(gate.flatten(), 0.6).item()

    assert taus["1"] == pytest.approx(quantile_of_second(taus["0"]), abs=1e-6)
    assert taus["1"] != pytest.approx(quantile_of_second(0.0), abs=1e-4)  # the order matters here
    net.eval()
    fresh.load_state_dict(net.state_dict())
    fresh.eval()
    with torch.no_grad():
        y = net(x)
        torch.testing.assert_close(net(x), y, rtol=0, atol=0)
        torch.testing.assert_close(fresh(x), y, rtol=0, atol=0)
        other = torch.randn(1, 16, 16, 16)
        torch.testing.assert_close(net(other), fresh(other), rtol=0, atol=0)
    assert {n: float(m.tau) for n, m in net.named_children()} == taus


@pytest.mark.parametrize("routing", ["gate", "all"])
def test_training_forward_and_gradients_equal_the_tile_schedule(routing, monkeypatch):
    """Training takes the dense form of R on small maps; forcing the tile schedule (by making
    nothing fit) gives the same output and parameter gradients."""
    from hsmla_med.nn import functional as HF

    torch.manual_seed(0)
    layer = HSMLA(2, 32, head_dim=8, block=2, window=5, routing=routing).train()
    x = torch.randn(2, 32, 9, 7)

    def run():
        layer.zero_grad()
        out = layer(x)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out.detach(), [p.grad.clone() for p in layer.parameters() if p.grad is not None]

    calls = []
    real = HF.dense_refine
    monkeypatch.setattr(HF, "dense_refine", lambda *a, **k: calls.append(1) or real(*a, **k))
    out, grads = run()
    assert calls, "training did not take the dense form"
    monkeypatch.setattr(HF, "DENSE_TOKENS", 0)
    out_tiled, grads_tiled = run()
    assert len(calls) == 1
    torch.testing.assert_close(out, out_tiled, rtol=1e-4, atol=1e-5)
    for a, b in zip(grads, grads_tiled):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("spatial", [(5, 7), (5, 6, 7)])
def test_partial_tile_gate_pooling_equals_the_tile_average(spatial):
    """Maps with partial edge tiles pool with one ceil-mode average pooling, whose edge windows
    divide by the tokens inside the map: equal to the tile average (float64, 2D and 3D)."""
    layer = _layer(spatial_dims=len(spatial), channels=16, block=4).double()
    torch.nn.init.normal_(layer.gate_conv.weight)
    ms = torch.randn(2, 48, *spatial, dtype=torch.float64)
    expected = HF.tile_average(layer.gate_conv(ms), 4)
    torch.testing.assert_close(layer._gate_pool(ms), expected, rtol=1e-12, atol=1e-12)
