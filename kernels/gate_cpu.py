"""The HSMLA block gate on the CPU at inference: ``gate_cpu.c``, built at first use by
:mod:`._cpu_build`.

Its reference is the layer's PyTorch gate (:meth:`hsmla_med.nn.HSMLA.gate` on the reference
backend): a strided depthwise convolution with the fused pooling kernel, then the per-head
projections, sigmoid and mean over heads. On the small maps of the late stages those are five
operations costing ~0.3 ms per layer inside a network, mostly dispatch; the C version is one
pass over the map.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from ._cpu_build import int64s, library, pointer

__all__ = ["block_gate"]


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    lib = library("gate_cpu")
    if lib is not None:
        i64p, fp = ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_float)
        lib.hsmla_block_gate.argtypes = [
            fp, i64p, ctypes.c_int64, ctypes.c_int64, i64p, i64p, i64p, fp, i64p, fp, fp, fp, ctypes.c_int64, fp,
        ]
        lib.hsmla_block_gate.restype = ctypes.c_int
    return lib


def block_gate(
    ms: torch.Tensor,
    taps: torch.Tensor,
    conv_bias: torch.Tensor,
    weight: torch.Tensor,
    gate_bias: torch.Tensor,
    block: int,
) -> torch.Tensor | None:
    """Block gate ``M`` ``(batch, *tiles)`` of a map whose sides are multiples of ``block``.

    Args:
        ms: multi-scale tokens ``(b, 3C, *S)``, float32, channels-last (channel stride 1).
        taps: the fused pooling kernel tap by tap, ``(prod(kernel), 3C)`` contiguous, with
            ``kernel = block + 2`` per axis (see ``HSMLA._gate_pool_kernel``).
        conv_bias: ``(3C,)``; weight: the per-head projections ``(3, heads, d)``;
        gate_bias: ``(heads,)``.

    Returns:
        The gate, or ``None`` when the library is not built or the inputs are not of that
        kind (then the caller runs the PyTorch gate).
    """
    lib = _library()
    spatial = tuple(ms.shape[2:])
    tensors = (ms, taps, conv_bias, weight, gate_bias)
    if (
        lib is None
        or any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors)
        or ms.stride(1) != 1
        or any(n % block for n in spatial)
        or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
    ):
        return None
    pad = [1] * (3 - len(spatial))  # 2D maps: one plane, one tap
    tiles = [n // block for n in spatial]
    gate = torch.empty(ms.shape[0], *tiles)
    params = [t.contiguous() for t in (taps, conv_bias, weight, gate_bias)]
    status = lib.hsmla_block_gate(
        pointer(ms), int64s([ms.stride(0), *([0] * len(pad)), *ms.stride()[2:]]), ms.shape[0], ms.shape[1],
        int64s(pad + list(spatial)), int64s(pad + [block] * len(spatial)), int64s(pad + tiles),
        pointer(params[0]), int64s(pad + [block + 2] * len(spatial)), pointer(params[1]), pointer(params[2]),
        pointer(params[3]), weight.shape[1], pointer(gate),
    )
    if status:
        raise MemoryError("the CPU gate kernel could not allocate its scratch memory.")
    return gate
