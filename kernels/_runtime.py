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

import functools
import os
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton: triton_available() says so and the kernels refuse to run
    triton = tl = None

__all__ = [
    "triton",
    "tl",
    "lazy_jit",
    "triton_available",
    "triton_unsupported",
    "interpreting",
    "check_features",
    "dot_precision",
    "LaunchConfig",
    "KernelSpec",
    "shared_memory_limit",
    "signature",
]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 128  # the kernels keep d x d (linear) or tile x d (refine) float32 blocks in registers
TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
DEFAULT_NUM_STAGES = 3  # Triton's own default on CUDA: loads of a loop prefetched two steps ahead


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


def triton_unsupported(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the Triton kernels would refuse features on ``device`` of ``dtype`` with ``head_dim``
    channels per head, or ``None`` when they take them (gradients aside: they have no backward)."""
    if triton is None:
        return "triton is not installed"
    if not triton_available(device):
        return f"the Triton kernels need a CUDA device (or TRITON_INTERPRET=1), the features are on {device}"
    if dtype not in SUPPORTED_DTYPES:
        return f"the Triton kernels take {', '.join(str(t) for t in SUPPORTED_DTYPES)}, got {dtype}"
    if head_dim > MAX_HEAD_DIM:
        return f"the Triton kernels take head_dim up to {MAX_HEAD_DIM}, got {head_dim}"
    return None


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

    @property
    def name(self) -> str:
        return self.fn.__name__

    def jit_function(self):
        """The kernel as the compiler sees it (a ``triton.JITFunction``) whatever ``TRITON_INTERPRET``
        says: what :func:`triton.compile` takes to build it for a target without a GPU."""
        if self._by_mode.get(False) is None:
            self._by_mode[False] = triton.runtime.jit.JITFunction(self.fn)
        return self._by_mode[False]


class LaunchConfig(NamedTuple):
    """The compile-time part of one kernel launch: constexpr arguments, ``num_warps``, ``num_stages``.

    Each kernel module computes it in one function, used by its launch and by
    ``tests/test_triton_compile.py``, which compiles exactly these for sm_75/80/90 and checks the
    shared memory against each target's limit and against ``shared_estimate``, the upper bound
    the module chose the block sizes by.
    """

    constexprs: dict
    num_warps: int
    num_stages: int
    shared_estimate: int  # bytes; an upper bound of what Triton allocates (checked by the test)

    @property
    def options(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}

    @property
    def launch_kwargs(self) -> dict:
        return {**self.constexprs, **self.options}


class KernelSpec(NamedTuple):
    """One kernel with the argument types and launch configuration it is compiled for."""

    kernel: lazy_jit
    signature: dict  # argument name -> Triton type ("*fp32", "i32", "fp32", "constexpr")
    config: LaunchConfig


def signature(kernel: lazy_jit, dtype: torch.dtype, **types: str) -> dict:
    """Triton argument types of ``kernel`` launched on ``dtype`` tensors: ``*_ptr`` arguments point
    to ``dtype``, constexprs are ``"constexpr"``, every other argument is ``i32`` unless
    ``types`` names it (``z_ptr="*fp32"``, ``eps="fp32"``)."""
    fn = kernel.jit_function()
    sig = {}
    for param in fn.params:
        if param.is_constexpr:
            sig[param.name] = "constexpr"
        elif param.name in types:
            sig[param.name] = types[param.name]
        elif param.name.endswith("_ptr"):
            sig[param.name] = "*" + TRITON_TYPES[dtype]
        else:
            sig[param.name] = "i32"
    unknown = set(types) - set(sig)
    if unknown:
        raise ValueError(f"{kernel.name} has no arguments {sorted(unknown)}")
    return sig


def shared_memory_limit(device: torch.device | str) -> int | None:
    """Bytes of shared memory one program may use on ``device``: the per-block opt-in maximum,
    which Triton requests for kernels above the 48 KiB default and checks at launch (64 KiB on
    sm_75, 163 KiB on sm_80, 99 KiB on sm_86/89, 227 KiB on sm_90). ``None`` off CUDA: the
    interpreter has no limit."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return _cuda_shared_memory(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_shared_memory(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block)


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
