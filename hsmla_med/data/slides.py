"""Whole-slide images through OpenSlide, read lazily: regions, a low-resolution tissue mask, patch grids.

A CAMELYON16 slide is about 100,000 x 200,000 pixels at level 0 (0.23-0.24 µm per pixel), a
pyramid of levels each halving the previous one. Nothing here reads a whole level 0: patches
come through :func:`read_region`, and the tissue mask is computed on a low-resolution level,
read in bands. Coordinates follow OpenSlide: (x, y) in level-0 pixels, sizes (width, height),
and a level pixel ``j`` of downsample ``d`` covers level-0 pixels ``j*d .. j*d + d - 1`` (the
convention of :func:`hsmla_med.data.asap.rasterise`, so tumour and tissue masks line up).

Pipeline: :func:`tissue_mask` -> :func:`patch_grid` (patch corners on tissue) ->
:func:`coverage` of a tumour mask (labels) -> :func:`read_region` per patch.
"""

from __future__ import annotations

import inspect
import math
import warnings
from pathlib import Path

import numpy as np
import openslide
from skimage.color import rgb2hsv
from skimage.filters import threshold_otsu
from skimage.measure import block_reduce
from skimage.morphology import remove_small_holes, remove_small_objects

from hsmla_med.errors import DataError

__all__ = ["SLIDE_SUFFIXES", "open_slide", "slide_mpp", "select_level", "read_region", "read_mask_level", "thumbnail", "tissue_mask", "patch_grid", "coverage"]

SLIDE_SUFFIXES = (".tif", ".tiff", ".svs", ".ndpi", ".mrxs", ".scn", ".bif")  # the whole-slide files looked for in a folder
# scikit-image 0.26 renamed min_size/area_threshold (removes sizes < n) to max_size (removes sizes <= n).
_SKIMAGE_MAX_SIZE = "max_size" in inspect.signature(remove_small_objects).parameters
_BAND_PIXELS = 1 << 22  # pixels read per band for the tissue mask: ~16 MB of RGBA
# Near-black pixels have an unstable, often high saturation (noise over ~0): scanner background,
# not stain. Darker than this HSV value, a pixel counts as background.
_MIN_VALUE = 0.15


def _name(slide: openslide.OpenSlide) -> str:
    """The slide's file, for messages (openslide-python keeps it only privately)."""
    return str(getattr(slide, "_filename", slide))


def open_slide(path: str | Path) -> openslide.OpenSlide:
    """Open a whole-slide image (any format OpenSlide reads; a pyramidal tiled TIFF for CAMELYON16).

    Raises:
        DataError: naming the file, if it is missing or OpenSlide cannot read it.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: slide file not found")
    try:
        return openslide.OpenSlide(path)
    except openslide.OpenSlideUnsupportedFormatError:
        raise DataError(
            f"{path}: not a slide OpenSlide can read (unsupported format, or a TIFF without tiles)"
        ) from None
    except openslide.OpenSlideError as err:
        raise DataError(f"{path}: cannot open slide ({err})") from None


def slide_mpp(slide: openslide.OpenSlide) -> float | None:
    """Level-0 microns per pixel (``openslide.mpp-x``); None when the file does not say."""
    try:
        mpp = float(slide.properties[openslide.PROPERTY_NAME_MPP_X])
    except (KeyError, ValueError):
        return None
    return mpp if math.isfinite(mpp) and mpp > 0 else None


def select_level(slide: openslide.OpenSlide, level: int | None = None, mpp: float | None = None) -> int:
    """A pyramid level, by index or by resolution; level 0 when neither is given.

    Args:
        level: index in ``0 .. slide.level_count - 1``.
        mpp: microns per pixel wanted; the level whose mpp is closest in ratio (``|log(mpp_l /
            mpp)|``, so 1.4 picks 1.0 over 2.0) is chosen. Needs the slide's mpp.

    Raises:
        ValueError: both or a non-positive mpp given.
        DataError: (naming the slide) the index is out of range, or mpp is asked of a slide
            without one.
    """
    if level is not None and mpp is not None:
        raise ValueError("select a level by index or by mpp, not both")
    if level is not None:
        if not 0 <= level < slide.level_count:
            raise DataError(f"{_name(slide)}: level {level} out of range, the slide has {slide.level_count} level(s)")
        return int(level)
    if mpp is None:
        return 0
    if not mpp > 0:
        raise ValueError(f"mpp must be positive, got {mpp}")
    base = slide_mpp(slide)
    if base is None:
        raise DataError(
            f"{_name(slide)}: the slide has no microns-per-pixel (openslide.mpp-x); select the level by index"
        )
    level_mpp = base * np.asarray(slide.level_downsamples)
    return int(np.argmin(np.abs(np.log(level_mpp / mpp))))


def read_region(slide: openslide.OpenSlide, x0: int, y0: int, level: int, size: int | tuple[int, int]) -> np.ndarray:
    """An RGB region of one level.

    Args:
        x0, y0: top-left corner in level-0 pixels (as OpenSlide's ``read_region``).
        level: pyramid level read.
        size: width and height in pixels of that level (an int: a square).

    Returns:
        uint8 (height, width, 3). Transparent pixels (alpha 0: outside the slide or its scanned
        area) become white, like glass; partly transparent ones are composited onto white.

    Raises:
        DataError: naming the slide, if its data cannot be decoded (a truncated file).
    """
    width, height = (size, size) if np.isscalar(size) else size
    if width <= 0 or height <= 0:
        raise ValueError(f"region size must be positive, got {width}x{height}")
    select_level(slide, level)
    try:
        image = slide.read_region((int(x0), int(y0)), level, (int(width), int(height)))
    except openslide.OpenSlideError as err:
        raise DataError(f"{_name(slide)}: cannot read region at ({x0}, {y0}) of level {level} ({err})") from None
    if image.getchannel("A").getextrema()[0] == 255:
        # inside the scanned area (nearly every patch): nothing to composite. PIL drops the alpha
        # in one pass, cheaper than NumPy's strided copy of the RGB channels
        return np.array(image.convert("RGB"))
    rgba = np.asarray(image)
    alpha = rgba[..., 3:].astype(np.uint16)  # OpenSlide un-premultiplies: colour * alpha + white * (255 - alpha)
    return ((rgba[..., :3] * alpha + 255 * (255 - alpha) + 127) // 255).astype(np.uint8)


def read_mask_level(path: str | Path, downsample: int) -> np.ndarray:
    """A ground-truth mask TIFF (CAMELYON16's ``Ground_Truth/Masks/<slide>_Mask.tif``) at
    ``downsample`` (a power of two), as ``Evaluation_FROC.py`` reads it: the first channel of
    OpenSlide's ``read_region`` of that level; a pixel is tumour where it is not 0.

    The official script reads level ``log2(downsample)`` by index; a mask whose pyramid lacks
    that level is read at its finest level whose downsample divides it, every
    ``downsample / d``-th pixel kept (the nearest-neighbour halving ASAP's pyramid does), in
    bands, to ``floor(size / downsample)`` pixels per axis, as ASAP's level has.
    CAMELYON16's masks are 0/255 and the script counts only 255 as tumour: other non-zero values
    (ASAP's default label 1) count here too, with a warning naming the file.

    Raises:
        DataError: naming the file, if OpenSlide cannot read it.
    """
    slide = open_slide(path)
    try:
        width, height = slide.dimensions
        level = int(math.log2(downsample))
        exact = level < slide.level_count and abs(slide.level_downsamples[level] / downsample - 1) < 0.01
        if exact:  # the official read: that level, its own size
            shape, step = slide.level_dimensions[level][::-1], 1
        else:  # the finest level whose downsample is a power of two dividing ``downsample``
            level = max(i for i, d in enumerate(slide.level_downsamples) if i == 0 or _divides(d, downsample))
            shape, step = (height // downsample, width // downsample), round(downsample / slide.level_downsamples[level])
        level_width = slide.level_dimensions[level][0]
        band = max(step, _BAND_PIXELS // max(1, level_width) // step * step)
        values = np.zeros(shape, np.uint8)
        for top in range(0, shape[0] * step, band):
            rows = min(band, shape[0] * step - top)
            y0 = int(round(top * slide.level_downsamples[level]))
            try:
                rgba = np.asarray(slide.read_region((0, y0), level, (min(level_width, shape[1] * step), rows)))
            except openslide.OpenSlideError as err:
                raise DataError(f"{path}: cannot read the mask ({err})") from None
            values[top // step: top // step + len(rgba[::step])] = rgba[::step, ::step, 0][:, : shape[1]] * (rgba[::step, ::step, 3][:, : shape[1]] > 0)
    finally:
        slide.close()
    other = np.setdiff1d(np.unique(values), [0, 255])
    if other.size:
        warnings.warn(f"{path}: mask values {', '.join(map(str, other[:5].tolist()))} count as tumour here; "
                      "Evaluation_FROC.py counts only 255 (CAMELYON16's masks are 0/255)", stacklevel=2)
    return values > 0


def _divides(level_downsample: float, downsample: int) -> bool:
    ratio = downsample / level_downsample
    return ratio >= 1 and abs(ratio - round(ratio)) < 0.01 and round(ratio) & (round(ratio) - 1) == 0


def _remove_small(mask: np.ndarray, area: float) -> np.ndarray:
    """``mask`` without objects and holes of fewer than ``area`` pixels."""
    size = max(1, math.ceil(area))
    if _SKIMAGE_MAX_SIZE:
        mask = remove_small_objects(mask, max_size=size - 1)
        return remove_small_holes(mask, max_size=size - 1)
    return remove_small_holes(remove_small_objects(mask, min_size=size), area_threshold=size)


def _level_bands(slide: openslide.OpenSlide, min_size: int, max_size: int):
    """The coarsest level whose longer side is at least ``min_size`` (level 0 when the whole
    slide is smaller), read in bands of about :data:`_BAND_PIXELS` and, where longer than
    ``max_size`` (a sparse pyramid, or a single-level file), averaged over ``f x f`` blocks with
    the smallest integer ``f`` that brings it within ``max_size``; blocks cut by the right or
    bottom edge are padded with white.

    Yields:
        ``(row, band, (height, width), downsample)``: the band's first row in the output, the
        band (uint8 ``(h, width, 3)`` as read, or its block means as float64 in 0..1 when
        ``f > 1``), the whole output's size and its level-0 pixels per output pixel.
    """
    if not 0 < min_size <= max_size:
        raise ValueError(f"need 0 < min_size <= max_size, got {min_size}, {max_size}")
    long_sides = [max(dims) for dims in slide.level_dimensions]
    level = max((i for i, side in enumerate(long_sides) if side >= min_size), default=0)
    width, height = slide.level_dimensions[level]
    factor = math.ceil(long_sides[level] / max_size)
    downsample = float(slide.level_downsamples[level] * factor)
    out_size = (math.ceil(height / factor), math.ceil(width / factor))
    rows = factor * max(1, _BAND_PIXELS // (width * factor))  # level rows per band, in whole blocks
    for top in range(0, height, rows):
        band_h = min(rows, height - top)
        band = read_region(slide, 0, round(top * slide.level_downsamples[level]), level, (width, band_h))
        if factor > 1:  # blocks cut by the edge are padded with white (cval), as glass
            band = block_reduce(band, (factor, factor, 1), np.mean, cval=255) / 255.0
        yield top // factor, band, out_size, downsample


def thumbnail(slide: openslide.OpenSlide, min_size: int = 1024, max_size: int = 2048) -> tuple[np.ndarray, float]:
    """A picture of the whole slide for overlays, its longer side in ``min_size .. max_size``
    where the pyramid allows: the level :func:`tissue_mask` would read for these sizes, reduced
    by whole ``f x f`` block means, never resampled by a fractional factor (OpenSlide's
    ``get_thumbnail`` resamples a finer level with Lanczos).

    Returns:
        (rgb, downsample): uint8 ``(H, W, 3)`` (transparent regions white) and its level-0
        pixels per picture pixel. Blocks cut by the right or bottom edge are padded with white,
        so the picture may reach up to ``f - 1`` level pixels past the slide's edge.
    """
    picture, downsample = None, 1.0
    for top, band, (height, width), downsample in _level_bands(slide, min_size, max_size):
        if picture is None:
            picture = np.empty((height, width, 3), np.uint8)
        if band.dtype != np.uint8:
            band = np.rint(band * 255.0).astype(np.uint8)
        picture[top : top + len(band)] = band
    return picture, downsample


def tissue_mask(
    slide: openslide.OpenSlide,
    min_size: int = 2048,
    max_size: int = 4096,
    min_saturation: float = 0.05,
    min_area: float = 2.0**18,
) -> tuple[np.ndarray, float]:
    """Boolean tissue mask at low resolution: saturated (stained) pixels, not glass or pale background.

    The picture is :func:`_level_bands`' for ``min_size`` and ``max_size``: the coarsest level
    whose longer side is at least ``min_size``, averaged over whole blocks down to ``max_size``.

    Tissue is where the HSV saturation exceeds Otsu's threshold, floored at ``min_saturation``
    so that a slide of bare glass (saturation noise only) finds none; near-black pixels (HSV value
    below 0.15: scanner background, whose noise is strongly saturated) count as background.
    Tissue pieces smaller than ``min_area`` level-0 pixels (dust, debris) are removed and holes
    smaller than that filled (``min_area / downsample**2`` mask pixels; the default 2**18,
    512 x 512 level-0 pixels, is 0.015 mm² at 0.24 µm per pixel).

    Returns:
        (mask, downsample): bool (H_m, W_m) mask and its level-0 pixels per mask pixel. A slide
        without tissue gives an all-False mask and a warning naming it.
    """
    saturation, downsample = None, 1.0
    for top, band, (out_h, out_w), downsample in _level_bands(slide, min_size, max_size):
        if saturation is None:
            saturation = np.empty((out_h, out_w), np.float32)
        hsv = rgb2hsv(band)
        band_sat = np.where(hsv[..., 2] < _MIN_VALUE, 0.0, hsv[..., 1])
        saturation[top : top + len(band_sat)] = band_sat

    if np.ptp(saturation) < 1e-6:  # uniform: Otsu has nothing to split
        warnings.warn(f"{_name(slide)}: blank slide (uniform colour), no tissue found", stacklevel=2)
        return np.zeros((out_h, out_w), bool), float(downsample)
    mask = saturation > max(threshold_otsu(saturation), min_saturation)
    mask = _remove_small(mask, min_area / downsample**2)
    if not mask.any():
        warnings.warn(
            f"{_name(slide)}: no tissue found (nothing stained above saturation {min_saturation})", stacklevel=2
        )
    return mask, float(downsample)


def patch_grid(
    tissue: np.ndarray,
    tissue_downsample: float,
    level0_size: tuple[int, int],
    patch_size: int,
    stride: int,
    level_downsample: float,
    min_tissue: float = 0.5,
) -> tuple[np.ndarray, np.ndarray]:
    """Top-left corners of the patches of a level that lie on tissue, and their grid cells.

    Patches are ``patch_size`` pixels of a level with ``level_downsample``, so each covers a
    footprint of ``patch_size * level_downsample`` level-0 pixels; they are stepped by
    ``stride`` pixels of that level from (0, 0), and kept when they lie wholly inside the slide
    and at least ``min_tissue`` of the footprint is tissue (see :func:`coverage`).

    Args:
        tissue: bool (H_m, W_m) mask, e.g. from :func:`tissue_mask`.
        tissue_downsample: level-0 pixels per mask pixel.
        level0_size: (width, height) of level 0.
        min_tissue: fraction in [0, 1]; 0 keeps every patch inside the slide.

    Returns:
        ``(coords, cells)``: int64 (n, 2) level-0 (x, y) corners, row by row (y, then x,
        ascending), and int64 (n, 2) (row, col) of each patch in the grid's enumeration: the
        patch of cell (r, c) has its corner at ``round(c * step), round(r * step)``, ``step``
        the stride in level-0 pixels. The cells come from the enumeration, not back from the
        rounded corners: where the downsample is not a whole number (an .svs level of 4.000121)
        ``corner // step`` puts neighbouring patches in one cell.
    """
    if patch_size <= 0 or stride <= 0:
        raise ValueError(f"patch_size and stride must be positive, got {patch_size}, {stride}")
    if not 0 <= min_tissue <= 1:
        raise ValueError(f"min_tissue must be in [0, 1], got {min_tissue}")
    footprint, step = patch_size * level_downsample, stride * level_downsample
    # per axis: corners i*step with i*step + footprint <= side
    cols, rows = (np.arange(max(0, math.floor((side - footprint) / step) + 1)) for side in level0_size)
    rows, cols = np.meshgrid(rows, cols, indexing="ij")
    cells = np.stack([rows.ravel(), cols.ravel()], axis=1).astype(np.int64)
    coords = np.round(cells[:, ::-1] * step).astype(np.int64)
    # the tolerance keeps fractions equal to min_tissue whose sum rounded a hair below it
    keep = coverage(tissue, tissue_downsample, coords, footprint) >= min_tissue - 1e-9
    return coords[keep], cells[keep]


def coverage(mask: np.ndarray, mask_downsample: float, coords: np.ndarray, footprint_level0: float) -> np.ndarray:
    """Fraction of each square patch footprint that the mask covers, by area.

    Exact for footprints that cut mask pixels: the integral image of a piecewise-constant mask
    is bilinear within each pixel, so interpolating it at the footprint's fractional corners
    gives the covered area. Parts of a footprint outside the mask count as uncovered.

    Args:
        mask: bool (H_m, W_m) mask (tissue, or tumour from :func:`~hsmla_med.data.asap.rasterise`).
        mask_downsample: level-0 pixels per mask pixel.
        coords: (n, 2) level-0 (x, y) top-left corners.
        footprint_level0: side of the footprints in level-0 pixels.

    Returns:
        float64 (n,) fractions in [0, 1].
    """
    height, width = mask.shape
    integral = np.zeros((height + 1, width + 1), np.float64)
    integral[1:, 1:] = np.cumsum(np.cumsum(mask, axis=0, dtype=np.int64), axis=1)
    corners = np.asarray(coords, np.float64).reshape(-1, 2) / mask_downsample
    side = footprint_level0 / mask_downsample

    def area_to(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Mask area in [0, x] x [0, y] (mask pixels), bilinear in the integral image."""
        x, y = np.clip(x, 0, width), np.clip(y, 0, height)
        j = np.minimum(np.floor(x), width - 1).astype(np.int64)
        k = np.minimum(np.floor(y), height - 1).astype(np.int64)
        a, b = x - j, y - k
        return (
            integral[k, j] * (1 - a) * (1 - b)
            + integral[k, j + 1] * a * (1 - b)
            + integral[k + 1, j] * (1 - a) * b
            + integral[k + 1, j + 1] * a * b
        )

    x, y = corners[:, 0], corners[:, 1]
    covered = area_to(x + side, y + side) - area_to(x, y + side) - area_to(x + side, y) + area_to(x, y)
    return np.clip(covered / side**2, 0.0, 1.0)
