"""The CPU threads of an inference forward, for library users: on the CPUs other processes
leave free, so that a thread their load deschedules does not hold up every barrier of the forward.
:mod:`hsmla_med.runtime` holds the process-wide settings and the reading of the load; this holds
the forward hooks, beside the networks that carry them (they need torch, which the runtime must
not import: it configures OpenMP before torch loads)."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from hsmla_med import runtime

__all__ = ["FreeCPUThreads"]


class FreeCPUThreads:
    """:class:`~hsmla_med.runtime.LoadAdaptiveThreads` for library use: a forward pre-hook and a
    forward hook that run a CPU inference forward (not in training, not while a tracer records
    it) on the CPUs that other processes' runnable threads leave free, at most the caller's count,
    and put the caller's count back after it (also when the forward raises), so a user's
    ``torch.set_num_threads`` and the rest of their program are left as they were.

    Every HSMLA network carries one (:class:`~hsmla_med.nn.hsmla_net.GatedNetwork`), so a
    script that calls the network directly gets what ``hsmla-med``'s prediction does (beside
    a background ``hsmla-med train ... &``, HSMLA-B2 took 4.1-4.5x its quiet time with two
    threads and 1.6-2.3x with these hooks, docs/benchmarks.md). ``HSMLA_MED_ADAPTIVE_THREADS=0`` (or
    ``HSMLA_MED_CPU_DEFAULTS=0``) turns it off, read at each forward.

    hsmla-med's own prediction keeps :class:`~hsmla_med.runtime.LoadAdaptiveThreads`, whose
    lowered count stays set between forwards until the prediction ends, so that the sliding-window
    inferer's own operations (padding, the weighted sums of the windows) run on the free CPUs too;
    a library call has no such end to restore at, hence the count put back after every forward.
    """

    def __init__(self, interval: float = 0.5, proc: Path = Path("/proc")) -> None:
        self.free = runtime.FreeCPUs(interval, proc)  # called: the free CPUs, read at most every interval
        # per calling thread: the counts to put back, innermost last (a dict, not threading.local:
        # a network that carries the hooks is deep-copied and pickled with them)
        self._saved: dict[int, list[int]] = {}

    @staticmethod
    def _recorded() -> bool:
        """A tracer records the forward (``torch.compile``, ``torch.export``, ``torch.jit.trace``):
        the hooks then do nothing, so that its graph holds no host reading and no break."""
        return torch.jit.is_tracing() or torch.compiler.is_compiling() or torch.compiler.is_exporting()

    def before(self, module, args) -> None:
        if self._recorded():
            return
        stack = self._saved.setdefault(threading.get_ident(), [])
        threads = torch.get_num_threads()
        stack.append(threads)
        if module.training or not runtime.adaptive_threads_enabled() or not any(
                isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args):
            return
        free = self.free()
        if free is not None and free < threads:
            torch.set_num_threads(free)

    def after(self, module, args, output) -> None:
        if self._recorded():
            return
        stack = self._saved.get(threading.get_ident())
        if stack:
            if torch.get_num_threads() != stack[-1]:
                torch.set_num_threads(stack[-1])
            stack.pop()

    def install(self, module) -> list:
        """Register both hooks on ``module``; returns their handles. A network compiled by
        ``torch.compile`` runs its hooks inside the compiled code, where they do nothing: install
        them on the compiled module (``install(torch.compile(net))``), whose own hooks run around it."""
        return [module.register_forward_pre_hook(self.before), module.register_forward_hook(self.after, always_call=True)]
