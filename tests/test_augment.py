"""Foreground-based MRI normalisation, the foreground crop of every intensity kind, and nnU-Net's
intensity and resolution augmentations."""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from monai.data import MetaTensor
from monai.transforms import (
    Compose,
    CropForegroundd,
    EnsureTyped,
    NormalizeIntensityd,
    Orientationd,
    RandSimulateLowResolutiond,
    ScaleIntensityRanged,
    Spacingd,
)
from torch import nn

from hsmla_med.config import merge_config, task_config
from hsmla_med.data.checks import CheckCased, LoadCased
from hsmla_med.data.intensity import (
    ForegroundPercentiled,
    ForegroundZScored,
    RandBiasFieldAboveFloord,
    intensity_augmentations,
    otsu_foreground,
)
from hsmla_med.engine import SegmentationModule
from hsmla_med.errors import ConfigError
from hsmla_med.pipelines import btcv, endovis, luna16
from hsmla_med.pipelines.task import InferenceOptions
from tests.conftest import phantom, tiny_config, write_nifti

AUGMENTATIONS = ["noise", "blur", "brightness", "contrast", "lowres", "inverted_gamma", "gamma"]
# nnU-Net v2's nnUNetTrainer.get_training_transforms: apply_probability of each
NNUNET_PROBS = {"noise": 0.1, "blur": 0.2, "brightness": 0.15, "contrast": 0.15, "lowres": 0.25, "inverted_gamma": 0.1, "gamma": 0.3}


def _volume(background_mean: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(1, 24, 20, 10): a foreground box of values 60..140 in a background of
    N(background_mean, 3) (all zero for background_mean 0), and the box's mask."""
    rng = np.random.default_rng(seed)
    fg = np.zeros((1, 24, 20, 10), bool)
    fg[:, 4:20, 5:15, 2:8] = True
    values = rng.uniform(60, 140, fg.sum())
    image = rng.normal(background_mean, 3, fg.shape) if background_mean else np.zeros(fg.shape)
    image[fg] = values
    return image.astype(np.float32), fg


def _apply(transform, image: np.ndarray) -> np.ndarray:
    return transform({"image": MetaTensor(torch.from_numpy(image))})["image"].numpy()


def test_foreground_zscore_uses_foreground_statistics():
    image, fg = _volume(background_mean=10.0)
    out = _apply(ForegroundZScored("image"), image)
    values = image[fg]
    # Otsu may take in the top of the background's noise, a few voxels, hence the tolerance
    np.testing.assert_allclose(out, (image - values.mean()) / values.std(), rtol=0.02, atol=0.02)
    assert abs(out[fg].mean()) < 0.05 and abs(out[fg].std() - 1) < 0.02
    # a noisy non-zero background leaves the foreground's values about where a clean one puts them
    clean, _ = _volume(background_mean=0.0)
    np.testing.assert_allclose(out[fg], _apply(ForegroundZScored("image"), clean)[fg], atol=0.05)
    # whereas the non-zero z-score counts the noisy background as tissue
    nonzero = _apply(NormalizeIntensityd("image", nonzero=True, channel_wise=True), image)
    assert abs(nonzero[fg].mean()) > 1.0


def test_otsu_foreground_per_channel_and_constant_channel():
    image, fg = _volume(background_mean=10.0)
    mask = otsu_foreground(torch.from_numpy(np.concatenate([image, 3 * image + 500, np.full_like(image, 7.0)])))
    assert isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.shape == (3, *fg.shape[1:])
    for channel in mask[:2].numpy():
        assert channel[fg[0]].all() and channel[~fg[0]].mean() < 0.01  # the box, and at most the noise's top
    assert mask[2].all()  # a constant channel: all of it, not nothing


def test_percentile_clips_foreground_percentiles_to_unit_range():
    image, fg = _volume(background_mean=10.0)
    image[0, 10, 10, 5] = 5000.0  # a bright outlier
    out = _apply(ForegroundPercentiled("image", lower=2.0, upper=98.0), image)
    lo, hi = np.percentile(image[otsu_foreground(image)], [2.0, 98.0])  # the mask is tested above
    np.testing.assert_allclose(out, (np.clip(image, lo, hi) - lo) / (hi - lo), atol=1e-6)
    assert out.min() == 0.0 and out.max() == pytest.approx(1.0) and (out[~fg] == 0).all()


def _augment(**override) -> dict:
    """btcv's packaged ``data.augment``, every intensity augmentation off, then ``override``."""
    aug = task_config("btcv")["data"]["augment"]
    return {**aug, **{f"{name}_prob": 0.0 for name in AUGMENTATIONS}, **override}


def _augmented(aug: dict, dims: int, seed: int = 0) -> tuple[MetaTensor, dict]:
    shape = (2, 24, 20) if dims == 2 else (1, 20, 16, 12)
    image = MetaTensor(torch.rand(shape, generator=torch.Generator().manual_seed(seed)))
    label = MetaTensor(torch.randint(0, 3, shape, generator=torch.Generator().manual_seed(seed + 1)))
    out = Compose(intensity_augmentations(aug, dims)).set_random_state(seed)({"image": image.clone(), "label": label.clone()})
    assert torch.equal(out["label"], label)
    assert out["image"].shape == image.shape and out["image"].dtype == torch.float32
    return image, out


@pytest.mark.parametrize("dims", [2, 3])
@pytest.mark.parametrize("name", AUGMENTATIONS)
def test_each_augmentation_changes_only_the_image(name, dims):
    # lowres_zoom pinned below 1, where a zoom near 1 would round back to the same grid
    image, out = _augmented(_augment(**{f"{name}_prob": 1.0, "lowres_zoom": [0.5, 0.6]}), dims)
    assert not torch.allclose(out["image"], image)


@pytest.mark.parametrize("dims", [2, 3])
def test_probability_zero_is_identity(dims):
    image, out = _augmented(_augment(), dims)
    assert torch.equal(out["image"], image)


def test_augmentations_follow_nnunet_formulas():
    image, out = _augmented(_augment(brightness_prob=1.0, brightness_range=[1.5, 1.5]), 3)
    torch.testing.assert_close(out["image"], image * 1.5)
    image, out = _augmented(_augment(contrast_prob=1.0, contrast_range=[2.0, 2.0]), 3)
    torch.testing.assert_close(out["image"], ((image - image.mean()) * 2 + image.mean()).clamp(image.min(), image.max()))

    def gamma(x, g):  # batchgenerators' gamma with retain_stats, in numpy
        x = x.numpy().astype(np.float64)
        y = ((x - x.min()) / (x.max() - x.min())) ** g * (x.max() - x.min()) + x.min()
        return torch.from_numpy((y - y.mean()) / y.std() * x.std() + x.mean()).float()

    image, out = _augmented(_augment(gamma_prob=1.0, gamma_range=[2.0, 2.0]), 3)
    torch.testing.assert_close(out["image"].as_tensor(), gamma(image, 2.0), atol=1e-4, rtol=1e-4)
    image, out = _augmented(_augment(inverted_gamma_prob=1.0, gamma_range=[2.0, 2.0]), 3)
    torch.testing.assert_close(out["image"].as_tensor(), -gamma(-image, 2.0), atol=1e-4, rtol=1e-4)
    image, out = _augmented(_augment(noise_prob=1.0, noise_std=0.05), 3)
    assert 0 < (out["image"] - image).std() <= 0.05 * 1.05
    image, out = _augmented(_augment(blur_prob=1.0, blur_sigma=[1.0, 1.0]), 3)
    assert out["image"].std() < 0.6 * image.std()  # white noise, smoothed
    image, out = _augmented(_augment(lowres_prob=1.0, lowres_zoom=[0.5, 0.5]), 2)  # in-plane, (24, 20) -> (12, 10) -> back
    coarse = F.interpolate(image[None].as_tensor(), size=(12, 10), mode="nearest-exact")
    torch.testing.assert_close(out["image"].as_tensor(), F.interpolate(coarse, size=(24, 20), mode="bilinear")[0])


@pytest.mark.parametrize("dims", [2, 3])
def test_bias_field_on_a_zscored_image_is_the_scanners_field(dims):
    """The field applied to a z-scored MRI equals the z-score (same mean and std) of the raw
    image times that field: ``(raw * f - mean) / std``, the field ``f`` being MONAI's own
    RandBiasField drawn with the same seed on the raw image (air at 0 in the crop)."""
    from monai.transforms import RandBiasField

    rng = np.random.default_rng(dims)
    shape = (2, 24, 20) if dims == 2 else (2, 20, 16, 12)
    raw = rng.uniform(50, 150, shape).astype(np.float32)
    raw[(slice(None), slice(0, 3))] = 0.0  # air along one side, in both channels
    mean, std = raw.mean(axis=tuple(range(1, dims + 1)), keepdims=True), raw.std(axis=tuple(range(1, dims + 1)), keepdims=True)
    z = (raw - mean) / std
    out = RandBiasFieldAboveFloord("image", prob=1.0, coeff=0.3).set_random_state(7)({"image": torch.from_numpy(z)})["image"]
    field = RandBiasField(coeff_range=(-0.3, 0.3), prob=1.0).set_random_state(7)(torch.ones(shape))
    assert not torch.allclose(field, torch.ones(shape), atol=0.05)  # a field of some size
    expected = (raw * field.numpy() - mean) / std
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-4, atol=1e-4)


def test_bias_field_only_for_mri_and_its_probability():
    aug = _augment(bias_field_prob=1.0)
    assert not any(isinstance(t, RandBiasFieldAboveFloord) for t in intensity_augmentations(aug, 3))
    (first, *_) = intensity_augmentations(aug, 3, mri=True)
    assert isinstance(first, RandBiasFieldAboveFloord) and first.prob == 1.0
    image = torch.rand(1, 8, 8)
    out = RandBiasFieldAboveFloord("image", prob=0.0, coeff=0.3)({"image": image})["image"]
    assert torch.equal(out, image)
    with pytest.raises(ConfigError, match="data.augment.bias_field_coeff"):
        intensity_augmentations(_augment(bias_field_coeff=1.5), 3, mri=True)
    with pytest.raises(ConfigError, match="data.augment.bias_field_prob"):
        intensity_augmentations(_augment(bias_field_prob=2), 3, mri=True)


def test_btcv_trains_mri_with_a_bias_field_and_ct_without(tmp_path):
    config = tiny_config(tmp_path, tmp_path / "out")
    train, _ = btcv.transforms(config, 1, 3)
    assert not any(isinstance(t, RandBiasFieldAboveFloord) for t in train.transforms)
    config["data"]["intensity"] = {"kind": "zscore_foreground"}
    train, _ = btcv.transforms(config, 1, 3)
    assert sum(isinstance(t, RandBiasFieldAboveFloord) for t in train.transforms) == 1


@pytest.mark.parametrize(
    "key, value",
    [
        ("noise_prob", -0.1),
        ("gamma_prob", 1.5),
        ("blur_prob", "often"),
        ("noise_std", -0.2),
        ("blur_sigma", [1.0, 0.5]),
        ("brightness_range", [0.0, 1.25]),
        ("contrast_range", [0.75]),
        ("lowres_zoom", [0.5, 1.5]),
        ("gamma_range", "0.7-1.5"),
    ],
)
def test_builder_refuses_bad_values(key, value):
    with pytest.raises(ConfigError, match=f"data.augment.{key}"):
        intensity_augmentations(_augment(**{key: value}), 3)


@pytest.mark.parametrize("task", ["btcv", "luna16", "endovis"])
def test_packaged_defaults_are_nnunets(task):
    transforms = intensity_augmentations(task_config(task)["data"]["augment"], 2)
    assert {name: t.prob for name, t in zip(AUGMENTATIONS, transforms)} == NNUNET_PROBS


def test_pipelines_train_with_the_augmentations(tmp_path):
    def count(compose):
        return sum(isinstance(t, RandSimulateLowResolutiond) for t in compose.transforms)

    train, val = btcv.transforms(tiny_config(tmp_path, tmp_path / "out"), 1, 3)
    assert (count(train), count(val)) == (1, 0)
    train, val = luna16.transforms(task_config("luna16"))
    assert (count(train), count(val)) == (1, 0)
    train, val = endovis.transforms(task_config("endovis"))
    assert (count(train), count(val)) == (1, 0)


def test_bad_intensity_config_is_refused(tmp_path):
    config = tiny_config(tmp_path, tmp_path / "out")
    config["data"]["intensity"].update(kind="percentile", lower=99.0, upper=1.0)
    with pytest.raises(ConfigError, match="data.intensity.lower"):
        btcv.preprocessing(config["data"], 1, 3)
    config["data"]["intensity"]["kind"] = "minmax"
    with pytest.raises(ConfigError, match="data.intensity.kind"):
        btcv.preprocessing(config["data"], 1, 3)


def test_ct_path_unchanged(tmp_path):
    """The CT window now runs after the crop, on ``HU > a_min``: the same voxels, byte for byte,
    as the earlier window-then-``x > 0`` crop. An air border to crop, a patch at a_min in it (not
    foreground) and one just above (foreground), at the target spacing so that they stay exact."""
    image, label = phantom((40, 36, 8), np.random.default_rng(0))
    image, label = np.pad(image, 6, constant_values=-1000), np.pad(label, 6)
    image[3, 10:20, 8:10], image[6:46, 2, 8:10] = -175, -174
    affine = np.array([[-1.5, 0, 0, 30], [0, 1.5, 0, -5], [0, 0, 2.0, 3], [0, 0, 0, 1]])
    case = {"image": str(write_nifti(tmp_path / "ct.nii.gz", image, affine)), "label": str(write_nifti(tmp_path / "lab.nii.gz", label, affine))}
    config = tiny_config(tmp_path, tmp_path / "out")
    keys = ["image", "label"]
    resampled = [
        LoadCased(keys, ensure_channel_first=True, image_only=True),
        CheckCased(1, 3),
        Orientationd(keys, axcodes="RAS", labels=(("L", "R"), ("P", "A"), ("I", "S"))),
        Spacingd(keys, pixdim=config["data"]["spacing"], mode=["bilinear", "nearest"]),
    ]
    before = Compose([
        *resampled,
        ScaleIntensityRanged("image", a_min=-175.0, a_max=250.0, b_min=0.0, b_max=1.0, clip=True),
        CropForegroundd(keys, source_key="image", allow_smaller=True),
        EnsureTyped(keys, dtype=[torch.float32, torch.int64], track_meta=True),
    ])(case)
    now = Compose(btcv.preprocessing(config["data"], 1, 3))(case)
    full = Compose(resampled)(case)["image"].shape
    assert now["image"].shape[1:] == (full[1] - 12, full[2] - 8, full[3] - 12)  # the phantom and the -174 patch
    for key in keys:
        assert torch.equal(now[key].as_tensor(), before[key].as_tensor()) and now[key].dtype == before[key].dtype
        torch.testing.assert_close(now[key].affine, before[key].affine, rtol=0, atol=0)


class Everywhere(nn.Module):
    """Logits of class 1 at every voxel: after ``Invertd``, class 1 is exactly where the
    foreground crop was (outside it the un-crop pads zero probabilities, class 0)."""

    def forward(self, x):
        return torch.cat([torch.zeros_like(x), torch.ones_like(x)], dim=1)


@pytest.mark.parametrize("kind, background", [("zscore", 0.0), ("zscore_foreground", 20.0), ("percentile", 20.0)])
def test_mri_kinds_crop_the_whole_head_and_invert(tmp_path, kind, background):
    """An MRI-like head (ellipsoid with an intensity ramp and a bias field) in a zero or noisy
    background, oblique voxels: ``infer`` (preprocessing, network, ``Invertd``) returns the input
    shape, and the foreground crop holds the whole head and little else; a crop to the above-mean
    voxels (``x > 0`` after a z-score) would keep about half of it."""
    shape = (44, 40, 11)
    x, y, z = np.meshgrid(*(np.linspace(-1, 1, s) for s in shape), indexing="ij")
    head = x**2 / 0.36 + y**2 / 0.3 + z**2 / 0.5 < 1
    rng = np.random.default_rng(0)
    image = np.where(head, 300 * (1 + 0.8 * x), rng.normal(background, 5, shape) if background else 0.0) * (1 + 0.2 * y)
    affine = np.array([[-1.1, 0.2, 0, 10], [0.2, 1.1, 0, -4], [0, 0, 3.0, 2], [0, 0, 0, 1]])
    src = write_nifti(tmp_path / "mri.nii.gz", image.astype(np.float32), affine)
    config = merge_config(tiny_config(tmp_path, tmp_path / "out"), {"data": {"intensity": {"kind": kind}}})
    module = SegmentationModule(btcv.module_config(config, {"variant": "b0"}, ["background", "head"]), network=Everywhere())
    [out] = btcv.infer(module, src, tmp_path / "pred", InferenceOptions(progress=lambda _: None))
    crop = np.asanyarray(nib.load(str(out)).dataobj).astype(bool)
    assert crop.shape == shape
    assert (crop & head).sum() / head.sum() > 0.99 and crop.mean() < 0.5


@pytest.mark.parametrize("roi", [[48, 32], [32, 32]])
def test_training_crops_of_one_case_batch_whatever_their_in_plane_shape(tmp_path, roi):
    """A planned crop is seldom square; a quarter turn made some crops 32 x 48 and the batch
    failed to stack them (``stack expects each tensor to be equal size``)."""
    from monai.data import list_data_collate

    config = tiny_config(tmp_path, tmp_path / "out")
    config["data"].update(roi_size_2d=roi, samples_per_case=8)
    config["data"]["augment"]["rot90_prob"] = 1.0
    train, _ = btcv.transforms(config, 1, 3)
    case = {"image": str(write_nifti(tmp_path / "img.nii.gz", np.random.default_rng(0).normal(0, 100, (60, 50, 6)).astype(np.int16), np.diag([1.5, 1.5, 2.0, 1.0]))),
            "label": str(write_nifti(tmp_path / "lab.nii.gz", (np.arange(60 * 50 * 6).reshape(60, 50, 6) % 3).astype(np.uint8), np.diag([1.5, 1.5, 2.0, 1.0])))}
    batch = list_data_collate([train(dict(case))])
    assert tuple(batch["image"].shape) == (8, 1, *roi)


def test_ct_zscore_background_crops_centre_on_the_body_below_the_mean(tmp_path):
    """With the CT z-score, soft tissue below the foreground's mean is negative: background
    crops must still centre on it (above the clipped air), not only on voxels above the mean."""
    config = tiny_config(tmp_path, tmp_path / "out")
    config["data"].update(roi_size_2d=[16, 16], samples_per_case=16, pos_neg=[0, 1])
    config["data"]["intensity"] = {"kind": "ct_zscore", "a_min": -100.0, "a_max": 300.0, "mean": 150.0, "std": 50.0}
    for key in config["data"]["augment"]:  # the crops alone: no flip moves their centre, no noise their values
        if key.endswith("_prob"):
            config["data"]["augment"][key] = 0.0
    image = np.full((64, 64, 4), -1000, np.int16)
    image[16:48, 16:48] = -50  # the body: below the mean, above a_min
    image[30:34, 30:34] = 200  # the organ (labelled)
    label = np.zeros(image.shape, np.uint8)
    label[30:34, 30:34] = 1
    affine = np.diag([1.5, 1.5, 2.0, 1.0])
    case = {"image": str(write_nifti(tmp_path / "ct.nii.gz", image, affine)), "label": str(write_nifti(tmp_path / "lab.nii.gz", label, affine))}
    train, _ = btcv.transforms(config, 1, 2)
    floor = (-100.0 - 150.0) / 50.0
    crops = train(dict(case))
    # each crop's centre voxel (16 x 16 crops): unlabelled body, never air, never the organ (the
    # fallback when no background voxel passes the threshold)
    assert all(crop["label"][0, 8, 8] == 0 for crop in crops)
    assert all(crop["image"][0, 8, 8] > floor + 0.5 for crop in crops)
