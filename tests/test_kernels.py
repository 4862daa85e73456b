"""Triton kernels (``hsmla_med.kernels``) against their references in ``hsmla_med.nn.functional``.

Without CUDA the kernels run under Triton's interpreter in float32 at small sizes; with CUDA
they run compiled and float16/bfloat16 cases and larger maps are added. Inputs are fresh random
numbers every run; sizes are in the test ids. Output buffers handed to a kernel are filled with
NaN first, so an element the kernel should write and does not fails the comparison; the
refinement, which adds into its output in place, gets finite values on the tiles it must change
and NaN on the ones it must leave alone. The forward must never wait for the device (a CUDA
graph cannot capture a host sync): the aten ops the kernels dispatch and their launches are
recorded and checked.
"""

import os
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

CUDA = torch.cuda.is_available()
if not CUDA:
    # Triton picks interpreter or compiler when a kernel is decorated; hsmla_med.kernels defers
    # that to the first launch, so setting this before any launch is enough.
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from hsmla_med import kernels  # noqa: E402
from hsmla_med.kernels import _runtime, linear, refine  # noqa: E402
from hsmla_med.nn import functional as HF  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if CUDA else [])
# Largest |kernel - reference| allowed, relative to the reference's largest magnitude.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}
LAYOUTS = ["channel_first", "contiguous"]


def _features(shape, count, dtype, layout):
    """``count`` random ``(b, h, *S, d)`` tensors: views of one channel-first map, as the HSMLA
    layer makes them (token axis contiguous), or plain contiguous tensors."""
    b, h, *spatial, d = shape
    if layout == "channel_first":
        x = torch.randn(b, count, h, d, *spatial, device=DEVICE, dtype=dtype)
        return list(x.movedim(3, -1).unbind(1))
    return [torch.randn(shape, device=DEVICE, dtype=dtype) for _ in range(count)]


def _poisoned(shape, dtype):
    """NaN-filled ``(b, h, *S, d)`` buffer laid out channel-first."""
    b, h, *spatial, d = shape
    return torch.full((b, h, d, *spatial), float("nan"), device=DEVICE, dtype=dtype).movedim(2, -1)


def _assert_close(out, ref, dtype):
    assert torch.isfinite(out).all(), "kernel left unwritten (NaN) or non-finite elements"
    err = (out.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    print(f"max abs error {err:.3g}, relative to max |ref| {err / scale if scale else err:.3g}")
    assert err <= TOLERANCE[dtype] * scale, f"error {err:.3g} exceeds {TOLERANCE[dtype]} x max |ref| {scale:.3g}"


# -- linear attention ---------------------------------------------------------------------------

LINEAR_SHAPES = [
    (2, 2, 7, 9, 16),  # odd map, one token chunk
    (1, 3, 13, 23, 24),  # 299 tokens: two chunks (partial Z summed), head_dim not a power of two
    (2, 1, 1, 1, 2),  # single token, tiny head_dim padded to the 16-wide dot
    (1, 2, 5, 7, 9, 8),  # 3D: 315 tokens, two chunks
    (1, 1, 3, 5, 128),  # widest supported head
    (1, 2, 23, 29, 64),  # 667 tokens, three chunks: apply spans of two blocks, the last one partial
] + ([(2, 4, 96, 80, 32), (1, 2, 17, 33, 29, 64)] if CUDA else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", LINEAR_SHAPES, ids=str)
def test_linear_attention_matches_reference(shape, layout, dtype):
    qh, kh, vh = _features(shape, 3, dtype, layout)
    out = _poisoned(shape, dtype)
    result = kernels.linear_attention(qh, kh, vh, 1e-6, out=out)
    assert result is out
    ref = HF.linear_attention(qh.float(), kh.float(), vh.float(), 1e-6)
    _assert_close(out, ref, dtype)


def test_linear_attention_allocates_token_major():
    """The result is laid out ``(b, *S, h, d)`` in memory, so that the layer's ``(b, h*d, *S)``
    view of it is channels-last, as the networks' maps are on CUDA, without a copy."""
    for shape, memory_format in [((2, 2, 5, 6, 8), torch.channels_last), ((1, 3, 3, 4, 5, 8), torch.channels_last_3d)]:
        qh, kh, vh = _features(shape, 3, torch.float32, "channel_first")
        out = kernels.linear_attention(qh, kh, vh)
        b, h, *spatial, d = shape
        token_major = torch.empty((b, *spatial, h, d)).movedim(-2, 1)
        assert out.shape == qh.shape and out.dtype == qh.dtype and out.stride() == token_major.stride()
        mapped = out.movedim(-1, 2).reshape(b, h * d, *spatial)
        assert mapped.data_ptr() == out.data_ptr() and mapped.is_contiguous(memory_format=memory_format)
        _assert_close(out, HF.linear_attention(qh.double(), kh.double(), vh.double()), torch.float32)


# Triton 3.x's interpreter multiplies bfloat16 tiles wrongly in ``tl.dot`` (a 16 x 16 product is
# off by ~1e10 while float16's is exact; checked), so bfloat16 runs only compiled.
HALF = [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not CUDA, reason="the interpreter's bfloat16 tl.dot is wrong"))]


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_linear_attention_aggregates_do_not_overflow_half(dtype):
    # 64^2 tokens of magnitude ~16: Z and Dn reach ~1e5..1e6, beyond float16's 65504. The float32
    # accumulation is the kernel's logic, not the GPU's: without CUDA the interpreter runs the
    # same kernel on float16 inputs (slowly, so only here and not in the general cases).
    qh, kh, vh = ((16 * t.abs()).to(dtype) for t in _features((1, 2, 64, 64, 32), 3, torch.float32, "contiguous"))
    ref = HF.linear_attention(qh.float(), kh.float(), vh.float())
    out = kernels.linear_attention(qh, kh, vh)
    _assert_close(out, ref, dtype)


# -- local refinement ---------------------------------------------------------------------------

REFINE_CASES = [
    ((2, 2, 7, 9, 16), 4, 3),  # partial edge tiles on both axes
    ((1, 2, 13, 5, 24), 4, 5),  # window wider than the tile
    ((1, 1, 13, 5, 8), 8, 7),  # window wider than the map: keys outside are masked
    ((2, 1, 9, 9, 4), 3, 1),  # 3x3 tiles (padded to 16 queries), window 1
    ((1, 2, 11, 6, 32), 8, 7),  # the layer's defaults
    ((1, 1, 20, 18, 8), 16, 3),  # 256 queries per tile: two programs of MAX_BLOCK_Q each
    ((1, 2, 5, 6, 7, 8), 4, 3),  # 3D: partial edge tiles on every axis
    ((2, 1, 6, 5, 3, 16), 2, 5),  # 3D: window wider than the tile, a map 3 deep
    ((1, 1, 9, 8, 8, 8), 8, 3),  # 3D: 512 queries per tile, four programs each; a partial tile 1 deep
] + ([
    ((2, 4, 64, 48, 32), 8, 7), ((1, 2, 37, 29, 64), 16, 9),
    ((1, 2, 24, 20, 16, 32), 4, 7), ((2, 2, 13, 17, 11, 64), 8, 5),
] if CUDA else [])
CASE_IDS = [f"{s}-b{b}-w{w}" for s, b, w in REFINE_CASES]
GATES = ["alpha0", "between", "alpha1", "none"]


def _gate(shape, block, which, tau_as="float"):
    """``(gate, tau, active tile mask)`` that refines no tile, some but not all, every tile, or
    ``gate=None`` (all tiles); ``tau`` a number or a 0-d tensor on the device."""
    grid = (shape[0], *HF.tile_grid(tuple(shape[2:-1]), block))
    gate = torch.rand(grid, device=DEVICE)
    if which == "none":
        return None, 0.0, torch.ones(grid, dtype=torch.bool, device=DEVICE)
    # gate values lie in [0, 1); the median tile itself is inactive (strict '>').
    tau = {"alpha0": 1.0, "alpha1": -1.0, "between": gate.flatten().median().item()}[which]
    active = gate > tau
    if which == "between":
        assert 0 < active.sum() < active.numel()
    return gate, (tau if tau_as == "float" else torch.tensor(tau, device=DEVICE)), active


def _token_mask(active, shape, block):
    """``(b, 1, *S, 1)`` bool: the token lies in an active tile."""
    for axis in range(1, active.dim()):
        active = active.repeat_interleave(block, dim=axis)
    return active[(slice(None), *(slice(0, n) for n in shape[2:-1]))].unsqueeze(1).unsqueeze(-1)


def _token_major(values):
    """``values`` (``(b, h, *S, d)``) copied into the layout of the layer's linear-attention
    output on CUDA: ``(b, *S, h, d)`` in memory."""
    return values.movedim(1, -2).contiguous().movedim(-2, 1)


def _reference_refine(tensors, gate, tau, block, window):
    """``R`` by the reference in float64."""
    return HF.local_refine(*(t.double() for t in tensors), gate, tau, block, window, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("which", GATES)
@pytest.mark.parametrize("case", REFINE_CASES, ids=CASE_IDS)
def test_local_refine_matches_reference(case, which, layout, dtype):
    shape, block, window = case
    tensors = _features(shape, 6, dtype, layout)
    gate, tau, active = _gate(shape, block, which, "tensor" if layout == "contiguous" else "float")
    out = kernels.local_refine(*tensors, gate, tau, block, window, 1e-6)
    assert out.shape == tensors[0].shape and out.dtype == dtype
    assert out.stride() == _poisoned(shape, dtype).stride(), "R is laid out channel-first like the reference's"
    inactive = ~_token_mask(active, shape, block).expand_as(out)
    assert (out[inactive] == 0).all(), "inactive tiles must hold exact zeros"
    _assert_close(out, _reference_refine(tensors, gate, tau, block, window), dtype)


@pytest.mark.parametrize("tau_as", ["float", "tensor"])
@pytest.mark.parametrize("case", REFINE_CASES, ids=CASE_IDS)
def test_local_refine_add_to_matches_reference(case, tau_as):
    """``add_to`` (the layer's inference path) adds ``gate * R`` in place, as the reference does."""
    shape, block, window = case
    tensors = _features(shape, 6, torch.float32, "channel_first")
    gate, tau, _ = _gate(shape, block, "between", tau_as)
    base = _token_major(torch.randn(shape, device=DEVICE))
    add_to = base.clone()
    out = kernels.local_refine(*tensors, gate, tau, block, window, 1e-6, add_to=add_to)
    assert out is add_to
    expected = HF.local_refine(*(t.double() for t in tensors), gate, tau, block, window, 1e-6, add_to=base.double())
    _assert_close(out, expected, torch.float32)


def _expected_add(base, tensors, gate, tau, active, block, window, weighted):
    """``base + w * R`` on the active tiles, ``base`` elsewhere (float64)."""
    shape = tuple(base.shape)
    r = _reference_refine(tensors, gate, tau, block, window)
    if weighted and gate is not None:
        r = r * HF.tile_broadcast(torch.where(active, gate, 0.0).double(), block, shape[2:-1]).unsqueeze(1).unsqueeze(-1)
    inside = _token_mask(active, shape, block).expand(shape)
    return torch.where(inside, base.double() + r, base.double()), inside


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "which, weighted", [("between", True), ("between", False), ("none", True)], ids=["weighted", "unweighted", "no-gate"]
)
@pytest.mark.parametrize("case", REFINE_CASES, ids=CASE_IDS)
def test_refine_add_changes_only_active_tiles(case, which, weighted, dtype):
    """``out += w * R`` on the active tiles, every other element bit for bit as it was; a NaN
    gate is inactive (``NaN > tau`` is false, as in the reference)."""
    shape, block, window = case
    tensors = _features(shape, 6, dtype, "channel_first")
    gate, tau, active = _gate(shape, block, which, "tensor")
    if gate is not None:  # an inactive tile's gate made NaN: a kernel testing 'M <= tau' would refine it
        gate.view(-1)[int(active.view(-1).int().argmin())] = float("nan")
        active = gate > tau
    base = _token_major(torch.randn(shape, device=DEVICE, dtype=dtype))
    out = base.clone()
    assert refine.refine_add(*tensors, gate, tau, block, window, 1e-6, out, weighted=weighted) is out
    expected, inside = _expected_add(base, tensors, gate, tau, active, block, window, weighted)
    assert torch.equal(out[~inside], base[~inside]), "an element of an inactive tile changed"
    _assert_close(out[inside], expected[inside], dtype)


@pytest.mark.parametrize("which", ["between", "alpha0"])
@pytest.mark.parametrize("case", REFINE_CASES, ids=CASE_IDS)
def test_refine_add_writes_nothing_on_inactive_tiles(case, which):
    """NaN on the inactive tiles and finite values on the active ones: afterwards NaN exactly on
    the inactive tiles. A store there (of anything but the NaN read back) would show, and so
    would a read of a NaN into an active tile (a tile's address mixed up with another's)."""
    shape, block, window = case
    tensors = _features(shape, 6, torch.float32, "contiguous")
    gate, tau, active = _gate(shape, block, which, "tensor")
    inside = _token_mask(active, shape, block).expand(shape)
    base = torch.randn(shape, device=DEVICE)
    out = _token_major(torch.where(inside, base, float("nan")))
    refine.refine_add(*tensors, gate, tau, block, window, 1e-6, out)
    assert torch.equal(torch.isnan(out), ~inside), "NaN must remain exactly on the inactive tiles"
    if inside.any():
        expected, _ = _expected_add(base, tensors, gate, tau, active, block, window, True)
        _assert_close(out[inside], expected[inside], torch.float32)


def test_refine_add_refuses_bad_inputs():
    shape = (1, 2, 5, 6, 8)
    tensors = _features(shape, 6, torch.float32, "contiguous")
    gate = torch.rand(1, 2, 2, device=DEVICE)
    out = torch.zeros(shape, device=DEVICE)
    with pytest.raises(ValueError, match="tau must be a number or a 0-d tensor"):
        refine.refine_add(*tensors, gate, torch.tensor([0.5], device=DEVICE), 4, 3, 1e-6, out)
    with pytest.raises(ValueError, match="gate must be a float tensor"):
        refine.refine_add(*tensors, gate > 0.5, 0.5, 4, 3, 1e-6, out)
    with pytest.raises(ValueError, match="out must be"):
        refine.refine_add(*tensors, gate, 0.5, 4, 3, 1e-6, out.double())
    with pytest.raises(ValueError, match="gate must have shape"):
        refine.refine_add(*tensors, gate[:, :1], 0.5, 4, 3, 1e-6, out)


# -- no host sync, no value-dependent launch (a CUDA graph captures neither) ---------------------

# aten ops that copy a tensor's values to the host (or shape a result by them)
SYNCING = ("aten::nonzero", "aten::_local_scalar_dense", "aten::item", "aten::bincount", "aten::masked_select",
           "aten::is_nonzero", "aten::equal")


def _syncing(func, args) -> bool:
    name = func._schema.name
    if name in SYNCING or "unique" in name:
        return True
    if func is torch.ops.aten.index.Tensor:  # boolean-mask indexing: a nonzero inside
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
    return False


@contextmanager
def _recorded(monkeypatch):
    """Record every Triton launch (kernel name, grid) and every aten op dispatched, as
    ``(op, args, inside a launch)``: the interpreter dispatches its own copies while it runs a
    kernel; what the host code dispatches around the launches is outside."""
    launches, ops, inside = [], [], [False]
    getitem = _runtime.lazy_jit.__getitem__

    def record_launch(kernel, grid):
        run = getitem(kernel, grid)

        def launch(*args, **kwargs):
            launches.append((kernel.name, tuple(grid)))
            inside[0] = True
            try:
                return run(*args, **kwargs)
            finally:
                inside[0] = False

        return launch

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append((func, args, inside[0]))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(_runtime.lazy_jit, "__getitem__", record_launch)
    with Recorder():
        yield launches, ops


def _host_ops(ops):
    """What the host code dispatched other than views and ``torch.empty``: work on the device."""
    allocations = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default)
    return [str(func) for func, _, inside in ops if not inside and not func.is_view and func not in allocations]


def test_refine_grid_does_not_depend_on_the_gate(monkeypatch):
    """A gate refining 10% of the tiles and one refining 90% launch the same grid: one program
    per tile, head and query chunk."""
    shape, block, window = (2, 2, 13, 11, 8), 4, 3
    tensors = _features(shape, 6, torch.float32, "channel_first")
    grids = []
    for alpha in (0.1, 0.9):
        gate = torch.rand(shape[0], *HF.tile_grid(shape[2:-1], block), device=DEVICE)
        tau = torch.quantile(gate.flatten(), 1.0 - alpha)
        assert abs((gate > tau).float().mean().item() - alpha) < 0.05
        with _recorded(monkeypatch) as (launches, _):
            kernels.local_refine(*tensors, gate, tau, block, window, add_to=torch.zeros(shape, device=DEVICE))
        grids += launches
    tiles = shape[0] * 4 * 3
    assert grids == [("_refine_kernel", (tiles, shape[1], 1))] * 2


@pytest.mark.parametrize("shape", [(1, 2, 9, 11, 8), (1, 1, 5, 6, 7, 8)], ids=str)
def test_forward_kernels_do_not_sync(shape, monkeypatch):
    """Linear attention and the refinement dispatch no op that waits for the device, launch a
    fixed number of kernels, and do no device work of their own besides ``torch.empty`` (and the
    zero fill of ``R`` where no output is given)."""
    block, window = 4, 3
    tensors = _features(shape, 6, torch.float32, "channel_first")
    gate, tau, _ = _gate(shape, block, "between", "tensor")

    with _recorded(monkeypatch) as (launches, ops):
        out = kernels.linear_attention(*tensors[3:])
    assert [name for name, _ in launches] == ["_aggregate_kernel", "_apply_kernel"]
    assert _host_ops(ops) == []
    assert not [str(func) for func, args, _ in ops if _syncing(func, args)]

    with _recorded(monkeypatch) as (launches, ops):
        kernels.local_refine(*tensors, gate, tau, block, window, add_to=out)
        refine.refine_add(*tensors, None, 0.0, block, window, 1e-6, out)
    assert [name for name, _ in launches] == ["_refine_kernel"] * 2
    assert _host_ops(ops) == []
    assert not [str(func) for func, args, _ in ops if _syncing(func, args)]

    tau = tau.item()
    with _recorded(monkeypatch) as (launches, ops):
        kernels.local_refine(*tensors, gate, tau, block, window)  # tau made a tensor on the device
    assert [name for name, _ in launches] == ["_refine_kernel"]
    assert sorted(_host_ops(ops)) == ["aten.new_full.default", "aten.zeros.default"]
    assert not [str(func) for func, args, _ in ops if _syncing(func, args)]


def test_sync_check_sees_a_sync(monkeypatch):
    """The recorder and :func:`_syncing` catch what the old refinement did (a test that cannot
    fail is a defect)."""
    gate = torch.rand(2, 3, device=DEVICE)
    with _recorded(monkeypatch) as (_, ops):
        torch.nonzero(gate > 0.5)
        gate[gate > 0.5]
        gate.sum().item()
    assert sum(_syncing(func, args) for func, args, _ in ops) == 3


# -- availability and refusals ------------------------------------------------------------------


def test_triton_available(monkeypatch):
    assert kernels.triton_available(DEVICE)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not kernels.triton_available("cpu")
    assert kernels.triton_available("cuda") == CUDA


@pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")
def test_kernels_refuse_cpu_tensors_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    qh, kh, vh = _features((1, 1, 3, 3, 4), 3, torch.float32, "contiguous")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.linear_attention(qh, kh, vh)


def test_kernels_refuse_bad_inputs():
    shape = (1, 2, 5, 6, 8)
    tensors = _features(shape, 6, torch.float32, "contiguous")
    with pytest.raises(ValueError, match="gate must have shape"):
        kernels.local_refine(*tensors, torch.rand(1, 3, 3, device=DEVICE), 0.5, 4, 3)
    with pytest.raises(ValueError, match="window"):
        kernels.local_refine(*tensors, None, 0.5, 4, 4)
    with pytest.raises(ValueError, match="does not match"):
        kernels.linear_attention(tensors[0], tensors[1], tensors[2][..., :4])
    with pytest.raises(ValueError, match="head_dim"):
        kernels.linear_attention(*_features((1, 1, 2, 2, 129), 3, torch.float32, "contiguous"))
    with pytest.raises(ValueError, match="out must be"):
        kernels.linear_attention(*tensors[:3], out=torch.empty(shape, dtype=torch.float64, device=DEVICE))
    grad = tensors[0].clone().requires_grad_()
    with pytest.raises(RuntimeError, match="inference-only"):
        kernels.linear_attention(grad, tensors[1], tensors[2])
    with torch.no_grad():
        kernels.linear_attention(grad, tensors[1], tensors[2])


def test_modules_pair_each_kernel_with_its_reference():
    assert linear.reference is HF.linear_attention
    assert refine.reference is HF.local_refine


# -- dispatch from the HSMLA layer ---------------------------------------------------------------


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_layer_triton_backend_matches_reference_backend(memory_format):
    """Also with channels-last maps (the networks' layout), whose head views have other strides."""
    from hsmla_med.nn import HSMLA

    layer = HSMLA(2, 16, head_dim=8, window=3, block=4).to(DEVICE, memory_format=memory_format).eval()
    x = torch.randn(2, 16, 9, 11, device=DEVICE).contiguous(memory_format=memory_format)
    with torch.no_grad():
        gate = layer.gate(layer._multiscale(layer.qkv(x)))
        layer.tau.fill_(gate.median().item())
        layer.backend = "reference"
        ref = layer(x)
        layer.backend = "triton"
        out = layer(x)
    assert 0.0 < layer.last_alpha < 1.0
    _assert_close(out, ref, torch.float32)
