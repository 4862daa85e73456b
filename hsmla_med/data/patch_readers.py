"""Patch readers of whole-slide images: OpenSlide everywhere; tifffile for tiled TIFF-family
slides; cuCIM where it is installed (imported only when a slide is read with it).

Patches are the hot path of whole-slide inference (thousands per slide). OpenSlide pays, per
region, for compositing the decoded tiles into a premultiplied ARGB canvas and converting it back;
for the TIFF family (generic tiled TIFF, as CAMELYON16 ships, Aperio SVS) the tiles themselves
are plain JPEG / deflate / JPEG 2000 streams that tifffile finds and imagecodecs
(libjpeg-turbo) decodes several times faster (docs/benchmarks.md, ``hsmla-med bench --only slide-reading``).
cuCIM does the same in C++ and needs no GPU for it. Tissue masks and thumbnails (once per slide)
always go through OpenSlide (:mod:`hsmla_med.data.slides`).

The readers give the same bytes where it matters: inside the slide the same tiles decode to the
same pixels; outside it (a patch across the slide's edge) :class:`TiffPatches` and
:class:`CuCIMPatches` give OpenSlide's white (glass). Regions at level-0 coordinates that are not
whole pixels of a coarser level are rounded differently (OpenSlide resamples at the fractional
offset, the others start at the pixel below: a few grey levels); the patch grids of
:func:`~hsmla_med.data.slides.patch_grid` at level 0, the heatmap default, never ask for those.

``HSMLA_MED_SLIDE_READER`` chooses: ``auto`` (default: tifffile, then cuCIM, the first that
opens the file, sees the pyramid OpenSlide sees and decodes a sample to the same bytes, else
OpenSlide), ``openslide``, ``tifffile`` or ``cucim`` (an error naming the slide when that reader
cannot read it).
"""

from __future__ import annotations

import logging
import math
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import tifffile

from hsmla_med.data.slides import open_slide, read_region
from hsmla_med.errors import DataError
from hsmla_med.quiet_cucim import cuimage, quiet_cuda_probe

__all__ = ["READERS", "READER_ENV", "OpenSlidePatches", "TiffPatches", "CuCIMPatches", "open_patches", "requested_reader"]

log = logging.getLogger("hsmla_med")

READERS = ("auto", "openslide", "tifffile", "cucim")
READER_ENV = "HSMLA_MED_SLIDE_READER"
_SAMPLE = 256  # side of the level-0 region both readers decode before auto takes one
# auto's order. tifffile first: through the whole heatmap it beat cuCIM in each of the three
# paired rounds of docs/benchmarks.md, "Heatmaps at a real slide's scale" (0.96 / 0.88 / 0.85 of the forward
# passes' speed against cuCIM's 0.90 / 0.87 / 0.82; best runs 39.4 s against 42.1 s), though
# cuCIM decodes a patch alone a little faster (0.41 ms against 0.47); and it is always installed,
# while importing cuCIM starts its CUDA probing (hsmla_med.quiet_cucim)
_AUTO_ORDER = ("tifffile", "cucim")


def requested_reader() -> str:
    """The reader ``HSMLA_MED_SLIDE_READER`` asks for (``auto`` when unset).

    Raises:
        DataError: naming the variable, for a value that is no reader.
    """
    reader = os.environ.get(READER_ENV, "auto").strip().lower() or "auto"
    if reader not in READERS:
        raise DataError(f"{READER_ENV}={os.environ[READER_ENV]!r}: not a slide reader; use one of {', '.join(READERS)}")
    return reader


class OpenSlidePatches:
    """Regions of one slide through OpenSlide (:func:`hsmla_med.data.slides.read_region`)."""

    def __init__(self, path: str | Path) -> None:
        self.slide = open_slide(path)

    def read(self, x0: int, y0: int, level: int, size: int) -> np.ndarray:
        """uint8 ``(size, size, 3)`` RGB at level-0 corner ``(x0, y0)`` of ``level``; white outside the slide."""
        return read_region(self.slide, x0, y0, level, size)

    def close(self) -> None:
        self.slide.close()


class TiffPatches:
    """Regions of a tiled TIFF-family slide, tile by tile with tifffile and imagecodecs, white
    outside the slide.

    The levels are the main-chain directories that hold tiled RGB / YCbCr uint8 images, largest
    first (what OpenSlide's generic-TIFF and Aperio readers take as the pyramid; :func:`open_patches`
    checks that both see the same). The region is put together from the tiles it touches here:
    tifffile decodes whole tiles or pages, not regions. The last few decoded tiles are kept, so
    that overlapping patches (a stride below the patch size) decode each tile once.

    Raises:
        DataError: naming the slide, when it is no tiled TIFF of 8-bit colour tiles or a tile
            cannot be decoded.
    """

    _KEEP = 64  # decoded tiles kept: a row of 256-px patches across a 16k-px wide slide

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        if not Path(self.path).is_file():
            raise DataError(f"{self.path}: slide file not found")
        try:
            self.file = tifffile.TiffFile(self.path)
            pages = [self.file.pages[i] for i in range(len(self.file.pages))]
        except (tifffile.TiffFileError, OSError, ValueError, IndexError) as err:
            raise DataError(f"{self.path}: tifffile cannot open the slide ({err})") from None
        self.pages = sorted((p for p in pages if p.is_tiled and p.dtype == np.uint8 and p.samplesperpixel in (3, 4)
                             and p.planarconfig == tifffile.PLANARCONFIG.CONTIG), key=lambda p: -p.imagewidth)
        if not self.pages:
            self.file.close()
            raise DataError(f"{self.path}: no tiled 8-bit colour image for tifffile")
        self.dimensions = [(p.imagewidth, p.imagelength) for p in self.pages]
        width, height = self.dimensions[0]
        self.downsamples = [(width / w + height / h) / 2 for w, h in self.dimensions]  # as OpenSlide's
        self._tiles: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def read(self, x0: int, y0: int, level: int, size: int) -> np.ndarray:
        """uint8 ``(size, size, 3)`` RGB at level-0 corner ``(x0, y0)`` of ``level``; white outside the slide."""
        if not 0 <= level < len(self.pages):
            raise DataError(f"{self.path}: level {level} out of range, the slide has {len(self.pages)} level(s)")
        if size <= 0:
            raise ValueError(f"region size must be positive, got {size}")
        page = self.pages[level]
        width, height = self.dimensions[level]
        left, top = math.floor(x0 / self.downsamples[level]), math.floor(y0 / self.downsamples[level])
        out = np.full((size, size, 3), 255, np.uint8)
        x_lo, x_hi, y_lo, y_hi = max(left, 0), min(left + size, width), max(top, 0), min(top + size, height)
        if x_lo >= x_hi or y_lo >= y_hi:
            return out
        tw, th = page.tilewidth, page.tilelength
        across = -(-width // tw)
        for ty in range(y_lo // th, (y_hi - 1) // th + 1):
            for tx in range(x_lo // tw, (x_hi - 1) // tw + 1):
                tile = self._tile(level, ty * across + tx, x0, y0)
                ax, bx = max(x_lo, tx * tw), min(x_hi, (tx + 1) * tw)
                ay, by = max(y_lo, ty * th), min(y_hi, (ty + 1) * th)
                out[ay - top : by - top, ax - left : bx - left] = tile[ay - ty * th : by - ty * th, ax - tx * tw : bx - tx * tw, :3]
        return out

    def _tile(self, level: int, index: int, x0: int, y0: int) -> np.ndarray:
        key = (level, index)
        if key in self._tiles:
            self._tiles.move_to_end(key)
            return self._tiles[key]
        page = self.pages[level]
        offset, count = page.dataoffsets[index], page.databytecounts[index]
        if count == 0:  # a sparse tile (never written): glass, as OpenSlide paints it
            tile = np.full((page.tilelength, page.tilewidth, 3), 255, np.uint8)
        else:
            decode = page.decode  # first: building the decoder may move the file's position
            handle = self.file.filehandle
            handle.seek(offset)
            try:
                tile = decode(handle.read(count), index, jpegtables=page.jpegtables)[0]
            except Exception as err:  # imagecodecs raises its codecs' own error types
                raise DataError(f"{self.path}: cannot read region at ({x0}, {y0}) of level {level} ({type(err).__name__}: {err})") from None
            tile = tile.reshape(page.tilelength, page.tilewidth, -1)
        self._tiles[key] = tile
        if len(self._tiles) > self._KEEP:
            self._tiles.popitem(last=False)
        return tile

    def close(self) -> None:
        self.file.close()


class CuCIMPatches:
    """Regions of one slide through cuCIM's ``CuImage`` (CPU decoding), white outside the slide.

    Raises:
        DataError: naming the slide, when cuCIM is missing or cannot open it.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        try:
            CuImage = cuimage()
        except ImportError as err:
            raise DataError(f"{self.path}: {READER_ENV}=cucim but cuCIM is not installed ({err})") from None
        if not Path(self.path).is_file():
            raise DataError(f"{self.path}: slide file not found")
        try:
            with quiet_cuda_probe():  # the first slide loads cuCIM's slide plugin, which probes again
                self.image = CuImage(self.path)
        except (RuntimeError, ValueError) as err:
            raise DataError(f"{self.path}: cuCIM cannot open the slide ({err})") from None
        resolutions = self.image.resolutions
        self.dimensions = [tuple(int(n) for n in dims) for dims in resolutions["level_dimensions"]]
        self.downsamples = [float(d) for d in resolutions["level_downsamples"]]

    def read(self, x0: int, y0: int, level: int, size: int) -> np.ndarray:
        """uint8 ``(size, size, 3)`` RGB at level-0 corner ``(x0, y0)`` of ``level``; white outside the slide."""
        if not 0 <= level < len(self.dimensions):
            raise DataError(f"{self.path}: level {level} out of range, the slide has {len(self.dimensions)} level(s)")
        if size <= 0:
            raise ValueError(f"region size must be positive, got {size}")
        try:
            region = np.asarray(self.image.read_region((int(x0), int(y0)), (int(size), int(size)), int(level)))
        except RuntimeError as err:
            raise DataError(f"{self.path}: cannot read region at ({x0}, {y0}) of level {level} ({err})") from None
        rgb = region[..., :3]
        # cuCIM fills what lies outside the level with black; OpenSlide composites it onto white
        width, height = self.dimensions[level]
        left = math.floor(x0 / self.downsamples[level])
        top = math.floor(y0 / self.downsamples[level])
        inside_x = slice(max(0, -left), max(0, min(size, width - left)))
        inside_y = slice(max(0, -top), max(0, min(size, height - top)))
        if (inside_x.start, inside_x.stop, inside_y.start, inside_y.stop) == (0, size, 0, size) and rgb.flags.c_contiguous:
            return rgb
        white = np.full((size, size, 3), 255, np.uint8)
        white[inside_y, inside_x] = rgb[inside_y, inside_x]
        return white

    def close(self) -> None:
        self.image.close()


def open_patches(path: str | Path, reader: str | None = None) -> OpenSlidePatches | TiffPatches | CuCIMPatches:
    """A patch reader of the slide at ``path``: ``reader`` (default :func:`requested_reader`)
    ``openslide``, ``tifffile``, ``cucim``, or ``auto``, which takes the first of tifffile and
    cuCIM that opens the file with the pyramid OpenSlide sees (levels and their sizes) and
    decodes a sample region to OpenSlide's bytes, and OpenSlide otherwise.

    Raises:
        DataError: naming the slide, when the reader asked for cannot open it.
    """
    reader = requested_reader() if reader is None else reader
    if reader not in READERS:
        raise ValueError(f"reader must be one of {READERS}, got {reader!r}")
    faster = {"tifffile": TiffPatches, "cucim": CuCIMPatches}
    if reader == "openslide":
        return OpenSlidePatches(path)
    if reader in faster:
        return faster[reader](path)
    fallback = OpenSlidePatches(path)  # opens or refuses the file with OpenSlide's clear errors
    for name in _AUTO_ORDER:
        try:
            patches = faster[name](path)
        except DataError as err:
            log.debug("%s: not reading patches with %s (%s)", path, name, err)
            continue
        problem = _disagreement(patches, fallback)
        if not problem:
            fallback.close()
            return patches
        log.debug("%s: not reading patches with %s (%s)", path, name, problem)
        patches.close()
    return fallback


def _disagreement(patches: TiffPatches | CuCIMPatches, openslide: OpenSlidePatches) -> str | None:
    """Why the two readers would not give the same patches of this slide, or ``None``: another
    pyramid, or other bytes for a sample at the centre of level 0 (a decoder that converts
    colours or upsamples chroma otherwise), checked once per slide so that ``auto`` never
    changes what the network sees."""
    levels = [tuple(d) for d in openslide.slide.level_dimensions]
    if patches.dimensions != levels:
        return f"it sees levels {patches.dimensions}, OpenSlide {levels}"
    width, height = levels[0]
    x, y = max(0, width // 2 - _SAMPLE // 2), max(0, height // 2 - _SAMPLE // 2)
    try:
        same = np.array_equal(patches.read(x, y, 0, _SAMPLE), openslide.read(x, y, 0, _SAMPLE))
    except DataError as err:
        return str(err)
    return None if same else f"it decodes the sample at ({x}, {y}) to other bytes than OpenSlide"
