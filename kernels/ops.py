"""The HSMLA kernels as PyTorch custom operators: ``torch.ops.hsmla.{linear_attention,
block_gate, local_refine, attention}``.

``torch.compile`` and ``torch.export`` cannot trace into a ctypes call or a Triton launch on raw
pointers, nor through the reference refinement's data-dependent tile list (``nonzero``): each of
these would break the graph. Registered with :mod:`torch.library`, every op is one node with a
fake (meta) implementation that gives its output's shape, dtype, strides and device from its
inputs' alone; what runs inside is chosen per device when the op executes:

========================  =======================================  ============================
op                        CPU                                      CUDA
========================  =======================================  ============================
``linear_attention``      the reference (no C kernel)              Triton (2 launches) where it
                                                                   takes the inputs, else the
                                                                   reference
``block_gate``            the C gate where it takes the inputs,    the reference
                          else the reference
``local_refine``          the C kernel where it takes the inputs,  Triton (2D and 3D) where it
                          else the reference                       takes the inputs, else the
                                                                   reference
``attention``             the reference linear attention, the C    Triton: 3 launches, no host
                          refinement added into it in place        sync (the layer's CUDA path)
========================  =======================================  ============================

(the references are the functions of the same name in :mod:`hsmla_med.ops_reference`; that of
``attention`` is :func:`.attention.reference`). The gate's tile selection (``gate > tau``) stays
inside ``local_refine`` and ``attention``, whose outputs have the shape of their inputs, so no
data-dependent shape leaves an op; on CUDA the Triton refinement reads the gate and ``tau`` on
the device (no tile list at all). ``tau`` is a 0-d tensor, not a Python float, so that the
layer's ``tau`` buffer stays a graph input. Results are laid out channel-first on the CPU (the
references' layout) and token-major on CUDA (the Triton kernels': the channels-last map the
layer's output projection reads).

Each op has one public function here with the calling convention of its reference, which is what
:meth:`hsmla_med.nn.dispatch.BackendChoice.ops` and :meth:`~hsmla_med.nn.dispatch.BackendChoice.attend`
hand the HSMLA layer (except the ``cpu`` backend's linear attention: with no C kernel behind it,
the reference's PyTorch operations trace as they are, without the op's dispatch cost). An op may
not write its inputs: ``local_refine(..., add_to=out)`` returns ``out + M * R`` as a new tensor
instead of adding into ``out`` (one copy of the map); ``attention`` refines its own linear output
in place. None of the ops has a backward (the kernels are inference-only; training runs the
references). Importing :mod:`hsmla_med.kernels` registers them, which loading a saved
``torch.export`` program needs.
"""

from typing import Optional

import torch
from torch import Tensor

from hsmla_med import ops_reference

from . import attention, gate_cpu, linear, refine, refine_cpu
from ._runtime import triton_unsupported

__all__ = ["linear_attention", "block_gate", "local_refine", "attention_op", "OPS"]


def _channel_first_empty(like: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """Empty ``(b, h, *S, d)`` laid out channel-first (``(b, h, d, *S)`` in memory): the layout
    of every reference's and kernel's result, which the layer maps back to ``(b, C, *S)`` as a
    view."""
    b, h, *spatial, d = like.shape
    return like.new_empty((b, h, d, *spatial), dtype=dtype or like.dtype).movedim(2, -1)


def _token_major_empty(like: Tensor) -> Tensor:
    """Empty ``(b, h, *S, d)`` laid out token-major (``(b, *S, h, d)`` in memory): the layout
    of the Triton kernels' results on CUDA, a channels-last map once the heads are merged."""
    b, h, *spatial, d = like.shape
    return like.new_empty((b, *spatial, h, d)).movedim(-2, 1)


def _triton_takes(*tensors: Tensor) -> bool:
    """Whether the Triton kernels run these features (no gradients: ops run below autograd)."""
    ref = tensors[0]
    same = all(t.dtype == ref.dtype and t.device == ref.device and t.shape == ref.shape for t in tensors)
    return same and triton_unsupported(ref.device, ref.dtype, ref.shape[-1]) is None


# -- linear attention -----------------------------------------------------------------------------


@torch.library.custom_op("hsmla::linear_attention", mutates_args=())
def _linear_attention(qh: Tensor, kh: Tensor, vh: Tensor, eps: float) -> Tensor:
    # every device without an own kernel, the CPU included: the reference
    return ops_reference.linear_attention(qh, kh, vh, eps)


@_linear_attention.register_kernel("cuda")
def _(qh: Tensor, kh: Tensor, vh: Tensor, eps: float) -> Tensor:
    if _triton_takes(qh, kh, vh):
        return linear.linear_attention(qh, kh, vh, eps)
    return _token_major_empty(qh).copy_(ops_reference.linear_attention(qh, kh, vh, eps))  # the layout the fake promises on CUDA


@_linear_attention.register_fake
def _(qh: Tensor, kh: Tensor, vh: Tensor, eps: float) -> Tensor:
    return _token_major_empty(qh) if qh.device.type == "cuda" else _channel_first_empty(qh)


def linear_attention(qh: Tensor, kh: Tensor, vh: Tensor, eps: float = ops_reference.DEFAULT_EPS) -> Tensor:
    """``torch.ops.hsmla.linear_attention``: global ReLU linear attention
    (:func:`hsmla_med.ops_reference.linear_attention`).

    Args:
        qh, kh, vh: ``(batch, heads, *spatial, head_dim)``, 2 or 3 spatial dims.
        eps: added to the denominator.

    Returns:
        ``(batch, heads, *spatial, head_dim)`` in ``qh``'s dtype, laid out channel-first.
    """
    return _linear_attention(qh, kh, vh, float(eps))


# -- block gate -----------------------------------------------------------------------------------


@torch.library.custom_op("hsmla::block_gate", mutates_args=())
def _block_gate(ms: Tensor, taps: Tensor, conv_bias: Tensor, weight: Tensor, gate_bias: Tensor, block: int) -> Tensor:
    return ops_reference.block_gate(ms, taps, conv_bias, weight, gate_bias, block)


@_block_gate.register_kernel("cpu")
def _(ms: Tensor, taps: Tensor, conv_bias: Tensor, weight: Tensor, gate_bias: Tensor, block: int) -> Tensor:
    # the C gate returns None for inputs it does not take (not float32, channel-first, not built)
    gate = gate_cpu.block_gate(ms, taps, conv_bias, weight, gate_bias, block)
    return gate if gate is not None else ops_reference.block_gate(ms, taps, conv_bias, weight, gate_bias, block)


@_block_gate.register_fake
def _(ms: Tensor, taps: Tensor, conv_bias: Tensor, weight: Tensor, gate_bias: Tensor, block: int) -> Tensor:
    if any(n % block for n in ms.shape[2:]):
        raise ValueError(f"block_gate takes maps of whole {block}-sized tiles, got spatial size {tuple(ms.shape[2:])}.")
    return ms.new_empty((ms.shape[0], *(n // block for n in ms.shape[2:])))


def block_gate(
    ms: Tensor, taps: Tensor, conv_bias: Tensor, weight: Tensor, gate_bias: Tensor, block: int
) -> Optional[Tensor]:
    """``torch.ops.hsmla.block_gate``: the block gate ``M`` (:func:`hsmla_med.ops_reference.block_gate`).

    Args:
        ms: multi-scale tokens ``(b, 3C, *S)``.
        taps: the fused pooling kernel tap by tap, ``(prod(kernel), 3C)``, ``kernel = block + 2``
            per axis; conv_bias: ``(3C,)``; weight: ``(3, heads, d)``; gate_bias: ``(heads,)``.
        block: tile size per axis.

    Returns:
        ``M`` ``(b, *S / block)``; ``None`` for a map with partial edge tiles, which the fused
        kernel does not cover (the caller runs the layer's PyTorch gate; the shapes are static,
        so this choice is made when tracing).
    """
    if any(n % block for n in ms.shape[2:]):
        return None
    return _block_gate(ms, taps, conv_bias, weight, gate_bias, int(block))


# -- local refinement -----------------------------------------------------------------------------


def _refine_with(fn, maps, gate, tau, block, window, eps, add_to) -> Tensor:
    """``fn`` (a ``local_refine`` of the reference's signature) into a fresh output laid out as
    the fake implementation says."""
    if add_to is None:
        r = fn(*maps, gate, tau, block, window, eps)
        expected = _channel_first_empty(maps[0])
        if r.stride() == expected.stride() and r.dtype == expected.dtype:
            return r  # the references' and kernels' own layout: no copy
        return expected.copy_(r)
    out = torch.empty_like(add_to).copy_(add_to)  # an op may not write its inputs
    return fn(*maps, gate, tau, block, window, eps, out)


@torch.library.custom_op("hsmla::local_refine", mutates_args=())
def _local_refine(
    q: Tensor, k: Tensor, v: Tensor, qh: Tensor, kh: Tensor, vh: Tensor,
    gate: Optional[Tensor], tau: Tensor, block: int, window: int, eps: float, add_to: Optional[Tensor],
) -> Tensor:
    return _refine_with(ops_reference.local_refine, (q, k, v, qh, kh, vh), gate, tau, block, window, eps, add_to)


@_local_refine.register_kernel("cpu")
def _(q, k, v, qh, kh, vh, gate, tau, block, window, eps, add_to):
    # refine_cpu.local_refine runs the C kernel where it takes the inputs, else its reference
    return _refine_with(refine_cpu.local_refine, (q, k, v, qh, kh, vh), gate, tau, block, window, eps, add_to)


@_local_refine.register_kernel("cuda")
def _(q, k, v, qh, kh, vh, gate, tau, block, window, eps, add_to):
    maps = (q, k, v, qh, kh, vh)
    fn = refine.local_refine if _triton_takes(*maps) else ops_reference.local_refine
    return _refine_with(fn, maps, gate, tau, block, window, eps, add_to)


@_local_refine.register_fake
def _(q, k, v, qh, kh, vh, gate, tau, block, window, eps, add_to):
    ops_reference.check_refine((q, k, v, qh, kh, vh), gate, block, window, add_to)
    return _channel_first_empty(q) if add_to is None else torch.empty_like(add_to)


def local_refine(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qh: Tensor,
    kh: Tensor,
    vh: Tensor,
    gate: Optional[Tensor],
    tau,
    block: int,
    window: int,
    eps: float = ops_reference.DEFAULT_EPS,
    add_to: Optional[Tensor] = None,
) -> Tensor:
    """``torch.ops.hsmla.local_refine``: the local residual ``R = O_loc - O_linloc`` on the tiles
    with ``gate > tau`` (:func:`hsmla_med.ops_reference.local_refine`), tile list inside the op.

    Args:
        q, k, v, qh, kh, vh: ``(batch, heads, *spatial, head_dim)``.
        gate: ``(batch, *ceil(spatial / block))``; ``None`` refines every tile.
        tau: threshold, a 0-d tensor (the layer's buffer) or a number.
        block: tile size per axis; window: odd window size per axis; eps: linear-term epsilon.
        add_to: optional ``(batch, heads, *spatial, head_dim)`` (needs a ``gate``).

    Returns:
        ``R`` (zero on inactive tiles; ``q``'s shape and dtype, channel-first), or with
        ``add_to`` a new tensor ``add_to + M * R`` (``add_to`` itself is left as it is, unlike the
        reference, which adds in place).
    """
    if not isinstance(tau, Tensor):
        tau = q.new_full((), float(tau))  # on q's device, without a host-to-device copy
    return _local_refine(q, k, v, qh, kh, vh, gate, tau, int(block), int(window), float(eps), add_to)


# -- the attention core: linear attention and gated refinement in one op ----------------------------


@torch.library.custom_op("hsmla::attention", mutates_args=())
def _attention(
    q: Tensor, k: Tensor, v: Tensor, qh: Tensor, kh: Tensor, vh: Tensor,
    gate: Optional[Tensor], tau: Tensor, refine: bool, block: int, window: int, eps: float,
) -> Tensor:
    # devices without a kernel: the reference's composition (channel-first, as the fake says)
    return _channel_first(attention.reference(q, k, v, qh, kh, vh, gate, tau, refine, block, window, eps))


@_attention.register_kernel("cpu")
def _(q, k, v, qh, kh, vh, gate, tau, refine, block, window, eps):
    out = ops_reference.linear_attention(qh, kh, vh, eps)  # a fresh tensor of this op's: refined in place
    if not refine:
        return out
    if gate is None:
        return out.add_(refine_cpu.local_refine(q, k, v, qh, kh, vh, None, 0.0, block, window, eps))
    return refine_cpu.local_refine(q, k, v, qh, kh, vh, gate, tau, block, window, eps, add_to=out)


@_attention.register_kernel("cuda")
def _(q, k, v, qh, kh, vh, gate, tau, refine, block, window, eps):
    if _triton_takes(q, k, v, qh, kh, vh):
        return attention.attention(q, k, v, qh, kh, vh, gate, tau, refine, block, window, eps)
    out = attention.reference(q, k, v, qh, kh, vh, gate, tau, refine, block, window, eps)
    return _token_major_empty(q).copy_(out)  # the layout the fake promises on CUDA


@_attention.register_fake
def _(q, k, v, qh, kh, vh, gate, tau, refine, block, window, eps):
    ops_reference.check_refine((q, k, v, qh, kh, vh), gate, block, window, None)
    return _token_major_empty(q) if q.device.type == "cuda" else _channel_first_empty(q)


def _channel_first(x: Tensor) -> Tensor:
    """``x`` laid out as :func:`_channel_first_empty` (a copy only where it is not)."""
    expected = _channel_first_empty(x)
    return x if x.stride() == expected.stride() else expected.copy_(x)


def attention_op(
    q: Tensor, k: Tensor, v: Tensor, qh: Tensor, kh: Tensor, vh: Tensor,
    gate: Optional[Tensor], tau, refine: bool, block: int, window: int, eps: float = ops_reference.DEFAULT_EPS,
) -> Tensor:
    """``torch.ops.hsmla.attention``: ``O_lin`` (``refine`` False), ``O_lin + R`` (``gate``
    None) or ``O_lin + [M > tau] * M * R`` (:func:`.attention.reference`).

    On CUDA the Triton kernels (:func:`.attention.attention`: three launches, no host sync,
    token-major result); on the CPU the reference linear attention and the C refinement added in
    place into it (channel-first result, as the references').

    Args:
        q, k, v, qh, kh, vh: ``(batch, heads, *spatial, head_dim)``.
        gate: ``(batch, *ceil(spatial / block))`` or ``None``; tau: 0-d tensor or number.
        refine: whether to add the local residual; block, window, eps: as :func:`local_refine`.
    """
    if not isinstance(tau, Tensor):
        tau = q.new_full((), float(tau))
    return _attention(q, k, v, qh, kh, vh, gate, tau, bool(refine), int(block), int(window), float(eps))


#: the registered operators, by name
OPS = {"linear_attention": _linear_attention, "block_gate": _block_gate, "local_refine": _local_refine, "attention": _attention}
