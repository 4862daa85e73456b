"""Building the package's C kernels with the system C compiler, at first use.

PyTorch's extension builder needs the PyTorch headers (a minute of compiling on two cores), so
the kernels are plain C called through :mod:`ctypes`. ``$CC`` (default ``cc``) builds each
source once per source, compiler and CPU (``-O3 -march=native``) into
``$HSMLA_MED_CACHE_DIR`` (default ``~/.cache/hsmla-med/kernels``, beside the synthetic
datasets), in about a second. OpenMP regions run on torch's own threads: the libraries'
``libgomp.so.1`` resolves to the one torch has loaded. Without a compiler, or with
``HSMLA_MED_CPU_KERNEL=0``, :func:`library` returns ``None`` and the callers run their PyTorch
reference.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import warnings
from pathlib import Path

import torch

__all__ = ["library", "int64s", "pointer"]

FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-std=c11", "-fPIC", "-shared")


def _cache_dir() -> Path:
    if os.environ.get("HSMLA_MED_CACHE_DIR"):
        return Path(os.environ["HSMLA_MED_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hsmla-med" / "kernels"


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: a cache shared by different machines (a cluster's
    home directory) keeps one library per CPU kind."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return platform.machine() + "\n".join(sorted(set(lines)))


@functools.lru_cache(maxsize=None)
def library(name: str) -> ctypes.CDLL | None:
    """``kernels/<name>.c`` built and loaded, or ``None`` (with a warning when a build was
    attempted and failed)."""
    if os.environ.get("HSMLA_MED_CPU_KERNEL", "1") == "0":
        return None
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        warnings.warn(f"no C compiler ({compiler!r}): HSMLA attention runs its slower PyTorch reference on the CPU.")
        return None
    source = Path(__file__).with_name(f"{name}.c")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256("\0".join([source.read_text(), " ".join(FLAGS), version, _cpu_signature()]).encode())
        target = _cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
            built = subprocess.run(
                [compiler, *FLAGS, "-o", str(partial), str(source), "-lm"], capture_output=True, text=True, timeout=300
            )
            if built.returncode:
                partial.unlink(missing_ok=True)
                raise OSError(f"{compiler} exited with {built.returncode}: {built.stderr.strip()[-2000:]}")
            os.replace(partial, target)  # atomic: a concurrent process sees the whole file or none
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as err:
        warnings.warn(f"the C kernel {name} could not be built ({err}); using the PyTorch reference.")
        return None


def int64s(values) -> ctypes.Array:
    """A C ``int64_t`` array of ``values``."""
    return (ctypes.c_int64 * len(values))(*values)


def pointer(t: torch.Tensor, ctype=ctypes.c_float):
    """A C pointer to ``t``'s first element (the tensor must stay alive during the call)."""
    return ctypes.cast(t.data_ptr(), ctypes.POINTER(ctype))
