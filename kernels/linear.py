"""Fused global ReLU linear attention (docs/design.md §2.3, §4.3) and its reference.

Two launches and nothing else on the device but two ``torch.empty`` buffers of partials and the
output's: ``_aggregate_kernel`` sums ``Z = phi(kh)^T vh`` and ``Dn = sum phi(kh)`` in float32
over one chunk of tokens per program (the token axis is split so that a single
``(batch, head)`` still fills the GPU) and writes each chunk's partials, a few ``d x d`` blocks;
``_apply_kernel`` sums them in a fixed order (deterministic: no atomics, no zero fill) and
computes ``phi(qh) Z / (phi(qh) . Dn + eps)`` over a span of tokens with the division fused,
writing the input dtype. A span is long enough that the partials a program sums are no more
than the tokens it reads and writes. The map is only a token axis here, so 2D and 3D are the
same kernels. The result is allocated token-major (``(batch, *spatial, heads, head_dim)`` in
memory), the channels-last layout in which the layer's output projection reads it.
"""

from __future__ import annotations

import torch

from hsmla_med.ops_reference import linear_attention as reference

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

__all__ = ["linear_attention", "reference", "launch_configs", "compile_specs"]

BLOCK_N = 64  # tokens per loop step / per apply program (fewer where shared memory is short)
SCRATCH = 2048  # bytes of shared memory allowed beyond the tiles (reductions, layout conversions)
MIN_BLOCKS_PER_CHUNK = 4  # a partial Z is d*d floats: keep it small next to the tokens it sums
TARGET_PROGRAMS = 1024  # aggregate programs to aim for: several waves on a 132-SM GPU


@lazy_jit
def _aggregate_kernel(
    k_ptr, v_ptr, z_ptr, dn_ptr,
    n_tokens, heads, head_dim, chunk,
    sk_b, sk_h, sk_n, sk_d,
    sv_b, sv_h, sv_n, sv_d,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    """Partial ``Z`` (``d x d``) and ``Dn`` (``d``) of one token chunk of one (batch, head)."""
    chunk_id = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    k_base = k_ptr + b * sk_b + h * sk_h + offs_d[None, :] * sk_d
    v_base = v_ptr + b * sv_b + h * sv_h + offs_d[None, :] * sv_d
    z = tl.full((BLOCK_D, BLOCK_D), 0.0, dtype=tl.float32)
    dn = tl.full((BLOCK_D,), 0.0, dtype=tl.float32)
    start = chunk_id * chunk
    stop = tl.minimum(start + chunk, n_tokens)
    for n0 in range(start, stop, BLOCK_N):
        n = (n0 + offs_n).to(tl.int64)
        mask = (n < stop)[:, None] & d_ok[None, :]
        k = tl.load(k_base + n[:, None] * sk_n, mask=mask, other=0.0)
        v = tl.load(v_base + n[:, None] * sv_n, mask=mask, other=0.0)
        k = tl.maximum(k, 0.0).to(k_ptr.dtype.element_ty)  # phi = relu; masked entries stay 0
        z = tl.dot(tl.trans(k), v, acc=z, input_precision=PRECISION)
        dn += tl.reduce(k.to(tl.float32), 0, tl.standard._sum_combine)
    part = bh * tl.num_programs(0) + chunk_id
    d_rows = offs_d[:, None]
    d_cols = offs_d[None, :]
    tl.store(z_ptr + (part * head_dim + d_rows) * head_dim + d_cols, z, mask=d_ok[:, None] & d_ok[None, :])
    tl.store(dn_ptr + part * head_dim + offs_d, dn, mask=d_ok)


@lazy_jit
def _apply_kernel(
    q_ptr, z_ptr, dn_ptr, o_ptr,
    n_tokens, heads, head_dim, chunks, span, eps,
    sq_b, sq_h, sq_n, sq_d,
    so_b, so_h, so_n, so_d,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, PRECISION: tl.constexpr,
):
    """``phi(qh) Z / (phi(qh) . Dn + eps)`` for the ``span`` tokens from ``span * program_id(0)``
    of one (batch, head), output channels ``BLOCK_E * program_id(2)`` on (all of them unless the
    shared memory is short); ``Z`` and ``Dn`` are first summed over the ``chunks`` partials."""
    bh = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.program_id(2) * BLOCK_E + tl.arange(0, BLOCK_E)
    d_ok = offs_d < head_dim
    e_ok = offs_e < head_dim
    z = tl.full((BLOCK_D, BLOCK_E), 0.0, dtype=tl.float32)
    dn = tl.full((BLOCK_D,), 0.0, dtype=tl.float32)
    first = bh.to(tl.int64) * chunks
    for c in range(0, chunks):  # always in chunk order: the same sum on every run
        part = (first + c) * head_dim
        z += tl.load(
            z_ptr + (part + offs_d[:, None]) * head_dim + offs_e[None, :], mask=d_ok[:, None] & e_ok[None, :], other=0.0
        )
        dn += tl.load(dn_ptr + part + offs_d, mask=d_ok, other=0.0)
    start = tl.program_id(0) * span
    stop = tl.minimum(start + span, n_tokens)
    for n0 in range(start, stop, BLOCK_N):
        offs_n = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        n_ok = offs_n < stop
        q = tl.load(
            q_ptr + b * sq_b + h * sq_h + offs_n[:, None] * sq_n + offs_d[None, :] * sq_d,
            mask=n_ok[:, None] & d_ok[None, :], other=0.0,
        )
        q = tl.maximum(q.to(tl.float32), 0.0)
        num = tl.dot(q, z, input_precision=PRECISION)
        den = tl.reduce(q * dn[None, :], 1, tl.standard._sum_combine) + eps
        out = num / den[:, None]
        o_ptrs = o_ptr + b * so_b + h * so_h + offs_n[:, None] * so_n + offs_e[None, :] * so_d
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=n_ok[:, None] & e_ok[None, :])


def _block_d(head_dim: int) -> int:
    # tl.dot needs every block dimension >= 16 and a power of two.
    return max(16, triton.next_power_of_2(head_dim))


def launch_configs(
    dtype: torch.dtype, head_dim: int, max_shared: int | None = None
) -> tuple[LaunchConfig, LaunchConfig]:
    """Constexprs, warps and stages of ``(_aggregate_kernel, _apply_kernel)`` for ``dtype`` inputs
    with ``head_dim`` channels, within ``max_shared`` bytes of shared memory per program (``None``:
    no limit, the interpreter).

    The largest configuration whose estimate fits is taken. The estimates bound what Triton
    3.x allocates (``tests/test_triton_compile.py`` checks them): the aggregate loop stages its
    ``BLOCK_N x BLOCK_D`` k and v tiles, once more per pipeline stage, ``2 * num_stages`` tiles
    in all; the apply kernel passes its float32 ``BLOCK_N x BLOCK_D`` query block and
    ``BLOCK_D x BLOCK_E`` block of ``Z`` through shared memory for the dot. Where even the
    smallest does not fit, the smallest is returned (Triton then refuses the launch).
    """
    block_d = _block_d(head_dim)
    precision = dot_precision(dtype)
    num_warps = 4 if block_d <= 64 else 8
    size = dtype.itemsize
    fits = (lambda need: True) if max_shared is None else (lambda need: need <= max_shared)

    aggregate = None
    for block_n, stages in ((BLOCK_N, DEFAULT_NUM_STAGES), (BLOCK_N, 2), (BLOCK_N, 1), (BLOCK_N // 2, 1), (16, 1)):
        need = 2 * stages * block_n * block_d * size + SCRATCH
        aggregate = LaunchConfig(
            dict(BLOCK_N=block_n, BLOCK_D=block_d, PRECISION=precision), num_warps, stages, need
        )
        if fits(need):
            break

    apply = None
    for block_n in (BLOCK_N, BLOCK_N // 2, 16):  # Z's columns are split first: Z is d x d floats
        for block_e in sorted({block_d, *(e for e in (64, 32, 16) if e < block_d)}, reverse=True):
            need = (block_n * block_d + block_d * block_e) * 4 + SCRATCH
            apply = LaunchConfig(
                dict(BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_E=block_e, PRECISION=precision), num_warps, 1, need
            )
            if fits(need):
                return aggregate, apply
    return aggregate, apply


def compile_specs(dtype: torch.dtype, head_dim: int, max_shared: int | None) -> list[KernelSpec]:
    """The two kernels as :func:`linear_attention` launches them on ``dtype`` inputs, with their
    argument types, for compiling them ahead of a launch (``tests/test_triton_compile.py``)."""
    aggregate, apply = launch_configs(dtype, head_dim, max_shared)
    return [
        KernelSpec(_aggregate_kernel, signature(_aggregate_kernel, dtype, z_ptr="*fp32", dn_ptr="*fp32"), aggregate),
        KernelSpec(_apply_kernel, signature(_apply_kernel, dtype, z_ptr="*fp32", dn_ptr="*fp32", eps="fp32"), apply),
    ]


def linear_attention(
    qh: torch.Tensor,
    kh: torch.Tensor,
    vh: torch.Tensor,
    eps: float = 1e-6,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Global ReLU linear attention with Triton; the semantics of :func:`reference`.

    ``out_i = phi(qh_i) Z / (phi(qh_i) . Dn + eps)``, ``Z = sum_j phi(kh_j)^T vh_j``,
    ``Dn = sum_j phi(kh_j)`` per batch element and head, aggregates and division in float32.
    Two kernel launches; nothing waits for the device.

    Args:
        qh, kh, vh: ``(batch, heads, *spatial, head_dim)``, 2 or 3 spatial dims, any strides,
            float32/float16/bfloat16, ``head_dim <= 128``.
        eps: added to the denominator.
        out: optional buffer of ``qh``'s shape and dtype whose spatial axes can be viewed as
            one token axis; every element is overwritten.

    Returns:
        ``out``, or a new tensor of ``qh``'s shape and dtype laid out token-major
        (``(batch, *spatial, heads, head_dim)`` in memory): its ``(batch, heads * head_dim,
        *spatial)`` view is channels-last, the layout of the networks on CUDA, so the layer's
        output projection reads it without a conversion.
    """
    check_features("linear_attention", (2, 3), qh=qh, kh=kh, vh=vh)
    b, h, *spatial, d = qh.shape
    if out is None:
        dims = len(spatial)
        token_major = torch.empty((b, *spatial, h, d), dtype=qh.dtype, device=qh.device)
        out = token_major.permute(0, dims + 1, *range(1, dims + 1), dims + 2)
    elif out.shape != qh.shape or out.dtype != qh.dtype or out.device != qh.device:
        raise ValueError(f"out must be {tuple(qh.shape)} {qh.dtype} on {qh.device}, got {tuple(out.shape)} {out.dtype}.")
    # Tokens as one axis; inputs whose spatial strides do not merge are copied, out must merge.
    q, k, v = (t.flatten(2, -2) for t in (qh, kh, vh))
    o = out.view(b, h, -1, d)
    n = q.shape[2]

    aggregate, apply = launch_configs(qh.dtype, d, shared_memory_limit(qh.device))
    block_n = aggregate.constexprs["BLOCK_N"]
    chunk = block_n * max(MIN_BLOCKS_PER_CHUNK, triton.cdiv(triton.cdiv(n, block_n) * b * h, TARGET_PROGRAMS))
    chunks = triton.cdiv(n, chunk)
    z_part = torch.empty((b * h, chunks, d, d), dtype=torch.float32, device=qh.device)
    dn_part = torch.empty((b * h, chunks, d), dtype=torch.float32, device=qh.device)
    _aggregate_kernel[(chunks, b * h)](
        k, v, z_part, dn_part, n, h, d, chunk, *k.stride(), *v.stride(), **aggregate.launch_kwargs
    )
    # Each apply program sums all the partials of its channels, so its span of tokens grows with
    # their number: the partials it reads (BLOCK_D x BLOCK_E per chunk) stay within the tokens
    # it reads and writes (BLOCK_D + BLOCK_E per token).
    block_n, block_d, block_e = (apply.constexprs[key] for key in ("BLOCK_N", "BLOCK_D", "BLOCK_E"))
    span = block_n * triton.cdiv(chunks * block_d * block_e, block_n * (block_d + block_e))
    grid = (triton.cdiv(n, span), b * h, triton.cdiv(d, block_e))
    _apply_kernel[grid](
        q, z_part, dn_part, o, n, h, d, chunks, span, float(eps), *q.stride(), *o.stride(), **apply.launch_kwargs
    )
    return out
