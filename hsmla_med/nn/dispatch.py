"""Which backend an HSMLA layer runs for one call, and why: :func:`select_backend`.

The layer asks once per call (and :meth:`~hsmla_med.nn.HSMLA.gate` once for itself); every
rule of the choice is here, and each choice is logged at DEBUG level on the ``hsmla_med``
logger with its reason.

This is the one place where :mod:`hsmla_med.nn` chooses among the attention kernels of
:mod:`hsmla_med.kernels`, through that package's public names only. The kernels import nothing
of :mod:`hsmla_med.nn` (their references are :mod:`hsmla_med.ops_reference`, which
:mod:`hsmla_med.nn.functional` imports too): the arrow runs from the networks down.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch

from hsmla_med import kernels
from hsmla_med.nn import functional as HF

__all__ = ["BACKENDS", "BackendChoice", "select_backend"]

#: ``auto``: at inference the C kernels on the CPU and the Triton kernels on CUDA, the reference
#: in training, with gradients, or for inputs the kernels do not take; ``reference``, ``cpu`` and
#: ``triton`` force one, and a forced kernel backend that cannot run raises. ``dense``: the
#: reference linear attention and ``R`` for every token from
#: :func:`~hsmla_med.nn.functional.dense_refine`, masked by the gate (``O_lin + [M > tau] * M * R``):
#: static shapes and no data-dependent indexing, for ONNX/TorchScript export; it always runs,
#: with work and memory growing as ``N**2`` tokens per map.
BACKENDS = ("auto", "reference", "triton", "cpu", "dense")

log = logging.getLogger("hsmla_med")


class BackendChoice(NamedTuple):
    """What one call runs.

    Attributes:
        backend: ``"reference"`` (:mod:`hsmla_med.nn.functional`), ``"cpu"`` (the C refinement
            kernel and, on maps of whole tiles, the C gate), ``"triton"`` (the Triton linear
            attention and 2D refinement kernels) or ``"dense"`` (the reference linear attention
            and :func:`~hsmla_med.nn.functional.dense_local_refine`: static shapes, for export).
        reason: why, in words.
        dense: the reference computes ``R`` for every token with
            :func:`~hsmla_med.nn.functional.dense_refine` (gradients on a small map) rather
            than the tile schedule.
        interpreter: ``triton`` on a device other than CUDA, under Triton's interpreter
            (``TRITON_INTERPRET=1``, for tests): the layer calls the Triton functions directly,
            since the registered ops would dispatch those tensors to their CPU implementations.
        as_op: ``reference`` at inference while ``torch.compile`` or ``torch.export`` traces:
            the refinement runs as ``torch.ops.hsmla.local_refine`` (whose implementation is
            the reference for these inputs), since the reference's tile list (``nonzero``) has
            a data-dependent shape that breaks the graph.
    """

    backend: str
    reason: str
    dense: bool = False
    interpreter: bool = False
    as_op: bool = False

    def ops(self):
        """``(linear_attention, local_refine)`` of this backend, looked up now (so that a
        patched module attribute is seen). The ``cpu`` and ``triton`` backends run the
        registered custom ops (``torch.ops.hsmla.*``, :mod:`hsmla_med.kernels.ops`): one graph
        node each for ``torch.compile`` and ``torch.export``, whose CPU implementations run the
        C kernels and CUDA implementations the Triton kernels. (The ``cpu`` backend's linear
        attention is the reference itself: there is no C kernel for it, its PyTorch operations
        trace as they are, and the op would only add its dispatch, ~25 us per call.)"""
        if self.backend == "reference":
            return HF.linear_attention, (kernels.local_refine_op if self.as_op else HF.local_refine)
        if self.backend == "dense":
            return HF.linear_attention, HF.dense_local_refine
        if self.interpreter:
            return kernels.linear_attention, kernels.local_refine
        if self.backend == "cpu":
            return HF.linear_attention, kernels.local_refine_op
        return kernels.linear_attention_op, kernels.local_refine_op

    def attend(self):
        """The inference computation ``O_lin + [M > tau] * M * R`` of this backend as one callable
        ``attend(q, k, v, qh, kh, vh, gate, tau, refine, block, window, eps)`` (``refine``
        False: ``O_lin`` alone, routing ``off``; ``gate`` None with ``refine``: ``R`` on every
        tile at weight 1, routing ``all``).

        ``triton`` runs the fused custom op ``torch.ops.hsmla.attention``
        (:func:`hsmla_med.kernels.attention_op`): the linear attention's two kernels and one
        refinement kernel that reads the gate and ``tau`` on the device, skips inactive tiles and
        adds ``M * R`` into the linear output in place: three launches, no host sync, a launch
        grid fixed by the shapes (what a CUDA graph needs). Under the interpreter the same
        function runs without the op. The other backends compose their two ops
        (:meth:`ops`)."""
        if self.backend == "triton":
            return kernels.attention if self.interpreter else kernels.attention_op
        return functools.partial(HF.attend, *self.ops())

    def gate_op(self):
        """The registered block gate on the ``cpu`` backend (the C gate; it returns ``None`` for
        maps that are not whole tiles, which the PyTorch gate then takes), else ``None``."""
        return kernels.block_gate_op if self.backend == "cpu" else None


# What the kernels take depends on the machine (a built library, triton, CUDA) and not on tensor
# values: torch.compile evaluates these once while tracing and keeps the answer as a constant
# (tracing into them would meet ctypes, file-system checks and lru_caches, and break the graph).
@torch.compiler.assume_constant_result
def _cpu_problem(device: torch.device, dtype: torch.dtype, channels_last: bool) -> str | None:
    return kernels.cpu_kernel_unsupported(device, dtype, channels_last)


@torch.compiler.assume_constant_result
def _triton_problem(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    return kernels.triton_unsupported(device, dtype, head_dim)


def _refuse(requested: str, problem: str) -> RuntimeError:
    log.debug("HSMLA backend %r refused: %s", requested, problem)
    return RuntimeError(
        f"HSMLA backend {requested!r} cannot run this call: {problem}. "
        "backend='auto' falls back to the PyTorch reference; backend='reference' forces it."
    )


def select_backend(
    requested: str,
    training: bool,
    device: torch.device | str,
    dtype: torch.dtype,
    features: tuple[int, ...],
    *,
    grad: bool = False,
    channels_last: bool = True,
) -> BackendChoice:
    """The backend of one HSMLA call and the reason for it.

    Args:
        requested: the layer's setting, one of :data:`BACKENDS`.
        training: the layer's mode (``auto`` trains on the reference, whose backward autograd
            derives, even without gradients).
        device, dtype: those of the attention features.
        features: their shape ``(batch, heads, *spatial, head_dim)``.
        grad: whether gradients flow through this call (grad mode on and an input or weight
            requiring them): no kernel has a backward.
        channels_last: whether ``head_dim`` is contiguous in the features (the layer's maps
            are channels-last), which the C kernel needs.

    Rules: ``auto`` takes the reference in training or with gradients, else the C kernels on
    the CPU and the Triton kernels on CUDA where they take the inputs (float32 and
    channels-last for C; float32/16, bfloat16 and ``head_dim <= 128`` for Triton), the
    reference otherwise. ``reference`` and ``dense`` (``R`` for every token, always with
    ``dense`` set) always run. A forced ``cpu`` or ``triton`` that cannot
    run (gradients, device, dtype, layout, head_dim, C kernel not built, triton missing) raises
    :class:`RuntimeError` naming the backend and the reason. The reference computes ``R``
    everywhere densely when gradients flow and the map is small
    (:func:`~hsmla_med.nn.functional.dense_fits`).

    Raises:
        ValueError: ``requested`` is not a backend.
        RuntimeError: a forced kernel backend cannot run.
    """
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {requested!r}.")
    if not isinstance(device, torch.device):
        device = torch.device(device)
    no_backward = "gradients are required and the kernels have no backward"
    if requested == "reference":
        choice = BackendChoice("reference", "requested")
    elif requested == "dense":
        choice = BackendChoice("dense", "requested: R for every token, static shapes", dense=True)
    elif requested == "cpu":
        problem = no_backward if grad else _cpu_problem(device, dtype, channels_last)
        if problem:
            raise _refuse(requested, problem)
        choice = BackendChoice("cpu", "requested")
    elif requested == "triton":
        problem = no_backward if grad else _triton_problem(device, dtype, features[-1])
        if problem:
            raise _refuse(requested, problem)
        choice = BackendChoice("triton", "requested", interpreter=device.type != "cuda")
    elif training:
        choice = BackendChoice("reference", "training: the reference, which autograd differentiates")
    elif grad:
        choice = BackendChoice("reference", no_backward)
    elif device.type == "cpu":
        problem = _cpu_problem(device, dtype, channels_last)
        choice = BackendChoice("reference", problem) if problem else BackendChoice("cpu", "CPU inference")
    elif device.type == "cuda":
        problem = _triton_problem(device, dtype, features[-1])
        choice = BackendChoice("reference", problem) if problem else BackendChoice("triton", "CUDA inference")
    else:
        choice = BackendChoice("reference", f"no kernels for {device.type} devices")
    if requested == "auto" and choice.backend == "reference" and not (training or grad) and torch.compiler.is_compiling():
        choice = choice._replace(as_op=True)
    if choice.backend == "reference" and grad and HF.dense_fits(features):
        choice = choice._replace(dense=True)
    if not torch.compiler.is_compiling() and log.isEnabledFor(logging.DEBUG):
        log.debug(
            "HSMLA backend %r -> %s%s (%s; %s %s %s, training=%s, grad=%s)",
            requested, choice.backend, " (dense R)" if choice.dense else "", choice.reason,
            tuple(features), dtype, device, training, grad,
        )
    return choice
