"""Process-wide CPU settings that the command line applies before it runs a network.

Threads and waiting (:func:`configure_cpu_threads`, applied by ``hsmla-med`` before torch
loads). PyTorch's CPU build runs its parallel regions on GNU OpenMP (``libgomp``), whose
threads spin at every barrier before they sleep. An HSMLA network runs many short regions, so
when other processes use the cores a spinning thread waits for one the kernel has descheduled,
and every barrier costs a time slice (HSMLA-B2 at 512^2 took 2.2-4.0 s beside other PyTorch
work instead of 107 ms). The spin is bounded with ``GOMP_SPINCOUNT``, and the thread count
follows the CPUs the process may use (its affinity and its cgroup's CPU quota, which OpenMP
ignores). libgomp reads its environment once, when torch loads it: a library user who
imports torch first sets these variables in the shell or calls :func:`configure_cpu_threads`
before ``import torch``.

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
import math
import os
import sys
import time
import warnings
from pathlib import Path

from hsmla_med.errors import ConfigError

__all__ = ["tune_cpu_allocator", "available_cpus", "configure_cpu_threads", "runnable_others", "FreeCPUs", "LoadAdaptiveThreads",
           "adaptive_threads_enabled", "applied_variables", "SPIN_COUNT", "MARK"]

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


#: ``GOMP_SPINCOUNT`` that hsmla-med sets where the environment leaves OpenMP's waiting to its
#: default (libgomp's 300000 spins, a few hundred microseconds): chosen from
#: ``hsmla-med bench --only contention`` (docs/benchmarks.md, "CPU contention")
SPIN_COUNT = 10000
#: variables through which a user (or a launcher) already decided how OpenMP threads wait
_WAIT_VARIABLES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "KMP_BLOCKTIME")
#: "NAME=VALUE;..." of the variables hsmla-med set, exported beside them: a child process that
#: inherits them (a DDP rank Lightning starts by running the command again) can tell them from a
#: user's own setting (:func:`applied_variables`; the benchmarks start their neighbours without them)
MARK = "HSMLA_MED_APPLIED"
_CGROUP = Path("/sys/fs/cgroup")


def _cgroup_quota(root: Path = _CGROUP) -> float | None:
    """CPUs allowed by the process's cgroup quota: cgroup v2 ``cpu.max`` ("QUOTA PERIOD" or
    "max PERIOD"), else v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; ``None`` when
    unlimited or unreadable. (Read by hand: neither os nor PyTorch reads cgroup quotas.)"""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def available_cpus(root: Path = _CGROUP) -> int:
    """The CPUs this process can use: those of its affinity mask, capped by its cgroup's CPU
    quota (rounded up: a quota of 1.5 CPUs keeps two threads busy part of the time), at least 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _cgroup_quota(root)
    return max(1, min(cpus, math.ceil(quota)) if quota is not None else cpus)


def configure_cpu_threads(environ=None, root: Path = _CGROUP) -> dict[str, str]:
    """Set, where ``environ`` (default ``os.environ``) does not already, how OpenMP threads wait
    (``GOMP_SPINCOUNT`` = :data:`SPIN_COUNT`, unless ``GOMP_SPINCOUNT``, ``OMP_WAIT_POLICY`` or
    ``KMP_BLOCKTIME`` is set) and how many there are (``OMP_NUM_THREADS`` = :func:`available_cpus`,
    only when a cgroup quota or the affinity mask leaves fewer CPUs than the machine has and
    ``OMP_NUM_THREADS`` is unset). ``HSMLA_MED_CPU_DEFAULTS=0`` turns both off.

    Effective only before torch (libgomp) loads; called later it warns and changes nothing.

    Beside them it exports :data:`MARK`, so that a child process started with this environment
    takes them for hsmla-med's, not the user's (:func:`applied_variables`).

    Returns:
        the variables it set.
    """
    environ = os.environ if environ is None else environ
    if environ.get("HSMLA_MED_CPU_DEFAULTS", "1") == "0":
        return {}
    if environ is os.environ and "torch" in sys.modules:
        warnings.warn("hsmla_med.runtime.configure_cpu_threads: torch is already loaded, so OpenMP keeps its settings; "
                      "call it before importing torch", RuntimeWarning, stacklevel=2)
        return {}
    applied = {}
    if not any(name in environ for name in _WAIT_VARIABLES):
        applied["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    cpus = available_cpus(root)
    if "OMP_NUM_THREADS" not in environ and cpus < (os.cpu_count() or cpus):
        applied["OMP_NUM_THREADS"] = str(cpus)
    inherited = applied_variables(environ)
    environ.update(applied)
    if applied or inherited:
        environ[MARK] = ";".join(f"{name}={value}" for name, value in {**inherited, **applied}.items())
    return applied


def applied_variables(environ=None) -> dict[str, str]:
    """The variables of ``environ`` (default ``os.environ``) that hsmla-med set, in this process
    or in the hsmla-med process that started it (:data:`MARK`), and that still hold the value it
    gave them; a user's own setting is never among them."""
    environ = os.environ if environ is None else environ
    pairs = (item.partition("=") for item in environ.get(MARK, "").split(";") if item)
    return {name: value for name, _, value in pairs if environ.get(name) == value}


_PROC = Path("/proc")


def _own_running(proc: Path) -> int:
    """Threads of this process in state R (running or runnable), from ``proc/self/task/*/stat``:
    the field after the parenthesised command name, which may itself hold spaces or ')'."""
    running = 0
    for stat in (proc / "self" / "task").glob("*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the thread ended between the listing and the read
            continue
        running += text.rpartition(")")[2].split()[:1] == ["R"]
    return running


def runnable_others(proc: Path = _PROC, samples: int = 3, gap: float = 5e-4) -> int | None:
    """Runnable threads on the machine that are not this process's: the kernel's count of
    runnable tasks (the fourth field of ``/proc/loadavg``, "running/total") less this process's
    threads in state R; the least of ``samples`` readings ``gap`` seconds apart, so that a thread
    caught between a wake-up and its sleep (a worker finishing its spin) is not taken for load.
    ``None`` where ``/proc`` cannot tell (not Linux)."""
    counts = []
    for i in range(samples):
        if i:
            time.sleep(gap)
        try:
            running = int((proc / "loadavg").read_text().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return None
        counts.append(max(0, running - _own_running(proc)))
    return min(counts)


class FreeCPUs:
    """The CPUs that other processes' runnable threads leave free on this machine, at least one
    (``None`` where ``/proc`` cannot tell): called, it reads the load at most every ``interval``
    seconds (:func:`runnable_others`, about 1 ms) and otherwise returns the last reading, so a
    stream of small windows pays for one reading per interval. The machine's CPU count
    (``os.cpu_count()``) is what the others' threads are counted against: a container's quota
    caps our share of the machine but does not reserve it. The one reading behind
    :class:`LoadAdaptiveThreads` (the CLI's prediction) and
    :class:`~hsmla_med.nn.threads.FreeCPUThreads` (library use)."""

    def __init__(self, interval: float = 0.5, proc: Path = _PROC) -> None:
        self.interval, self.proc = interval, proc
        self.cpus = os.cpu_count() or 1
        self._next, self._free = 0.0, None

    def __call__(self) -> int | None:
        if time.monotonic() >= self._next:
            others = runnable_others(self.proc)
            self._free = None if others is None else max(1, self.cpus - others)
            self._next = time.monotonic() + self.interval
        return self._free


class LoadAdaptiveThreads:
    """A forward pre-hook that lowers PyTorch's intra-op threads, before a CPU forward, to the
    CPUs that other processes' runnable threads leave free (:class:`FreeCPUs`: at least one, at
    most ``threads``, PyTorch's count when it was made), and raises them again when the load goes.

    Why: an HSMLA network runs hundreds of short parallel regions per forward, and
    each ends at a barrier where every thread of the team must have run. Beside processes that
    keep the CPUs busy, one of our threads is often descheduled there, and the region lasts until
    the scheduler gives it a time slice: two threads then do worse than one (HSMLA-B2 at 512^2
    beside one neighbour of two busy threads: 572 ms with two threads, 387 ms with one; beside
    two: 938 against 763, docs/benchmarks.md). libgomp's own ``OMP_DYNAMIC`` follows the
    one-minute load average, which lags the load by a minute.
    """

    def __init__(self, threads: int | None = None, interval: float = 0.5, proc: Path = _PROC) -> None:
        import torch

        self.threads = threads or torch.get_num_threads()
        self.free = FreeCPUs(interval, proc)

    def choose(self) -> int:
        """Threads for the load (``threads`` where the load cannot be read), read at most every
        ``interval`` seconds."""
        free = self.free()
        return self.threads if free is None else min(self.threads, free)

    def __call__(self, module, args) -> None:
        import torch

        if any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args):
            self.apply()

    def apply(self) -> None:
        """Set PyTorch's threads to :meth:`choose`'s count."""
        import torch

        chosen = self.choose()
        if chosen != torch.get_num_threads():  # also where something else set them since
            torch.set_num_threads(chosen)


def adaptive_threads_enabled(environ=None) -> bool:
    """Whether hsmla-med's prediction uses :class:`LoadAdaptiveThreads`: unless
    ``HSMLA_MED_ADAPTIVE_THREADS=0`` or ``HSMLA_MED_CPU_DEFAULTS=0``."""
    environ = os.environ if environ is None else environ
    return environ.get("HSMLA_MED_ADAPTIVE_THREADS", "1") != "0" and environ.get("HSMLA_MED_CPU_DEFAULTS", "1") != "0"
