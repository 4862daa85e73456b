"""A network run as captured CUDA graphs, one per input shape: :class:`GraphedCallable`.

A batch-1 forward of a small network on a GPU is bound by the host launching its kernels, not by
the arithmetic (HSMLA-B2 at 512²: some 300 launches, docs/benchmarks.md). Sliding-window and
whole-slide inference call the network on a handful of fixed shapes (the window batch, the last
smaller batch, the patch batch), so each shape is captured once into a CUDA graph
(``torch.cuda.CUDAGraph``) and replayed: the host then launches one graph instead of hundreds of
kernels. ``torch.compile(mode="reduce-overhead")`` does the same after compiling, which costs
tens of seconds per shape at start-up; capturing the eager forward costs two warm-up forwards.

What the capture needs from the network (checked by ``tests/test_graph_ready.py``): no host sync
and no shape that depends on values in a forward (the HSMLA layers keep the gate's tile selection
on the device), and tensors derived from the weights (folded BatchNorm, merged multi-scale
kernels) built in the warm-up, not in the captured forward.

Written by hand: MONAI and Lightning have no CUDA graph runner for inference, and
``torch.cuda.make_graphed_callables`` is for training (it records backward graphs and requires
``requires_grad`` inputs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = ["GraphedCallable", "weights_version"]

log = logging.getLogger("hsmla_med")

#: forwards run on a side stream before a capture: the first builds the caches (folded weights,
#: Triton's compiled kernels, cuDNN's plans), the second runs as the capture will
WARMUP = 2


def weights_version(module: torch.nn.Module) -> tuple:
    """What a captured graph depends on besides its input: every parameter's and buffer's storage
    and version counter. A graph reads the weights where they lie, but tensors derived from them
    (a folded BatchNorm) are copies made before the capture; an optimizer step or loaded weights
    change this, and the graphs are captured again."""
    return tuple((t.data_ptr(), _version(t)) for t in (*module.parameters(), *module.buffers()))


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter; ``None`` for an inference tensor (made under
    ``torch.inference_mode``), which has none."""
    try:
        return t._version
    except RuntimeError:
        return None


def _autocast_state(device: torch.device) -> tuple:
    if not torch.is_autocast_enabled(device.type):
        return (False,)
    return True, torch.get_autocast_dtype(device.type)


class _Entry:
    """One captured shape: the graph, its static inputs and outputs, and what restores the
    module state its capture left (``restore``)."""

    def __init__(self, replay: Callable[[], None], inputs: list[torch.Tensor], outputs: Any) -> None:
        self.replay, self.inputs, self.outputs = replay, inputs, outputs
        self.restore: Callable[[], None] | None = None


def _capture(fn: Callable, inputs: tuple[torch.Tensor, ...], pool) -> _Entry:
    """Warm ``fn`` up on a side stream and capture it into a CUDA graph on static copies of
    ``inputs`` (the only part of this module that needs CUDA)."""
    device = inputs[0].device
    static = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device).copy_(x) for x in inputs]
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            fn(*static)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # autocast's cache of cast weights would hand the capture tensors of the warm-up's memory
    state = _autocast_state(device)
    recast = torch.autocast(device.type, dtype=state[1], cache_enabled=False) if state[0] else nullcontext()
    with recast, torch.cuda.graph(graph, pool=pool):
        outputs = fn(*static)
    return _Entry(graph.replay, static, outputs)


class GraphedCallable:
    """``fn(*tensors)`` replayed from a CUDA graph captured per input shape, dtype, strides and
    autocast state; ``fn`` itself wherever a graph does not apply.

    A call is graphed when every input is a CUDA tensor, gradients are off and the runner is
    enabled; the inputs are copied into the graph's static inputs, the graph is replayed and its
    outputs (a tensor or a tuple/list/dict of them) are returned as fresh copies, so that a later
    replay does not overwrite what a caller holds. State that ``fn`` leaves on modules during the
    capture (an HSMLA layer's ``last_gate``) is the graph's own memory, refilled by every replay;
    a replay runs no Python, so ``state`` (called right after each capture) returns a function
    that puts that state back, and every replay calls it: after a call the modules describe that
    call, whichever shape was replayed or ran eagerly before.

    When ``version`` (e.g. ``lambda: weights_version(net)``) returns something new, every graph is
    dropped and captured again. A capture that fails (an operation that a graph cannot hold) is
    logged once and the runner runs ``fn`` eagerly from then on.

    Args:
        fn: the function to run (a network in eval mode, or a function of one).
        version: what the graphs depend on besides the inputs; ``None``: nothing.
        enabled: ``False`` always runs ``fn`` (``--no-cuda-graphs``).
        state: called after a capture, returns the function that restores the module state
            the captured call left (e.g. :func:`hsmla_med.nn.gate_snapshot` of the network).
        after: called with the inputs after every call, replayed or eager, once the modules
            describe it (e.g. to count the tiles the gates refined).
    """

    def __init__(self, fn: Callable, version: Callable[[], Any] | None = None, enabled: bool = True,
                 state: Callable[[], Callable[[], None]] | None = None, after: Callable[[], None] | None = None) -> None:
        self.fn, self.version, self.enabled, self.state, self.after = fn, version, enabled, state, after
        self.failed = False  # a capture failed: eager from then on
        self._graphs: dict[tuple, _Entry] = {}
        self._version = None
        self._pool = None

    def graphed(self, inputs: tuple) -> bool:
        """Whether a call on ``inputs`` replays a graph."""
        return (
            self.enabled
            and not self.failed
            and bool(inputs)
            and all(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in inputs)
            and not torch.is_grad_enabled()
        )

    def __call__(self, *inputs):
        outputs = self._run(inputs)
        if self.after is not None:
            self.after(*inputs)
        return outputs

    def _run(self, inputs: tuple):
        if not self.graphed(inputs):
            return self.fn(*inputs)
        if self.version is not None:
            version = self.version()
            if version != self._version:
                self._graphs.clear()
                self._version = version
        key = (
            tuple((tuple(x.shape), x.stride(), x.dtype, x.device) for x in inputs),
            _autocast_state(inputs[0].device),
            torch.is_inference_mode_enabled(),  # static inputs made in inference mode take copies only there
        )
        entry = self._graphs.get(key)
        if entry is None:
            try:
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                entry = _capture(self.fn, inputs, self._pool)
                entry.restore = self.state() if self.state is not None else None
                self._graphs[key] = entry
            except Exception as error:  # noqa: BLE001 - any capture failure: run eagerly, say why once
                log.warning("CUDA graph capture of %s failed (%s: %s); running it eagerly", _name(self.fn), type(error).__name__, error)
                self.failed = True
                self._graphs.clear()
                return self.fn(*inputs)
            log.debug("captured a CUDA graph of %s for inputs %s", _name(self.fn), [tuple(x.shape) for x in inputs])
        for static, x in zip(entry.inputs, inputs):
            static.copy_(x)
        entry.replay()
        if entry.restore is not None:
            entry.restore()
        return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, entry.outputs)

    @property
    def captured(self) -> int:
        """The number of graphs held (one per input shape seen)."""
        return len(self._graphs)


def _name(fn: Callable) -> str:
    return type(fn).__name__ if isinstance(fn, torch.nn.Module) else getattr(fn, "__name__", repr(fn))
