"""Tile-compacted local refinement ``R = O_loc - O_linloc`` (docs/design.md §2.5-2.6, §4.3) and
its reference.

The active tiles (``gate > tau``) are compacted into a dense ``(n, 1 + dims)`` list of
``(batch, *tile index)`` with ``torch.nonzero``; one program per (active tile, head, chunk of
at most ``MAX_BLOCK_Q`` of the tile's queries) walks the tile's ``(block + window - 1)^dims``
halo of keys in chunks, evaluates for its queries the window softmax with a running maximum
(flash-attention style) and the local ReLU linear term over the same band, and writes ``R`` for
them. Tiles are disjoint, so programs never write the same element and no atomics are needed.
2D and 3D maps share the kernel: a 2D map is a 3D one of depth 1 with no tile or window in z.
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
MAX_BLOCK_Q = 128  # queries per program: bigger tiles (3D 8^3) are split over programs
SCRATCH = 2048  # bytes of shared memory allowed beyond the tiles (reductions, layout conversions)


@lazy_jit
def _refine_kernel(
    q_ptr, k_ptr, v_ptr, qh_ptr, kh_ptr, vh_ptr, o_ptr, tiles_ptr,
    heads, depth, height, width, head_dim, scale_log2, eps,
    sq_b, sq_h, sq_z, sq_y, sq_x, sq_d,
    sk_b, sk_h, sk_z, sk_y, sk_x, sk_d,
    sv_b, sv_h, sv_z, sv_y, sv_x, sv_d,
    sqh_b, sqh_h, sqh_z, sqh_y, sqh_x, sqh_d,
    skh_b, skh_h, skh_z, skh_y, skh_x, skh_d,
    svh_b, svh_h, svh_z, svh_y, svh_x, svh_d,
    so_b, so_h, so_z, so_y, so_x, so_d,
    BLOCK: tl.constexpr, BLOCK_Z: tl.constexpr, RADIUS: tl.constexpr, RADIUS_Z: tl.constexpr,
    HALO: tl.constexpr, HALO_Z: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    """``R`` for one chunk of ``BLOCK_Q`` queries of one listed tile and one head; nothing
    outside the tile is written.

    Maps are ``(depth, height, width)``: a 2D map is one slice (``depth`` 1, ``BLOCK_Z`` 1,
    ``RADIUS_Z`` 0, ``HALO_Z`` 1, its ``z`` strides 0), so both ranks share one kernel."""
    tile = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    b = tl.load(tiles_ptr + 4 * tile)
    z0 = tl.load(tiles_ptr + 4 * tile + 1) * BLOCK_Z
    y0 = tl.load(tiles_ptr + 4 * tile + 2) * BLOCK
    x0 = tl.load(tiles_ptr + 4 * tile + 3) * BLOCK

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    # row-major positions in the tile of this program's chunk of queries; past its size: padding
    qi = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    qz = z0 + qi // (BLOCK * BLOCK)
    qy = y0 + (qi // BLOCK) % BLOCK
    qx = x0 + qi % BLOCK
    q_ok = (qi < BLOCK_Z * BLOCK * BLOCK) & (qz < depth) & (qy < height) & (qx < width)
    q_mask = q_ok[:, None] & d_ok[None, :]
    q = tl.load(
        q_ptr + b * sq_b + h * sq_h + qz[:, None] * sq_z + qy[:, None] * sq_y + qx[:, None] * sq_x
        + offs_d[None, :] * sq_d,
        mask=q_mask, other=0.0,
    )
    qh = tl.load(
        qh_ptr + b * sqh_b + h * sqh_h + qz[:, None] * sqh_z + qy[:, None] * sqh_y + qx[:, None] * sqh_x
        + offs_d[None, :] * sqh_d,
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
    for j0 in range(0, HALO_Z * HALO * HALO, BLOCK_K):
        j = j0 + tl.arange(0, BLOCK_K)  # row-major position in the halo
        kz = z0 - RADIUS_Z + j // (HALO * HALO)
        ky = y0 - RADIUS + (j // HALO) % HALO
        kx = x0 - RADIUS + j % HALO
        k_ok = (
            (j < HALO_Z * HALO * HALO) & (kz >= 0) & (kz < depth) & (ky >= 0) & (ky < height)
            & (kx >= 0) & (kx < width)
        )
        k_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_ptr + b * sk_b + h * sk_h + kz[:, None] * sk_z + ky[:, None] * sk_y + kx[:, None] * sk_x
            + offs_d[None, :] * sk_d,
            mask=k_mask, other=0.0,
        )
        v = tl.load(
            v_ptr + b * sv_b + h * sv_h + kz[:, None] * sv_z + ky[:, None] * sv_y + kx[:, None] * sv_x
            + offs_d[None, :] * sv_d,
            mask=k_mask, other=0.0,
        )
        kh = tl.load(
            kh_ptr + b * skh_b + h * skh_h + kz[:, None] * skh_z + ky[:, None] * skh_y + kx[:, None] * skh_x
            + offs_d[None, :] * skh_d,
            mask=k_mask, other=0.0,
        )
        vh = tl.load(
            vh_ptr + b * svh_b + h * svh_h + kz[:, None] * svh_z + ky[:, None] * svh_y + kx[:, None] * svh_x
            + offs_d[None, :] * svh_d,
            mask=k_mask, other=0.0,
        )
        # Key j is in query i's window (Chebyshev distance <= the radius per axis) and inside the map.
        band = (
            (tl.abs(qz[:, None] - kz[None, :]) <= RADIUS_Z)
            & (tl.abs(qy[:, None] - ky[None, :]) <= RADIUS)
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
    o_ptrs = (
        o_ptr + b * so_b + h * so_h + qz[:, None] * so_z + qy[:, None] * so_y + qx[:, None] * so_x
        + offs_d[None, :] * so_d
    )
    tl.store(o_ptrs, r.to(o_ptr.dtype.element_ty), mask=q_mask)


def launch_config(
    dtype: torch.dtype,
    head_dim: int,
    block: int,
    window: int,
    max_shared: int | None = None,
    spatial_dims: int = 2,
) -> LaunchConfig:
    """Constexprs, warps and stages of ``_refine_kernel`` for ``dtype`` inputs with ``head_dim``
    channels, tiles of ``block`` and a window of ``window`` per axis over ``spatial_dims`` (2 or
    3) axes, within ``max_shared`` bytes of shared memory per program (``None``: no limit, the
    interpreter).

    A program takes up to :data:`MAX_BLOCK_Q` of its tile's queries (a 3D tile of 8^3 is four
    programs of 128). Keys per step (``BLOCK_K``) are the whole halo up to :data:`MAX_BLOCK_K`,
    fewer for many queries so that the (queries x keys) float32 score block stays at 4096
    elements; then the pipeline stages, after them ``BLOCK_K`` and last ``BLOCK_Q`` (more
    programs per tile) are cut until the estimate fits. The estimate bounds what Triton 3.x
    allocates (``tests/test_triton_compile.py`` checks it): float32 copies of three
    ``BLOCK_K x BLOCK_D`` key-side tiles, two ``BLOCK_Q x BLOCK_D`` query-side ones and the
    ``BLOCK_Q x BLOCK_K`` scores pass through shared memory for the dots, and each extra stage
    prefetches the four key-side loads (k, v, kh, vh) once more in the input dtype. Where even ``BLOCK_Q = BLOCK_K = 16`` and one stage do not fit, that is
    returned (Triton then refuses the launch).
    """
    if spatial_dims not in (2, 3):
        raise ValueError(f"spatial_dims must be 2 or 3, got {spatial_dims}")
    halo = block + window - 1
    depth = spatial_dims == 3  # a 2D map is one slice of depth 1: no tile, window or halo in z
    block_q = max(16, min(MAX_BLOCK_Q, triton.next_power_of_2(block**spatial_dims)))
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_k = max(16, min(MAX_BLOCK_K, triton.next_power_of_2(halo**spatial_dims), 4096 // block_q))
    constexprs = dict(
        BLOCK=block, BLOCK_Z=block if depth else 1, RADIUS=window // 2, RADIUS_Z=window // 2 if depth else 0,
        HALO=halo, HALO_Z=halo if depth else 1, BLOCK_D=block_d, PRECISION=dot_precision(dtype),
    )
    while True:
        num_warps = 4 if block_q * block_d <= 64 * 64 else 8
        for stages in (DEFAULT_NUM_STAGES, 2, 1):
            need = (
                (3 * block_k * block_d + 2 * block_q * block_d + block_q * block_k) * 4
                + 4 * (stages - 1) * block_k * block_d * dtype.itemsize
                + SCRATCH
            )
            config = LaunchConfig(dict(constexprs, BLOCK_Q=block_q, BLOCK_K=block_k), num_warps, stages, need)
            if max_shared is None or need <= max_shared:
                return config
        if block_k > 16:
            block_k //= 2
        elif block_q > 16:  # the tile's queries over more programs
            block_q //= 2
        else:
            return config


def compile_specs(
    dtype: torch.dtype, head_dim: int, block: int, window: int, max_shared: int | None, spatial_dims: int = 2
) -> list[KernelSpec]:
    """The kernel as :func:`refine_tiles` launches it on ``dtype`` inputs, with its argument
    types, for compiling it ahead of a launch (``tests/test_triton_compile.py``)."""
    sig = signature(_refine_kernel, dtype, tiles_ptr="*i64", scale_log2="fp32", eps="fp32")
    return [KernelSpec(_refine_kernel, sig, launch_config(dtype, head_dim, block, window, max_shared, spatial_dims))]


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    """``(b, h, z, y, x, d)`` strides of a 2D or 3D feature map; a 2D map is one slice (z stride 0)."""
    stride = t.stride()
    return stride if t.dim() == 6 else (*stride[:2], 0, *stride[2:])


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
    """The kernel launch alone: write ``R`` into ``out`` on the listed tiles of a 2D or 3D map.

    Args:
        q, k, v, qh, kh, vh: ``(batch, heads, *spatial, head_dim)``, 2 or 3 spatial dims, any
            strides, one dtype.
        tiles: ``(n, 1 + spatial dims)`` integer ``(batch, *tile index)`` rows (``torch.nonzero``
            of the gate's ``(batch, *tiles)`` mask), each tile at most once.
        block: tile size per axis; window: odd window size per axis; eps: linear-term epsilon.
        out: ``q``'s shape and dtype; elements of the listed tiles inside the map are
            overwritten, every other element is left untouched.

    Returns:
        ``out``.
    """
    check_features("local_refine", (2, 3), q=q, k=k, v=v, qh=qh, kh=kh, vh=vh)
    dims = q.dim() - 3
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, got {tuple(out.shape)} {out.dtype}.")
    if tiles.dim() != 2 or tiles.shape[1] != 1 + dims or tiles.dtype.is_floating_point:
        raise ValueError(f"tiles must be an (n, {1 + dims}) integer tensor, got {tuple(tiles.shape)} {tiles.dtype}.")
    if tiles.shape[0] == 0:
        return out
    tiles = tiles.to(device=q.device, dtype=torch.int64)
    if dims == 2:  # (batch, 0, tile_y, tile_x): the slice index of a 2D map
        tiles = torch.cat([tiles[:, :1], torch.zeros_like(tiles[:, :1]), tiles[:, 1:]], dim=1)
    heads, *spatial, d = q.shape[1:]
    depth, height, width = ([1] + spatial)[-3:]
    config = launch_config(q.dtype, d, block, window, shared_memory_limit(q.device), dims)
    chunks = triton.cdiv(block**dims, config.constexprs["BLOCK_Q"])  # programs per tile and head
    _refine_kernel[(tiles.shape[0], heads, chunks)](
        q, k, v, qh, kh, vh, out, tiles.contiguous(),
        heads, depth, height, width, d, math.log2(math.e) / math.sqrt(d), float(eps),
        *_strides(q), *_strides(k), *_strides(v), *_strides(qh), *_strides(kh), *_strides(vh), *_strides(out),
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
        q, k, v: raw projections, ``(batch, heads, *spatial, head_dim)``, 2 or 3 spatial dims.
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
        exactly zero outside the active tiles (softmax and linear terms accumulated in float32).
    """
    check_features("local_refine", (2, 3), q=q, k=k, v=v, qh=qh, kh=kh, vh=vh)
    check_refine((q, k, v, qh, kh, vh), gate, block, window, add_to)
    if add_to is not None:
        r = local_refine(q, k, v, qh, kh, vh, gate, tau, block, window, eps)
        weight = tile_broadcast(gate, block, tuple(q.shape[2:-1])).unsqueeze(1).unsqueeze(-1)
        return add_to.addcmul_(weight.to(r.dtype), r)
    b, heads, *spatial, d = q.shape
    if gate is None:
        grid = (b, *(triton.cdiv(n, block) for n in spatial))
        tiles = torch.cartesian_prod(*(torch.arange(n, device=q.device) for n in grid))
    else:
        tiles = torch.nonzero(gate > tau)
    out = torch.zeros((b, heads, d, *spatial), dtype=q.dtype, device=q.device).movedim(2, -1)
    return refine_tiles(q, k, v, qh, kh, vh, tiles, block, window, eps, out)
