"""Sliding-window prediction of whole volumes, for 2D (slice-wise) and 3D networks.

One function, :func:`predict_volume`, serves validation, ``evaluate`` and ``infer``: MONAI's
``SlidingWindowInferer`` with Gaussian blending (``SliceInferer`` for a 2D network, which
slides the 2D window over every axial slice), optional mirroring test-time augmentation, so 2D
and 3D models share the inference and metric code.
"""

from __future__ import annotations

from collections.abc import Sequence

import logging
import math

import torch
from monai.inferers import SliceInferer, SlidingWindowInferer
from torch import nn

from hsmla_med.inference.uncertainty import predictive_entropy

__all__ = ["predict_volume", "accumulation_device"]

log = logging.getLogger("hsmla_med")

#: share of the GPU's free memory that a volume's class maps (output and blending weights) may take
#: before they are accumulated on the CPU instead
GPU_SHARE = 0.5


def predict_volume(
    network: nn.Module,
    image: torch.Tensor,
    roi_size: Sequence[int],
    spatial_dims: int,
    overlap: float = 0.5,
    sw_batch_size: int = 4,
    tta: bool = False,
    slab: int = 8,
    device: torch.device | str | None = None,
    sigmoid: bool = False,
    mean_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Class probabilities ``(B, classes, H, W, D)`` for volumes ``(B, C, H, W, D)`` (with
    ``sigmoid``: each output's own probability, a region-based network's); with
    ``mean_entropy`` also the mean over the mirrored copies of each copy's normalised
    :func:`~hsmla_med.inference.uncertainty.predictive_entropy` ``(B, H, W, D)``, from which
    the copies' mutual information follows (:func:`~hsmla_med.inference.uncertainty.mutual_information`).

    Args:
        network: a network from :mod:`hsmla_med.nn` (or any MONAI-style network) in eval mode.
        roi_size: window size, ``(h, w)`` for a 2D network (in-plane) or ``(h, w, d)`` for 3D.
            Volumes smaller than the window are padded by MONAI and cropped back.
        spatial_dims: 2 for a slice-wise network, 3 for a volumetric one.
        overlap: fraction by which neighbouring windows overlap (in-plane only for 2D: a
            slice-wise network gives every slice one prediction, blending across slices would only
            repeat work).
        sw_batch_size: windows per forward pass.
        tta: average over mirrored copies of the input along every spatial axis of the network
            (in-plane axes for 2D), flipping each prediction back.
        slab: for a 2D network, a multiplier of ``sw_batch_size``: each forward pass takes
            ``sw_batch_size * slab`` one-slice windows (as many slices as the former windows of
            ``slab`` slices did).
        device: where the windows' outputs are accumulated (MONAI's ``device``; the network
            runs where ``image`` is, MONAI's ``sw_device``): ``cpu`` for a volume whose class
            maps do not fit the GPU (:func:`accumulation_device`); default ``image``'s device.
        mean_entropy: return ``(probs, mean entropy)`` (softmax outputs only).
    """
    if spatial_dims == 2:
        # SliceInferer's windows are one slice of the last axis (spatial_dim=2: D) thick, so
        # nothing overlaps across slices and every slice gets the same in-plane Gaussian weights.
        # (The former slab-thick windows used a 3D Gaussian, clamped at 1e-3 of its peak, which
        # blended a slab's outer slices almost uniformly in-plane: results differed by slice.)
        inferer: SlidingWindowInferer = SliceInferer(
            spatial_dim=2, roi_size=tuple(roi_size), sw_batch_size=sw_batch_size * slab, overlap=overlap, mode="gaussian",
            sw_device=image.device, device=device,
        )
        axes: tuple[int, ...] = (2, 3)
    elif spatial_dims == 3:
        inferer = SlidingWindowInferer(tuple(roi_size), sw_batch_size, overlap=overlap, mode="gaussian", sw_device=image.device, device=device)
        axes = (2, 3, 4)
    else:
        raise ValueError(f"spatial_dims must be 2 or 3, got {spatial_dims}")
    flips = [()] + [(a,) for a in axes] if tta else [()]
    probs = entropy = None
    for flip in flips:
        x = torch.flip(image, flip) if flip else image
        logits = inferer(x, network).float()
        p = logits.sigmoid_() if sigmoid else _softmax_(logits)
        p = torch.flip(p, flip) if flip else p
        if mean_entropy:  # this copy's, before p becomes the running sum
            h = predictive_entropy(p)
            entropy = h if entropy is None else entropy.add_(h)
        probs = p if probs is None else probs.add_(p)
    probs = probs.div_(len(flips)) if len(flips) > 1 else probs
    return (probs, entropy.div_(len(flips))) if mean_entropy else probs


def _softmax_(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over classes (dim 1) in the logits' own memory: a volume's class maps are the
    largest tensors of inference (14 classes of a resampled CT: 0.9 GB), and ``torch.softmax``
    would hold a second copy."""
    logits.sub_(logits.amax(1, keepdim=True)).exp_()
    return logits.div_(logits.sum(1, keepdim=True))


def accumulation_device(image: torch.Tensor, classes: int) -> torch.device:
    """Where :func:`predict_volume` should accumulate the class maps of ``image``
    ``(B, C, *spatial)``: its own device, unless it is a GPU whose free memory holds less than
    ``1 / GPU_SHARE`` times the maps (float32 output and weights, ``classes + 1`` channels per
    voxel); then the CPU, and the GPU runs only the windows (nnU-Net does the same for large
    volumes)."""
    if image.device.type != "cuda":
        return image.device
    need = image.shape[0] * (classes + 1) * math.prod(image.shape[2:]) * 4
    free, _ = torch.cuda.mem_get_info(image.device)
    if need <= GPU_SHARE * free:
        return image.device
    log.info("class maps of %s voxels need %.1f GiB, %.1f GiB free on %s: accumulating on the CPU", tuple(image.shape[2:]), need / 2**30, free / 2**30, image.device)
    return torch.device("cpu")

