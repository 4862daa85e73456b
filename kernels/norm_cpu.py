"""Instance normalisation (and the Hardswish after it) of a channels-last map on the CPU at
inference: ``norm_cpu.c``, built at first use by :mod:`._cpu_build`.

Its reference is :class:`hsmla_med.nn.blocks.InstanceNorm` followed by ``torch.nn.Hardswish``:
five tensor passes and two temporary maps for the norm, a sixth pass for the activation. The C
version reads the map twice and writes it once, in place: at 512 x 512 the norms were a quarter of
HSMLA-B2's forward with instance norm (docs/benchmarks.md, "Instance norm at inference").
"""

from __future__ import annotations

import ctypes
import functools

import torch

from ._cpu_build import library, pointer

__all__ = ["instance_norm_act"]


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    lib = library("norm_cpu")
    if lib is not None:
        fp = ctypes.POINTER(ctypes.c_float)
        lib.hsmla_instance_norm_act.argtypes = [
            fp, fp, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, fp, fp, ctypes.c_float, ctypes.c_int,
        ]
        lib.hsmla_instance_norm_act.restype = ctypes.c_int
    return lib


def instance_norm_act(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, hardswish: bool, out: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``hardswish(instance_norm(x) * weight + bias)`` (without the Hardswish unless asked), per
    image and channel over the spatial axes, biased variance, ``eps`` inside the root.

    Args:
        x: ``(batch, C, *spatial)`` float32 on the CPU, channels-last (2D or 3D).
        weight, bias: ``(C,)``.
        eps: added to the variance.
        hardswish: apply Hardswish to the normalised map.
        out: where to write (``x`` itself for in place; same shape and layout); a new
            channels-last map when ``None``.

    Returns:
        The result, or ``None`` when the library is not built or the inputs are not of that kind
        (another device, dtype or layout, or gradients needed): then the caller runs the reference.
    """
    lib = _library()
    layout = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    tensors = (x, weight, bias)
    if (
        lib is None
        or layout is None
        or any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors)
        or not x.is_contiguous(memory_format=layout)
        or weight.shape != (x.shape[1],)
        or bias.shape != (x.shape[1],)
        or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
        or (out is not None and (out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous(memory_format=layout)))
    ):
        return None
    out = torch.empty_like(x, memory_format=layout) if out is None else out
    params = [t.contiguous() for t in (weight, bias)]
    status = lib.hsmla_instance_norm_act(
        pointer(x), pointer(out), x.shape[0], x[0, 0].numel(), x.shape[1], pointer(params[0]), pointer(params[1]), eps, int(hardswish)
    )
    if status:
        raise MemoryError("the CPU instance norm kernel could not allocate its scratch memory.")
    return out
