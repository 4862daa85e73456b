"""HSMLA networks as MONAI networks: shapes, sliding windows, gate access, switches, arguments."""

import io

import pytest
import torch
from monai.inferers import sliding_window_inference

from hsmla_med.nn import VARIANTS, HSMLA, HSMLAClassifier, HSMLASegNet, calibrate_tau
from hsmla_med.nn.blocks import ConvNormAct, DSConv


@pytest.mark.parametrize("variant", ["b0", "b1", "b2"])
def test_segnet_2d_any_size(variant):
    net = HSMLASegNet(2, 1, 14, variant=variant).eval()
    with torch.no_grad():
        for size in [(37, 53), (64, 64), (5, 9)]:
            assert net(torch.randn(1, 1, *size)).shape == (1, 14, *size)


@pytest.mark.parametrize("spatial_dims, size", [(2, (37, 21)), (3, (9, 20, 13))])
def test_segnet_stride4_head_fuses_one_more_stage(spatial_dims, size):
    coarse = HSMLASegNet(spatial_dims, 1, 3, decoder="fpn", head_stride=8)
    fine = HSMLASegNet(spatial_dims, 1, 3, decoder="fpn", head_stride=4)
    assert len(fine.lateral) == len(coarse.lateral) + 1
    assert fine.lateral[0][0].in_channels == VARIANTS["b0"].widths[1]
    with torch.no_grad():
        assert fine.eval()(torch.randn(1, 1, *size)).shape == (1, 3, *size)
    with pytest.raises(ValueError, match="head_stride"):
        HSMLASegNet(2, 1, 3, decoder="fpn", head_stride=2)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("spatial_dims, size", [(2, (37, 53)), (2, (5, 9)), (3, (9, 20, 13))])
def test_unet_decoder_reaches_full_resolution(variant, spatial_dims, size):
    net = HSMLASegNet(spatial_dims, 2, 4, variant=variant, decoder="unet", block=2).eval()
    x = torch.randn(1, 2, *size)
    with torch.no_grad():
        assert net(x).shape == (1, 4, *size)
    # every level of the decoder receives a skip: the full-resolution one at the input's size
    seen = []
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape[2:]))) for m in net.decoder.skip]
    with torch.no_grad():
        net(x)
    for h in hooks:
        h.remove()
    expected = [size]
    for _ in range(4):
        expected.append(tuple(-(-n // 2) for n in expected[-1]))
    assert sorted(seen, reverse=True) == sorted(expected, reverse=True)
    assert [m[0].out_channels for m in net.decoder.skip] == list(VARIANTS[variant].decoder_widths)


@pytest.mark.parametrize("spatial_dims, full_res, expected", [(2, None, "refine"), (3, None, "sum"), (3, "refine", "refine"),
                                                           (2, "light", "light"), (3, "sum", "sum")])
def test_full_res_level(spatial_dims, full_res, expected):
    """The full-resolution level: refined as the others by default in 2D, the sum alone in 3D,
    either on request; ``sum`` gives exactly the classifier of the two projections' sum."""
    net = HSMLASegNet(spatial_dims, 1, 3, full_res=full_res).eval()
    level = net.decoder.refine[0]
    kinds = {"refine": [ConvNormAct, DSConv], "light": [DSConv], "sum": []}[expected]
    assert [type(m) for m in level.children()] == kinds
    assert all([type(m) for m in r.children()] == [ConvNormAct, DSConv] for r in net.decoder.refine[1:])
    if expected == "sum":
        x = torch.randn(1, 1, *[16] * spatial_dims)
        seen = {}
        net.decoder.up[0].register_forward_hook(lambda m, i, o: seen.setdefault("up", o.clone()))
        net.decoder.skip[0].register_forward_hook(lambda m, i, o: seen.setdefault("skip", o))
        with torch.no_grad():
            logits = net(x)
        mode = "bilinear" if spatial_dims == 2 else "trilinear"
        up = torch.nn.functional.interpolate(seen["up"], size=x.shape[2:], mode=mode, align_corners=False)
        torch.testing.assert_close(logits, net.classify(up + seen["skip"]))


def test_full_res_is_checked_and_belongs_to_the_unet_decoder():
    with pytest.raises(ValueError, match="full_res must be one of"):
        HSMLASegNet(3, 1, 3, full_res="none")
    with pytest.raises(ValueError, match="full_res belongs to the unet decoder"):
        HSMLASegNet(2, 1, 3, decoder="fpn", full_res="sum")


def test_unet_decoder_is_sensitive_to_every_pixel():
    """One changed input pixel changes the logits at that pixel (a full-resolution path), and the
    prediction of a 1-pixel-wide line is not smeared like a stride-8 head's bilinear upsampling."""
    torch.manual_seed(0)
    net = HSMLASegNet(2, 1, 2, decoder="unet").eval()
    x = torch.randn(1, 1, 32, 32)
    y = x.clone()
    y[0, 0, 17, 9] += 5.0
    with torch.no_grad():
        delta = (net(y) - net(x)).abs().sum(1)[0]
    assert delta[17, 9] > 0
    assert delta[17, 9] >= delta.max() * 0.2


def test_attention_strides_place_hsmla_layers():
    cfg = VARIANTS["b0"]
    net = HSMLASegNet(2, 1, 3, attention_strides=(8, 16, 32))
    layers = net.hsmla_layers()
    assert len(layers) == cfg.depths[2] + cfg.depths[3] + cfg.depths[4]
    assert {m.in_channels for m in layers.values()} == {cfg.widths[2], cfg.widths[3], cfg.widths[4]}
    assert len(HSMLASegNet(2, 1, 3, attention_strides=(32,)).hsmla_layers()) == cfg.depths[4]
    with torch.no_grad():
        assert net.eval()(torch.randn(1, 1, 33, 47)).shape == (1, 3, 33, 47)
    for bad in [(2, 16), (64,)]:
        with pytest.raises(ValueError, match="attention_strides"):
            HSMLASegNet(2, 1, 3, attention_strides=bad)
    with pytest.raises(ValueError, match="decoder"):
        HSMLASegNet(2, 1, 3, decoder="deeplab")


def test_segnet_3d_any_size():
    net = HSMLASegNet(3, 2, 4, variant="b0", block=2).eval()
    with torch.no_grad():
        assert net(torch.randn(1, 2, 19, 33, 8)).shape == (1, 4, 19, 33, 8)
        assert net(torch.randn(2, 2, 1, 16, 16)).shape == (2, 4, 1, 16, 16)


@pytest.mark.parametrize("spatial_dims,size", [(2, (48, 40)), (3, (16, 16, 12))])
def test_classifier_shapes(spatial_dims, size):
    net = HSMLAClassifier(spatial_dims, 3, 2, variant="b0")
    assert net(torch.randn(2, 3, *size)).shape == (2, 2)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_layout(variant):
    cfg = VARIANTS[variant]
    net = HSMLASegNet(2, 1, 2, variant=variant)
    layers = net.hsmla_layers()
    assert len(layers) == cfg.depths[3] + cfg.depths[4]
    assert {m.in_channels for m in layers.values()} == {cfg.widths[3], cfg.widths[4]}
    assert {m.head_dim for m in layers.values()} == {cfg.head_dim}
    feats = net.backbone(torch.randn(1, 1, 64, 64))
    assert [f.shape[1] for f in feats] == list(cfg.widths)
    assert [f.shape[-1] for f in feats] == [32, 16, 8, 4, 2]


def test_sliding_window_inference_2d_and_3d():
    net2 = HSMLASegNet(2, 1, 3, variant="b0").eval()
    net3 = HSMLASegNet(3, 1, 3, variant="b0", block=2).eval()
    with torch.no_grad():
        out2 = sliding_window_inference(torch.randn(1, 1, 45, 70), (32, 32), 2, net2, overlap=0.25, mode="gaussian")
        out3 = sliding_window_inference(torch.randn(1, 1, 20, 30, 9), (16, 16, 16), 1, net3, overlap=0.5)
    assert out2.shape == (1, 3, 45, 70)
    assert out3.shape == (1, 3, 20, 30, 9)
    # one window covering the input exactly: the sliding window is the network itself
    x2, x3 = torch.randn(1, 1, 32, 32), torch.randn(1, 1, 16, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(sliding_window_inference(x2, (32, 32), 1, net2, mode="gaussian"), net2(x2), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(sliding_window_inference(x3, (16, 16, 16), 1, net3), net3(x3), atol=1e-5, rtol=1e-4)


def test_gate_regularization_sums_the_layers():
    net = HSMLASegNet(2, 1, 2, variant="b0", block=2).train()
    net(torch.randn(2, 1, 64, 64))
    terms = net.gate_regularization()
    layers = net.hsmla_layers().values()
    assert terms["budget"].item() == pytest.approx(sum(m.regularizers()[0].item() for m in layers))
    assert terms["smoothness"].item() == pytest.approx(sum(m.regularizers()[1].item() for m in layers))
    (terms["budget"] + terms["smoothness"]).backward()
    assert all(m.gate_weight.grad is not None for m in layers)


def test_gate_stats_and_switches():
    net = HSMLASegNet(2, 1, 2, variant="b0", block=2).eval()
    x = torch.randn(1, 1, 64, 64)
    with torch.no_grad():
        net(x)
        stats = net.gate_stats()
        assert len(stats) == 4
        for s in stats.values():
            assert s["gate"].shape == (1, 2, 2) or s["gate"].shape == (1, 1, 1)
            assert s["alpha"] == pytest.approx((s["gate"] > s["tau"]).float().mean().item())
        net.set_routing("all")
        net(x)
        assert all(s["alpha"] == 1.0 and s["gate"] is None for s in net.gate_stats().values())
        net.set_routing("off")
        off = net(x)
        assert all(s["alpha"] == 0.0 for s in net.gate_stats().values())
        assert all(t.item() == 0 for t in net.gate_regularization().values())
        net.set_routing("gate")
        assert not torch.allclose(net(x), off)
    with pytest.raises(ValueError, match="routing"):
        net.set_routing("never")
    with pytest.raises(ValueError, match="backend"):
        net.set_backend("gpu")


def test_calibrated_tau_survives_a_checkpoint_round_trip():
    net = HSMLASegNet(2, 1, 2, variant="b0", block=2)
    taus = calibrate_tau(net, torch.randn(2, 1, 64, 64), 0.5)
    buffer = io.BytesIO()
    torch.save(net.state_dict(), buffer)
    buffer.seek(0)
    other = HSMLASegNet(2, 1, 2, variant="b0", block=2)
    other.load_state_dict(torch.load(buffer, weights_only=True))
    assert {n: float(m.tau) for n, m in other.hsmla_layers().items()} == pytest.approx(taus)


def test_attention_options_reach_every_layer():
    net = HSMLASegNet(2, 1, 2, variant="b1", window=5, block=3, tau=0.4, routing="off")
    for layer in net.hsmla_layers().values():
        assert isinstance(layer, HSMLA)
        assert (layer.window, layer.block, float(layer.tau), layer.routing) == (5, 3, pytest.approx(0.4), "off")


@pytest.mark.parametrize(
    "args,kwargs,name",
    [
        ((1, 1, 2), {}, "spatial_dims"),
        ((2, 0, 2), {}, "in_channels"),
        ((2, 1, 0), {}, "out_channels"),
        ((2, 1, 2), {"variant": "b9"}, "variant"),
        ((2, 1, 2), {"window": 6}, "window"),
        ((2, 1, 2), {"block": 0}, "block"),
    ],
)
@pytest.mark.parametrize("cls", [HSMLASegNet, HSMLAClassifier])
def test_bad_arguments(cls, args, kwargs, name):
    with pytest.raises(ValueError, match=name):
        cls(*args, **kwargs)


def test_bad_inputs():
    net = HSMLASegNet(2, 3, 2, variant="b0")
    with pytest.raises(ValueError, match="in_channels=3"):
        net(torch.randn(1, 1, 32, 32))
    with pytest.raises(ValueError, match="spatial_dims=2"):
        net(torch.randn(1, 3, 8, 8, 8))


@pytest.mark.parametrize("spatial_dims, groups, stride", [(2, 1, 1), (2, 6, 2), (3, 1, 2)])
def test_conv_norm_act_folds_batchnorm_at_inference(spatial_dims, groups, stride):
    """Eval mode folds the BatchNorm into the convolution: the output equals conv, then
    BatchNorm with its running statistics, then Hardswish, evaluated separately in float64."""
    from hsmla_med.nn.blocks import ConvNormAct

    block = ConvNormAct(spatial_dims, 6, 12, 3, stride=stride, groups=groups).double()
    conv, norm, act = block
    with torch.no_grad():
        norm.running_mean.normal_()
        norm.running_var.uniform_(0.5, 2.0)
        norm.weight.normal_()
        norm.bias.normal_()
    block.eval()
    x = torch.randn(2, 6, *[9] * spatial_dims, dtype=torch.float64)
    expected = act((conv(x) - norm.running_mean.view(-1, *[1] * spatial_dims))
                   / torch.sqrt(norm.running_var + norm.eps).view(-1, *[1] * spatial_dims)
                   * norm.weight.view(-1, *[1] * spatial_dims) + norm.bias.view(-1, *[1] * spatial_dims))
    torch.testing.assert_close(block(x), expected, rtol=1e-10, atol=1e-10)
    block.train()  # training normalises with the batch statistics, not the folded running ones
    torch.testing.assert_close(block(x), act(torch.nn.functional.batch_norm(conv(x), None, None, norm.weight, norm.bias, True)))


def _unfused(block, x):
    """conv, BatchNorm with its running statistics, activation: three separate modules' math."""
    conv, norm, act = block
    return act(torch.nn.functional.batch_norm(conv(x), norm.running_mean, norm.running_var, norm.weight, norm.bias, False, 0.0, norm.eps))


def _randomise_norm(norm):
    with torch.no_grad():
        norm.running_mean.normal_()
        norm.running_var.uniform_(0.5, 2.0)
        norm.weight.normal_()
        norm.bias.normal_()


@pytest.mark.parametrize("spatial_dims, groups, stride", [(2, 1, 1), (2, 6, 2), (3, 1, 2)])
def test_folded_batchnorm_is_kept_and_follows_every_change(spatial_dims, groups, stride):
    """Without gradients the folded convolution is built once and reused; it equals the
    unfused modules (1e-5, float32) and is rebuilt after an in-place weight update, new running
    statistics, loaded weights, a cast, and a round through training mode."""
    from hsmla_med.nn.blocks import ConvNormAct

    block = ConvNormAct(spatial_dims, 6, 12, 3, stride=stride, groups=groups)
    conv, norm, _ = block
    _randomise_norm(norm)
    block.eval()
    x = torch.randn(2, 6, *[9] * spatial_dims)
    with torch.no_grad():
        torch.testing.assert_close(block(x), _unfused(block, x), rtol=1e-5, atol=1e-5)
        folded = block._fused[1]
        block(x)
        assert block._fused[1] is folded  # kept
        for change in (
            lambda: conv.weight.mul_(-1.5),  # an optimizer step
            lambda: norm.running_var.mul_(3.0),  # new statistics
            lambda: norm.bias.add_(1.0),
            lambda: block.load_state_dict(ConvNormAct(spatial_dims, 6, 12, 3, stride=stride, groups=groups).state_dict()),
        ):
            change()
            torch.testing.assert_close(block(x), _unfused(block, x), rtol=1e-5, atol=1e-5)
        block.double()
        torch.testing.assert_close(block(x.double()), _unfused(block, x.double()), rtol=1e-10, atol=1e-10)
        block.float()
    block.train()
    assert block._fused is None
    block(x)  # batch statistics move the running ones
    block.eval()
    with torch.no_grad():
        torch.testing.assert_close(block(x), _unfused(block, x), rtol=1e-5, atol=1e-5)
    # with gradients the fold is differentiable: they reach the BatchNorm's parameters
    block(x).sum().backward()
    assert norm.weight.grad is not None and conv.weight.grad is not None


def test_network_with_folded_batchnorm_equals_the_unfused_network(monkeypatch):
    """A whole network's eval output with the cached folds equals the same network computing
    every BatchNorm separately (1e-5), twice in a row."""
    from hsmla_med.nn.blocks import ConvNormAct

    torch.manual_seed(0)
    net = HSMLASegNet(2, 1, 3, variant="b0", block=2)
    for m in net.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            _randomise_norm(m)
    net.eval()
    x = torch.randn(1, 1, 48, 40)
    with torch.no_grad():
        first, second = net(x), net(x)
        monkeypatch.setattr(ConvNormAct, "forward", _unfused)
        unfused = net(x)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    torch.testing.assert_close(first, unfused, rtol=1e-5, atol=1e-5)


def test_network_calibrate_tau_method():
    """``GatedNetwork.calibrate_tau`` is the module function's pass: the same taus, about
    ``target_alpha`` of the tiles refine in every gated layer at the next forward, and the
    network's mode is kept."""
    torch.manual_seed(0)
    net = HSMLASegNet(2, 1, 2, variant="b0", block=2)
    for layer in net.hsmla_layers().values():
        torch.nn.init.normal_(layer.gate_weight, std=2.0)
    other = HSMLASegNet(2, 1, 2, variant="b0", block=2)
    other.load_state_dict(net.state_dict())
    x = torch.randn(2, 1, 128, 128)
    net.eval()
    taus = net.calibrate_tau(x, 0.3)
    assert taus == pytest.approx(calibrate_tau(other.eval(), x, 0.3))
    assert not net.training
    with torch.no_grad():
        net(x)
    for stats in net.gate_stats().values():
        assert stats["alpha"] == pytest.approx(0.3, abs=0.13)  # few tiles at stride 32: 4 x 4 x 2


@pytest.mark.parametrize("spatial_dims, size", [(2, (37, 29)), (3, (11, 13, 9))])
def test_channels_last_layout_gives_the_channel_first_result(spatial_dims, size):
    """The networks compute channels-last; the same weights in plain channel-first layout give
    the same logits, for the segmentation and the classification net."""
    import copy

    for net in (HSMLASegNet(spatial_dims, 2, 3), HSMLAClassifier(spatial_dims, 2, 3)):
        net.eval()
        plain = copy.deepcopy(net).to(memory_format=torch.contiguous_format)
        plain._memory_format = torch.contiguous_format
        conv = next(m for m in net.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d)) and m.weight.shape[1] > 1)
        assert not conv.weight.is_contiguous()
        x = torch.randn(2, 2, *size)
        with torch.no_grad():
            torch.testing.assert_close(net(x), plain(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("spatial_dims, size", [(2, (40, 36)), (3, (48, 40, 36))])
def test_instance_norm_network_ignores_the_intensity_scale(spatial_dims, size):
    """With ``norm="instance"`` every convolution path starts with a bias-free convolution followed
    by instance normalisation, so scaling an image's intensities by a > 0 (a scanner's gain)
    leaves the logits unchanged; the batch-normalised network is not invariant."""
    torch.manual_seed(0)
    x = torch.randn(2, 1, *size)
    inst = HSMLASegNet(spatial_dims, 1, 3, norm="instance", block=2).eval()
    batch = HSMLASegNet(spatial_dims, 1, 3, norm="batch", block=2).eval()
    with torch.no_grad():
        torch.testing.assert_close(inst(3.7 * x), inst(x), rtol=1e-3, atol=1e-3)
        assert not torch.allclose(batch(3.7 * x), batch(x), rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="norm"):
        HSMLASegNet(2, 1, 3, norm="group")


@pytest.mark.parametrize("spatial_dims, size", [(2, (23, 17)), (3, (9, 7, 6))])
@pytest.mark.parametrize("channels_last", [False, True])
def test_instance_norm_matches_torch_in_values_and_gradients(spatial_dims, size, channels_last):
    """``blocks.InstanceNorm`` against ``F.instance_norm`` in float64, fresh random inputs and
    affine: values and the gradients of input, weight and bias; the output keeps the input's
    layout (torch's is channels-first whatever the input)."""
    from hsmla_med.nn.blocks import InstanceNorm

    x = (torch.randn(3, 5, *size, dtype=torch.float64) * 4 + 2)
    if channels_last:
        x = x.to(memory_format=torch.channels_last if spatial_dims == 2 else torch.channels_last_3d)
    x.requires_grad_(True)
    norm = InstanceNorm(5).double()
    with torch.no_grad():
        norm.weight.copy_(torch.rand(5) + 0.5)
        norm.bias.copy_(torch.randn(5))
    reference = torch.nn.functional.instance_norm(x, weight=norm.weight, bias=norm.bias, eps=norm.eps)
    out = norm(x)
    torch.testing.assert_close(out, reference, rtol=1e-10, atol=1e-10)
    assert out.is_contiguous(memory_format=torch.channels_last if spatial_dims == 2 else torch.channels_last_3d) == channels_last
    grad = torch.randn_like(out)
    expected = torch.autograd.grad(reference, (x, norm.weight, norm.bias), grad)
    for got, want in zip(torch.autograd.grad(out, (x, norm.weight, norm.bias), grad), expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="channels"):
        InstanceNorm(0)


def test_instance_norm_float32_keeps_precision_far_from_zero():
    """Maps whose mean is 1000x their spread (a CT map in HU before any normalisation): in
    float32 the statistics must not cancel (E[x^2] - E[x]^2 loses every digit here); compared
    with ``F.instance_norm`` in float64."""
    from hsmla_med.nn.blocks import InstanceNorm

    x = torch.randn(2, 4, 64, 48, dtype=torch.float64) + 1000.0
    norm = InstanceNorm(4)
    reference = torch.nn.functional.instance_norm(x, eps=norm.eps)
    out = norm(x.float().to(memory_format=torch.channels_last))
    torch.testing.assert_close(out.double(), reference, rtol=0, atol=2e-3)


def test_instance_norm_loads_the_parameters_of_torchs_instance_norm():
    """Checkpoints trained with ``torch.nn.InstanceNorm2d(affine=True)`` (before the layout-keeping
    norm) load into the network unchanged: the same parameter names and shapes."""
    from hsmla_med.nn.blocks import InstanceNorm

    theirs = torch.nn.InstanceNorm2d(6, affine=True)
    theirs.weight.data.uniform_(0.5, 1.5)
    ours = InstanceNorm(6)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 6, 10, 12)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


def test_2d_default_network_initialises_as_before_full_res():
    """The full_res option builds only the level it uses: with seed 0 the 2D default draws the
    same initial weights as before the option existed (values taken at commit 867b882). A module
    built and dropped shifted the random stream (commit 3fce24a), and with it every seeded run
    and the untrained checkpoints the export tests use."""
    torch.manual_seed(0)
    net = HSMLASegNet(2, 1, 3)
    with torch.no_grad():
        assert float(net.classify.weight.double().sum()) == pytest.approx(0.5016725063323975, abs=1e-9)
        assert float(sum(p.double().abs().sum() for p in net.parameters())) == pytest.approx(42910.71709097471, rel=1e-9)
