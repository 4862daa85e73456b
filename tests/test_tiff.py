"""Pyramidal TIFF writer: what OpenSlide reads back (levels, pixels, mpp), the TIFF layout as
tifffile sees it, atomic replacement and refused inputs."""

import numpy as np
import openslide
import pytest
import tifffile

from hsmla_med.io import tiff
from hsmla_med.io.tiff import pyramid_shapes, write_pyramidal_tiff
from hsmla_med.errors import DataError

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


def _read(slide: openslide.OpenSlide, level: int, location=(0, 0), size=None) -> np.ndarray:
    """RGB pixels of ``level`` (``location`` in level-0 pixels), checking they are opaque."""
    rgba = np.asarray(slide.read_region(location, level, size or slide.level_dimensions[level]))
    assert (rgba[..., 3] == 255).all()
    return rgba[..., :3]


def _no_temporaries(folder):
    assert not [p for p in folder.iterdir() if "tmp" in p.name]


def test_grey_lossless_pyramid(tmp_path):
    image = np.random.default_rng(0).integers(0, 256, (H, W), dtype=np.uint8)
    path = write_pyramidal_tiff(tmp_path / "heat.tif", image, mpp=0.5)
    assert path == tmp_path / "heat.tif"
    slide = openslide.OpenSlide(path)
    assert slide.properties["openslide.vendor"] == "generic-tiff"
    assert slide.level_count == 3
    assert slide.level_dimensions == ((1001, 701), (501, 351), (251, 176))
    assert slide.level_downsamples == pytest.approx([1.0, (1001 / 501 + 701 / 351) / 2, (1001 / 251 + 701 / 176) / 2])
    assert float(slide.properties["openslide.mpp-x"]) == pytest.approx(0.5, rel=1e-6)
    assert float(slide.properties["openslide.mpp-y"]) == pytest.approx(0.5, rel=1e-6)
    assert slide.properties["tiff.ResolutionUnit"] == "centimeter"

    level0 = _read(slide, 0)
    assert (level0 == image[..., None]).all()  # grey comes back as R = G = B
    # A window across tile borders, read at an offset.
    assert (_read(slide, 0, (300, 200), (400, 300))[..., 0] == image[200:500, 300:700]).all()
    level1 = _block_mean(image)
    assert (_read(slide, 1)[..., 0] == level1).all()
    assert (_read(slide, 2)[..., 0] == _block_mean(level1)).all()
    _no_temporaries(tmp_path)


def test_layout_seen_by_tifffile(tmp_path):
    """One main IFD per level, tiled 256 x 256, reduced levels flagged, nothing else."""
    write_pyramidal_tiff(tmp_path / "rgb.tif", _smooth_rgb(), mpp=0.25)
    write_pyramidal_tiff(tmp_path / "jpeg.tif", _smooth_rgb(), mpp=0.25, compression="jpeg")
    with tifffile.TiffFile(tmp_path / "rgb.tif") as tif:
        assert not tif.is_bigtiff
        assert [p.shape for p in tif.pages] == [(701, 1001, 3), (351, 501, 3), (176, 251, 3)]
        assert [p.subfiletype for p in tif.pages] == [0, 1, 1]
        assert all(p.is_tiled and (p.tilewidth, p.tilelength) == (256, 256) for p in tif.pages)
        assert all(p.compression == 8 and p.predictor == 2 and p.photometric == 2 for p in tif.pages)
        assert tif.pages[1].asarray().shape == (351, 501, 3)  # tifffile decodes it too
        x_resolution = tif.pages[1].tags["XResolution"].value
        assert x_resolution[0] / x_resolution[1] == pytest.approx(1e4 / 0.25 * 501 / 1001, rel=1e-6)
    with tifffile.TiffFile(tmp_path / "jpeg.tif") as tif:
        assert all(p.compression == 7 and p.photometric == 6 for p in tif.pages)
        assert tif.pages[0].tags["YCbCrSubSampling"].value == (2, 2)


def test_rgb_lossless_and_jpeg(tmp_path):
    image = _smooth_rgb()
    lossless = openslide.OpenSlide(write_pyramidal_tiff(tmp_path / "rgb.tif", image, mpp=0.25))
    assert (_read(lossless, 0) == image).all()
    assert (_read(lossless, 1) == _block_mean(image)).all()

    jpeg = openslide.OpenSlide(write_pyramidal_tiff(tmp_path / "jpeg.tif", image, mpp=0.25, compression="jpeg"))
    assert jpeg.level_dimensions == lossless.level_dimensions
    for level, expected in enumerate([image, _block_mean(image)]):
        error = np.abs(_read(jpeg, level).astype(int) - expected)
        assert error.mean() < 1.5 and error.max() < 16, (level, error.mean(), error.max())
    assert float(jpeg.properties["openslide.mpp-x"]) == pytest.approx(0.25, rel=1e-6)


def test_grey_jpeg_and_bigtiff(tmp_path):
    image = _smooth_rgb()[..., 0]
    path = write_pyramidal_tiff(tmp_path / "grey.tif", image, mpp=None, compression="jpeg", bigtiff=True)
    with tifffile.TiffFile(path) as tif:
        assert tif.is_bigtiff and tif.pages[0].photometric == 1
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
