"""Sliding-window prediction of whole volumes, for 2D (slice-wise) and 3D networks.

One function, :func:`predict_volume`, serves validation, ``evaluate`` and ``infer``: MONAI's
``sliding_window_inference`` with Gaussian blending, optional mirroring test-time augmentation,
and — for a 2D network — a slab adapter that runs the network on every axial slice of each
window, so 2D and 3D models share the inference and metric code.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from monai.inferers import sliding_window_inference
from torch import nn

__all__ = ["SliceNetwork", "predict_volume"]


class SliceNetwork(nn.Module):
    """Apply a 2D network to every slice along the last axis of ``(B, C, H, W, D)`` input.

    The slices go through the network as one batch of ``B * D`` images; output is
    ``(B, out_channels, H, W, D)``.
    """

    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        self.network = network

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w, d = x.shape
        slices = x.permute(0, 4, 1, 2, 3).reshape(b * d, c, h, w)
        out = self.network(slices)
        return out.reshape(b, d, -1, h, w).permute(0, 2, 3, 4, 1)


def predict_volume(
    network: nn.Module,
    image: torch.Tensor,
    roi_size: Sequence[int],
    spatial_dims: int,
    overlap: float = 0.5,
    sw_batch_size: int = 4,
    tta: bool = False,
    slab: int = 8,
) -> torch.Tensor:
    """Class probabilities ``(B, classes, H, W, D)`` for volumes ``(B, C, H, W, D)``.

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
        slab: slices per window for a 2D network.
    """
    if spatial_dims == 2:
        predictor: nn.Module = SliceNetwork(network)
        roi = (*roi_size, slab)
        overlaps: float | tuple[float, ...] = (overlap, overlap, 0.0)
        axes = (2, 3)
    elif spatial_dims == 3:
        predictor, roi, overlaps, axes = network, tuple(roi_size), overlap, (2, 3, 4)
    else:
        raise ValueError(f"spatial_dims must be 2 or 3, got {spatial_dims}")
    flips = [()] + [(a,) for a in axes] if tta else [()]
    probs = None
    for flip in flips:
        x = torch.flip(image, flip) if flip else image
        logits = sliding_window_inference(x, roi, sw_batch_size, predictor, overlap=overlaps, mode="gaussian")
        p = torch.softmax(logits.float(), dim=1)
        p = torch.flip(p, flip) if flip else p
        probs = p if probs is None else probs + p
    return probs / len(flips)
