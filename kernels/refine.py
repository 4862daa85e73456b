"""Tile-compacted local refinement ``R = O_loc - O_linloc`` (docs/design.md §2.5-2.6, §4.3) and
its reference.

The active tiles (``gate > tau``) are compacted into a dense ``(n, 3)`` list of
``(batch, tile_y, tile_x)`` with ``torch.nonzero``; one program per (active tile, head) walks
the tile's ``(block + window - 1)^2`` halo of keys in chunks, evaluates for the tile's queries
the window softmax with a running maximum (flash-attention style) and the local ReLU linear
term over the same band, and writes ``R`` for its tile. Tiles are disjoint, so programs never
write the same element and no atomics are needed. 2D only; 3D maps fall back to the reference.
"""

from __future__ import annotations

import math

import torch

from hsmla_med.nn.functional import check_refine, tile_broadcast
from hsmla_med.nn.functional import local_refine as reference

from ._runtime import (
    DEFAULT_NUM_STAGES,
    KernelSpec,
    LaunchConfig,
    check_features,
    dot_precision,
    lazy_jit,
    shared_memory_limit,
    signature,
    tl,
    triton,
)

__all__ = ["local_refine", "refine_tiles", "reference", "launch_config", "compile_specs"]

MAX_BLOCK_K = 64  # halo keys per loop step (fewer for big tiles or where shared memory is short)
SCRATCH = 2048  # bytes of shared memory allowed beyond the tiles (reductions, layout conversions)


@lazy_jit
def _refine_kernel(
    q_ptr, k_ptr, v_ptr, qh_ptr, kh_ptr, vh_ptr, o_ptr, tiles_ptr,
    heads, height, width, head_dim, scale_log2, eps,
    sq_b, sq_h, sq_y, sq_x, sq_d,
    sk_b, sk_h, sk_y, sk_x, sk_d,
    sv_b, sv_h, sv_y, sv_x, sv_d,
    sqh_b, sqh_h, sqh_y, sqh_x, sqh_d,
    skh_b, skh_h, skh_y, skh_x, skh_d,
    svh_b, svh_h, svh_y, svh_x, svh_d,
    so_b, so_h, so_y, so_x, so_d,
    BLOCK: tl.constexpr, RADIUS: tl.constexpr, HALO: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    """``R`` for the queries of one listed tile and one head; nothing outside the tile is written."""
    tile = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    b = tl.load(tiles_ptr + 3 * tile)
    y0 = tl.load(tiles_ptr + 3 * tile + 1) * BLOCK
    x0 = tl.load(tiles_ptr + 3 * tile + 2) * BLOCK

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    qi = tl.arange(0, BLOCK_Q)  # row-major position in the tile; BLOCK_Q >= BLOCK^2 is padding
    qy = y0 + qi // BLOCK
    qx = x0 + qi % BLOCK
    q_ok = (qi < BLOCK * BLOCK) & (qy < height) & (qx < width)
    q_mask = q_ok[:, None] & d_ok[None, :]
    q = tl.load(
        q_ptr + b * sq_b + h * sq_h + qy[:, None] * sq_y + qx[:, None] * sq_x + offs_d[None, :] * sq_d,
        mask=q_mask, other=0.0,
    )
    qh = tl.load(
        qh_ptr + b * sqh_b + h * sqh_h + qy[:, None] * sqh_y + qx[:, None] * sqh_x + offs_d[None, :] * sqh_d,
        mask=q_mask, other=0.0,
    )
    qh = tl.maximum(qh, 0.0).to(qh_ptr.dtype.element_ty)  # phi = relu, kept in the input dtype for tl.dot

    # Running max starts finite so that a row with no valid key yet gives exp(0) rescales and
    # exp(-inf) weights, never inf - inf.
    m = tl.full((BLOCK_Q,), -1.0e30, dtype=tl.float32)
    l = tl.full((BLOCK_Q,), 0.0, dtype=tl.float32)
    acc = tl.full((BLOCK_Q, BLOCK_D), 0.0, dtype=tl.float32)
    num = tl.full((BLOCK_Q, BLOCK_D), 0.0, dtype=tl.float32)
    den = tl.full((BLOCK_Q,), 0.0, dtype=tl.float32)
    for j0 in range(0, HALO * HALO, BLOCK_K):
        j = j0 + tl.arange(0, BLOCK_K)  # row-major position in the halo
        ky = y0 - RADIUS + j // HALO
        kx = x0 - RADIUS + j % HALO
        k_ok = (j < HALO * HALO) & (ky >= 0) & (ky < height) & (kx >= 0) & (kx < width)
        k_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_ptr + b * sk_b + h * sk_h + ky[:, None] * sk_y + kx[:, None] * sk_x + offs_d[None, :] * sk_d,
            mask=k_mask, other=0.0,
        )
        v = tl.load(
            v_ptr + b * sv_b + h * sv_h + ky[:, None] * sv_y + kx[:, None] * sv_x + offs_d[None, :] * sv_d,
            mask=k_mask, other=0.0,
        )
        kh = tl.load(
            kh_ptr + b * skh_b + h * skh_h + ky[:, None] * skh_y + kx[:, None] * skh_x + offs_d[None, :] * skh_d,
            mask=k_mask, other=0.0,
        )
        vh = tl.load(
            vh_ptr + b * svh_b + h * svh_h + ky[:, None] * svh_y + kx[:, None] * svh_x + offs_d[None, :] * svh_d,
            mask=k_mask, other=0.0,
        )
        # Key j is in query i's window (Chebyshev distance <= RADIUS) and inside the map.
        band = (
            (tl.abs(qy[:, None] - ky[None, :]) <= RADIUS)
            & (tl.abs(qx[:, None] - kx[None, :]) <= RADIUS)
            & k_ok[None, :]
        )

        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # log2 domain: exp2
        s = tl.where(band, s, float("-inf"))
        m_new = tl.maximum(m, tl.reduce(s, 1, tl.standard._elementwise_max))
        rescale = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * rescale + tl.reduce(p, 1, tl.standard._sum_combine)
        acc = acc * rescale[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
        m = m_new

        kh = tl.maximum(kh, 0.0).to(kh_ptr.dtype.element_ty)
        w = tl.dot(qh, tl.trans(kh), input_precision=PRECISION)
        w = tl.where(band, w, 0.0)
        num += tl.dot(w, vh.to(tl.float32), input_precision=PRECISION)
        den += tl.reduce(w, 1, tl.standard._sum_combine)

    # Padded queries (no valid key) have l = 0; they are masked out of the store.
    r = acc / tl.where(l > 0, l, 1.0)[:, None] - num / (den[:, None] + eps)
    o_ptrs = o_ptr + b * so_b + h * so_h + qy[:, None] * so_y + qx[:, None] * so_x + offs_d[None, :] * so_d
    tl.store(o_ptrs, r.to(o_ptr.dtype.element_ty), mask=q_mask)


def launch_config(
    dtype: torch.dtype, head_dim: int, block: int, window: int, max_shared: int | None = None
) -> LaunchConfig:
    """Constexprs, warps and stages of ``_refine_kernel`` for ``dtype`` inputs with ``head_dim``
    channels, ``block`` x ``block`` tiles and a ``window`` x ``window`` window, within
    ``max_shared`` bytes of shared memory per program (``None``: no limit, the interpreter).

    Keys per step (``BLOCK_K``) are the whole halo up to :data:`MAX_BLOCK_K`, fewer for big
    tiles so that the (queries x keys) float32 score block stays at 4096 elements; then the
    pipeline stages, and after them ``BLOCK_K``, are cut until the estimate fits. The estimate
    bounds what Triton 3.x allocates (``tests/test_triton_compile.py`` checks it): float32 copies
    of three ``BLOCK_K x BLOCK_D`` key-side tiles, two ``BLOCK_Q x BLOCK_D`` query-side ones and
    the ``BLOCK_Q x BLOCK_K`` scores pass through shared memory for the dots, and each extra
    stage prefetches the four key-side loads (k, v, kh, vh) once more in the input dtype.
    Where even ``BLOCK_K = 16`` and one stage do not fit, that is returned (Triton then
    refuses the launch).
    """
    halo = block + window - 1
    block_q = max(16, triton.next_power_of_2(block * block))
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_k = max(16, min(MAX_BLOCK_K, triton.next_power_of_2(halo * halo), 4096 // block_q))
    num_warps = 4 if block_q * block_d <= 64 * 64 else 8
    constexprs = dict(BLOCK=block, RADIUS=window // 2, HALO=halo, BLOCK_Q=block_q, BLOCK_D=block_d)
    config = None
    while True:
        for stages in (DEFAULT_NUM_STAGES, 2, 1):
            need = (
                (3 * block_k * block_d + 2 * block_q * block_d + block_q * block_k) * 4
                + 4 * (stages - 1) * block_k * block_d * dtype.itemsize
                + SCRATCH
            )
            config = LaunchConfig(
                dict(constexprs, BLOCK_K=block_k, PRECISION=dot_precision(dtype)), num_warps, stages, need
            )
            if max_shared is None or need <= max_shared:
                return config
        if block_k == 16:
            return config
        block_k //= 2


def compile_specs(
    dtype: torch.dtype, head_dim: int, block: int, window: int, max_shared: int | None
) -> list[KernelSpec]:
    """The kernel as :func:`refine_tiles` launches it on ``dtype`` inputs, with its argument
    types, for compiling it ahead of a launch (``tests/test_triton_compile.py``)."""
    sig = signature(_refine_kernel, dtype, tiles_ptr="*i64", scale_log2="fp32", eps="fp32")
    return [KernelSpec(_refine_kernel, sig, launch_config(dtype, head_dim, block, window, max_shared))]


def refine_tiles(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qh: torch.Tensor,
    kh: torch.Tensor,
    vh: torch.Tensor,
    tiles: torch.Tensor,
    block: int,
    window: int,
    eps: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """The kernel launch alone: write ``R`` into ``out`` on the listed tiles of a 2D map.

    Args:
        q, k, v, qh, kh, vh: ``(batch, heads, H, W, head_dim)``, any strides, one dtype.
        tiles: ``(n, 3)`` integer ``(batch, tile_y, tile_x)`` rows, each tile at most once.
        block: tile size per axis; window: odd window size per axis; eps: linear-term epsilon.
        out: ``q``'s shape and dtype; elements of the listed tiles inside the map are
            overwritten, every other element is left untouched.

    Returns:
        ``out``.
    """
    check_features("local_refine", (2,), q=q, k=k, v=v, qh=qh, kh=kh, vh=vh)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, got {tuple(out.shape)} {out.dtype}.")
    if tiles.dim() != 2 or tiles.shape[1] != 3 or tiles.dtype.is_floating_point:
        raise ValueError(f"tiles must be an (n, 3) integer tensor, got {tuple(tiles.shape)} {tiles.dtype}.")
    if tiles.shape[0] == 0:
        return out
    heads, height, width, d = q.shape[1:]
    config = launch_config(q.dtype, d, block, window, shared_memory_limit(q.device))
    _refine_kernel[(tiles.shape[0], heads)](
        q, k, v, qh, kh, vh, out, tiles.to(device=q.device, dtype=torch.int64).contiguous(),
        heads, height, width, d, math.log2(math.e) / math.sqrt(d), float(eps),
        *q.stride(), *k.stride(), *v.stride(), *qh.stride(), *kh.stride(), *vh.stride(), *out.stride(),
        **config.launch_kwargs,
    )
    return out


def local_refine(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qh: torch.Tensor,
    kh: torch.Tensor,
    vh: torch.Tensor,
    gate: torch.Tensor | None,
    tau: float,
    block: int,
    window: int,
    eps: float = 1e-6,
    add_to: torch.Tensor | None = None,
) -> torch.Tensor:
    """Local residual ``R = O_loc - O_linloc`` on tiles with ``gate > tau``; the semantics of
    :func:`reference`, ``add_to`` included.

    Args:
        q, k, v: raw projections, ``(batch, heads, *spatial, head_dim)``.
        qh, kh, vh: multi-scale projections, same shape, dtype and device.
        gate: ``(batch, *ceil(spatial / block))``; ``None`` refines every tile.
        tau: a tile is active when ``gate > tau``.
        block: tile size per axis (edge tiles may be partial).
        window: odd local window size per axis; keys outside the map are excluded.
        eps: linear-term denominator epsilon.
        add_to: optional tensor of ``q``'s shape; with a ``gate``, ``gate * R`` is added to it
            in place and it is returned.

    Returns:
        ``R`` of ``q``'s shape and dtype, laid out channel-first like the reference's result,
        exactly zero outside the active tiles. 2D maps run the Triton kernel (softmax and
        linear terms accumulated in float32); 3D maps are computed by :func:`reference`.
    """
    if q.dim() == 6:
        return reference(q, k, v, qh, kh, vh, gate, tau, block, window, eps, add_to)
    check_features("local_refine", (2,), q=q, k=k, v=v, qh=qh, kh=kh, vh=vh)
    check_refine((q, k, v, qh, kh, vh), gate, block, window, add_to)
    if add_to is not None:
        r = local_refine(q, k, v, qh, kh, vh, gate, tau, block, window, eps)
        weight = tile_broadcast(gate, block, tuple(q.shape[2:-1])).unsqueeze(1).unsqueeze(-1)
        return add_to.addcmul_(weight.to(r.dtype), r)
    b, heads, height, width, d = q.shape
    grid = (b, triton.cdiv(height, block), triton.cdiv(width, block))
    if gate is None:
        tiles = torch.cartesian_prod(*(torch.arange(n, device=q.device) for n in grid))
    else:
        tiles = torch.nonzero(gate > tau)
    out = torch.zeros((b, heads, d, height, width), dtype=q.dtype, device=q.device).movedim(2, -1)
    return refine_tiles(q, k, v, qh, kh, vh, tiles, block, window, eps, out)
