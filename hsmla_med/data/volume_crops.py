"""Volume crops and augmentation shared by the volumetric segmentation tasks (BTCV, LUNA16).

The training mode ``config["mode"]`` (``2d``: axial slices, ``3d``: patches) sets the network's
spatial dims and which ``data.roi_size_*`` is the crop and inference window.
"""

from __future__ import annotations

import torch
from monai.transforms import (
    RandCropByPosNegLabeld,
    RandFlipd,
    RandRotate90d,
    RandShiftIntensityd,
    SpatialPadd,
    SqueezeDimd,
)
from monai.transforms.utils import map_binary_to_indices

from hsmla_med.data.intensity import intensity_augmentations
from hsmla_med.errors import ConfigError

__all__ = ["MODES", "MRI_KINDS", "MIN_ROI_SIDE", "spatial_dims", "roi_size", "RandCropAnnotatedd", "crop_and_augment"]

MODES = {"2d": 2, "3d": 3}
MRI_KINDS = ("zscore", "zscore_foreground")  # data.intensity kinds that give tissue negative values
# Smallest window side: below it the HSMLA networks' first attention stage (stride 16) holds one
# token along that axis and MONAI networks of four stride-2 levels cannot concatenate their skips;
# a 1 x 1 window trained, then ran sliding-window validation for hours (1024 windows per 32 x 32).
MIN_ROI_SIDE = 16


def spatial_dims(config: dict) -> int:
    """2 or 3, from ``config["mode"]``."""
    if config["mode"] not in MODES:
        raise ConfigError(f"mode must be one of {sorted(MODES)}, got {config['mode']!r}")
    return MODES[config["mode"]]


def roi_size(config: dict) -> list[int]:
    """The training crop and inference window of the config's mode, whole voxels of at least
    :data:`MIN_ROI_SIDE` per side (:class:`ConfigError` naming the option otherwise)."""
    key = "roi_size_2d" if spatial_dims(config) == 2 else "roi_size_3d"
    roi = config["data"][key]
    if not all(isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer() for v in roi):
        raise ConfigError(f"data.{key} must be whole numbers of voxels, got {roi!r}")
    if min(roi) < MIN_ROI_SIDE:
        raise ConfigError(
            f"data.{key} must be at least {MIN_ROI_SIDE} voxels per side (the network's first attention stage works at stride "
            f"{MIN_ROI_SIDE}, and smaller windows multiply the sliding windows of validation), got {list(roi)}"
        )
    return [int(v) for v in roi]


class RandCropAnnotatedd(RandCropByPosNegLabeld):
    """:class:`~monai.transforms.RandCropByPosNegLabeld` whose crops centre on no voxel of
    ``ignore_label``: foreground crops on labelled voxels, background crops on label 0 (above
    ``image_threshold`` where ``image_key`` is given).

    MONAI's crop counts every non-zero label as foreground: nnU-Net's ignore label (voxels without
    annotation) would centre "foreground" crops on unannotated tissue, which the loss then masks
    out. The indices are drawn per call, as MONAI's are (not cached with the preprocessing,
    where a volume's background indices would take 8 bytes per voxel).
    """

    def __init__(self, *args, ignore_label: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ignore_label = ignore_label

    def randomize(self, label: torch.Tensor | None = None, fg_indices=None, bg_indices=None, image: torch.Tensor | None = None) -> None:
        if self.ignore_label is not None and label is not None and fg_indices is None and bg_indices is None:
            annotated = label != self.ignore_label
            usable = annotated if image is None else annotated & (image > self.cropper.image_threshold).any(0, keepdim=True)
            fg_indices, bg_indices = map_binary_to_indices((label > 0) & annotated, usable, 0)
        super().randomize(label, fg_indices, bg_indices, image)


def crop_and_augment(config: dict, ignore_label: int | None = None) -> list:
    """Random training crops of a preprocessed ``image``/``label`` volume, centred on foreground
    or background in the ratio ``data.pos_neg``, and augmentation: flips, 90-degree rotations (of
    square in-plane crops), an
    intensity shift and nnU-Net's intensity and resolution augmentations
    (:func:`~hsmla_med.data.intensity.intensity_augmentations`; for an MRI intensity kind also a
    bias field, ``data.augment.bias_field_prob``, off by default). 2D mode crops single axial
    slices (``(h, w, 1)`` crops, the slice axis squeezed); 3D crops patches. Voxels of
    ``ignore_label`` centre no crop (:class:`RandCropAnnotatedd`)."""
    keys = ["image", "label"]
    dims = spatial_dims(config)
    roi = roi_size(config)
    crop = roi + [1] if dims == 2 else roi
    aug = config["data"]["augment"]
    pos, neg = config["data"]["pos_neg"]
    intensity = config["data"].get("intensity", {})
    # a CT window maps air to 0 and the CT z-score clips it to (a_min - mean) / std: background
    # crops centre on body voxels, above that floor. A z-scored MRI has negative tissue voxels,
    # so there any background voxel may be a centre.
    floor = (intensity["a_min"] - intensity["mean"]) / intensity["std"] if intensity.get("kind") == "ct_zscore" else 0.0
    train = [
        SpatialPadd(keys, spatial_size=crop),
        RandCropAnnotatedd(
            keys, "label", spatial_size=crop, pos=pos, neg=neg, num_samples=config["data"]["samples_per_case"],
            image_key=None if intensity.get("kind") in MRI_KINDS else "image", image_threshold=floor, ignore_label=ignore_label
        ),
    ]
    if dims == 2:
        train.append(SqueezeDimd(keys, dim=-1))
    train += [RandFlipd(keys, prob=aug["flip_prob"], spatial_axis=axis) for axis in range(dims)]
    # a quarter turn swaps the two in-plane sides: only a square crop keeps its shape (crops of
    # two shapes cannot be batched); flips along both axes still give the half turn
    if roi[0] == roi[1]:
        train.append(RandRotate90d(keys, prob=aug["rot90_prob"], max_k=3, spatial_axes=(0, 1)))
    train.append(RandShiftIntensityd("image", offsets=aug["shift_offset"], prob=aug["shift_prob"]))
    return train + intensity_augmentations(aug, dims, mri=intensity.get("kind") in MRI_KINDS)
