"""Reference math of HSMLA attention (docs/design.md §2), in plain PyTorch, 2D and 3D.

Every tensor of attention features has the layout ``(batch, heads, *spatial, head_dim)`` with
``spatial = (H, W)`` or ``(D, H, W)``. These functions are the reference the kernels are tested
against, and the path the :class:`~hsmla_med.nn.HSMLA` layer takes on CPU and in training.

Those that a kernel computes or falls back to (the tile-compacted schedule of the local terms,
the linear attention, the block gate and what they share) are defined in
:mod:`hsmla_med.ops_reference`, below the kernels, and imported here with the rest of this
module's API: the kernels need nothing of :mod:`hsmla_med.nn`, so every import runs from the
networks down to the kernels. Defined here is what no kernel needs: ``R`` for every token
without a tile list, for training and export (:func:`dense_refine`, :func:`window_refine`,
:func:`dense_local_refine`), the gate's tile pooling and broadcast, and its regularisers.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

from hsmla_med.ops_reference import (
    DEFAULT_EPS,
    HIDDEN,
    attend,
    block_gate,
    check_refine,
    linear_attention,
    local_attention,
    local_linear_attention,
    local_refine,
    tile_grid,
)

__all__ = [
    "linear_attention",
    "local_attention",
    "local_linear_attention",
    "local_refine",
    "attend",
    "dense_refine",
    "dense_local_refine",
    "dense_fits",
    "window_refine",
    "tile_grid",
    "tile_broadcast",
    "tile_average",
    "block_gate",
    "gate_regularizers",
    "check_refine",
    "building_graph",
]


def building_graph() -> bool:
    """Whether a tracer records this call (``torch.jit.trace``, ``torch.compile``,
    ``torch.export``): then derived tensors are computed in the graph rather than taken from a
    cache, which a trace would store as constants on the device it was traced on."""
    return torch.jit.is_tracing() or torch.compiler.is_compiling()


def _build_window_masks(spatial: tuple[int, ...], window: int, device: torch.device,
                        like: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(N, N)`` float32 score bias (0 where key ``j`` lies in query ``i``'s window, else
    ``HIDDEN``) and the matching 0/1 mask. Only keys inside the map exist, so keys outside it
    are excluded, not zero-padded. Built from the sizes alone, so that a traced graph (export
    with dynamic spatial axes) builds them for whatever size it is given. With ``like`` the
    positions come from ``like.new_ones``: ``torch.jit.trace`` writes ``torch.arange``'s device
    into the graph as a constant, ``new_ones`` follows its tensor's device, so a TorchScript file
    traced on the CPU runs on a GPU."""
    def positions(n: int) -> torch.Tensor:
        return torch.arange(n, device=device) if like is None else like.new_ones(n, dtype=torch.long).cumsum(0) - 1

    grids = torch.meshgrid(*(positions(n) for n in spatial), indexing="ij")
    coords = torch.stack([g.reshape(-1) for g in grids], dim=-1)
    inside = (coords[:, None] - coords[None]).abs().amax(dim=-1) <= window // 2
    return torch.where(inside, 0.0, HIDDEN), inside.float()


#: the masks of one size, kept between eager calls
_window_masks = lru_cache(maxsize=32)(_build_window_masks)


def dense_refine(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qh: torch.Tensor,
    kh: torch.Tensor,
    vh: torch.Tensor,
    window: int,
    eps: float = DEFAULT_EPS,
) -> torch.Tensor:
    """``R = O_loc - O_linloc`` for every token of a small map, from all ``N x N`` scores with
    each query's window as a mask.

    The same function as ``local_refine(..., gate=None)``, arranged for training on the small
    maps where HSMLA layers sit (6 x 6 tokens at stride 16 of a 96-pixel crop): four batched
    matrix products, a softmax and a mask, whose backward autograd derives. The tile schedule
    needs gathers, scatters and per-chunk loops (which sparse inference needs and dense training
    does not), and on such maps it took 4-6x longer forward and backward (docs/benchmarks.md).
    Work and memory grow with ``N**2``: :func:`dense_fits` says when to use it.

    Args:
        q, k, v, qh, kh, vh: ``(batch, heads, *spatial, head_dim)``.
        window: odd window size per axis.
        eps: linear-attention denominator term.

    Returns:
        ``R`` in the shape and dtype of ``q`` (computed in float32, or float64 for float64).
    """
    check_refine((q, k, v, qh, kh, vh), None, 1, window, None)
    dtype, shape = q.dtype, q.shape
    with torch.autocast(device_type=q.device.type, enabled=False):
        # float32 at least (float64 stays, for gradient checks); (b, h, N, d)
        q, k, v, qh, kh, vh = (t.to(torch.promote_types(dtype, torch.float32)).flatten(2, -2) for t in (q, k, v, qh, kh, vh))
        # while tracing, in the graph: symbolic sizes (dynamic spatial axes) neither hash nor fix the masks
        if torch.jit.is_tracing():
            masks = _build_window_masks(tuple(shape[2:-1]), window, q.device, like=q)
        else:
            masks = (_build_window_masks if torch.compiler.is_compiling() else _window_masks)(tuple(shape[2:-1]), window, q.device)
        bias, inside = (m.to(q.dtype) for m in masks)
        scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2) + bias
        local = scores.softmax(dim=-1) @ v
        weights = (qh.relu() @ kh.relu().transpose(-1, -2)) * inside
        linear = (weights @ vh) / (weights.sum(dim=-1, keepdim=True) + eps)
    return (local - linear).view(shape).to(dtype)


def dense_local_refine(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qh: torch.Tensor,
    kh: torch.Tensor,
    vh: torch.Tensor,
    gate: torch.Tensor | None,
    tau: float | torch.Tensor,
    block: int,
    window: int,
    eps: float = DEFAULT_EPS,
    add_to: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`local_refine` with static shapes: ``R`` from :func:`dense_refine` for every token,
    masked by the gate instead of gathered tile by tile (the ``dense`` backend, for export).

    No tile list, no ``nonzero``, no scatter: every shape follows from the inputs' shapes, so
    ``torch.export``, ONNX and TorchScript tracing see one fixed graph. Work and memory grow with
    ``N**2`` tokens per map.

    Args:
        q, k, v, qh, kh, vh: ``(batch, heads, *spatial, head_dim)``.
        gate: ``(batch, *tiles)``, or ``None`` for every tile.
        tau: a tile is active when ``gate > tau`` (a float or a 0-d tensor such as the layer's
            ``tau`` buffer, which tracing keeps as a tensor).
        block, window, eps: as for :func:`local_refine`.
        add_to: with a ``gate``, the result is ``add_to + [M > tau] * M * R`` (a new tensor:
            nothing is written in place).

    Returns:
        ``[M > tau] * R`` (``R`` without a gate), or ``add_to + [M > tau] * M * R``; shape and
        dtype of ``q`` (of ``add_to`` when given).
    """
    check_refine((q, k, v, qh, kh, vh), gate, block, window, add_to)
    r = dense_refine(q, k, v, qh, kh, vh, window, eps)
    if gate is None:
        return r
    active = gate > tau
    weight = torch.where(active, gate, torch.zeros_like(gate)) if add_to is not None else active.to(gate.dtype)
    weight = tile_broadcast(weight, block, tuple(q.shape[2:-1])).unsqueeze(1).unsqueeze(-1).to(r.dtype)
    return weight * r if add_to is None else add_to + weight * r


#: Crossover of :func:`dense_fits`: tokens per map up to which the ``N x N`` form beat the tile
#: schedule, forward and backward (at 24 x 24 tokens they were even, docs/benchmarks.md), and
#: the largest score matrix (elements, all batch elements and heads) it accepts.
DENSE_TOKENS = 400
DENSE_ELEMENTS = 1 << 24


def dense_fits(shape: torch.Size) -> bool:
    """Whether :func:`dense_refine` suits features ``shape`` ``(b, h, *S, d)``."""
    tokens = math.prod(shape[2:-1])
    return tokens <= DENSE_TOKENS and shape[0] * shape[1] * tokens**2 <= DENSE_ELEMENTS


def _build_window_tables(spatial: tuple[int, ...], block: int, window: int, device: torch.device):
    """The tile tables of :func:`window_refine`, by arithmetic on the sizes alone.

    Returns ``(q_index, k_index, bias, visible, inverse)``: ``q_index`` ``(tiles * block**s,)``
    and ``k_index`` ``(tiles * halo**s,)`` the flat map positions of every tile's queries and
    halo keys (clamped into the map; the same rows as ``q_flat`` and ``k_flat`` of
    :func:`hsmla_med.ops_reference._tile_tables`), ``bias`` ``(tiles, block**s, halo**s)``
    float32, 0 where the halo key lies in the query's window and in the map, else ``HIDDEN``
    (``_tile_tables``' ``hidden``),
    ``visible`` the matching 0/1 mask, and ``inverse`` ``(N,)`` the row of each map token in the
    tile-major query rows (``tile * block**s + position in tile``): every token lies in exactly
    one tile, so the map is a static permutation of those rows, without their padded queries.

    Each axis contributes a factor (positions, in-map and band tests) on its own slots of a
    ``(*grid, *[block] * s, *[halo] * s)`` broadcast, summed or multiplied over the axes: no
    data-dependent step (``_tile_tables`` tests ``all()`` on a tensor), so ``torch.compile``
    traces it into the graph, for symbolic sizes too, and inductor folds it into the gathers'
    index expressions.
    """
    dims, grid = len(spatial), tile_grid(spatial, block)
    halo, reach = block + window - 1, window // 2
    tile_rows = [math.prod(grid[a + 1 :]) * block**dims for a in range(dims)]  # token -> query row, per axis

    def place(x: torch.Tensor, axis: int) -> torch.Tensor:
        """``(grid[axis], block, halo)`` -> its slots of the ``3 * s``-dim broadcast."""
        shape = [1] * (3 * dims)
        shape[axis], shape[dims + axis], shape[2 * dims + axis] = x.shape
        return x.view(shape)

    q_index = k_index = inverse = 0
    visible = True
    for axis, n in enumerate(spatial):
        start = torch.arange(grid[axis], device=device).view(-1, 1, 1) * block
        p = torch.arange(block, device=device).view(1, -1, 1)
        u = torch.arange(halo, device=device).view(1, 1, -1)
        stride = math.prod(spatial[axis + 1 :])
        key = start + u - reach  # (grid, 1, halo) map coordinate of halo key u
        q_index = q_index + place((start + p).clamp(max=n - 1) * stride, axis)
        k_index = k_index + place(key.clamp(0, n - 1) * stride, axis)
        visible = visible & place((key >= 0) & (key < n) & (u >= p) & (u < p + window), axis)
        token = torch.arange(n, device=device)
        row = token // block * tile_rows[axis] + token % block * block ** (dims - 1 - axis)
        inverse = inverse + row.view([n if a == axis else 1 for a in range(dims)])
    visible = visible.reshape(math.prod(grid), block**dims, halo**dims)
    bias = torch.where(visible, 0.0, HIDDEN)
    return q_index.reshape(-1), k_index.reshape(-1), bias, visible.float(), inverse.reshape(-1)


#: the window tables of one map geometry, kept between eager calls
_window_tables = lru_cache(maxsize=64)(_build_window_tables)


def _window_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, fused: bool) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d) + bias) v`` of tile queries ``(b * h, tiles, Bq, d)`` over their
    halos ``(b * h, tiles, Bk, d)``, ``bias`` ``(tiles, Bq, Bk)``.

    ``fused`` (what :func:`window_refine` takes on CUDA): ``scaled_dot_product_attention`` with
    the bias as a float mask, which CUDA runs in its memory-efficient kernel, forward and
    backward, without writing the scores out. On the CPU the fused kernel gives the same values
    but took 1.1-2x longer forward and backward at these tile shapes (16 queries, 100 or 1000
    keys) than the explicit products, which therefore run there.
    """
    if fused:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    return ((q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2) + bias).softmax(dim=-1) @ v


def window_refine(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qh: torch.Tensor,
    kh: torch.Tensor,
    vh: torch.Tensor,
    block: int,
    window: int,
    eps: float = DEFAULT_EPS,
) -> torch.Tensor:
    """``R = O_loc - O_linloc`` for every token, as batched window attention over all tiles at
    once.

    The same function as ``local_refine(..., gate=None)`` and :func:`dense_refine`, arranged for
    training on maps of any size with the device alone in the loop: every tile's queries and
    halo keys are gathered by one ``index_select`` per tensor with static index tables (their
    shapes follow from the map's shape), each tile's queries attend to its halo under a score
    bias that hides keys outside their window or the map, and one more ``index_select`` with a
    static inverse permutation puts the tile rows back in map order. No Python loop over tiles,
    no host sync, no value-dependent shape: autograd derives the backward and ``torch.compile``
    captures it whole (``fullgraph``).

    The softmax term is :func:`_window_softmax` (``scaled_dot_product_attention`` on CUDA, the
    explicit products on the CPU). The linear term is ``w = phi(qh) phi(kh)^T`` times the 0/1
    window mask (a product, not the bias and a ``relu``: one operation fewer forward and
    backward), then ``(w vh) / (w.sum(-1) + eps)``.

    Memory: with ``T`` tiles, ``Bq = block**s`` queries and ``Bk = (block + window - 1)**s``
    halo keys per tile, the temporaries are the linear term's weights, ``b * h * T * Bq * Bk``
    (about ``N * Bk``; the CPU softmax term as much again, CUDA's none), and the gathered halos,
    four tensors of ``b * h * T * Bk * d`` (about ``N * d * Bk / Bq``, 6x the map at block 4,
    window 7 in 2D, 16x in 3D), against :func:`dense_refine`'s ``b * h * N**2`` scores and
    weights: linear in ``N`` rather than quadratic.

    Args:
        q, k, v: raw projections, ``(batch, heads, *spatial, head_dim)``.
        qh, kh, vh: multi-scale projections, same shape.
        block: tile size per axis (the result does not depend on it; its cost does).
        window: odd window size per axis.
        eps: linear-attention denominator term.

    Returns:
        ``R`` in the shape and dtype of ``q``, contiguous ``(batch, heads, *spatial, head_dim)``
        (computed in float32 with autocast off, or float64 for float64).
    """
    check_refine((q, k, v, qh, kh, vh), None, block, window, None)
    dtype, shape = q.dtype, q.shape
    work = torch.promote_types(dtype, torch.float32)  # float64 stays, for gradient checks
    # while compiling, in the graph: symbolic sizes (dynamic shapes) neither hash nor fix a cache
    tables = (_build_window_tables if building_graph() else _window_tables)(tuple(shape[2:-1]), block, window, q.device)
    q_index, k_index, bias, visible, inverse = tables
    tiles, bq, bk = bias.shape
    bias, visible = bias.to(work), visible.to(work)

    def gather(x: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
        """Map ``(b, h, *S, d)`` -> tile rows ``(b * h, tiles, rows, d)``, cast before the gather
        (halos repeat tokens)."""
        return x.to(work).flatten(2, -2).index_select(2, index).view(-1, tiles, rows, shape[-1])

    with torch.autocast(device_type=q.device.type, enabled=False):
        local = _window_softmax(gather(q, q_index, bq), gather(k, k_index, bk), gather(v, k_index, bk), bias, q.is_cuda)
        # phi after the gathers: inductor (torch 2.13) failed to compile a relu of the map fused
        # into a gather whose index it derives from the tables' arithmetic
        weights = (gather(qh, q_index, bq).relu() @ gather(kh, k_index, bk).relu().transpose(-1, -2)) * visible
        linear = (weights @ gather(vh, k_index, bk)) / (weights.sum(dim=-1, keepdim=True) + eps)
        r = (local - linear).view(*shape[:2], tiles * bq, shape[-1]).index_select(2, inverse)
    return r.view(shape).to(dtype)


def tile_broadcast(gate: torch.Tensor, block: int, spatial: tuple[int, ...]) -> torch.Tensor:
    """A tile map ``(batch, *tiles)`` repeated over each tile's tokens: ``(batch, *spatial)``
    (partial edge tiles cut to the map).

    One ``expand`` of a ``(batch, t1, 1, t2, 1, ...)`` view and a reshape: static shapes that
    every exporter takes (ONNX ``Expand``/``Reshape``/``Slice``), one copy."""
    b, tiles = gate.shape[0], gate.shape[1:]
    split = gate.reshape(b, *[s for n in tiles for s in (n, 1)])
    whole = split.expand(b, *[s for n in tiles for s in (n, block)]).reshape(b, *[n * block for n in tiles])
    return whole[(slice(None), *(slice(0, n) for n in spatial))]


def tile_average(x: torch.Tensor, block: int) -> torch.Tensor:
    """Mean of ``(batch, C, *spatial)`` over ``block``-sized tiles -> ``(batch, C, *tiles)``.

    Partial edge tiles average over the tokens that exist: the map is zero-padded to whole
    tiles, summed per tile (``avg_pool`` with stride ``block``) and divided by the same pooling
    of a map of ones (each tile's share of existing tokens). Every size here is arithmetic on
    the input's shape, with no comparison of a size against ``block``, so an export with
    dynamic spatial axes keeps them symbolic (``avg_pool``'s ``ceil_mode`` made the exporter fix
    the tile count, and its 3D form refuses a kernel longer than the map).
    """
    pool = (F.avg_pool2d, F.avg_pool3d)[x.dim() - 4]
    spatial = x.shape[2:]
    pad = [p for n in reversed(spatial) for p in (0, (-n) % block)]
    share = pool(F.pad(x.new_ones(1, 1, *spatial), pad), block, stride=block)
    return pool(F.pad(x, pad), block, stride=block) / share


def gate_regularizers(gate: torch.Tensor, rho: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Budget and smoothness terms of a block gate ``(batch, *tiles)``, docs/design.md §2.7.

    budget = ``|mean_b M_b - rho|`` and smoothness = ``sum_{adjacent b, b'} |M_b - M_b'|``
    (4-neighbourhood in 2D, 6 in 3D), each per sample and then averaged over the batch.
    """
    budget = (gate.flatten(1).mean(dim=1) - rho).abs().mean()
    smooth = gate.new_zeros(())
    for axis in range(1, gate.dim()):
        smooth = smooth + gate.diff(dim=axis).abs().flatten(1).sum(dim=1).mean()
    return budget, smooth
