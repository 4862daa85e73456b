"""Building the package's C kernels with the system C compiler, at first use.

The kernels are plain C11 called through :mod:`ctypes` (they take pointers and strides, no
PyTorch headers). ``$CC`` (default ``cc``) builds each
source once per source, compiler and CPU (``-O3 -march=native``) into
``$HSMLA_MED_CACHE_DIR`` (default ``~/.cache/hsmla-med/kernels``, beside the synthetic
datasets), in about a second. OpenMP regions run on torch's own threads: the libraries'
``libgomp.so.1`` resolves to the one torch has loaded. Without a compiler, or with
``HSMLA_MED_CPU_KERNEL=0``, :func:`library` returns ``None`` (:func:`failure` says why) and the
callers run their PyTorch reference.

Loading a library runs its code in this process, so a cached one is loaded only when

- the cache folder belongs to this user and neither group nor others may write to it (else
  the library is built into a private temporary folder, loaded from there and deleted, with
  one warning per folder), and
- it is the file this process's build wrote: each build records the SHA-256 of the library in
  a sidecar ``<library>.sha256`` (written before the library is moved into place, each by an
  atomic rename), and both files must belong to this user, be writable by no one else and
  agree. A library without its sidecar is rebuilt; one that does not match it (or whose
  sidecar is not a checksum at all) is rebuilt with a warning, and so is one that matches but
  does not load (a damaged file).

A cache folder that cannot be made or written (an unwritable or missing home) is treated like
an untrusted one: the kernels are built privately at every start, with one warning, rather than
giving up the kernels or failing.

``torch.utils.cpp_extension.load`` was tried instead of this builder (docs/design.md §4.2): it
compiles every source as C++ (these C11 kernels do not compile as C++ as they are), needs
``ninja`` besides the compiler, and decides what to rebuild from ninja's timestamps, which know
neither the compiler's version nor the CPU and trust any file in the folder; the checks above
would all stay, so it would replace only the one compiler call of :func:`_build`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

__all__ = ["library", "failure", "int64s", "pointer"]

FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-std=c11", "-fPIC", "-shared")
_failures: dict[str, str] = {}  # name -> why library(name) is None
_unusable_warned: set[str] = set()  # cache folders already warned about


def _cache_dir() -> Path:
    if os.environ.get("HSMLA_MED_CACHE_DIR"):
        return Path(os.environ["HSMLA_MED_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hsmla-med" / "kernels"


def _usable_cache() -> tuple[Path | str, str | None]:
    """The cache folder (created if missing) and why it cannot be used, or ``None``."""
    try:
        folder = _cache_dir()
    except RuntimeError as err:  # Path.home(): no HOME and no password entry
        return "~/.cache/hsmla-med/kernels", f"no home folder: {err}"
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as err:
        return folder, f"it cannot be created: {err.strerror or err}"
    if not os.access(folder, os.W_OK | os.X_OK):
        return folder, "it is not writable"
    problem = _not_private(folder)
    return folder, problem and f"it is not trusted: {problem}"


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: a cache shared by different machines (a cluster's
    home directory) keeps one library per CPU kind."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return platform.machine() + "\n".join(sorted(set(lines)))


def _not_private(path: Path) -> str | None:
    """Why another user could change ``path`` (a file or folder), or ``None``: it must belong to
    this user and not be writable by group or others."""
    info = path.stat()
    if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
        return f"it belongs to user id {info.st_uid}, not to this user ({os.geteuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"group or others may write to it (mode {stat.filemode(info.st_mode)})"
    return None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _sidecar(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _check_cached(target: Path) -> str | None:
    """Why the cached ``target`` may not be loaded, or ``None`` when it is the library its build
    recorded (see the module's docstring)."""
    sidecar = _sidecar(target)
    if not sidecar.exists():
        return "no checksum was recorded for it"
    for path in (target, sidecar):
        problem = _not_private(path)
        if problem:
            return f"{path.name}: {problem}"
    if sidecar.read_bytes().strip() != _sha256(target).encode():
        return "it does not match the checksum recorded when it was built"
    return None


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    partial.write_text(text)
    os.chmod(partial, 0o644)
    os.replace(partial, path)


def _build(compiler: str, source: Path, target: Path) -> None:
    """Compile ``source`` into ``target``, its checksum into the sidecar first."""
    partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        built = subprocess.run(
            [compiler, *FLAGS, "-o", str(partial), str(source), "-lm"], capture_output=True, text=True, timeout=300
        )
        if built.returncode:
            raise OSError(f"{compiler} exited with {built.returncode}: {built.stderr.strip()[-2000:]}")
        os.chmod(partial, 0o755)
        _write_atomically(_sidecar(target), _sha256(partial) + "\n")
        os.replace(partial, target)  # atomic: a concurrent process sees the whole file or none
    finally:
        partial.unlink(missing_ok=True)


def _load_private(compiler: str, source: Path, name: str) -> ctypes.CDLL:
    """Build into a fresh folder only this user can open, load, delete the folder (the loaded
    library stays mapped)."""
    folder = Path(tempfile.mkdtemp(prefix="hsmla-med-kernels-"))
    try:
        target = folder / f"{name}.so"
        _build(compiler, source, target)
        return ctypes.CDLL(str(target))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _load_cached(compiler: str, source: Path, target: Path) -> ctypes.CDLL:
    """``target`` loaded from the cache, (re)built first unless it is the library its build
    recorded; a recorded one that does not load is rebuilt once."""
    problem = _check_cached(target) if target.exists() else "not built yet"
    if problem and _sidecar(target).exists():
        warnings.warn(f"not loading the cached kernel {target} ({problem}); rebuilding it.")
    if problem:
        _build(compiler, source, target)
    try:
        return ctypes.CDLL(str(target))
    except OSError as err:
        if problem:  # built just now: the build itself is broken
            raise
        warnings.warn(f"the cached kernel {target} does not load ({err}); rebuilding it.")
        _build(compiler, source, target)
        return ctypes.CDLL(str(target))


def failure(name: str) -> str | None:
    """Why :func:`library` returned ``None`` for ``name`` (``None`` if it was not asked or
    succeeded)."""
    return _failures.get(name)


@functools.lru_cache(maxsize=None)
def library(name: str) -> ctypes.CDLL | None:
    """``kernels/<name>.c`` built and loaded, or ``None`` (with a warning when a build was
    attempted and failed; :func:`failure` gives the reason)."""
    _failures.pop(name, None)
    if os.environ.get("HSMLA_MED_CPU_KERNEL", "1") == "0":
        _failures[name] = "the C kernels are switched off (HSMLA_MED_CPU_KERNEL=0)"
        return None
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        _failures[name] = f"no C compiler ({compiler!r}) to build it"
        warnings.warn(f"no C compiler ({compiler!r}): HSMLA attention runs its slower PyTorch reference on the CPU.")
        return None
    source = Path(__file__).with_name(f"{name}.c")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # the kernels' shared header (cpu_team.h)
        key = hashlib.sha256("\0".join([source.read_text(), *headers, " ".join(FLAGS), version, _cpu_signature()]).encode())
        folder, problem = _usable_cache()
        if problem:
            if str(folder) not in _unusable_warned:
                _unusable_warned.add(str(folder))
                warnings.warn(
                    f"the kernel cache {folder} cannot be used ({problem}): the C kernels are built into a "
                    "private temporary folder at every start instead; make the folder private and writable "
                    "(chmod go-w) or point HSMLA_MED_CACHE_DIR elsewhere."
                )
            return _load_private(compiler, source, name)
        return _load_cached(compiler, source, folder / f"{name}-{key.hexdigest()[:16]}.so")
    except (OSError, subprocess.SubprocessError) as err:
        _failures[name] = f"it could not be built ({err})"
        warnings.warn(f"the C kernel {name} could not be built ({err}); using the PyTorch reference.")
        return None


def int64s(values) -> ctypes.Array:
    """A C ``int64_t`` array of ``values``."""
    return (ctypes.c_int64 * len(values))(*values)


def pointer(t: torch.Tensor, ctype=ctypes.c_float):
    """A C pointer to ``t``'s first element (the tensor must stay alive during the call)."""
    return ctypes.cast(t.data_ptr(), ctypes.POINTER(ctype))
