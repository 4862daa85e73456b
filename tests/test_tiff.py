"""Pyramidal TIFF writer: what OpenSlide reads back (levels, pixels, mpp), the OME metadata and
TIFF layout as tifffile sees them, a pipeline heatmap registered to its slide by the two files'
pixel sizes alone, atomic replacement and refused inputs."""

import json

import numpy as np
import openslide
import pytest
import tifffile
import torch
from torch import nn

from hsmla_med.config import merge_config, task_config
from hsmla_med.data.asap import read_asap_xml, rasterise
from hsmla_med.data.synthetic.wsi import generate_camelyon16
from hsmla_med.engine.classification import ClassificationModule
from hsmla_med.errors import DataError
from hsmla_med.io import tiff
from hsmla_med.io.tiff import pyramid_shapes, write_pyramidal_tiff
from hsmla_med.pipelines import camelyon16
from hsmla_med.pipelines.task import InferenceOptions

H, W = 701, 1001  # odd on both axes: partial edge tiles and partial 2x2 blocks


def _smooth_rgb(height=H, width=W) -> np.ndarray:
    """Gradients and soft waves: JPEG keeps them within a few grey levels."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    rgb = np.stack([128 + 100 * np.sin(x / 37) * np.cos(y / 53), 255 * x / width, 255 * y / height], axis=-1)
    return np.clip(np.rint(rgb), 0, 255).astype(np.uint8)


def _block_mean(image: np.ndarray) -> np.ndarray:
    """Mean of the pixels each 2x2 block covers (fewer along odd edges), rounded half up."""
    height, width = image.shape[:2]
    padded = np.full((height + height % 2, width + width % 2) + image.shape[2:], np.nan)
    padded[:height, :width] = image
    blocks = padded.reshape(padded.shape[0] // 2, 2, padded.shape[1] // 2, 2, *image.shape[2:])
    return np.floor(np.nanmean(blocks, axis=(1, 3)) + 0.5).astype(np.uint8)


def _levels(image: np.ndarray, count: int) -> list[np.ndarray]:
    """The float64 reference pyramid: level 0, then 2x2 block means."""
    levels = [image]
    while len(levels) < count:
        levels.append(_block_mean(levels[-1]))
    return levels


def _read(slide: openslide.OpenSlide, level: int, location=(0, 0), size=None) -> np.ndarray:
    """RGB pixels of ``level`` (``location`` in level-0 pixels), checking they are opaque."""
    rgba = np.asarray(slide.read_region(location, level, size or slide.level_dimensions[level]))
    assert (rgba[..., 3] == 255).all()
    return rgba[..., :3]


def _ome_pixels(path) -> dict:
    """The OME ``Pixels`` element of the file's single image, as tifffile parses it."""
    with tifffile.TiffFile(path) as tif:
        assert tif.is_ome
        ome = tifffile.xml2dict(tif.ome_metadata)["OME"]
    assert isinstance(ome["Image"], dict)  # one image: level 0
    return ome["Image"]["Pixels"]


def _no_temporaries(folder):
    assert not [p for p in folder.iterdir() if "tmp" in p.name]


def _assert_pyramid_geometry(slide: openslide.OpenSlide, height: int, width: int, min_size: int = 256):
    shapes = pyramid_shapes(height, width, min_size)
    assert slide.level_count == len(shapes)
    assert slide.level_dimensions == tuple((w, h) for h, w in shapes)
    # OpenSlide's downsample of a level: the mean of its two axes' size ratios
    assert slide.level_downsamples == pytest.approx([(width / w + height / h) / 2 for h, w in shapes])


@pytest.mark.parametrize("shape", [(H, W), (H, W, 3)], ids=["grey", "rgb"])
def test_random_lossless_pyramid_reads_back_exactly_at_every_level(tmp_path, shape):
    image = np.random.default_rng(sum(shape)).integers(0, 256, shape, dtype=np.uint8)
    path = write_pyramidal_tiff(tmp_path / "heat.tif", image, mpp=0.5, min_size=128)
    assert path == tmp_path / "heat.tif"
    slide = openslide.OpenSlide(path)
    assert slide.properties["openslide.vendor"] == "generic-tiff"
    _assert_pyramid_geometry(slide, H, W, min_size=128)
    assert slide.level_count == 4
    assert float(slide.properties["openslide.mpp-x"]) == pytest.approx(0.5, rel=1e-6)
    assert float(slide.properties["openslide.mpp-y"]) == pytest.approx(0.5, rel=1e-6)
    assert slide.properties["tiff.ResolutionUnit"] == "centimeter"

    rgb = lambda a: a if a.ndim == 3 else np.repeat(a[..., None], 3, axis=2)  # noqa: E731  grey comes back as R = G = B
    for level, expected in enumerate(_levels(image, slide.level_count)):
        np.testing.assert_array_equal(_read(slide, level), rgb(expected), err_msg=f"level {level}")
    # A window across tile borders, read at an offset.
    np.testing.assert_array_equal(_read(slide, 0, (300, 200), (400, 300)), rgb(image[200:500, 300:700]))
    _no_temporaries(tmp_path)


def test_jpeg_rgb_close_at_every_level_and_at_the_edges(tmp_path):
    image = _smooth_rgb()
    slide = openslide.OpenSlide(write_pyramidal_tiff(tmp_path / "jpeg.tif", image, mpp=0.25, compression="jpeg"))
    _assert_pyramid_geometry(slide, H, W)
    for level, expected in enumerate(_levels(image, slide.level_count)):
        error = np.abs(_read(slide, level).astype(int) - expected)
        assert error.mean() < 1.5 and error.max() < 16, (level, error.mean(), error.max())
        # the last rows/columns of partial edge tiles (zero padding before JPEG darkened them by up to 81)
        assert error[-8:].max() < 16 and error[:, -8:].max() < 16, level
    assert float(slide.properties["openslide.mpp-x"]) == pytest.approx(0.25, rel=1e-6)


def test_layout_and_ome_seen_by_tifffile(tmp_path):
    """One main IFD per level, tiled 256 x 256, reduced levels flagged; OME-XML on the first page
    only, describing level 0 with the physical pixel size."""
    write_pyramidal_tiff(tmp_path / "rgb.tif", _smooth_rgb(), mpp=0.25)
    write_pyramidal_tiff(tmp_path / "jpeg.tif", _smooth_rgb(), mpp=0.25, compression="jpeg")
    with tifffile.TiffFile(tmp_path / "rgb.tif") as tif:
        assert not tif.is_bigtiff
        pages = [tif.pages[i] for i in range(len(tif.pages))]  # every one a full TiffPage
        assert [p.shape for p in pages] == [(701, 1001, 3), (351, 501, 3), (176, 251, 3)]
        assert [p.subfiletype for p in pages] == [0, 1, 1]
        assert all(p.is_tiled and (p.tilewidth, p.tilelength) == (256, 256) for p in pages)
        assert all(p.compression == 8 and p.predictor == 2 and p.photometric == 2 for p in pages)
        assert [p.description for p in pages][1:] == ["", ""]
        assert pages[1].asarray().shape == (351, 501, 3)  # tifffile decodes it too
        x_resolution = pages[1].tags["XResolution"].value
        assert x_resolution[0] / x_resolution[1] == pytest.approx(1e4 / 0.25 * 501 / 1001, rel=1e-6)
        assert tif.series[0].kind == "ome" and tif.series[0].shape == (701, 1001, 3)
    with tifffile.TiffFile(tmp_path / "jpeg.tif") as tif:
        assert all(tif.pages[i].compression == 7 and tif.pages[i].photometric == 6 for i in range(len(tif.pages)))
        assert tif.pages[0].tags["YCbCrSubSampling"].value == (2, 2)
    for name in ("rgb.tif", "jpeg.tif"):
        pixels = _ome_pixels(tmp_path / name)
        assert (pixels["SizeX"], pixels["SizeY"], pixels["SizeC"], pixels["Type"]) == (1001, 701, 3, "uint8")
        assert pixels["PhysicalSizeX"] == pixels["PhysicalSizeY"] == pytest.approx(0.25)
        assert "PhysicalSizeXUnit" not in pixels  # OME's default, µm


def test_grey_jpeg_and_bigtiff_without_mpp(tmp_path):
    image = _smooth_rgb()[..., 0]
    path = write_pyramidal_tiff(tmp_path / "grey.tif", image, mpp=None, compression="jpeg", bigtiff=True)
    with tifffile.TiffFile(path) as tif:
        assert tif.is_bigtiff and tif.pages[0].photometric == 1
    assert "PhysicalSizeX" not in _ome_pixels(path)
    slide = openslide.OpenSlide(path)
    assert slide.level_count == 3
    assert "openslide.mpp-x" not in slide.properties  # no mpp: no resolution written
    assert np.abs(_read(slide, 0)[..., 0].astype(int) - image).mean() < 1.0


def test_level_count():
    assert pyramid_shapes(701, 1001, 256) == [(701, 1001), (351, 501), (176, 251)]
    assert pyramid_shapes(512, 300, 256) == [(512, 300), (256, 150), (128, 75)]
    # Smaller than min_size: still two levels when the image can be halved at all.
    assert pyramid_shapes(60, 100, 256) == [(60, 100), (30, 50)]
    assert pyramid_shapes(1, 2, 256) == [(1, 2), (1, 1)]
    assert pyramid_shapes(1, 1, 256) == [(1, 1)]


def test_small_image_has_two_levels(tmp_path):
    image = np.arange(60 * 100, dtype=np.uint8).reshape(60, 100)
    slide = openslide.OpenSlide(write_pyramidal_tiff(tmp_path / "small.tif", image, mpp=2.0, tile=16))
    assert slide.level_dimensions == ((100, 60), (50, 30))
    assert (_read(slide, 1)[..., 0] == _block_mean(image)).all()


class _DarkIsTumour(nn.Module):
    """A deterministic stub classifier: tumour logit from how dark the patch is (the synthetic
    metastases are darker than the normal tissue, glass is bright)."""

    def forward(self, x):
        darkness = 1 - x.mean(dim=(1, 2, 3))
        return torch.stack([torch.zeros_like(darkness), 100 * (darkness - 0.33)], dim=1)


def test_pipeline_heatmap_covers_the_slide_and_registers_by_pixel_size(tmp_path):
    """A ``wsi-heatmap`` heatmap spans the slide's physical extent within one grid step, carries
    its pixel size in OME and the TIFF resolution, and the slide's tumour outlines, placed on it
    by the two files' mpp alone, fall on its high values."""
    root = generate_camelyon16(tmp_path / "data", num_normal=0, num_tumor=1, num_test=0, size=(1024, 768))
    step = 64
    config = merge_config(task_config("camelyon16"), {"data": {"data_dir": str(root), "cache_dir": str(tmp_path / "cache"),
                                                                "patch_size": step, "stride": step}})
    module = ClassificationModule(camelyon16.module_config(config, {"variant": "b0"}, camelyon16.LABELS), network=_DarkIsTumour())
    slide_path = root / "training" / "tumor" / "tumor_001.tif"
    camelyon16.infer(module, slide_path, tmp_path / "out", InferenceOptions(progress=lambda _: None))
    heat_path = tmp_path / "out" / "tumor_001_heatmap.tif"
    slide, heat = openslide.OpenSlide(slide_path), openslide.OpenSlide(heat_path)
    slide_mpp, heat_mpp = (float(s.properties["openslide.mpp-x"]) for s in (slide, heat))
    assert float(heat.properties["openslide.mpp-y"]) == pytest.approx(heat_mpp, rel=1e-6)
    assert _ome_pixels(heat_path)["PhysicalSizeX"] == pytest.approx(heat_mpp, rel=1e-6)
    for heat_px, slide_px in zip(heat.dimensions, slide.dimensions):
        excess = heat_px * heat_mpp - slide_px * slide_mpp  # µm
        assert 0 <= excess < heat_mpp, (heat_px, slide_px, excess)  # within one heatmap pixel (ASAP maps by width ratio)
    k = json.loads((tmp_path / "out" / "tumor_001.json").read_text())["heatmap_pixels_per_cell"]
    assert max(heat.dimensions) > 1024 - k and heat.level_count >= 3  # the grid >= 1024 px, cut to the slide

    # the outlines in level-0 pixels, drawn at the heatmap's scale: heatmap mpp / slide mpp
    values = _read(heat, 0)[..., 0].astype(float)
    tumour = rasterise(read_asap_xml(root / "training" / "lesion_annotations" / "tumor_001.xml"),
                       slide.dimensions, heat_mpp / slide_mpp)
    rows, cols = min(tumour.shape[0], values.shape[0]), min(tumour.shape[1], values.shape[1])
    tumour, values = tumour[:rows, :cols], values[:rows, :cols]
    assert tumour.mean() > 0.01
    assert values[tumour].mean() > values[~tumour].mean() + 100


def test_failure_keeps_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "heat.tif"
    first = np.full((300, 400), 7, dtype=np.uint8)
    write_pyramidal_tiff(path, first, mpp=1.0)

    def broken(level):
        raise RuntimeError("disk full")

    # Fails after level 0 is written: mid-file.
    monkeypatch.setattr(tiff, "_downsample", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        write_pyramidal_tiff(path, np.zeros((300, 400), dtype=np.uint8), mpp=1.0)
    assert (_read(openslide.OpenSlide(path), 0)[..., 0] == 7).all()
    _no_temporaries(tmp_path)


def test_bad_inputs(tmp_path):
    path = tmp_path / "x.tif"
    good = np.zeros((32, 32), dtype=np.uint8)
    with pytest.raises(DataError, match="x.tif.*float32"):
        write_pyramidal_tiff(path, good.astype(np.float32), mpp=1.0)
    with pytest.raises(DataError, match="x.tif"):
        write_pyramidal_tiff(path, np.zeros((32, 32, 4), dtype=np.uint8), mpp=1.0)
    with pytest.raises(ValueError, match="tile"):
        write_pyramidal_tiff(path, good, mpp=1.0, tile=100)
    with pytest.raises(ValueError, match="compression"):
        write_pyramidal_tiff(path, good, mpp=1.0, compression="lzw")
    with pytest.raises(ValueError, match="mpp"):
        write_pyramidal_tiff(path, good, mpp=0.0)
    assert not path.exists()
