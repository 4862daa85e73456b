"""What every kernel module shares: the guarded Triton import, deferred ``jit``, input checks.

Triton is optional (the reference path runs everywhere), so its import is guarded and nothing
here fails without it. Triton decides between compiling and interpreting a kernel when the
kernel is *decorated*, reading ``TRITON_INTERPRET`` at that moment; decorating at import time
would freeze that choice at whenever ``hsmla_med.kernels`` happened to be imported first.
:func:`lazy_jit` therefore decorates at the first launch, once per mode.

The same choice is made for triton.language's own ``@jit`` helpers (``tl.sum``, ``tl.max``,
``tl.zeros``) when triton is first imported, and torch or MONAI may import it before anyone sets
``TRITON_INTERPRET``; the interpreter cannot call helpers decorated for the compiler. The kernels
therefore use only builtins, which the interpreter patches at every launch: ``tl.full`` for
zeros, and ``tl.reduce`` with triton's standard combine functions (``_sum_combine``,
``_elementwise_max``), which the interpreter maps to NumPy reductions.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton: triton_available() says so and the kernels refuse to run
    triton = tl = None

__all__ = ["triton", "tl", "lazy_jit", "triton_available", "interpreting", "check_features", "dot_precision"]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 128  # the kernels keep d x d (linear) or tile x d (refine) float32 blocks in registers


def interpreting() -> bool:
    """Whether Triton would decorate a kernel for its interpreter now (``TRITON_INTERPRET``)."""
    knobs = getattr(triton, "knobs", None)  # recent triton parses the variable itself
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_available(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run on tensors on ``device``.

    True when triton is importable and either ``device`` is a CUDA device (with CUDA present)
    or ``TRITON_INTERPRET=1`` is set, in which case the interpreter runs them on any device.
    """
    if triton is None:
        return False
    if interpreting():
        return True
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


class lazy_jit:
    """``triton.jit`` applied at the first launch, once per interpreter mode; ``kernel[grid](...)``."""

    def __init__(self, fn):
        self.fn = fn
        self._by_mode = {}

    def __getitem__(self, grid):
        mode = interpreting()
        if mode not in self._by_mode:
            self._by_mode[mode] = triton.jit(self.fn)
        return self._by_mode[mode][grid]


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` precision for float32 operands: exact IEEE for float32 inputs (TF32's 10-bit
    mantissa would miss a 1e-4 tolerance), TF32 tensor cores for half inputs, whose own
    precision is no better."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_features(op: str, spatial_dims: tuple[int, ...], **tensors: torch.Tensor) -> torch.Tensor:
    """Validate ``(batch, heads, *spatial, head_dim)`` inputs of one op; returns the first.

    All tensors must share shape, dtype (float32/16, bfloat16) and device, have a spatial rank
    in ``spatial_dims`` and ``head_dim <= 128``; the device must run Triton, and no gradient may
    be required (the kernels have no backward: training uses the reference path).
    """
    name, ref = next(iter(tensors.items()))
    if ref.dim() - 3 not in spatial_dims:
        raise ValueError(
            f"{op}: {name} must have shape (batch, heads, *spatial, head_dim) with "
            f"{' or '.join(map(str, spatial_dims))} spatial dims, got {tuple(ref.shape)}."
        )
    for other, t in tensors.items():
        if t.shape != ref.shape or t.dtype != ref.dtype or t.device != ref.device:
            raise ValueError(
                f"{op}: {other} {tuple(t.shape)} {t.dtype} on {t.device} does not match "
                f"{name} {tuple(ref.shape)} {ref.dtype} on {ref.device}."
            )
    if ref.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: dtype must be one of {SUPPORTED_DTYPES}, got {ref.dtype}.")
    if ref.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"{op}: head_dim must be at most {MAX_HEAD_DIM}, got {ref.shape[-1]}.")
    if not triton_available(ref.device):
        raise RuntimeError(
            f"{op}: the Triton kernels need triton and a CUDA device (or TRITON_INTERPRET=1), "
            f"got tensors on {ref.device}; use hsmla_med.nn.functional instead."
        )
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors.values()):
        raise RuntimeError(f"{op}: the Triton kernels are inference-only (no backward); run under torch.no_grad().")
    return ref
