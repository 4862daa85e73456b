"""Slides through OpenSlide: opening, levels, regions, tissue masks, patch grids and coverage.

The slides are small pyramidal TIFFs written here with tifffile (not the project's writer, so
that these tests stand alone). What OpenSlide's generic-tiff driver needs: tiled pages (a
stripped TIFF is refused as unsupported), and the lower levels marked as reduced-resolution
images (``subfiletype=1``), else they are not seen as levels. A centimetre or inch resolution
gives ``openslide.mpp-x``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import tifffile

from hsmla_med.data.slides import coverage, open_slide, patch_grid, read_region, select_level, slide_mpp, thumbnail, tissue_mask
from hsmla_med.errors import DataError

WIDTH, HEIGHT = 2048, 1536
DOWNSAMPLES = (1, 2, 4)
MPP = 0.25
GLASS, PINK, PURPLE = (242, 242, 240), (222, 140, 185), (150, 80, 170)


def write_slide(path, rgb: np.ndarray, downsamples=DOWNSAMPLES, mpp: float | None = MPP, compression=None):
    """A pyramidal tiled TIFF: level ``i`` is ``rgb`` averaged over ``downsamples[i]``-pixel blocks."""
    resolution = {} if mpp is None else {"resolution": (1e4 / mpp, 1e4 / mpp), "resolutionunit": "CENTIMETER"}
    with tifffile.TiffWriter(path) as tif:
        for i, d in enumerate(downsamples):
            h, w = rgb.shape[0] // d, rgb.shape[1] // d
            level = rgb[: h * d, : w * d].reshape(h, d, w, d, 3).mean(axis=(1, 3)).round().astype(np.uint8)
            res = {k: (v[0] / d, v[1] / d) if k == "resolution" else v for k, v in resolution.items()}
            tif.write(level, tile=(128, 128), photometric="rgb", subfiletype=int(i > 0), compression=compression, **res)
    return path


def known_tissue(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The tissue of the synthetic slide at level-0 points: an ellipse and a band, apart."""
    ellipse = ((x - 650) / 450) ** 2 + ((y - 700) / 380) ** 2 <= 1
    band = (x >= 1300) & (x < 1900) & (y >= 300) & (y < 1300)
    return ellipse | band


def synthetic_rgb(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[:HEIGHT, :WIDTH]
    tissue = known_tissue(x, y)
    rgb = np.where(tissue[..., None], np.where((x // 64 + y // 64)[..., None] % 3 == 0, PURPLE, PINK), GLASS)
    return np.clip(rgb + rng.normal(0, 4, rgb.shape), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def rgb():
    return synthetic_rgb()


@pytest.fixture(scope="module")
def slide_path(tmp_path_factory, rgb):
    return write_slide(tmp_path_factory.mktemp("slides") / "tumor_001.tif", rgb)


@pytest.fixture
def slide(slide_path):
    with open_slide(slide_path) as s:
        yield s


def truth_at(mask_shape, downsample):
    """``known_tissue`` at the mask pixels' centres (level-0 ``j*d + (d - 1)/2``)."""
    rows, cols = np.mgrid[: mask_shape[0], : mask_shape[1]]
    return known_tissue(cols * downsample + (downsample - 1) / 2, rows * downsample + (downsample - 1) / 2)


def iou(a, b):
    return (a & b).sum() / (a | b).sum()


def test_generic_tiff_levels_and_mpp(slide):
    assert slide.properties["openslide.vendor"] == "generic-tiff"
    assert slide.level_dimensions == ((2048, 1536), (1024, 768), (512, 384))
    assert slide.level_downsamples == (1.0, 2.0, 4.0)
    assert slide_mpp(slide) == pytest.approx(MPP)


def test_slide_without_resolution_has_no_mpp(tmp_path):
    with open_slide(write_slide(tmp_path / "s.tif", np.full((256, 256, 3), 240, np.uint8), (1, 2), mpp=None)) as s:
        assert slide_mpp(s) is None
        assert select_level(s, level=1) == 1
        with pytest.raises(DataError, match=r"s\.tif: the slide has no microns-per-pixel"):
            select_level(s, mpp=0.5)


def test_select_level(slide, slide_path):
    assert select_level(slide) == 0
    assert [select_level(slide, level=i) for i in range(3)] == [0, 1, 2]
    # levels at 0.25, 0.5 and 1.0 µm per pixel; closeness is by ratio
    assert [select_level(slide, mpp=m) for m in (0.25, 0.3, 0.5, 0.7, 1.4, 100.0)] == [0, 0, 1, 1, 2, 2]
    with pytest.raises(DataError, match=rf"{slide_path.name}: level 3 out of range, the slide has 3 level"):
        select_level(slide, level=3)
    with pytest.raises(DataError, match="level -1 out of range"):
        select_level(slide, level=-1)
    with pytest.raises(ValueError, match="not both"):
        select_level(slide, level=1, mpp=0.5)


def test_read_region(slide, rgb):
    region = read_region(slide, 256, 128, 0, (40, 24))
    assert region.dtype == np.uint8 and region.shape == (24, 40, 3)
    np.testing.assert_array_equal(region, rgb[128:152, 256:296])
    assert read_region(slide, 512, 512, 2, 32).shape == (32, 32, 3)
    # past the right edge OpenSlide returns transparent pixels: white here
    edge = read_region(slide, WIDTH - 8, 0, 0, (16, 4))
    assert (edge[:, 8:] == 255).all() and (edge[:, :8] < 255).any()


def test_read_region_of_corrupt_tile_names_file(tmp_path, rgb):
    path = write_slide(tmp_path / "cut.tif", rgb[:256, :256], (1,), compression="zlib")
    with tifffile.TiffFile(path) as tif:
        offset, count = tif.pages[0].dataoffsets[3], tif.pages[0].databytecounts[3]
    data = bytearray(path.read_bytes())
    data[offset : offset + count] = bytes(count)  # the last tile's deflate stream zeroed
    path.write_bytes(data)
    with open_slide(path) as s:
        assert read_region(s, 0, 0, 0, 8).shape == (8, 8, 3)
        with pytest.raises(DataError, match=r"cut\.tif: cannot read region at \(200, 200\)"):
            read_region(s, 200, 200, 0, 8)


def test_open_slide_refuses_missing_and_foreign_files(tmp_path):
    with pytest.raises(DataError, match=r"absent\.tif: slide file not found"):
        open_slide(tmp_path / "absent.tif")
    (tmp_path / "notes.tif").write_text("not a slide")
    with pytest.raises(DataError, match=r"notes\.tif: not a slide OpenSlide can read"):
        open_slide(tmp_path / "notes.tif")
    tifffile.imwrite(tmp_path / "strips.tif", np.zeros((64, 64, 3), np.uint8), photometric="rgb")
    with pytest.raises(DataError, match=r"strips\.tif: not a slide"):
        open_slide(tmp_path / "strips.tif")


@pytest.mark.parametrize("min_size, downsample", [(512, 4.0), (1024, 2.0)])
def test_tissue_mask_finds_the_known_tissue(slide, min_size, downsample):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mask, d = tissue_mask(slide, min_size=min_size, min_area=4096)
    assert d == downsample and mask.shape == (HEIGHT / d, WIDTH / d) and mask.dtype == bool
    assert iou(mask, truth_at(mask.shape, d)) > 0.9


def test_tissue_mask_of_single_level_slide_without_specks_or_black(tmp_path, rgb):
    rgb = rgb.copy()
    rgb[100:104, 100:104] = PURPLE  # 16 level-0 pixels of debris on glass
    rng = np.random.default_rng(2)
    rgb[1400:, :500] = rng.integers(2, 12, (HEIGHT - 1400, 500, 3))  # black scanner background: noise, saturated
    with open_slide(write_slide(tmp_path / "flat.tif", rgb, (1,))) as s:
        mask, d = tissue_mask(s, min_size=512, max_size=1024, min_area=4096)  # level 0 averaged in 2x2 blocks
    assert d == 2.0 and mask.shape == (HEIGHT // 2, WIDTH // 2)
    assert not mask[40:60, 40:60].any() and not mask[700:, :250].any()
    assert iou(mask, truth_at(mask.shape, d)) > 0.9


def test_thumbnail_is_a_pyramid_level_as_written(slide, rgb):
    """Within the sizes asked, a level is returned as it is: the writer's block means of level 0."""
    picture, d = thumbnail(slide, min_size=512, max_size=600)
    level = rgb.reshape(HEIGHT // 4, 4, WIDTH // 4, 4, 3).mean(axis=(1, 3)).round().astype(np.uint8)
    assert d == 4.0 and picture.dtype == np.uint8
    np.testing.assert_array_equal(picture, level)


def test_thumbnail_of_single_level_slide_averages_whole_blocks_padded_with_white(tmp_path, rgb):
    cut = rgb[:1531, :2045]  # neither side a multiple of the block
    with open_slide(write_slide(tmp_path / "flat.tif", cut, (1,))) as s:
        picture, d = thumbnail(s, min_size=512, max_size=700)
    assert d == 3.0 and picture.shape == (511, 682, 3)  # ceil(1531 / 3), ceil(2045 / 3)
    expected = np.empty(picture.shape)
    for r in range(picture.shape[0]):  # brute force: each 3 x 3 block, white beyond the edge
        for c in range(picture.shape[1]):
            block = np.full((3, 3, 3), 255.0)
            part = cut[3 * r : 3 * r + 3, 3 * c : 3 * c + 3]
            block[: part.shape[0], : part.shape[1]] = part
            expected[r, c] = block.mean(axis=(0, 1))
    assert np.abs(picture - expected).max() <= 0.5 + 1e-9  # rounded to the nearest byte


@pytest.mark.parametrize("noise", [0, 2])
def test_blank_slide_gives_empty_mask_and_warning(tmp_path, noise):
    rgb = np.full((512, 768, 3), GLASS, np.float64) + np.random.default_rng(1).normal(0, noise, (512, 768, 3))
    with open_slide(write_slide(tmp_path / "blank.tif", np.clip(rgb, 0, 255).astype(np.uint8))) as s:
        with pytest.warns(UserWarning, match=r"blank\.tif: .*no tissue found"):
            mask, downsample = tissue_mask(s, min_size=128)
    assert downsample == 4.0 and mask.shape == (128, 192) and not mask.any()


def brute_coverage(mask, d, coords, footprint):
    """Per-patch mean of the mask repeated to level 0 (integer downsample and coordinates)."""
    full = np.kron(mask, np.ones((d, d), bool))
    out = []
    for x, y in coords:
        window = np.zeros((footprint, footprint), bool)
        part = full[y : y + footprint, x : x + footprint]
        window[: part.shape[0], : part.shape[1]] = part
        out.append(window.mean())
    return np.array(out)


def test_coverage_equals_brute_force():
    rng = np.random.default_rng(3)
    mask = rng.random((30, 40)) < 0.4
    # corners cutting mask pixels, footprints larger than a pixel and patches past the mask's edge
    coords = np.stack([rng.integers(0, 170, 200), rng.integers(0, 130, 200)], axis=1)
    for footprint in (3, 8, 13):
        got = coverage(mask, 4, coords, footprint)
        np.testing.assert_allclose(got, brute_coverage(mask, 4, coords, footprint), atol=1e-12)
    assert coverage(mask, 4, np.zeros((0, 2), np.int64), 8).shape == (0,)


@pytest.fixture(scope="module")
def fractional_slide_path(tmp_path_factory, rgb):
    """The slide cut to 2047 x 1535: its levels (1023 x 767, 511 x 383) have the downsamples
    2.00114 and 4.00498 (OpenSlide's mean of the width and height ratios), as .svs levels do."""
    return write_slide(tmp_path_factory.mktemp("fractional") / "tumor_002.tif", rgb[:1535, :2047])


@pytest.mark.parametrize("level, patch_size, stride", [(1, 64, 64), (1, 48, 32), (2, 32, 16)])
def test_patch_grid(slide, level, patch_size, stride):
    tissue, tissue_d = tissue_mask(slide, min_size=512, min_area=4096)
    d = slide.level_downsamples[level]
    assert d == int(d) and tissue_d == int(tissue_d)  # the brute force below steps whole pixels
    footprint, step = int(patch_size * d), int(stride * d)
    coords, cells = patch_grid(tissue, tissue_d, slide.dimensions, patch_size, stride, d, min_tissue=0.5)
    assert coords.dtype == cells.dtype == np.int64 and coords.ndim == 2 and len(coords) > 0
    assert (coords % step == 0).all()
    np.testing.assert_array_equal(cells, coords[:, ::-1] // step)  # whole steps: the cell is the corner's quotient
    assert (coords >= 0).all() and (coords + footprint <= (WIDTH, HEIGHT)).all()
    # centres on the known tissue for nearly all, and the brute-force loop finds the same patches
    assert known_tissue(coords[:, 0] + footprint / 2, coords[:, 1] + footprint / 2).mean() > 0.95
    full = np.kron(tissue, np.ones((int(tissue_d),) * 2, bool))
    expected = [
        (x, y)
        for y in range(0, HEIGHT - footprint + 1, step)
        for x in range(0, WIDTH - footprint + 1, step)
        if full[y : y + footprint, x : x + footprint].mean() >= 0.5
    ]
    np.testing.assert_array_equal(coords, np.array(expected).reshape(-1, 2))


@pytest.mark.parametrize("level, patch_size, stride", [(1, 64, 64), (1, 48, 32), (2, 32, 16)])
def test_patch_grid_at_a_fractional_downsample_gives_each_patch_its_own_cell(slide, fractional_slide_path, level, patch_size, stride):
    """At a downsample that is not a whole number, the corner of cell (r, c) is the level-0
    pixel nearest (c, r) * step, every patch has its own cell (``corner // step`` would merge
    neighbours), and the grid is the one of the uncut slide but for its last pixel."""
    with open_slide(fractional_slide_path) as cut:
        d = cut.level_downsamples[level]
        assert d != int(d)
        tissue, tissue_d = tissue_mask(cut, min_size=512, min_area=4096)
        coords, cells = patch_grid(tissue, tissue_d, cut.dimensions, patch_size, stride, d, min_tissue=0.5)
    step, footprint = stride * d, patch_size * d
    assert len(coords) > 0 and len(set(map(tuple, cells))) == len(cells)
    np.testing.assert_array_equal(coords, np.round(cells[:, ::-1] * step))
    assert (coords >= 0).all() and (coords + footprint <= (2047, 1535)).all()
    assert known_tissue(coords[:, 0] + footprint / 2, coords[:, 1] + footprint / 2).mean() > 0.95
    whole, whole_d = tissue_mask(slide, min_size=512, min_area=4096)
    _, whole_cells = patch_grid(whole, whole_d, slide.dimensions, patch_size, stride, slide.level_downsamples[level], 0.5)
    ours, theirs = set(map(tuple, cells)), set(map(tuple, whole_cells))
    assert len(ours & theirs) / len(ours | theirs) > 0.97


def test_patch_grid_bounds():
    tissue = np.ones((10, 10), bool)
    coords, cells = patch_grid(tissue, 4, (40, 30), patch_size=8, stride=8, level_downsample=2, min_tissue=0)
    np.testing.assert_array_equal(coords, [(0, 0), (16, 0)])  # a third column or second row would leave the slide
    np.testing.assert_array_equal(cells, [(0, 0), (0, 1)])
    assert [a.shape for a in patch_grid(tissue, 4, (10, 10), 8, 8, 2)] == [(0, 2), (0, 2)]
    with pytest.raises(ValueError, match="min_tissue"):
        patch_grid(tissue, 4, (40, 40), 8, 8, 2, min_tissue=1.5)
