"""Predictions back in an input's own grid: the inverse of a preprocessing ``Compose`` for one
channel at a time, with the resampling of ``Spacingd`` done axis by axis.

MONAI's ``Invertd`` undoes the preprocessing through each transform's ``inverse``. Its
resampling (``SpatialResample`` -> ``AffineTransform``) builds a sampling grid of three float
coordinates per output voxel for every call (0.94 GB for a 512 x 512 x 300 CT, and 4.5 s per
class on two cores). ``Spacingd`` only changes voxel sizes: the map from the input's voxel
indices to the resampled ones is diagonal, and linear interpolation then separates into one 1D
pass per axis, which needs no grid and takes a fraction of the time. MONAI has no separable
resampler, so :func:`separable_resample` is written here; every other inverse, and a spacing
inverse that is not axis-aligned or not linear, is MONAI's own.

:func:`labels_in_input_geometry` brings class probabilities back one class at a time and takes
their argmax there; ``infer`` writes the result (the label map in its input's format:
:func:`~hsmla_med.io.volumes.write_labels`; the probabilities: :func:`write_probabilities`) and
validation scores it against the original label file, so both see the same label maps.
"""

from __future__ import annotations

import math

from collections.abc import Hashable
from copy import deepcopy
from pathlib import Path

import numpy as np
import torch
from monai.data import MetaTensor
from monai.transforms import Compose, CropForegroundd, InvertibleTransform, Spacingd
from monai.transforms.utils import allow_missing_keys_mode
from monai.utils import TraceKeys

from hsmla_med.io import atomic_path

__all__ = ["UNCROPPED_BACKGROUND", "invert", "separable_resample", "labels_in_input_geometry", "write_probabilities"]

AXIS_TOLERANCE = 1e-6  # off-diagonal voxel-map entries below this count as axis-aligned
# The background's probability outside the foreground crop (nnU-Net's rule; MONAI's inverse of
# the crop pads every class with 0). The exported bundle, whose Invertd pads with 0, subtracts it
# from the background before Invertd and adds it back after (the inverse resampling and flips are
# linear), which gives the same probabilities up to rounding; infer and validation set the
# uncropped voxels instead, so that probabilities inside the crop, and their ties, stay exact.
UNCROPPED_BACKGROUND = 1.0


def separable_resample(x: torch.Tensor, scale: np.ndarray, offset: np.ndarray, size: tuple[int, ...], padding_mode: str = "border") -> torch.Tensor:
    """Linear interpolation of ``x`` ``(C, *spatial)`` at output voxel ``i`` from input voxel
    coordinate ``scale * i + offset`` (voxel centres at integer indices), per axis; ``size`` is
    the output's spatial shape. ``padding_mode`` ``border`` repeats the edge voxels beyond the
    input, ``zeros`` fades to zero over the half voxel past it, as ``grid_sample`` does with
    ``align_corners=False``. Equals MONAI's ``SpatialResample`` (bilinear) on a diagonal map up
    to float rounding."""
    # the axis that shrinks most first: later passes then run over fewer voxels
    for axis in sorted(range(1, x.dim()), key=lambda a: size[a - 1] / x.shape[a]):
        x = _lerp_axis(x, axis, float(scale[axis - 1]), float(offset[axis - 1]), size[axis - 1], padding_mode)
    return x


def _lerp_axis(x: torch.Tensor, axis: int, scale: float, offset: float, n: int, padding_mode: str) -> torch.Tensor:
    """:func:`separable_resample` along one axis of ``x``: ``n`` samples at ``scale * i + offset``.

    The map is viewed as (before, axis, after) and ``index_select`` runs on the middle dim of that
    view: on the last dim of a 4D map its CPU kernel gathered single elements 20-40x slower
    (0.67-0.75 s against 0.002-0.017 s for 256 x 256 x 64 -> 256 x 256 x 96; 0.50 s against
    0.03 s for 14 x 128 x 128 x 40 -> 60, measured); it was the largest single cost in a profile
    of ``infer`` (docs/benchmarks.md)."""
    length = x.shape[axis]
    coord = torch.arange(n, dtype=torch.float64) * scale + offset
    low = torch.floor(coord)
    weight = (coord - low).to(x.dtype).view(1, n, 1)
    low = low.long()
    high = low + 1
    flat = x.reshape(math.prod(x.shape[:axis]), length, -1)
    lo = flat.index_select(1, low.clamp(0, length - 1))
    hi = flat.index_select(1, high.clamp(0, length - 1))
    if padding_mode == "zeros":  # samples outside [0, length - 1] are zero
        lo.mul_(((low >= 0) & (low < length)).to(x.dtype).view(1, n, 1))
        hi.mul_(((high >= 0) & (high < length)).to(x.dtype).view(1, n, 1))
    return lo.lerp_(hi, weight).view(*x.shape[:axis], n, *x.shape[axis + 1 :])


def _undo_spacing(t: Spacingd, key: Hashable, img: MetaTensor) -> MetaTensor | None:
    """``t``'s inverse on ``img`` by :func:`separable_resample` (the record popped), or ``None``
    (nothing popped) where the voxel map is not axis-aligned or the interpolation not linear."""
    resample = t.spacing_transform.sp_resample
    record = resample.get_most_recent_transform(img, check=True)
    info = record[TraceKeys.EXTRA_INFO]
    if info["mode"] != "bilinear" or info["padding_mode"] not in ("border", "zeros") or info["align_corners"] is True:
        return None
    original = np.asarray(info["src_affine"], dtype=np.float64)
    xform = np.linalg.solve(np.asarray(img.affine, dtype=np.float64), original)  # input voxel -> resampled voxel
    if xform.shape != (4, 4) or np.abs(xform[:3, :3] - np.diag(np.diag(xform[:3, :3]))).max() > AXIS_TOLERANCE:
        return None
    resample.pop_transform(img, check=False)
    size = tuple(int(s) for s in record[TraceKeys.ORIG_SIZE])
    out = separable_resample(img.as_tensor(), np.diag(xform)[:3], xform[:3, 3], size, info["padding_mode"])
    out = MetaTensor(out, meta=img.meta, applied_operations=img.applied_operations)
    out.affine = torch.as_tensor(original)
    return out


def _fill_uncropped(img: MetaTensor, cropped, value: float) -> None:
    """Set the voxels of ``img`` that a crop's inverse padded back (``cropped``: voxels cut
    before and after, per spatial axis, MONAI's record) to ``value``, in place."""
    for axis, (before, after) in enumerate(np.asarray(cropped, dtype=int).reshape(-1, 2), start=1):
        img.narrow(axis, 0, before).fill_(value)
        img.narrow(axis, img.shape[axis] - after, after).fill_(value)


def invert(pred: torch.Tensor, image: MetaTensor, transform: Compose, key: Hashable = "image", uncropped: float = 0.0) -> torch.Tensor:
    """``pred`` ``(C, *spatial)``, on the grid of ``image`` (the output of ``transform`` under
    ``key``), mapped back to the grid ``transform`` started from: what ``Invertd("pred",
    transform, orig_keys=key, nearest_interp=False)`` returns, with ``Spacingd``'s inverse by
    :func:`separable_resample` where it is axis-aligned and bilinear, and the voxels that a
    ``CropForegroundd`` cut off set to ``uncropped`` (MONAI's inverse pads them with 0; the
    background's probability there is 1). A plain tensor."""
    data = {key: MetaTensor(pred, meta=deepcopy(image.meta), applied_operations=deepcopy(image.applied_operations))}
    # the transform's other keys (a validation transform's label) are absent, as in Invertd
    with allow_missing_keys_mode(transform):
        for t in reversed(transform.flatten().transforms):
            if not isinstance(t, InvertibleTransform):
                continue
            undone = _undo_spacing(t, key, data[key]) if isinstance(t, Spacingd) else None
            if undone is not None:
                data[key] = undone
            elif isinstance(t, CropForegroundd) and uncropped:
                cropped = t.cropper.get_most_recent_transform(data[key])[TraceKeys.EXTRA_INFO]["cropped"]
                data = t.inverse(data)
                _fill_uncropped(data[key], cropped, uncropped)
            else:
                data = t.inverse(data)
    out = data[key]
    return out.as_tensor() if isinstance(out, MetaTensor) else torch.as_tensor(out)


def labels_in_input_geometry(probs: torch.Tensor, image: MetaTensor, transform: Compose, probabilities: bool = False,
                             regions_class_order: list[int] | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """The argmax of ``probs`` (``(classes, *spatial)`` on the grid of ``image``, the output of
    ``transform``) in the grid ``transform`` started from, mapping one class at a time back
    through :func:`invert`: two float maps of the input's size at a time instead of one per class
    (a 512 x 512 x 300 CT with 14 classes: 0.6 GB instead of 4.4 GB). Ties go to the lower class,
    as ``argmax``. With ``probabilities`` also every class's probability there, float16
    ``(classes, *shape)``.

    Outside a foreground crop the background's probability is :data:`UNCROPPED_BACKGROUND` (1)
    and every other class's 0, as nnU-Net writes them (MONAI's inverse of the crop pads with 0).

    ``regions_class_order`` (a region-based network: ``probs`` are the background's and each
    region's sigmoid): the label map is nnU-Net's instead, each region's voxels above 0.5 set
    to its value in ``regions_class_order``, later regions over earlier ones.
    """
    best = labels = stack = None
    for c, p in enumerate(probs):
        p = invert(p[None], image, transform, uncropped=UNCROPPED_BACKGROUND if c == 0 else 0.0)[0]
        if probabilities:
            if stack is None:
                stack = np.empty((len(probs), *p.shape), np.float16)
            stack[c] = p.numpy()
        if regions_class_order is not None:
            labels = torch.zeros(p.shape, dtype=torch.uint8) if labels is None else labels
            if c > 0:  # (channel 0: the background's output, not a region)
                labels[p > 0.5] = regions_class_order[c - 1]
        elif best is None:
            best, labels = p.clone(), torch.zeros(p.shape, dtype=torch.uint8)  # p may share the probabilities' memory
        else:
            labels[p > best] = c
            torch.maximum(best, p, out=best)
    return labels.numpy(), stack


def write_probabilities(path: Path, probabilities: np.ndarray) -> Path:
    """Write class probabilities as nnU-Net keeps them: ``path`` (``<case>.npz``, compressed)
    with the key ``probabilities``, ``(classes, *shape)`` float16, atomically."""
    with atomic_path(path) as tmp, tmp.open("wb") as f:
        np.savez_compressed(f, probabilities=probabilities)
    return path
