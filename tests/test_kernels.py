"""Triton kernels (``hsmla_med.kernels``) against their references in ``hsmla_med.nn.functional``.

Without CUDA the kernels run under Triton's interpreter in float32 at small sizes; with CUDA
they run compiled and float16/bfloat16 cases and larger maps are added. Inputs are fresh random
numbers every run; sizes are in the test ids. Output buffers handed to a kernel are filled with
NaN first, so an element the kernel should write and does not fails the comparison.
"""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    # Triton picks interpreter or compiler when a kernel is decorated; hsmla_med.kernels defers
    # that to the first launch, so setting this before any launch is enough.
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from hsmla_med import kernels  # noqa: E402
from hsmla_med.kernels import linear, refine  # noqa: E402
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


def test_linear_attention_allocates_like_reference():
    qh, kh, vh = _features((2, 2, 5, 6, 8), 3, torch.float32, "contiguous")
    out = kernels.linear_attention(qh, kh, vh)
    ref = HF.linear_attention(qh, kh, vh)
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.stride() == ref.stride()
    _assert_close(out, ref, torch.float32)


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
    ((1, 1, 9, 10, 9, 8), 8, 3),  # 3D: 512 queries per tile, four programs each
] + ([
    ((2, 4, 64, 48, 32), 8, 7), ((1, 2, 37, 29, 64), 16, 9),
    ((1, 2, 24, 20, 16, 32), 4, 7), ((2, 2, 13, 17, 11, 64), 8, 5),
] if CUDA else [])
CASE_IDS = [f"{s}-b{b}-w{w}" for s, b, w in REFINE_CASES]
GATES = ["alpha0", "between", "alpha1", "none"]


def _gate(shape, block, which):
    """``(gate, tau, active tile mask)`` that refines no tile, some but not all, every tile, or
    ``gate=None`` (all tiles)."""
    grid = (shape[0], *HF.tile_grid(tuple(shape[2:-1]), block))
    gate = torch.rand(grid, device=DEVICE)
    if which == "none":
        return None, 0.0, torch.ones(grid, dtype=torch.bool, device=DEVICE)
    # gate values lie in [0, 1); the median tile itself is inactive (strict '>').
    tau = {"alpha0": 1.0, "alpha1": -1.0, "between": gate.flatten().median().item()}[which]
    active = gate > tau
    if which == "between":
        assert 0 < active.sum() < active.numel()
    return gate, tau, active


def _token_mask(active, shape, block):
    """``(b, 1, *S, 1)`` bool: the token lies in an active tile."""
    for axis in range(1, active.dim()):
        active = active.repeat_interleave(block, dim=axis)
    return active[(slice(None), *(slice(0, n) for n in shape[2:-1]))].unsqueeze(1).unsqueeze(-1)


def _reference_refine(tensors, gate, tau, block, window):
    return HF.local_refine(*(t.float() for t in tensors), gate, tau, block, window, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("which", GATES)
@pytest.mark.parametrize("case", REFINE_CASES, ids=CASE_IDS)
def test_local_refine_matches_reference(case, which, layout, dtype):
    shape, block, window = case
    tensors = _features(shape, 6, dtype, layout)
    gate, tau, active = _gate(shape, block, which)
    out = kernels.local_refine(*tensors, gate, tau, block, window, 1e-6)
    assert out.shape == tensors[0].shape and out.dtype == dtype
    inactive = ~_token_mask(active, shape, block).expand_as(out)
    assert (out[inactive] == 0).all(), "inactive tiles must hold exact zeros"
    _assert_close(out, _reference_refine(tensors, gate, tau, block, window), dtype)


@pytest.mark.parametrize("case", REFINE_CASES, ids=CASE_IDS)
def test_local_refine_add_to_matches_reference(case):
    """``add_to`` (the layer's inference path) adds ``gate * R`` in place, as the reference does."""
    shape, block, window = case
    tensors = _features(shape, 6, torch.float32, "channel_first")
    gate, tau, _ = _gate(shape, block, "between")
    base = torch.randn(shape, device=DEVICE)
    out = kernels.local_refine(*tensors, gate, tau, block, window, 1e-6, add_to=base.clone())
    expected = HF.local_refine(*tensors, gate, tau, block, window, 1e-6, add_to=base.clone())
    _assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", REFINE_CASES, ids=CASE_IDS)
def test_refine_tiles_writes_exactly_the_listed_tiles(case, dtype):
    shape, block, window = case
    tensors = _features(shape, 6, dtype, "channel_first")
    gate, tau, active = _gate(shape, block, "between")
    out = _poisoned(shape, dtype)
    refine.refine_tiles(*tensors, torch.nonzero(active), block, window, 1e-6, out)
    inside = _token_mask(active, shape, block).expand_as(out)
    assert torch.isnan(out[~inside]).all(), "the kernel wrote outside the listed tiles"
    ref = _reference_refine(tensors, gate, tau, block, window)
    _assert_close(out[inside], ref[inside], dtype)


def test_refine_tiles_with_no_tiles_writes_nothing():
    shape = (1, 2, 7, 9, 8)
    out = _poisoned(shape, torch.float32)
    tiles = torch.zeros((0, 3), dtype=torch.long, device=DEVICE)
    refine.refine_tiles(*_features(shape, 6, torch.float32, "contiguous"), tiles, 4, 3, 1e-6, out)
    assert torch.isnan(out).all()


def test_refine_tiles_refuses_a_tile_list_of_another_rank():
    shape = (1, 2, 5, 6, 7, 8)
    tensors = _features(shape, 6, torch.float32, "contiguous")
    with pytest.raises(ValueError, match=r"tiles must be an \(n, 4\)"):
        refine.refine_tiles(*tensors, torch.zeros((1, 3), dtype=torch.long), 4, 3, 1e-6, _poisoned(shape, torch.float32))


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
