"""Sync-free local refinement ``R = O_loc - O_linloc`` added into the output in place
(docs/design.md §2.5-2.6, §4.3) and its reference.

One launch on a grid fixed by the shapes alone, ``(batch * tiles, heads, chunks)``: one program
per tile of the map (row-major over the tile grid), head, and chunk of at most ``MAX_BLOCK_Q``
of the tile's queries. Each program reads its tile's gate value ``M`` and the threshold ``tau``
from device memory and returns at once unless ``M > tau``, so the gate's choice never reaches the
host: no ``nonzero``, no value-dependent grid, nothing that stops a CUDA graph capture. An
active program walks the tile's ``(block + window - 1)^dims`` halo of keys in chunks, evaluates
for its queries the window softmax with a running maximum (flash-attention style) and the
local ReLU linear term over the same band, and adds ``M * R`` (or ``R``) into the output's
elements of its tile: a read-modify-write of tokens no other program touches (tiles are
disjoint), so no atomics. 2D and 3D maps share the kernel: a 2D map is a 3D one of depth 1
with no tile or window in z.
"""

from __future__ import annotations

import math

import torch

from hsmla_med.ops_reference import check_refine, tile_grid
from hsmla_med.ops_reference import local_refine as reference

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

__all__ = ["local_refine", "refine_add", "reference", "launch_config", "compile_specs"]

MAX_BLOCK_K = 64  # halo keys per loop step (fewer for big tiles or where shared memory is short)
MAX_BLOCK_Q = 128  # queries per program: bigger tiles (3D 8^3) are split over programs
SCRATCH = 2048  # bytes of shared memory allowed beyond the tiles (reductions, layout conversions)


@lazy_jit
def _refine_kernel(
    q_ptr, k_ptr, v_ptr, qh_ptr, kh_ptr, vh_ptr, o_ptr, gate_ptr, tau_ptr,
    depth, height, width, head_dim, scale_log2, eps,
    sq_b, sq_h, sq_z, sq_y, sq_x, sq_d,
    sk_b, sk_h, sk_z, sk_y, sk_x, sk_d,
    sv_b, sv_h, sv_z, sv_y, sv_x, sv_d,
    sqh_b, sqh_h, sqh_z, sqh_y, sqh_x, sqh_d,
    skh_b, skh_h, skh_z, skh_y, skh_x, skh_d,
    svh_b, svh_h, svh_z, svh_y, svh_x, svh_d,
    so_b, so_h, so_z, so_y, so_x, so_d,
    sg_b, sg_z, sg_y, sg_x,
    BLOCK: tl.constexpr, BLOCK_Z: tl.constexpr, RADIUS: tl.constexpr, RADIUS_Z: tl.constexpr,
    HALO: tl.constexpr, HALO_Z: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    HAS_GATE: tl.constexpr, WEIGHTED: tl.constexpr,
):
    """``out += w * R`` for one chunk of ``BLOCK_Q`` queries of one tile and one head, where the
    tile is active (``M > tau``; every tile without a gate); ``w`` is ``M`` when ``WEIGHTED``,
    else 1. Nothing outside an active tile is read from or written to ``out``.

    Maps are ``(depth, height, width)``: a 2D map is one slice (``depth`` 1, ``BLOCK_Z`` 1,
    ``RADIUS_Z`` 0, ``HALO_Z`` 1, its ``z`` strides 0), so both ranks share one kernel. Without a
    gate (``HAS_GATE`` false) ``gate_ptr`` and ``tau_ptr`` are never read."""
    tiles_x = (width + BLOCK - 1) // BLOCK
    tiles_y = (height + BLOCK - 1) // BLOCK
    tiles_z = (depth + BLOCK_Z - 1) // BLOCK_Z
    tile = tl.program_id(0)
    b = (tile // (tiles_z * tiles_y * tiles_x)).to(tl.int64)
    tz = ((tile // (tiles_y * tiles_x)) % tiles_z).to(tl.int64)
    ty = ((tile // tiles_x) % tiles_y).to(tl.int64)
    tx = (tile % tiles_x).to(tl.int64)
    weight = 1.0
    if HAS_GATE:
        gate = tl.load(gate_ptr + b * sg_b + tz * sg_z + ty * sg_y + tx * sg_x)
        # Compared in the gate's dtype, as torch compares ``gate > tau``; written as not '>' rather
        # than '<=' so that a NaN gate is inactive, as it is there.
        if not (gate > tl.load(tau_ptr).to(gate_ptr.dtype.element_ty)):
            return
        if WEIGHTED:
            weight = gate.to(tl.float32)
    h = tl.program_id(1).to(tl.int64)
    z0 = tz * BLOCK_Z
    y0 = ty * BLOCK
    x0 = tx * BLOCK

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

    # Padded queries (no valid key) have l = 0; they are masked out of the load and the store.
    r = acc / tl.where(l > 0, l, 1.0)[:, None] - num / (den[:, None] + eps)
    o_ptrs = (
        o_ptr + b * so_b + h * so_h + qz[:, None] * so_z + qy[:, None] * so_y + qx[:, None] * so_x
        + offs_d[None, :] * so_d
    )
    prior = tl.load(o_ptrs, mask=q_mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, (prior + weight * r).to(o_ptr.dtype.element_ty), mask=q_mask)


def launch_config(
    dtype: torch.dtype,
    head_dim: int,
    block: int,
    window: int,
    max_shared: int | None = None,
    spatial_dims: int = 2,
    *,
    has_gate: bool = True,
    weighted: bool = True,
) -> LaunchConfig:
    """Constexprs, warps and stages of ``_refine_kernel`` for ``dtype`` inputs with ``head_dim``
    channels, tiles of ``block`` and a window of ``window`` per axis over ``spatial_dims`` (2 or
    3) axes, within ``max_shared`` bytes of shared memory per program (``None``: no limit, the
    interpreter); ``has_gate`` and ``weighted`` as :func:`refine_add` takes them (a gate, and
    ``M * R`` rather than ``R`` added).

    A program takes up to :data:`MAX_BLOCK_Q` of its tile's queries (a 3D tile of 8^3 is four
    programs of 128). Keys per step (``BLOCK_K``) are the whole halo up to :data:`MAX_BLOCK_K`,
    fewer for many queries so that the (queries x keys) float32 score block stays at 4096
    elements; then the pipeline stages, after them ``BLOCK_K`` and last ``BLOCK_Q`` (more
    programs per tile) are cut until the estimate fits. The estimate bounds what Triton 3.x
    allocates (``tests/test_triton_compile.py`` checks it): float32 copies of three
    ``BLOCK_K x BLOCK_D`` key-side tiles, two ``BLOCK_Q x BLOCK_D`` query-side ones and the
    ``BLOCK_Q x BLOCK_K`` scores pass through shared memory for the dots, and each extra stage
    prefetches the four key-side loads (k, v, kh, vh) once more in the input dtype. Where even
    ``BLOCK_Q = BLOCK_K = 16`` and one stage do not fit, that is returned (Triton then refuses
    the launch).
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
        HAS_GATE=has_gate, WEIGHTED=has_gate and weighted,
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
    dtype: torch.dtype,
    head_dim: int,
    block: int,
    window: int,
    max_shared: int | None,
    spatial_dims: int = 2,
    *,
    has_gate: bool = True,
    weighted: bool = True,
) -> list[KernelSpec]:
    """The kernel as :func:`refine_add` launches it on ``dtype`` inputs (by default as the HSMLA
    layer's inference path does: a float32 gate and ``M * R`` added), with its argument types,
    for compiling it ahead of a launch (``tests/test_triton_compile.py``). Without a gate both
    of its pointers are dummies of the input dtype, as :func:`refine_add` passes them."""
    pointers = dict(gate_ptr="*fp32", tau_ptr="*fp32") if has_gate else {}
    sig = signature(_refine_kernel, dtype, scale_log2="fp32", eps="fp32", **pointers)
    config = launch_config(
        dtype, head_dim, block, window, max_shared, spatial_dims, has_gate=has_gate, weighted=weighted
    )
    return [KernelSpec(_refine_kernel, sig, config)]


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    """``(b, h, z, y, x, d)`` strides of a 2D or 3D feature map; a 2D map is one slice (z stride 0)."""
    stride = t.stride()
    return stride if t.dim() == 6 else (*stride[:2], 0, *stride[2:])


def refine_add(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qh: torch.Tensor,
    kh: torch.Tensor,
    vh: torch.Tensor,
    gate: torch.Tensor | None,
    tau: torch.Tensor | float,
    block: int,
    window: int,
    eps: float,
    out: torch.Tensor,
    *,
    weighted: bool = True,
) -> torch.Tensor:
    """Add ``M * R`` (``R`` when not ``weighted``) into ``out`` in place on the tiles with
    ``gate > tau``, in one launch whose grid depends on the shapes alone.

    Nothing here reads a value of a tensor on the host: each program compares its tile's gate
    value with ``tau`` on the device and returns when the tile is inactive, so the call never
    waits for the device and can be captured in a CUDA graph whatever the gate selects.

    Args:
        q, k, v: raw projections, ``(batch, heads, *spatial, head_dim)``, 2 or 3 spatial dims,
            any strides.
        qh, kh, vh: multi-scale projections, same shape, dtype and device.
        gate: ``(batch, *ceil(spatial / block))`` of any float dtype and strides, on ``q``'s
            device; ``None`` refines every tile at weight 1.
        tau: a tile is active when ``gate > tau`` (compared in the gate's dtype, as torch
            compares them): a 0-d tensor on ``q``'s device, read there, or a number, made one
            (a fill on the device, no copy from the host). Unused without a gate.
        block: tile size per axis (edge tiles may be partial).
        window: odd local window size per axis; keys outside the map are excluded.
        eps: linear-term denominator epsilon.
        out: ``q``'s shape, dtype and device, any strides (the layer's linear-attention output);
            each element of an active tile becomes ``out + w * R``, summed in float32; every
            other element is neither read nor written.
        weighted: ``w`` is the tile's gate value ``M`` (the layer's inference path), else 1.

    Returns:
        ``out``.
    """
    check_features("refine_add", (2, 3), q=q, k=k, v=v, qh=qh, kh=kh, vh=vh)
    dims = check_refine((q, k, v, qh, kh, vh), gate, block, window, None)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, got {tuple(out.shape)} {out.dtype}.")
    b, heads, *spatial, d = q.shape
    has_gate = gate is not None
    if not has_gate:
        gate = tau = q  # dummy pointers: HAS_GATE is false, the kernel never reads them
        gate_strides = (0, 0, 0, 0)
    else:
        if not gate.is_floating_point() or gate.device != q.device:
            raise ValueError(f"gate must be a float tensor on {q.device}, got {gate.dtype} on {gate.device}.")
        if not isinstance(tau, torch.Tensor):
            tau = q.new_full((), float(tau), dtype=torch.float32)
        elif tau.dim() != 0 or tau.device != q.device:
            raise ValueError(f"tau must be a number or a 0-d tensor on {q.device}, got {tuple(tau.shape)} on {tau.device}.")
        gate_strides = gate.stride() if dims == 3 else (gate.stride(0), 0, *gate.stride()[1:])
    depth, height, width = ([1] + spatial)[-3:]
    config = launch_config(
        q.dtype, d, block, window, shared_memory_limit(q.device), dims, has_gate=has_gate, weighted=weighted
    )
    tiles = b * math.prod(tile_grid(tuple(spatial), block))
    chunks = triton.cdiv(block**dims, config.constexprs["BLOCK_Q"])  # programs per tile and head
    _refine_kernel[(tiles, heads, chunks)](
        q, k, v, qh, kh, vh, out, gate, tau,
        depth, height, width, d, math.log2(math.e) / math.sqrt(d), float(eps),
        *_strides(q), *_strides(k), *_strides(v), *_strides(qh), *_strides(kh), *_strides(vh), *_strides(out),
        *gate_strides,
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
    tau: torch.Tensor | float,
    block: int,
    window: int,
    eps: float = 1e-6,
    add_to: torch.Tensor | None = None,
) -> torch.Tensor:
    """Local residual ``R = O_loc - O_linloc`` on tiles with ``gate > tau``; the semantics of
    :func:`reference`, ``add_to`` included, through :func:`refine_add` (no host sync).

    Args:
        q, k, v: raw projections, ``(batch, heads, *spatial, head_dim)``, 2 or 3 spatial dims.
        qh, kh, vh: multi-scale projections, same shape, dtype and device.
        gate: ``(batch, *ceil(spatial / block))``; ``None`` refines every tile.
        tau: a tile is active when ``gate > tau``; a 0-d tensor on the device or a number.
        block: tile size per axis (edge tiles may be partial).
        window: odd local window size per axis; keys outside the map are excluded.
        eps: linear-term denominator epsilon.
        add_to: optional tensor of ``q``'s shape and dtype, any strides; with a ``gate``,
            ``gate * R`` is added to it in place (one launch) and it is returned.

    Returns:
        ``R`` of ``q``'s shape and dtype, laid out channel-first like the reference's result,
        exactly zero outside the active tiles (softmax and linear terms accumulated in float32;
        a zero fill and one launch); or ``add_to``.
    """
    check_features("local_refine", (2, 3), q=q, k=k, v=v, qh=qh, kh=kh, vh=vh)
    check_refine((q, k, v, qh, kh, vh), gate, block, window, add_to)
    if add_to is not None:
        return refine_add(q, k, v, qh, kh, vh, gate, tau, block, window, eps, add_to, weighted=True)
    b, heads, *spatial, d = q.shape
    out = torch.zeros((b, heads, d, *spatial), dtype=q.dtype, device=q.device).movedim(2, -1)
    return refine_add(q, k, v, qh, kh, vh, gate, tau, block, window, eps, out, weighted=False)
