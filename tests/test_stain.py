"""Slide-level Macenko stain normalisation and HED stain augmentation (hsmla_med.data.stain):
stain vectors of synthetic slides recovered, the per-pixel map against a float64 reference,
overlapping patches normalised alike (MONAI's per-patch normalisation does not), a second-stain
copy of a slide brought onto the first, the cache, the HED jitter's identity and statistics, the
config checks, and the CAMELYON16 pipeline's wiring (training chain, checkpoint, wsi-heatmap)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from monai.apps.pathology.transforms.stain.array import NormalizeHEStains
from monai.transforms import Compose
from skimage.color import rgb2hed
from torch import nn

from hsmla_med.config import merge_config, task_config
from hsmla_med.data.slides import open_slide, patch_grid, read_region, tissue_mask
from hsmla_med.data.stain import (REFERENCE_BACKGROUND, REFERENCE_MAX_CONCENTRATIONS, REFERENCE_STAINS, NormalizeStaind, RandHEDJitterd,
                                  SlideStain, hed_jitter, normalize_stain, optical_density, slide_stain, stain_normalization)
from hsmla_med.data.synthetic.wsi import DEFAULT_STAIN, OTHER_STAIN, generate_camelyon16
from hsmla_med.engine.classification import ClassificationModule
from hsmla_med.errors import ConfigError
from hsmla_med.pipelines import camelyon16
from hsmla_med.pipelines.task import InferenceOptions

SIZE = (1024, 768)
TUMOUR = "training/tumor/tumor_001.tif"
MIN_AREA_UM2 = 15000.0  # the task's default tissue_min_area_um2


def _cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """One synthetic tumour slide written twice: Ruifrok's H&E and another laboratory's."""
    root = tmp_path_factory.mktemp("stain")
    common = dict(num_normal=0, num_tumor=1, num_test=0, size=SIZE, seed=0)
    return {"default": generate_camelyon16(root / "default", **common) / TUMOUR,
            "other": generate_camelyon16(root / "other", stain=OTHER_STAIN, **common) / TUMOUR}


def _rgb(path) -> np.ndarray:
    slide = open_slide(path)
    return read_region(slide, 0, 0, 0, slide.dimensions)


def _chw(rgb: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(rgb).permute(2, 0, 1)


def test_stain_vectors_of_both_copies_are_recovered(copies):
    for name, (haematoxylin, eosin) in (("default", DEFAULT_STAIN), ("other", OTHER_STAIN)):
        stain = slide_stain(copies[name], None, MIN_AREA_UM2)
        assert _cosine(stain.stains[:, 0], haematoxylin) > 0.99, name  # haematoxylin first
        assert _cosine(stain.stains[:, 1], eosin) > 0.99, name
        np.testing.assert_allclose(np.linalg.norm(stain.stains, axis=0), 1.0, rtol=1e-9)
        # the glass, (240, 238, 241) up to noise, is the background: OD 0 there
        assert np.abs(stain.background - [241, 239, 242]).max() <= 2
    # the other laboratory's haematoxylin is 1.25 times as strong, its eosin 0.8 times
    ratio = slide_stain(copies["other"], None, MIN_AREA_UM2).max_concentrations / slide_stain(copies["default"], None, MIN_AREA_UM2).max_concentrations
    assert ratio[0] > 1.05 and ratio[1] < 0.9


def test_stains_come_from_tiles_at_the_patch_level_not_the_low_resolution_picture(copies):
    """The stain strengths estimated from tissue tiles read at level 0 match the estimate from all of
    level 0's tissue pixels even when the tissue mask's picture is level 2 (4 x 4 block means, where
    the picture's own pixels under-estimate the second laboratory's weaker eosin: 1.04 times the
    first's against 0.88 from level 0, the truth 0.8)."""
    def eosin_ratio(**kwargs) -> float:
        other, default = (slide_stain(copies[name], None, MIN_AREA_UM2, **kwargs) for name in ("other", "default"))
        return float(other.max_concentrations[1] / default.max_concentrations[1])

    level0 = eosin_ratio(tiles=0)  # this slide's default picture is its level 0: every tissue pixel
    coarse = dict(picture=(256, 512))  # level 2, 256 x 192
    assert abs(eosin_ratio(**coarse, tiles=0) - level0) > 0.1  # the picture's pixels alone: off
    assert abs(eosin_ratio(**coarse, tiles=64) - level0) < 0.02
    # the tiles' level by index or by resolution (0.972 µm at level 0, about 1.94 at level 1)
    by_index = slide_stain(copies["default"], None, MIN_AREA_UM2, **coarse, level=1)
    by_mpp = slide_stain(copies["default"], None, MIN_AREA_UM2, **coarse, mpp=1.9)
    np.testing.assert_array_equal(by_index.stains, by_mpp.stains)
    assert not np.array_equal(by_index.stains, slide_stain(copies["default"], None, MIN_AREA_UM2, **coarse).stains)
    with pytest.raises(ValueError, match="tiles"):
        slide_stain(copies["default"], None, MIN_AREA_UM2, tiles=-1)


def _reference_map(rgb: np.ndarray, stain: SlideStain) -> np.ndarray:
    """Macenko's normalisation written out per pixel in float64: OD, least-squares concentrations
    with the slide's matrix, scaled to the reference maxima, re-coloured with the reference."""
    od = -np.log(np.minimum(rgb.reshape(-1, 3).astype(np.float64) + 1, stain.background) / stain.background)
    concentrations = np.linalg.lstsq(stain.stains, od.T, rcond=None)[0]
    concentrations *= (REFERENCE_MAX_CONCENTRATIONS / stain.max_concentrations)[:, None]
    out = REFERENCE_BACKGROUND * np.exp(-(REFERENCE_STAINS @ concentrations)) - 1
    return np.clip(out.T, 0, 255).reshape(rgb.shape)


def test_normalisation_is_macenkos_map_in_float64():
    rng = np.random.default_rng(0)
    stains = np.array([[0.62, 0.10], [0.72, 0.97], [0.31, 0.22]])
    stain = SlideStain(stains / np.linalg.norm(stains, axis=0), np.array([1.7, 0.9]), np.array([241.0, 237.0, 243.0]))
    rgb = rng.integers(0, 256, (37, 53, 3), dtype=np.uint8)
    expected = _reference_map(rgb, stain)
    out = normalize_stain(_chw(rgb), stain)
    assert out.dtype == torch.uint8 and out.shape == (3, 37, 53)
    assert out.permute(1, 2, 0).is_contiguous()  # channels last, as the patch was read
    assert np.abs(out.permute(1, 2, 0).numpy() - np.rint(expected)).max() <= 1  # float32 tables: a half grey level may round either way
    assert (out.permute(1, 2, 0).numpy() == np.rint(expected)).mean() > 0.99
    floats = normalize_stain(_chw(rgb).float() / 255, stain)
    assert floats.dtype == torch.float32
    np.testing.assert_allclose(floats.permute(1, 2, 0).numpy() * 255, expected, atol=2e-3 * 255)
    # the reference stain and maxima with Io = 240: pixels in the stain plane come back as they were
    plane = np.clip(240 * np.exp(-(rng.uniform(0, 1.5, (500, 2)) @ REFERENCE_STAINS.T)) - 1, 0, 255).round().astype(np.uint8)[None]
    same = normalize_stain(_chw(plane), SlideStain(REFERENCE_STAINS, REFERENCE_MAX_CONCENTRATIONS, np.full(3, 240.0)))
    assert np.abs(same.permute(1, 2, 0).numpy().astype(int) - plane).max() <= 1


def test_a_pixel_shared_by_overlapping_patches_is_normalised_identically(copies, tmp_path):
    """Neighbouring 128-pixel patches of the tissue, overlapping by half: with the slide's stain
    matrix the shared pixels are the same in both; MONAI's NormalizeHEStains, which estimates a
    matrix per patch, gives them different colours (MONAI #4015)."""
    path = str(copies["default"])
    slide = open_slide(path)
    tissue, downsample = tissue_mask(slide, min_area=MIN_AREA_UM2 / 0.972**2)
    corners = {tuple(c) for c in patch_grid(tissue, downsample, slide.dimensions, 128, 64, 1.0, 0.9)[0].tolist()}
    pairs = [(x, y) for x, y in sorted(corners) if (x + 64, y) in corners]
    assert pairs
    read = Compose([camelyon16.ReadPatchd(uint8=True), NormalizeStaind("image", tmp_path, MIN_AREA_UM2)])
    monai = NormalizeHEStains()
    per_patch = []
    for x, y in pairs:
        left, right = (read({"slide": path, "x": x + dx, "y": y, "level": 0, "size": 128})["image"] for dx in (0, 64))
        assert left.dtype == torch.uint8
        assert torch.equal(left[:, :, 64:], right[:, :, :64])
        raw = [read_region(slide, x + dx, y, 0, 128) for dx in (0, 64)]
        left, right = (monai(r).astype(np.int64) for r in raw)
        per_patch.append(np.abs(left[:, 64:] - right[:, :64]).mean())
    assert max(per_patch) > 2  # grey levels, on average over the shared pixels


def test_normalisation_brings_the_other_stain_onto_the_first(copies, tmp_path):
    """Mean colour distance of tissue pixels between the two copies of the slide, before and
    after each is normalised with its own slide's stain matrix: at least 3 times smaller."""
    default, other = _rgb(copies["default"]), _rgb(copies["other"])
    slide = open_slide(copies["default"])
    tissue, downsample = tissue_mask(slide, min_area=MIN_AREA_UM2 / 0.972**2)
    assert downsample == 1.0 and tissue.shape == default.shape[:2] and tissue.mean() > 0.05
    before = np.linalg.norm(default[tissue].astype(np.float64) - other[tissue], axis=1).mean()
    normalised = [normalize_stain(_chw(rgb), slide_stain(path, tmp_path, MIN_AREA_UM2)).permute(1, 2, 0).numpy()
                  for rgb, path in ((default, copies["default"]), (other, copies["other"]))]
    after = np.linalg.norm(normalised[0][tissue].astype(np.float64) - normalised[1][tissue], axis=1).mean()
    assert before > 20 and before / after >= 3, (before, after)


def test_the_estimate_is_cached_per_slide_and_parameters(copies, tmp_path, caplog):
    fresh = slide_stain(copies["default"], None, MIN_AREA_UM2)
    first = slide_stain(copies["default"], tmp_path, MIN_AREA_UM2)
    files = list(tmp_path.glob("tumor_001-stain-*.npz"))
    assert len(files) == 1
    for got in (first, slide_stain(copies["default"], tmp_path, MIN_AREA_UM2)):
        for field in ("stains", "max_concentrations", "background"):
            np.testing.assert_array_equal(getattr(got, field), getattr(fresh, field))
    slide_stain(copies["default"], tmp_path, 2 * MIN_AREA_UM2)  # other parameters: another entry
    assert len(list(tmp_path.glob("tumor_001-stain-*.npz"))) == 2
    files[0].write_bytes(b"not an npz")
    with caplog.at_level("WARNING", logger="hsmla_med"):
        again = slide_stain(copies["default"], tmp_path, MIN_AREA_UM2)
    assert "damaged stain cache" in caplog.text
    np.testing.assert_array_equal(again.stains, fresh.stains)


def test_optical_density_is_zero_on_glass_and_beer_lambert_below():
    background = np.array([241.0, 239.0, 242.0])
    np.testing.assert_array_equal(optical_density([[240, 238, 241], [255, 255, 255]], background), 0.0)
    np.testing.assert_allclose(optical_density([[119, 59, 241]], background), -np.log([[120 / 241, 60 / 239, 1.0]]))


def _tissue_patch(path, size: int = 96) -> torch.Tensor:
    """A float patch in 0..1 from the middle of the slide's tissue."""
    slide = open_slide(path)
    tissue, _ = tissue_mask(slide, min_area=MIN_AREA_UM2 / 0.972**2)
    rows, cols = np.nonzero(tissue)
    y, x = int(np.median(rows)) - size // 2, int(np.median(cols)) - size // 2
    return _chw(read_region(slide, x, y, 0, size)).float() / 255


def test_hed_jitter_without_sigma_and_bias_is_the_identity(copies):
    image = _tissue_patch(copies["default"])
    out = RandHEDJitterd("image", prob=1.0, sigma=0.0, bias=0.0)({"image": image})["image"]
    assert out.shape == image.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, image, atol=1e-6, rtol=0)


def test_hed_jitter_scales_and_shifts_each_stain_as_configured(copies):
    """rgb2hed of the output is ``a * s + b`` per stain (where neither clipping nor rgb2hed's
    floor at 0 acts), with ``a`` and ``b`` within the configured ranges and spread over them."""
    image = _tissue_patch(copies["default"])
    before = rgb2hed(image.permute(1, 2, 0).numpy().astype(np.float64)).reshape(-1, 3)
    jitter = RandHEDJitterd("image", prob=1.0, sigma=0.2, bias=0.01)
    jitter.set_random_state(seed=3)
    scales, shifts = [], []
    for _ in range(40):
        out = jitter({"image": image})["image"].permute(1, 2, 0).numpy().astype(np.float64)
        after = rgb2hed(out).reshape(-1, 3)
        unclipped = ((out > 0) & (out < 1)).all(axis=-1).reshape(-1)
        for k in range(3):
            used = unclipped & (before[:, k] > 1e-3) & (after[:, k] > 1e-3)
            slope, intercept = np.polyfit(before[used, k], after[used, k], 1)
            assert slope == pytest.approx(jitter.scale[k], abs=1e-4) and intercept == pytest.approx(jitter.shift[k], abs=1e-5)
        scales.append(jitter.scale.copy())
        shifts.append(jitter.shift.copy())
    scales, shifts = np.array(scales), np.array(shifts)
    assert np.abs(scales - 1).max() <= 0.2 and np.abs(scales - 1).max() > 0.15
    assert np.abs(shifts).max() <= 0.01 and np.abs(shifts).max() > 0.0075
    assert abs(scales.mean() - 1) < 0.05 and abs(shifts.mean()) < 0.003  # centred
    # the stains change: haematoxylin of the tissue moves with the draw
    assert np.std([s[0] for s in scales]) > 0.05


def test_hed_jitter_is_seeded_like_monais_random_transforms(copies):
    image = _tissue_patch(copies["default"], 32)
    outputs = []
    for seed in (1, 1, 2):
        chain = Compose([RandHEDJitterd("image", prob=0.5, sigma=0.1, bias=0.01)])
        chain.set_random_state(seed=seed)
        outputs.append(torch.stack([chain({"image": image})["image"] for _ in range(8)]))
    assert torch.equal(outputs[0], outputs[1]) and not torch.equal(outputs[0], outputs[2])
    applied = [not torch.equal(o, image) for o in outputs[0]]
    assert 0 < sum(applied) < 8  # prob 0.5: some patches left as read


def _config(root, **data) -> dict:
    override = {
        "data": {"data_dir": str(root), "cache_dir": str(root / "cache"), "patch_size": 64, "stride": 64, "folds": 2,
                 "samples_per_epoch": 8, "batch_size": 4, "num_workers": 0, **data},
        "trainer": {"max_steps": 1, "accelerator": "cpu"},
    }
    return merge_config(task_config("camelyon16"), override)


@pytest.mark.parametrize("key, value", [
    ("stain_normalization", "reinhard"), ("stain_normalization", 1),
    ("augment.hed_prob", 1.5), ("augment.hed_prob", True), ("augment.hed_sigma", 1.0), ("augment.hed_sigma", -0.1),
    ("augment.hed_sigma", "0.1"), ("augment.hed_bias", -0.01),
])
def test_bad_stain_options_are_refused_naming_the_key(tmp_path, key, value):
    section, _, name = key.rpartition(".")
    data = {section: {name: value}} if section else {name: value}
    config = _config(tmp_path, **data)
    with pytest.raises(ConfigError, match=re.escape(f"data.{key} must be")) as err:
        camelyon16.transforms(config)
    assert str(err.value).endswith(f"got {value!r}")


def test_options_off_by_default_build_no_normalisation(tmp_path):
    config = task_config("camelyon16")
    assert config["data"]["stain_normalization"] is None and config["data"]["augment"]["hed_prob"] == 0.0
    assert stain_normalization(config["data"], tmp_path) == []
    assert hed_jitter(config["data"]["augment"]).prob == 0.0


class Recorder(nn.Module):
    """A stub classifier that keeps every batch it sees (tumour logit: the patch's darkness)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def forward(self, x):
        self.seen.append(x.detach().float().clone())
        darkness = 1 - x.mean(dim=(1, 2, 3))
        return torch.stack([torch.zeros_like(darkness), 10 * darkness], dim=1)


def test_the_pipeline_normalises_training_validation_and_heatmap_patches(copies, tmp_path):
    """With ``stain_normalization: macenko`` the stain is estimated once per slide by the main
    process (while the patch grid is cut) and cached; training and validation patches, and the
    patches ``wsi-heatmap`` reads from a checkpoint's config, are the normalised bytes."""
    root = copies["default"].parents[2]
    config = _config(root, stain_normalization="macenko", augment={"flip_prob": 0.0, "rot90_prob": 0.0, "colour_prob": 0.0})
    case = {"slide": str(copies["default"]), "annotation": str(root / "training/lesion_annotations/tumor_001.xml"), "label": 1}
    grid = camelyon16.slide_patches(case, config["data"])
    cache = root / "cache" / "camelyon16-patches"
    assert len(list(cache.glob("tumor_001-stain-*.npz"))) == 1
    stain = slide_stain(copies["default"], cache, MIN_AREA_UM2)
    item = {"slide": case["slide"], "x": int(grid["coords"][0][0]), "y": int(grid["coords"][0][1]), "level": 0, "size": 64}
    raw = camelyon16.ReadPatchd(uint8=True)(item)["image"]
    expected = normalize_stain(raw, stain)
    train, val = camelyon16.transforms(config)
    assert torch.equal(val(item)["image"], expected)
    torch.testing.assert_close(train(item)["image"], normalize_stain(raw.float() / 255, stain))
    hparams = camelyon16.module_config(config, {"variant": "b0"}, camelyon16.LABELS)
    assert hparams["data"]["stain_normalization"] == "macenko"
    module = ClassificationModule(hparams, network=Recorder())
    camelyon16.infer(module, case["slide"], tmp_path / "heat", InferenceOptions(progress=lambda _: None, batch_size=len(grid["coords"])))
    seen = torch.cat(module.network.seen)
    assert len(seen) == len(grid["coords"])
    reader = camelyon16.ReadPatchd(uint8=True)
    for (x, y), patch in zip(grid["coords"], seen):
        normalised = normalize_stain(reader({**item, "x": int(x), "y": int(y)})["image"], stain)
        assert torch.equal(patch, normalised.float() / 255)
