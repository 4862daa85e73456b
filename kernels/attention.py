"""The HSMLA attention core at inference, ``O_lin + [M > tau] * M * R``, as one call of three
Triton launches (docs/design.md §4), and its reference.

:func:`attention` runs the linear attention (:func:`.linear.linear_attention`: two launches,
the result laid out token-major, which is the channels-last map the layer's output projection
reads) and then the refinement (:func:`.refine.refine_add`: one launch over every tile of the
map, whose programs read the gate and ``tau`` from device memory, return at once on inactive
tiles and add ``M * R`` into the linear output in place). Nothing in it reads a value back to the
host or sizes anything from one, so a CUDA graph can capture it, and the launch grids are the same
whatever share of tiles the gate selects.
"""

from __future__ import annotations

from typing import Optional

import torch

from hsmla_med import ops_reference

from . import linear as _linear
from . import refine as _refine

__all__ = ["attention", "reference"]


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
    gate: Optional[torch.Tensor], tau, refine: bool, block: int, window: int, eps: float,
) -> torch.Tensor:
    """``O_lin`` (``refine`` False), ``O_lin + R`` (``gate`` None) or ``O_lin + [M > tau] * M * R``
    from :mod:`hsmla_med.ops_reference`; the semantics :func:`attention` is tested against."""
    return ops_reference.attend(ops_reference.linear_attention, ops_reference.local_refine, q, k, v, qh, kh, vh, gate, tau, refine, block, window, eps)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
    gate: Optional[torch.Tensor], tau, refine: bool, block: int, window: int, eps: float,
) -> torch.Tensor:
    """:func:`reference` with the Triton kernels: three launches with ``refine``, two without.

    Args:
        q, k, v: raw projections, qh, kh, vh: multi-scale projections,
            ``(batch, heads, *spatial, head_dim)``, 2 or 3 spatial dims, one dtype.
        gate: ``(batch, *ceil(spatial / block))`` or ``None`` (every tile, weight 1).
        tau: a 0-d tensor on the features' device (the layer's buffer; a number is turned into
            one there, without a host sync).
        refine: add the local residual (routing ``gate`` or ``all``); False: linear attention only.
        block, window, eps: tile size, odd window size, linear-term epsilon.

    Returns:
        ``(batch, heads, *spatial, head_dim)`` in ``q``'s dtype, laid out token-major
        (``(batch, *spatial, heads, head_dim)`` in memory).
    """
    out = _linear.linear_attention(qh, kh, vh, eps)
    if refine:
        _refine.refine_add(q, k, v, qh, kh, vh, gate, tau, block, window, eps, out, weighted=True)
    return out
