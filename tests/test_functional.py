"""The reference ops against brute-force masked O(N^2) attention in float64."""

import itertools
import math

import pytest
import torch

from hsmla_med import ops_reference
from hsmla_med.nn import functional as HF


def _coords(spatial):
    return torch.tensor(list(itertools.product(*(range(n) for n in spatial))), dtype=torch.long)


def _window_mask(spatial, window):
    """(N, N) bool: key j lies in the window centred on query i (Chebyshev distance <= r)."""
    c = _coords(spatial)
    return (c[:, None, :] - c[None, :, :]).abs().amax(-1) <= window // 2


def _flat(x):
    return x.double().flatten(2, -2)  # (b, h, N, d)


def brute_softmax(q, k, v, window):
    mask = _window_mask(q.shape[2:-1], window)
    scores = _flat(q) @ _flat(k).transpose(-1, -2) / math.sqrt(q.shape[-1])
    out = scores.masked_fill(~mask, -math.inf).softmax(-1) @ _flat(v)
    return out.reshape(q.shape)


def brute_linear(qh, kh, vh, eps, window=None):
    weights = _flat(qh).relu() @ _flat(kh).relu().transpose(-1, -2)
    if window is not None:
        weights = weights * _window_mask(qh.shape[2:-1], window)
    out = (weights @ _flat(vh)) / (weights.sum(-1, keepdim=True) + eps)
    return out.reshape(qh.shape)


def _rand(shape, n=3):
    return [torch.randn(shape) for _ in range(n)]


SHAPES = [(2, 3, 5, 7, 4), (1, 2, 11, 9, 8), (2, 2, 3, 4, 6, 4), (1, 1, 1, 1, 2), (1, 2, 5, 3, 3, 3)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [1, 3, 5, 13])
def test_local_attention_matches_brute_force(shape, window):
    q, k, v = _rand(shape)
    out = HF.local_attention(q, k, v, window)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), brute_softmax(q, k, v, window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [1, 3, 7])
def test_local_linear_attention_matches_brute_force(shape, window):
    qh, kh, vh = _rand(shape)
    out = HF.local_linear_attention(qh, kh, vh, window, eps=1e-6)
    torch.testing.assert_close(out.double(), brute_linear(qh, kh, vh, 1e-6, window), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_linear_attention_matches_brute_force(shape):
    qh, kh, vh = _rand(shape)
    out = HF.linear_attention(qh, kh, vh, eps=1e-6)
    assert out.shape == qh.shape
    torch.testing.assert_close(out.double(), brute_linear(qh, kh, vh, 1e-6), rtol=1e-4, atol=1e-5)


def test_window_covering_the_map_is_full_softmax():
    q, k, v = _rand((2, 2, 6, 5, 8))
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.flatten(2, 3) for t in (q, k, v)))
    torch.testing.assert_close(HF.local_attention(q, k, v, 11), ref.reshape(q.shape), rtol=1e-5, atol=1e-5)


def test_keys_outside_the_map_are_excluded_not_zero_padded():
    # A corner query with window 3 sees exactly its 4 in-map neighbours (2D): with equal scores
    # the softmax is their plain mean; zero padding would average 9 keys instead.
    q = torch.zeros(1, 1, 4, 4, 2)
    k = torch.zeros_like(q)
    v = torch.arange(32, dtype=torch.float32).view(1, 1, 4, 4, 2)
    out = HF.local_attention(q, k, v, 3)
    torch.testing.assert_close(out[0, 0, 0, 0], v[0, 0, :2, :2].reshape(4, 2).mean(0))


@pytest.mark.parametrize("spatial,block", [((7, 9), 4), ((13, 5), 8), ((5, 6, 7), 4), ((4, 4), 1)])
def test_local_refine_selects_tiles(spatial, block):
    b, h, d, window = 2, 2, 4, 5
    q, k, v, qh, kh, vh = _rand((b, h, *spatial, d), 6)
    grid = HF.tile_grid(spatial, block)
    gate = torch.rand(b, *grid)
    tau = 0.5
    r = HF.local_refine(q, k, v, qh, kh, vh, gate, tau, block, window)
    full = brute_softmax(q, k, v, window) - brute_linear(qh, kh, vh, HF.DEFAULT_EPS, window)
    active = gate > tau
    for axis, n in enumerate(spatial):
        active = active.repeat_interleave(block, dim=1 + axis).narrow(1 + axis, 0, n)
    expected = torch.where(active[:, None, ..., None], full, torch.zeros_like(full))
    torch.testing.assert_close(r.double(), expected, rtol=1e-4, atol=1e-5)
    # tiles below the threshold hold exact zeros
    assert (r[~active[:, None, ..., None].expand_as(r)] == 0).all()


@pytest.mark.parametrize("shape", [(2, 2, 6, 5, 4), (1, 2, 3, 5, 4, 3)])
def test_local_refine_gradients_match_brute_force(shape):
    """The training path differentiates through the dense local residual: its gradients with
    respect to all six maps equal those of the float64 brute force. (``eps`` keeps the linear
    denominator away from zero: a near-empty ReLU overlap makes the float32 gradient
    ill-conditioned, not wrong.)"""
    window, eps = 3, 1e-2
    maps = [torch.randn(shape, requires_grad=True) for _ in range(6)]
    weight = torch.randn(shape, dtype=torch.float64)
    r = HF.local_refine(*maps, None, 0.0, 4, window, eps)
    grads = torch.autograd.grad((r.double() * weight).sum(), maps)
    q, k, v, qh, kh, vh = (m.detach().double().requires_grad_() for m in maps)
    expected = brute_softmax(q, k, v, window) - brute_linear(qh, kh, vh, eps, window)
    expected_grads = torch.autograd.grad((expected * weight).sum(), (q, k, v, qh, kh, vh))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_local_refine_every_tile_and_no_tile():
    q, k, v, qh, kh, vh = _rand((1, 2, 9, 10, 4), 6)
    dense = HF.local_refine(q, k, v, qh, kh, vh, None, 0.0, 4, 3)
    expected = HF.local_attention(q, k, v, 3) - HF.local_linear_attention(qh, kh, vh, 3)
    torch.testing.assert_close(dense, expected, rtol=1e-5, atol=1e-5)
    none = HF.local_refine(q, k, v, qh, kh, vh, torch.zeros(1, 3, 3), 0.5, 4, 3)
    assert torch.count_nonzero(none) == 0


def test_local_refine_never_touches_inactive_tiles(monkeypatch):
    """Inputs poisoned with NaN away from the active tile's halo leave R finite, and only the
    active tile's queries are evaluated."""
    block, window = 4, 3
    q, k, v, qh, kh, vh = _rand((1, 2, 16, 16, 4), 6)
    gate = torch.zeros(1, 4, 4)
    gate[0, 1, 2] = 1.0  # rows 4..7, columns 8..11; halo rows 3..8, columns 7..12
    keep = torch.zeros(16, 16, dtype=torch.bool)
    keep[3:9, 7:13] = True
    for t in (q, k, v, qh, kh, vh):
        t[:, :, ~keep] = math.nan
    seen = []
    original = ops_reference._window_attention
    monkeypatch.setattr(ops_reference, "_window_attention", lambda q_, *a: seen.append(q_.shape) or original(q_, *a))
    r = HF.local_refine(q, k, v, qh, kh, vh, gate, 0.5, block, window)
    assert torch.isfinite(r).all()
    # (softmax and linear terms x heads, active tiles, tokens, d)
    assert seen == [torch.Size([2 * 2, 1, block * block, 4])]
    assert torch.count_nonzero(r[:, :, 4:8, 8:12]) == r[:, :, 4:8, 8:12].numel()


def test_tile_average_partial_edge_tiles():
    x = torch.arange(1, 26, dtype=torch.float32).view(1, 1, 5, 5)
    got = HF.tile_average(x, 4)
    expected = torch.tensor([[x[0, 0, :4, :4].mean(), x[0, 0, :4, 4:].mean()], [x[0, 0, 4:, :4].mean(), x[0, 0, 4, 4]]])
    torch.testing.assert_close(got[0, 0], expected)
    x3 = torch.rand(2, 3, 5, 2, 7)
    got3 = HF.tile_average(x3, 3)
    assert got3.shape == (2, 3, 2, 1, 3)
    torch.testing.assert_close(got3[..., 1, 0, 2], x3[..., 3:, :, 6:].mean(dim=(-3, -2, -1)))


@pytest.mark.parametrize("spatial,block", [((5, 5), 4), ((9, 7), 2), ((3, 11), 4), ((5, 2, 7), 3), ((1, 6, 4), 4), ((8, 8), 4), ((2, 3), 5)])
def test_tile_average_equals_the_mean_of_each_tile(spatial, block):
    """Against a loop over the tiles: partial edge tiles (and axes shorter than a tile, which
    ``avg_pool3d`` refuses as a kernel size) divide by the tokens that exist, in value and in
    gradient."""
    x = torch.randn(2, 3, *spatial, dtype=torch.float64, requires_grad=True)
    got = HF.tile_average(x, block)
    grid = HF.tile_grid(spatial, block)
    assert got.shape == (2, 3, *grid)
    expected = torch.empty_like(got)
    for tile in itertools.product(*(range(n) for n in grid)):
        region = tuple(slice(t * block, (t + 1) * block) for t in tile)
        expected[(..., *tile)] = x[(..., *region)].mean(dim=tuple(range(2, 2 + len(spatial))))
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    w = torch.randn_like(got)
    (g_got,) = torch.autograd.grad((got * w).sum(), x)
    (g_exp,) = torch.autograd.grad((expected * w).sum(), x)
    torch.testing.assert_close(g_got, g_exp, rtol=1e-12, atol=1e-12)


def test_gate_regularizers_hand_computed():
    gate = torch.tensor([[[0.0, 1.0], [1.0, 1.0]], [[0.5, 0.5], [0.5, 0.5]]])
    budget, smooth = HF.gate_regularizers(gate, rho=0.3)
    # sample 1: |0.75 - 0.3| = 0.45, smoothness |0-1| (row) + |0-1| (column) = 2
    # sample 2: |0.5 - 0.3| = 0.2, smoothness 0
    assert budget.item() == pytest.approx((0.45 + 0.2) / 2)
    assert smooth.item() == pytest.approx(1.0)
    gate3 = torch.zeros(1, 2, 2, 2)
    gate3[0, 0, 0, 0] = 1.0  # one corner of a 2x2x2 cube: three neighbours differ
    budget3, smooth3 = HF.gate_regularizers(gate3, rho=0.0)
    assert budget3.item() == pytest.approx(1 / 8)
    assert smooth3.item() == pytest.approx(3.0)


def test_linear_attention_half_precision_with_many_tokens_stays_finite():
    # 128x128 tokens of magnitude ~100: sum_j phi(k_j) v_j ~ 1e8 overflows float16 (max 65504).
    shape = (1, 2, 128, 128, 16)
    qh, kh, vh = (torch.randn(shape) * 100 for _ in range(3))
    q, k, v = (t.double().flatten(2, 3) for t in (qh, kh, vh))
    z = k.relu().transpose(-1, -2) @ v
    ref = ((q.relu() @ z) / (q.relu() @ k.relu().sum(-2, keepdim=True).transpose(-1, -2) + 1e-6)).reshape(shape)
    for dtype in (torch.float16, torch.bfloat16):
        out = HF.linear_attention(*(t.to(dtype) for t in (qh, kh, vh)))
        assert out.dtype == dtype and torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.parametrize("bad", [0, 2, -3, 4])
def test_bad_window(bad):
    q, k, v = _rand((1, 1, 4, 4, 2))
    with pytest.raises(ValueError, match="window"):
        HF.local_attention(q, k, v, bad)


def test_bad_block_and_gate_shape():
    t = _rand((1, 1, 4, 4, 2), 6)
    with pytest.raises(ValueError, match="block"):
        HF.local_refine(*t, None, 0.0, 0, 3)
    with pytest.raises(ValueError, match="gate"):
        HF.local_refine(*t, torch.zeros(1, 3, 3), 0.0, 2, 3)


def test_bad_feature_layout():
    with pytest.raises(ValueError, match="spatial"):
        HF.linear_attention(*_rand((1, 4, 2)))
    with pytest.raises(ValueError, match="share"):
        HF.local_attention(torch.zeros(1, 1, 4, 4, 2), torch.zeros(1, 1, 4, 5, 2), torch.zeros(1, 1, 4, 4, 2), 3)


def test_chunked_tile_evaluation_matches(monkeypatch):
    """Tiles are evaluated in bounded chunks; one tile per chunk gives the same result."""
    q, k, v, qh, kh, vh = _rand((2, 2, 9, 11, 4), 6)
    gate = torch.rand(2, 3, 3)
    whole = HF.local_refine(q, k, v, qh, kh, vh, gate, 0.3, 4, 5)
    monkeypatch.setattr(ops_reference, "_CHUNK_ELEMENTS", 1)
    torch.testing.assert_close(HF.local_refine(q, k, v, qh, kh, vh, gate, 0.3, 4, 5), whole)


@pytest.mark.parametrize("layout", ["channel_first", "contiguous"])
@pytest.mark.parametrize("spatial", [(9, 11), (5, 6, 7)])
def test_local_refine_adds_gate_weighted_residual_in_place(spatial, layout):
    """``add_to`` receives ``M * R`` on active tiles (the float64 brute force weighted by the
    hand-broadcast gate) and nothing elsewhere; channel-first buffers (the layer's linear
    output) are written tile by tile, other layouts through a full-size ``R``."""
    b, h, d, block, window, tau = 2, 2, 4, 4, 3, 0.5
    q, k, v, qh, kh, vh = _rand((b, h, *spatial, d), 6)
    gate = torch.rand(b, *HF.tile_grid(spatial, block))
    shape = (b, h, *spatial, d)
    base = torch.randn(b, h, d, *spatial).movedim(2, -1) if layout == "channel_first" else torch.randn(shape)
    expected = base.double().clone()
    weight = gate * (gate > tau)
    for axis, n in enumerate(spatial):
        weight = weight.repeat_interleave(block, dim=1 + axis).narrow(1 + axis, 0, n)
    full = brute_softmax(q, k, v, window) - brute_linear(qh, kh, vh, HF.DEFAULT_EPS, window)
    expected += weight[:, None, ..., None].double() * full
    out = HF.local_refine(q, k, v, qh, kh, vh, gate, tau, block, window, add_to=base)
    assert out is base
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="add_to"):
        HF.local_refine(q, k, v, qh, kh, vh, None, 0.0, block, window, add_to=base)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [1, 3, 7])
def test_dense_refine_values_and_gradients_match_brute_force(shape, window):
    """The training form of R (all N x N scores, each query's window as a mask) against the
    float64 brute force, values and gradients with respect to all six maps, fresh random inputs;
    the float32 path against the tile schedule too."""
    eps = 1e-2
    maps = [torch.randn(shape, dtype=torch.float64, requires_grad=True) for _ in range(6)]
    weight = torch.randn(shape, dtype=torch.float64)
    r = HF.dense_refine(*maps, window, eps)
    q, k, v, qh, kh, vh = (m.detach().clone().requires_grad_() for m in maps)
    expected = brute_softmax(q, k, v, window) - brute_linear(qh, kh, vh, eps, window)
    torch.testing.assert_close(r, expected, rtol=1e-9, atol=1e-9)
    grads = torch.autograd.grad((r * weight).sum(), maps)
    expected_grads = torch.autograd.grad((expected * weight).sum(), (q, k, v, qh, kh, vh))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-8)
    single = [m.detach().float() for m in maps]
    torch.testing.assert_close(
        HF.dense_refine(*single, window, eps), HF.local_refine(*single, None, 0.0, 3, window, eps), rtol=1e-4, atol=1e-5
    )


def test_dense_refine_keeps_half_precision_dtype_and_checks_arguments():
    maps = [torch.randn(1, 2, 6, 5, 8).bfloat16() for _ in range(6)]
    r = HF.dense_refine(*maps, 3)
    assert r.dtype == torch.bfloat16 and torch.isfinite(r).all()
    with pytest.raises(ValueError, match="window"):
        HF.dense_refine(*maps, 4)
    assert HF.dense_fits(torch.Size((8, 4, 6, 6, 16)))
    assert not HF.dense_fits(torch.Size((8, 4, 24, 24, 16)))  # more tokens than the crossover
    assert not HF.dense_fits(torch.Size((512, 8, 16, 16, 16)))  # too large a score matrix
