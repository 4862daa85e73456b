"""Tile-compacted local refinement on the CPU: ``refine_cpu.c``, built at first use by
:mod:`._cpu_build`.

The reference (:func:`hsmla_med.ops_reference.local_refine`) assembles the active tiles from
whole-tensor PyTorch operations: a token-major stack of the keys and values, gathers of every
tile's halo, batched matmuls over the full halo, a scatter back. On a CPU that costs a fixed
~1 ms per layer plus memory traffic per tile, as much as the rest of the layer at alpha = 0.3
(docs/benchmarks.md). The C kernel reads each halo where it lies and adds the residual in
place, with no intermediate tensors. Without the built library, for inputs it does not take
(not float32, ``head_dim`` not contiguous) or when gradients are needed, :func:`local_refine`
runs the reference instead, with the same result.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from hsmla_med.ops_reference import check_refine, tile_grid
from hsmla_med.ops_reference import local_refine as reference

from ._cpu_build import failure, int64s, library, pointer

__all__ = ["local_refine", "compiled", "unsupported"]


class _FeatureMap(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("stride", ctypes.c_int64 * 5)]


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    lib = library("refine_cpu")
    if lib is not None:
        i64p, fp = ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_float)
        lib.hsmla_refine_tiles.argtypes = [
            _FeatureMap * 6, fp, i64p, i64p, fp, ctypes.c_int64, ctypes.c_int64, i64p, i64p, i64p,
            ctypes.c_int64, ctypes.c_float,
        ]
        lib.hsmla_refine_tiles.restype = ctypes.c_int
    return lib


def compiled() -> bool:
    """Whether the C kernel is built (building it now if needed) and enabled."""
    return _library() is not None


def unsupported(device: torch.device | str, dtype: torch.dtype, head_dim_contiguous: bool = True) -> str | None:
    """Why the C kernel would not run on features on ``device`` of ``dtype`` (with ``head_dim``
    contiguous or not), or ``None`` when it would (building it now if needed). Gradients are
    left to the caller: the kernel has none, and :func:`local_refine` runs the reference when
    they are needed."""
    if (device if isinstance(device, torch.device) else torch.device(device)).type != "cpu":
        return f"the C kernel runs on the CPU, the features are on {device}"
    if dtype != torch.float32:
        return f"the C kernel takes float32 features, got {dtype}"
    if not head_dim_contiguous:
        return "the C kernel needs features with head_dim contiguous (channels-last maps), got channel-first ones"
    if _library() is None:
        return f"the C kernel is not available: {failure('refine_cpu') or 'it was not built'}"
    return None


def _takes(maps: list[torch.Tensor], add_to: torch.Tensor | None) -> bool:
    """The inputs the kernel works on: float32 CPU tensors, maps with ``head_dim`` contiguous
    (``add_to`` may have any strides), and no gradient to compute."""
    tensors = maps if add_to is None else [*maps, add_to]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and all(
        m.stride(-1) == 1 for m in maps
    )


def _zyx(values: tuple[int, ...], pad: int) -> list[int]:
    """Per-axis values of a 2D or 3D map as (z, y, x): 2D maps get ``pad`` on z."""
    return [pad] * (3 - len(values)) + list(values)


def local_refine(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qh: torch.Tensor,
    kh: torch.Tensor,
    vh: torch.Tensor,
    gate: torch.Tensor | None,
    tau: float,
    block: int,
    window: int,
    eps: float = 1e-6,
    add_to: torch.Tensor | None = None,
) -> torch.Tensor:
    """Local residual ``R = O_loc - O_linloc`` on tiles with ``gate > tau``, or ``add_to +=
    gate * R``: the semantics and arguments of :func:`reference`, 2D and 3D.

    Returns:
        ``R`` (shape of ``q``, channel-first like the reference's result), or ``add_to``.
    """
    maps = [q, k, v, qh, kh, vh]
    lib = _library()
    if lib is None or not _takes(maps, add_to):
        return reference(*maps, gate, tau, block, window, eps, add_to)
    spatial_dims = check_refine(maps, gate, block, window, add_to)
    b, heads, *spatial, d = q.shape
    if gate is None:
        grid = (b, *tile_grid(tuple(spatial), block))
        tiles = torch.cartesian_prod(*(torch.arange(n) for n in grid)).view(-1, len(grid))
        weights = torch.ones(tiles.shape[0])
    else:
        active = gate.detach() > tau
        tiles = torch.nonzero(active)
        weights = gate.detach()[active].float() if add_to is not None else torch.ones(tiles.shape[0])
    out = add_to if add_to is not None else torch.zeros((b, heads, d, *spatial)).movedim(2, -1)
    if tiles.shape[0] == 0:
        return out
    if spatial_dims == 2:
        tiles = torch.cat([tiles[:, :1], torch.zeros_like(tiles[:, :1]), tiles[:, 1:]], dim=1)
    tiles, weights = tiles.contiguous(), weights.contiguous()
    structs = (_FeatureMap * 6)()
    for s, m in zip(structs, maps):
        strides = m.stride()
        s.data = m.data_ptr()
        s.stride[:] = [strides[0], strides[1], *_zyx(strides[2:-1], 0)]
    o = out.stride()
    status = lib.hsmla_refine_tiles(  # the (tile, head) items run on torch's OpenMP threads
        structs,
        pointer(out),
        int64s([o[0], o[1], *_zyx(o[2:-1], 0), o[-1]]),
        pointer(tiles, ctypes.c_int64),
        pointer(weights),
        tiles.shape[0] * heads,
        heads,
        int64s(_zyx(tuple(spatial), 1)),
        int64s(_zyx((block,) * spatial_dims, 1)),
        int64s(_zyx((window // 2,) * spatial_dims, 0)),
        d,
        float(eps),
    )
    if status:
        raise MemoryError("the CPU refinement kernel could not allocate its scratch memory.")
    return out
