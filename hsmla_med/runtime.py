"""Process-wide CPU settings that the command line applies before it runs a network.

PyTorch's CPU allocator keeps no cache: every tensor is a fresh ``malloc``. glibc serves large
blocks (above a threshold that adapts up to 32 MiB) with new ``mmap`` regions and gives freed
memory back to the system, so every forward pass page-faults and zero-fills its large maps again.
On a 256 x 256 map of 128 channels that doubled the time of one HSMLA layer and of a plain 1x1
convolution (docs/benchmarks.md). Keeping a pad of freed memory at the top of the heap lets
later tensors reuse pages that are already mapped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from hsmla_med.errors import ConfigError

__all__ = ["tune_cpu_allocator"]

# glibc mallopt parameters
_M_TOP_PAD, _M_MMAP_THRESHOLD = -2, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc refuses larger thresholds on 64-bit
DEFAULT_TOP_PAD = 1 << 30


def _top_pad_variable() -> int:
    """``HSMLA_MED_MALLOC_TOP_PAD`` in bytes (default 1 GiB)."""
    text = os.environ.get("HSMLA_MED_MALLOC_TOP_PAD", str(DEFAULT_TOP_PAD))
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"HSMLA_MED_MALLOC_TOP_PAD={text!r}: not a whole number of bytes (0 keeps glibc's behaviour)") from None


def tune_cpu_allocator(top_pad: int | None = None) -> bool:
    """Keep up to ``top_pad`` bytes (default 1 GiB, or ``HSMLA_MED_MALLOC_TOP_PAD``) of freed
    heap memory mapped for reuse (glibc ``M_TOP_PAD``), and serve blocks up to 32 MiB from the
    heap (``M_MMAP_THRESHOLD``): the heap then grows by the pad at once, and larger blocks are
    carved from it too. Resident memory may stay up to the pad above the live tensors;
    ``HSMLA_MED_MALLOC_TOP_PAD=0`` keeps glibc's behaviour.

    Does nothing off glibc, or when the environment already configures glibc malloc
    (``MALLOC_*_`` variables or ``GLIBC_TUNABLES``): the user's or a caller's choice wins.

    Returns:
        whether the setting was applied.

    Raises:
        ConfigError: ``HSMLA_MED_MALLOC_TOP_PAD`` is not a whole number of bytes.
    """
    if top_pad is None:
        top_pad = _top_pad_variable()
    if top_pad <= 0 or "GLIBC_TUNABLES" in os.environ or any(k.startswith("MALLOC_") for k in os.environ):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        if not libc.gnu_get_libc_version:
            return False
        pad = ctypes.c_int(min(top_pad, 2**31 - 1))
        return bool(libc.mallopt(_M_TOP_PAD, pad) and libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(_MMAP_THRESHOLD_MAX)))
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): leave the allocator alone
        return False
