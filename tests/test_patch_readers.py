"""Patch readers: tifffile and cuCIM give OpenSlide's bytes (inside the slide and, as white,
outside it), the reader is chosen as ``HSMLA_MED_SLIDE_READER`` says, and bad slides get one
clear error.

The slide is a JPEG-tiled pyramid written by the project's writer (the format of the synthetic
CAMELYON16 slides and of CAMELYON16 itself); OpenSlide is the reference."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
import tifffile

from hsmla_med.data.patch_readers import CuCIMPatches, OpenSlidePatches, TiffPatches, open_patches
from hsmla_med.data.slides import open_slide, read_region
from hsmla_med.io.tiff import write_pyramidal_tiff
from hsmla_med.errors import DataError
from tests.test_slides import HEIGHT, WIDTH, synthetic_rgb, write_slide

needs_cucim = pytest.mark.skipif(importlib.util.find_spec("cucim") is None, reason="cuCIM is not installed")


@pytest.fixture(scope="module")
def jpeg_slide(tmp_path_factory):
    path = tmp_path_factory.mktemp("readers") / "tumor_007.tif"
    return write_pyramidal_tiff(path, synthetic_rgb(3), mpp=0.25, tile=256, compression="jpeg", min_size=300)


READERS = [TiffPatches, pytest.param(CuCIMPatches, marks=needs_cucim)]


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("level", [0, 1, 2])
def test_patches_equal_openslide_inside_and_across_the_edges(jpeg_slide, level, reader):
    d = 2**level
    # a patch inside one tile, one across four tiles, across the slide's corner, before it, past it
    corners = [(0, 0), (200 * d, 130 * d), (WIDTH - 40 * d, HEIGHT - 24 * d), (-16 * d, -8 * d), (WIDTH + 8 * d, 0)]
    patches, reference = reader(jpeg_slide), open_slide(jpeg_slide)
    for x, y in corners:
        for size in (64, 300):
            patch = patches.read(x, y, level, size)
            assert patch.dtype == np.uint8 and patch.shape == (size, size, 3)
            np.testing.assert_array_equal(patch, read_region(reference, x, y, level, size), err_msg=f"({x}, {y}) level {level}")
    outside = patches.read(WIDTH + 8 * d, 0, level, 64)
    assert (outside == 255).all()  # wholly past the edge: glass, as OpenSlide composites it
    patches.close()
    reference.close()


def test_tifffile_patches_of_a_deflate_slide_with_odd_sides_equal_openslide(tmp_path):
    """Lossless tiles, a pyramid whose downsamples are not whole numbers, random corners at
    level 0: every byte as OpenSlide's, the pyramid as OpenSlide's."""
    path = write_pyramidal_tiff(tmp_path / "odd.tif", synthetic_rgb(5)[:999, :1301], mpp=0.5, tile=128, compression="zlib", min_size=200)
    patches, reference = TiffPatches(path), open_slide(path)
    assert patches.dimensions == [tuple(d) for d in reference.level_dimensions]
    np.testing.assert_allclose(patches.downsamples, reference.level_downsamples)
    rng = np.random.default_rng()
    for x, y, size in zip(rng.integers(-100, 1300, 12), rng.integers(-100, 1000, 12), rng.integers(1, 400, 12)):
        np.testing.assert_array_equal(patches.read(x, y, 0, size), read_region(reference, x, y, 0, size), err_msg=f"({x}, {y}) {size}")
    patches.close()
    reference.close()


def test_auto_takes_tifffile_for_tiff_and_the_variable_decides(jpeg_slide, monkeypatch):
    monkeypatch.delenv("HSMLA_MED_SLIDE_READER", raising=False)
    assert isinstance(open_patches(jpeg_slide), TiffPatches)
    monkeypatch.setenv("HSMLA_MED_SLIDE_READER", "openslide")
    assert isinstance(open_patches(jpeg_slide), OpenSlidePatches)


@needs_cucim
def test_auto_takes_cucim_where_tifffile_decodes_other_bytes_and_the_variable_forces_it(jpeg_slide, monkeypatch):
    """A decoder that differs (colour conversion, chroma upsampling) must never change what the
    network sees: auto checks a sample per slide and takes the next reader that agrees."""
    read = TiffPatches.read
    monkeypatch.setattr(TiffPatches, "read", lambda self, *a: read(self, *a) ^ np.uint8(1))
    monkeypatch.setenv("HSMLA_MED_SLIDE_READER", "auto")
    assert isinstance(open_patches(jpeg_slide), CuCIMPatches)
    cucim_read = CuCIMPatches.read
    monkeypatch.setattr(CuCIMPatches, "read", lambda self, *a: cucim_read(self, *a) ^ np.uint8(1))
    assert isinstance(open_patches(jpeg_slide), OpenSlidePatches)
    monkeypatch.setattr(TiffPatches, "read", read)
    monkeypatch.setattr(CuCIMPatches, "read", cucim_read)
    monkeypatch.setenv("HSMLA_MED_SLIDE_READER", "cucim")
    assert isinstance(open_patches(jpeg_slide), CuCIMPatches)


def test_without_cucim_auto_reads_with_tifffile_and_forced_cucim_says_so(jpeg_slide, monkeypatch):
    monkeypatch.setitem(sys.modules, "cucim", None)  # import cucim raises ImportError
    monkeypatch.setenv("HSMLA_MED_SLIDE_READER", "auto")
    patches = open_patches(jpeg_slide)
    assert isinstance(patches, TiffPatches)
    with open_slide(jpeg_slide) as reference:
        np.testing.assert_array_equal(patches.read(512, 256, 1, 32), read_region(reference, 512, 256, 1, 32))
    monkeypatch.setenv("HSMLA_MED_SLIDE_READER", "tifffile")
    assert isinstance(open_patches(jpeg_slide), TiffPatches)
    monkeypatch.setenv("HSMLA_MED_SLIDE_READER", "cucim")
    with pytest.raises(DataError, match=r"tumor_007\.tif: HSMLA_MED_SLIDE_READER=cucim but cuCIM is not installed"):
        open_patches(jpeg_slide)


def test_auto_keeps_openslide_where_tifffile_decodes_other_bytes_or_sees_another_pyramid(jpeg_slide, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "cucim", None)
    monkeypatch.setenv("HSMLA_MED_SLIDE_READER", "auto")
    read = TiffPatches.read
    monkeypatch.setattr(TiffPatches, "read", lambda self, *a: read(self, *a) ^ np.uint8(1))
    assert isinstance(open_patches(jpeg_slide), OpenSlidePatches)
    monkeypatch.setattr(TiffPatches, "read", read)
    # a stripped (untiled) TIFF: OpenSlide reads it as one level, tifffile here refuses it
    flat = tmp_path / "flat.tif"
    tifffile.imwrite(flat, synthetic_rgb()[:300, :400], photometric="rgb")
    with pytest.raises(DataError, match=r"flat\.tif: no tiled 8-bit colour image"):
        TiffPatches(flat)


# cuCIM's JPEG decoder returns a zeroed stream's tile without an error: deflate only there
@pytest.mark.parametrize("reader, compression", [(TiffPatches, "zlib"), (TiffPatches, "jpeg"),
                                                 pytest.param(CuCIMPatches, "zlib", marks=needs_cucim)])
def test_corrupt_tile_and_missing_file_name_the_slide(tmp_path, reader, compression):
    path = write_slide(tmp_path / "cut.tif", synthetic_rgb()[:256, :256], (1,), compression=compression)
    with tifffile.TiffFile(path) as tif:
        offset, count = tif.pages[0].dataoffsets[3], tif.pages[0].databytecounts[3]
    data = bytearray(path.read_bytes())
    data[offset : offset + count] = bytes(count)  # the last tile's compressed stream zeroed
    path.write_bytes(data)
    patches = reader(path)
    assert patches.read(0, 0, 0, 8).shape == (8, 8, 3)
    with pytest.raises(DataError, match=r"cut\.tif: cannot read region at \(200, 200\)"):
        patches.read(200, 200, 0, 8)
    with pytest.raises(DataError, match="level 3 out of range"):
        patches.read(0, 0, 3, 8)
    with pytest.raises(DataError, match=r"gone\.tif: slide file not found"):
        reader(tmp_path / "gone.tif")


def test_a_bad_reader_name_is_refused(jpeg_slide, monkeypatch):
    monkeypatch.setenv("HSMLA_MED_SLIDE_READER", "pillow")
    with pytest.raises(DataError, match=r"HSMLA_MED_SLIDE_READER='pillow': not a slide reader; use one of auto, openslide, tifffile, cucim"):
        open_patches(jpeg_slide)
    with pytest.raises(ValueError, match="reader must be one of"):
        open_patches(jpeg_slide, "pillow")
