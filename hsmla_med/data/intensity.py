"""Intensity normalisation that does not need an exactly-zero background, and nnU-Net's default
intensity and resolution augmentations, as MONAI transforms.

Scanners differ in bias field, noise, contrast and resolution: the augmentations show the network
such differences during training, and the foreground-based normalisations keep the intensity scale
of an MRI volume independent of what its background holds (noise, a bias field, non-zero air).
"""

from __future__ import annotations

from abc import abstractmethod

import math
from collections.abc import Hashable, Mapping, Sequence

import numpy as np
import torch
from monai.config import KeysCollection, NdarrayOrTensor
from monai.data.meta_obj import get_track_meta
from monai.transforms import (
    MapTransform,
    RandAdjustContrastd,
    RandBiasField,
    RandGaussianNoised,
    RandGaussianSmoothd,
    RandScaleIntensityd,
    RandScaleIntensityFixedMeand,
    RandSimulateLowResolutiond,
    RandomizableTransform,
)
from monai.utils import convert_to_dst_type, convert_to_numpy, convert_to_tensor
from skimage.filters import threshold_otsu

from hsmla_med.errors import ConfigError

__all__ = ["otsu_foreground", "ForegroundZScored", "ForegroundPercentiled", "RandBiasFieldAboveFloord", "intensity_augmentations"]


def _channel_foreground(channel: np.ndarray) -> np.ndarray:
    # Otsu's threshold of the channel clipped at its 99.9th percentile: a few extreme voxels (a
    # vessel, an artefact) would otherwise make the best split "them against the rest"
    top = np.percentile(channel, 99.9)
    clipped = np.minimum(channel, top)
    if clipped.min() < top:
        # flattened: Otsu's threshold depends on the histogram only (skimage flattens it too), and a
        # volume whose last axis is 3 or 4 voxels long would be taken for an RGB image and warned about
        return channel > threshold_otsu(clipped.reshape(-1))
    above = channel > top  # at least 99.9% of the voxels at the minimum: the rest is foreground
    return above if above.any() else np.ones(channel.shape, bool)  # a constant channel: all of it


def otsu_foreground(image: NdarrayOrTensor) -> NdarrayOrTensor:
    """Channel-first boolean mask of the voxels above each channel's Otsu threshold. Otsu splits
    the intensity histogram into background and tissue wherever the background lies, so noise or
    a bias field in the background does not move the mask much, unlike ``x != 0``."""
    mask = np.stack([_channel_foreground(c) for c in convert_to_numpy(image)])
    return convert_to_dst_type(mask, image, dtype=bool)[0]


class _ForegroundNormalised(MapTransform):
    """Per channel: clip to ``[low, high]``, then ``(x - offset) / scale``, the four numbers taken
    from the channel's Otsu foreground (:func:`otsu_foreground`) by :meth:`statistics` and applied
    to every voxel. MONAI's intensity transforms take their statistics from the whole image or
    from ``x != 0``; none finds the foreground mask itself, hence these transforms."""

    @abstractmethod
    def statistics(self, values: np.ndarray) -> tuple[float, float, float, float]:
        """``low, high, offset, scale`` from a channel's foreground values."""

    def __call__(self, data: Mapping[Hashable, NdarrayOrTensor]) -> dict:
        d = dict(data)
        for key in self.key_iterator(d):
            image = convert_to_tensor(d[key], dtype=torch.float32, track_meta=get_track_meta())
            array, mask = convert_to_numpy(image), convert_to_numpy(otsu_foreground(image))
            stats = torch.tensor([self.statistics(c[m]) for c, m in zip(array, mask)], dtype=torch.float32)
            low, high, offset, scale = stats.reshape(len(stats), 4, *[1] * (image.ndim - 1)).unbind(1)
            d[key] = (image.clamp(low, high) - offset) / scale
        return d


class ForegroundZScored(_ForegroundNormalised):
    """Z-score with the mean and standard deviation of the Otsu foreground (nnU-Net's MRI z-score,
    with an automatic mask where nnU-Net uses ``x != 0``), no clipping; background voxels get
    whatever value results (far below 0)."""

    def statistics(self, values: np.ndarray) -> tuple[float, float, float, float]:
        std = float(values.std())
        return -math.inf, math.inf, float(values.mean()), std if std > 0 else 1.0


class ForegroundPercentiled(_ForegroundNormalised):
    """Clip to the ``lower``/``upper`` percentiles (0..100) of the Otsu foreground and map that
    range linearly to 0..1: a CT-window-like scale for MRI, where no fixed window exists, robust to
    bright outliers; the background (below the foreground's low percentile) becomes 0."""

    def __init__(self, keys: KeysCollection, lower: float = 0.5, upper: float = 99.5, allow_missing_keys: bool = False) -> None:
        super().__init__(keys, allow_missing_keys)
        self.lower, self.upper = lower, upper

    def statistics(self, values: np.ndarray) -> tuple[float, float, float, float]:
        low, high = (float(v) for v in np.percentile(values, [self.lower, self.upper]))
        return low, high, low, high - low if high > low else 1.0


class RandBiasFieldAboveFloord(RandomizableTransform, MapTransform):
    """An MRI bias field (MONAI's :class:`~monai.transforms.RandBiasField`: ``exp`` of a random
    Legendre polynomial of ``degree``, coefficients uniform in ``[-coeff, coeff]``) on an image
    that is already z-scored.

    A scanner's field multiplies the measured intensities, whose air is about 0; after the
    z-score the air sits at ``-mean / std`` instead, and MONAI's transform, which multiplies the
    stored values, would scale tissue around that z-score's 0 (the tissue mean) instead. Here each
    channel is multiplied above its minimum in the crop, the air of a crop that holds air: ``floor +
    (x - floor) * field``. For a crop wholly inside tissue the darkest voxel stands in for the
    air, a smaller field than a scanner's on those intensities.
    """

    def __init__(self, keys: KeysCollection, prob: float, coeff: float, degree: int = 3, allow_missing_keys: bool = False) -> None:
        MapTransform.__init__(self, keys, allow_missing_keys)
        RandomizableTransform.__init__(self, prob)
        self.field = RandBiasField(degree=degree, coeff_range=(-coeff, coeff), prob=1.0)

    def set_random_state(self, seed=None, state=None) -> RandBiasFieldAboveFloord:
        super().set_random_state(seed, state)
        self.field.set_random_state(seed, state)
        return self

    def __call__(self, data: Mapping[Hashable, NdarrayOrTensor]) -> dict:
        d = dict(data)
        self.randomize(None)
        if not self._do_transform:
            return d
        for key in self.key_iterator(d):
            image = convert_to_tensor(d[key], dtype=torch.float32, track_meta=get_track_meta())
            floor = image.flatten(1).amin(dim=1).reshape(-1, *[1] * (image.ndim - 1))
            d[key] = self.field(image - floor) + floor
        return d


def _prob(aug: Mapping, key: str) -> float:
    value = aug[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(f"data.augment.{key} must be a probability in [0, 1], got {value!r}")
    return float(value)


def _range(aug: Mapping, key: str, high: float = math.inf) -> tuple[float, float]:
    """``[min, max]`` with ``0 < min <= max <= high``."""
    value = aug[key]
    ok = isinstance(value, Sequence) and len(value) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    if not ok or not 0 < value[0] <= value[1] <= high:
        bound = "" if high == math.inf else f" <= {high:g}"
        raise ConfigError(f"data.augment.{key} must be [min, max] with 0 < min <= max{bound}, got {value!r}")
    return float(value[0]), float(value[1])


def intensity_augmentations(aug: Mapping, spatial_dims: int, keys: KeysCollection = "image", mri: bool = False) -> list:
    """nnU-Net's default intensity and resolution augmentations (``nnUNetTrainer.
    get_training_transforms``), in its order, on ``keys`` only: labels stay exact and every
    transform keeps the shape. ``aug`` is a task's ``data.augment`` section; a ``*_prob`` of 0
    switches one off. ``spatial_dims`` 2 (slices, frames) blurs and lowers the resolution in-plane.
    ``mri`` (a z-scored MRI) puts a bias field first (:class:`RandBiasFieldAboveFloord`,
    ``bias_field_prob``, ``bias_field_coeff``), as a scanner's coil puts it before the noise;
    nnU-Net has none, and a CT's Hounsfield units have no such field.

    Where MONAI's transform draws its parameter differently from nnU-Net: the noise standard
    deviation is drawn uniformly in ``(0, noise_std)`` (nnU-Net: the variance in ``(0, 0.1)``,
    ``noise_std`` defaults to its square root), and factors uniformly in their range (nnU-Net:
    below or above 1 with equal chance); nnU-Net's per-channel coin flips for blur and low
    resolution are left out.
    """
    if spatial_dims not in (2, 3):
        raise ValueError(f"spatial_dims must be 2 or 3, got {spatial_dims}")
    noise_std = aug["noise_std"]
    if isinstance(noise_std, bool) or not isinstance(noise_std, (int, float)) or noise_std < 0:
        raise ConfigError(f"data.augment.noise_std must be a number >= 0, got {noise_std!r}")
    sigma = _range(aug, "blur_sigma")
    brightness = _range(aug, "brightness_range")
    contrast = _range(aug, "contrast_range")
    gamma = _range(aug, "gamma_range")
    bias = []
    if mri:
        coeff = aug["bias_field_coeff"]
        if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or not 0 <= coeff <= 1:
            raise ConfigError(f"data.augment.bias_field_coeff must be a number in [0, 1], got {coeff!r}")
        bias = [RandBiasFieldAboveFloord(keys, prob=_prob(aug, "bias_field_prob"), coeff=float(coeff))]
    return bias + [
        RandGaussianNoised(keys, prob=_prob(aug, "noise_prob"), std=float(noise_std)),
        RandGaussianSmoothd(keys, sigma_x=sigma, sigma_y=sigma, sigma_z=sigma, prob=_prob(aug, "blur_prob")),
        # v * (1 + factor): a multiplier range m becomes factors m - 1
        RandScaleIntensityd(keys, factors=(brightness[0] - 1, brightness[1] - 1), prob=_prob(aug, "brightness_prob"), channel_wise=True),
        # contrast around the mean, clipped to the original range: nnU-Net's ContrastTransform
        RandScaleIntensityFixedMeand(
            keys, factors=(contrast[0] - 1, contrast[1] - 1), preserve_range=True, prob=_prob(aug, "contrast_prob"), channel_wise=True
        ),
        RandSimulateLowResolutiond(
            keys,
            prob=_prob(aug, "lowres_prob"),
            downsample_mode="nearest-exact",
            upsample_mode="bilinear" if spatial_dims == 2 else "trilinear",
            zoom_range=_range(aug, "lowres_zoom", high=1.0),
        ),
        # gamma of the min-max-scaled image with mean and std restored: nnU-Net's GammaTransform,
        # once on the inverted image (dark structures brightened), once as is
        RandAdjustContrastd(keys, prob=_prob(aug, "inverted_gamma_prob"), gamma=gamma, invert_image=True, retain_stats=True),
        RandAdjustContrastd(keys, prob=_prob(aug, "gamma_prob"), gamma=gamma, retain_stats=True),
    ]
