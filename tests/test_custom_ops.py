"""The kernels as PyTorch custom operators (``torch.ops.hsmla.*``, ``hsmla_med.kernels.ops``).

Per op: ``torch.library.opcheck`` (schema, fake implementation, AOT dispatch with dynamic
shapes) and its output against an independent float64 reference, on fresh random inputs; the
fake implementation's layout equals the real output's. Then whole networks: ``torch.compile(
fullgraph=True)`` (a graph break fails it) and ``torch.export`` with a save/load round trip give
the eager output, with BatchNorm (folded in the graph while tracing) and with the 3D maps that
``auto`` refines with the reference (through the op while tracing).
"""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from hsmla_med import kernels
from hsmla_med.kernels import ops
from hsmla_med.nn import HSMLA, HSMLASegNet

CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


@pytest.fixture(autouse=True)
def no_interpreter(monkeypatch):
    """Triton's interpreter would make CPU tensors 'run Triton' in the dispatch."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _features(shape, count, dtype=torch.float32, device="cpu", layout="channels_last"):
    """``count`` random ``(b, h, *S, d)`` maps: views of one channels-last ``(b, count*h*d, *S)``
    map, as the HSMLA layer makes them (``head_dim`` contiguous), or channel-first views."""
    b, h, *spatial, d = shape
    if layout == "channels_last":
        x = torch.randn(b, *spatial, count, h, d, dtype=dtype, device=device)
        return [t.movedim(-2, 1) for t in x.unbind(-3)]
    x = torch.randn(b, count, h, d, *spatial, dtype=dtype, device=device)
    return [t.movedim(2, -1) for t in x.unbind(1)]


def _fake_layout(op, *args):
    """The fake implementation's output: shape, dtype and strides."""
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        out = op(*fake)
    return out.shape, out.dtype, out.stride()


def _check_op(op, args):
    """opcheck, then the real output has the layout the fake one promises; returns the output.
    Inputs are left unchanged (an op may not write them)."""
    torch.library.opcheck(op, args)
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    out = op(*args)
    for a, b in zip(args, before):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), "the op wrote an input"
    assert (out.shape, out.dtype, out.stride()) == _fake_layout(op, *args)
    assert torch.isfinite(out).all()
    return out


# -- linear attention -----------------------------------------------------------------------------


def _linear_reference(qh, kh, vh, eps):
    """float64, per token: ``phi(q_i) Z / (phi(q_i) . Dn + eps)``."""
    q, k, v = (t.double().flatten(2, -2) for t in (qh, kh, vh))  # (b, h, N, d)
    q, k = q.relu(), k.relu()
    z = torch.einsum("bhnd,bhne->bhde", k, v)
    dn = k.sum(dim=2)
    out = torch.einsum("bhnd,bhde->bhne", q, z) / (torch.einsum("bhnd,bhd->bhn", q, dn)[..., None] + eps)
    return out.view(qh.shape)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(2, 2, 5, 7, 8), (1, 3, 3, 4, 5, 4)], ids=["2d", "3d"])
@pytest.mark.parametrize("layout", ["channels_last", "channel_first"])
def test_linear_attention_op(shape, layout, device):
    qh, kh, vh = _features(shape, 3, device=device, layout=layout)
    out = _check_op(ops.OPS["linear_attention"], (qh, kh, vh, 1e-6))
    torch.testing.assert_close(out.double(), _linear_reference(qh, kh, vh, 1e-6), rtol=1e-4, atol=1e-5)
    assert torch.equal(kernels.linear_attention_op(qh, kh, vh, 1e-6), out)


# -- block gate -----------------------------------------------------------------------------------


def _gate_inputs(spatial, block, dtype, device="cpu", heads=2, head_dim=4):
    layer = HSMLA(len(spatial), heads * head_dim, head_dim=head_dim, window=3, block=block)
    for p in (layer.gate_conv.weight, layer.gate_conv.bias, layer.gate_weight, layer.gate_bias):
        torch.nn.init.normal_(p)
    layer = layer.to(device, dtype)
    ms = torch.randn(2, 3 * heads * head_dim, *spatial, dtype=dtype, device=device)
    ms = ms.contiguous(memory_format=(torch.channels_last, torch.channels_last_3d)[len(spatial) - 2])
    with torch.no_grad():
        taps = layer._gate_pool_kernel().flatten(1).t().contiguous()
    return layer, (ms, taps, layer.gate_conv.bias.detach(), layer.gate_weight.detach(), layer.gate_bias.detach(), block)


def _gate_reference(layer, ms):
    """float64 from the unfused pieces: 3x3 depthwise convolution, tile mean, per-head
    projections, sigmoid, mean over heads."""
    conv = (F.conv2d, F.conv3d)[ms.dim() - 4]
    pool = (F.avg_pool2d, F.avg_pool3d)[ms.dim() - 4]
    g = conv(ms.double(), layer.gate_conv.weight.double(), layer.gate_conv.bias.double(), padding=1, groups=ms.shape[1])
    pooled = pool(g, layer.block)  # whole tiles
    b, tiles = pooled.shape[0], pooled.shape[2:]
    per_head = pooled.view(b, 3, layer.heads, layer.head_dim, -1)
    logits = torch.einsum("bthin,thi->bhn", per_head, layer.gate_weight.double()) + layer.gate_bias.double()[:, None]
    return logits.sigmoid().mean(dim=1).view(b, *tiles)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spatial,block", [((8, 12), 4), ((4, 6, 8), 2)], ids=["2d", "3d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])  # C gate; reference
def test_block_gate_op(spatial, block, dtype, device):
    layer, args = _gate_inputs(spatial, block, dtype, device)
    out = _check_op(ops.OPS["block_gate"], args)
    torch.testing.assert_close(out.double(), _gate_reference(layer, args[0]), rtol=1e-5, atol=1e-6)
    assert torch.equal(kernels.block_gate_op(*args), out)


def test_block_gate_op_refuses_partial_tiles():
    _, args = _gate_inputs((9, 8), 4, torch.float32)
    assert kernels.block_gate_op(*args) is None  # the layer's PyTorch gate takes such maps
    with pytest.raises(ValueError, match="whole"):
        ops.OPS["block_gate"](*args)


# -- local refinement -----------------------------------------------------------------------------


def _refine_reference(maps, gate, tau, block, window, eps, add_to):
    """float64 from all ``N x N`` scores with the window as a mask (no tiles): ``R``, weighted
    by ``[M > tau] * M`` and added to ``add_to`` when it is given, by ``[M > tau]`` otherwise."""
    q, k, v, qh, kh, vh = (t.double().flatten(2, -2) for t in maps)
    spatial = maps[0].shape[2:-1]
    coords = torch.cartesian_prod(*(torch.arange(n) for n in spatial)).view(-1, len(spatial))
    inside = ((coords[:, None] - coords[None]).abs().amax(-1) <= window // 2).to(q.device)
    scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~inside, float("-inf"))
    local = scores.softmax(-1) @ v
    w = (qh.relu() @ kh.relu().transpose(-1, -2)) * inside
    r = (local - (w @ vh) / (w.sum(-1, keepdim=True) + eps)).view(maps[0].shape)
    if gate is None:
        return r
    m = gate.double() * (gate > tau) if add_to is not None else (gate > tau).double()
    for axis in range(len(spatial)):
        m = m.repeat_interleave(block, dim=1 + axis)
    m = m[(slice(None), *(slice(0, n) for n in spatial))]
    r = m[:, None, ..., None] * r
    return r if add_to is None else add_to.double() + r


REFINE_CASES = {
    "2d-partial": ((2, 2, 9, 11, 8), 4, 3),
    "3d": ((1, 2, 5, 6, 7, 4), 2, 3),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])  # C kernel; reference
@pytest.mark.parametrize("mode", ["add_to", "masked", "every_tile"])
@pytest.mark.parametrize("case", REFINE_CASES, ids=list(REFINE_CASES))
def test_local_refine_op(case, mode, dtype, device):
    shape, block, window = REFINE_CASES[case]
    maps = _features(shape, 6, dtype, device)
    tiles = [-(-n // block) for n in shape[2:-1]]
    gate = None if mode == "every_tile" else torch.rand(shape[0], *tiles, dtype=dtype, device=device)
    tau = torch.tensor(0.5, dtype=dtype, device=device)
    # the linear output the layer adds to (random: every element of it is kept)
    add_to = _features(shape, 1, dtype, device, "channel_first")[0] if mode == "add_to" else None
    out = _check_op(ops.OPS["local_refine"], (*maps, gate, tau, block, window, 1e-6, add_to))
    expected = _refine_reference(maps, gate, tau, block, window, 1e-6, add_to)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)
    if gate is not None:
        assert 0 < int((gate > tau).sum()) < gate.numel()
    assert torch.equal(kernels.local_refine_op(*maps, gate, tau, block, window, 1e-6, add_to), out)


def test_local_refine_op_float_tau_and_c_kernel(monkeypatch):
    """A float ``tau`` becomes a tensor; float32 channels-last maps run the C kernel (its
    reference made unreachable), whose output equals the float64 reference."""
    if not kernels.cpu_kernel_available():
        pytest.skip("the C kernel is not built")
    from hsmla_med.kernels import refine_cpu

    shape, block, window = REFINE_CASES["2d-partial"]
    maps = _features(shape, 6)
    gate = torch.rand(shape[0], 3, 3)
    add_to = _features(shape, 1, layout="channel_first")[0]
    monkeypatch.setattr(refine_cpu, "reference", lambda *a, **k: pytest.fail("the C kernel fell back"))
    out = kernels.local_refine_op(*maps, gate, 0.4, block, window, 1e-6, add_to)
    expected = _refine_reference(maps, gate, 0.4, block, window, 1e-6, add_to)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)


# -- the attention core: linear attention and gated refinement in one op ------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])  # C kernel; reference
@pytest.mark.parametrize("routing", ["gate", "off", "all"])
@pytest.mark.parametrize("case", REFINE_CASES, ids=list(REFINE_CASES))
def test_attention_op(case, routing, dtype, device):
    """``hsmla::attention`` = float64 ``O_lin`` (+ ``R`` on every tile, or + ``[M > tau] * M * R``)."""
    shape, block, window = REFINE_CASES[case]
    maps = _features(shape, 6, dtype, device)
    tiles = [-(-n // block) for n in shape[2:-1]]
    gate = torch.rand(shape[0], *tiles, dtype=dtype, device=device) if routing == "gate" else None
    tau = torch.tensor(0.5, dtype=dtype, device=device)
    out = _check_op(ops.OPS["attention"], (*maps, gate, tau, routing != "off", block, window, 1e-6))
    linear = _linear_reference(*maps[3:], 1e-6)
    if routing == "off":
        expected = linear
    elif routing == "all":
        expected = linear + _refine_reference(maps, None, tau, block, window, 1e-6, None)
    else:
        expected = _refine_reference(maps, gate, tau, block, window, 1e-6, linear)
        assert 0 < int((gate > tau).sum()) < gate.numel()
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)
    assert torch.equal(kernels.attention_op(*maps, gate, tau, routing != "off", block, window, 1e-6), out)


# -- networks: one graph --------------------------------------------------------------------------


def _network(spatial_dims, backend="auto", seed=0):
    """A small HSMLA-B0 in eval mode whose gates refine about half of their tiles."""
    torch.manual_seed(seed)
    net = HSMLASegNet(spatial_dims, 1, 2, variant="b0", block=2).eval()
    for layer in net.hsmla_layers().values():
        torch.nn.init.normal_(layer.gate_weight, std=2.0)
    for norm in net.modules():  # batch statistics that make the fold change the output
        if isinstance(norm, torch.nn.modules.batchnorm._BatchNorm):
            norm.running_mean.uniform_(-0.5, 0.5)
            norm.running_var.uniform_(0.5, 2.0)
    net.set_backend(backend)
    return net


def _input(spatial_dims):
    torch.manual_seed(1)
    return torch.randn(1, 1, *((96, 96) if spatial_dims == 2 else (64, 64, 96)))


def _ops_in(graph_module) -> dict[str, int]:
    code = graph_module.code
    return {name: code.count(f"hsmla.{name}") for name in ops.OPS}


# 2D: ``auto`` runs the registered ops (channels-last float32 maps: the C kernels). 3D networks'
# maps are channel-first, on which ``auto`` runs the reference refinement, as the op while tracing
# (its tile list, ``nonzero``, is data-dependent). ``dense``: static shapes, the export backend.
NETWORKS = [(2, "auto"), (3, "auto"), (3, "dense")]
IDS = ["2d-auto", "3d-auto", "3d-dense"]


@pytest.mark.parametrize("spatial_dims,backend", NETWORKS, ids=IDS)
def test_compile_fullgraph_equals_eager(spatial_dims, backend):
    net = _network(spatial_dims, backend)
    x = _input(spatial_dims)
    net.calibrate_tau(x, 0.5)
    graphs = []

    def recording_aot_eager(gm, example_inputs):
        graphs.append(gm)
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()  # no earlier test's compiled frames or recompilation counts
    with torch.no_grad():
        eager = net(x)
        alphas = [layer.last_alpha for layer in net.hsmla_layers().values()]
        assert all(0.0 < a < 1.0 for a in alphas), alphas
        compiled = torch.compile(net, fullgraph=True, backend=recording_aot_eager)(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    (gm,) = graphs
    layers = len(net.hsmla_layers()) if backend == "auto" else 0
    counts = _ops_in(gm)  # on the CPU the linear attention is the reference's PyTorch operations
    assert counts["local_refine"] == layers and counts["linear_attention"] == 0, counts
    assert (counts["block_gate"] >= 1) == (backend == "auto" and spatial_dims == 2), counts  # the C gate: 2D


@pytest.mark.parametrize("spatial_dims,backend", NETWORKS, ids=IDS)
def test_export_save_load_equals_eager(spatial_dims, backend, tmp_path):
    net = _network(spatial_dims, backend, seed=2)
    x = _input(spatial_dims)
    net.calibrate_tau(x, 0.5)
    with torch.no_grad():
        eager = net(x)
        program = torch.export.export(net, (x,))
    counts = _ops_in(program.graph_module)
    layers = len(net.hsmla_layers()) if backend == "auto" else 0
    assert counts["local_refine"] == layers and counts["linear_attention"] == 0, counts
    path = tmp_path / "net.pt2"
    torch.export.save(program, path)
    loaded = torch.export.load(path)
    with torch.no_grad():
        torch.testing.assert_close(loaded.module()(x), eager, rtol=1e-5, atol=1e-5)
        # a fresh input: the tile selection is inside the op, not baked into the graph
        y = torch.randn_like(x)
        torch.testing.assert_close(loaded.module()(y), net(y), rtol=1e-5, atol=1e-5)
