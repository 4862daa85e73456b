"""Patch readers of whole-slide images: OpenSlide everywhere, cuCIM where it is installed.

Patches are the hot path of whole-slide inference (thousands per slide). cuCIM reads the TIFF
family (generic tiled TIFF, as CAMELYON16 ships, Aperio SVS, Philips TIFF) several times faster
than OpenSlide on the CPU (docs/benchmarks.md, ``scripts/bench_slide_reading.py``) and
needs no GPU for it; every other format, and machines without cuCIM, use OpenSlide. Tissue
masks and thumbnails (once per slide) always go through OpenSlide (:mod:`hsmla_med.data.slides`).

The two give the same bytes where it matters: inside the slide cuCIM decodes the same tiles to
the same pixels; outside it (a patch across the slide's edge) cuCIM returns black, which
:class:`CuCIMPatches` turns into OpenSlide's white (glass). Regions at level-0 coordinates that
are not whole pixels of a coarser level are rounded differently by the two libraries (a few
grey levels); the patch grids of :func:`~hsmla_med.data.slides.patch_grid` never ask for those.

``HSMLA_MED_SLIDE_READER`` chooses: ``auto`` (default: cuCIM when importable, when it opens the
file, sees the pyramid OpenSlide sees and decodes a sample to the same bytes, else OpenSlide),
``openslide``, or ``cucim`` (an error naming the slide when cuCIM cannot read it).
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import numpy as np

from hsmla_med.data.slides import open_slide, read_region
from hsmla_med.errors import DataError

__all__ = ["READERS", "READER_ENV", "OpenSlidePatches", "CuCIMPatches", "open_patches", "requested_reader"]

log = logging.getLogger("hsmla_med")

READERS = ("auto", "openslide", "cucim")
READER_ENV = "HSMLA_MED_SLIDE_READER"
_SAMPLE = 256  # side of the level-0 region both readers decode before auto takes cuCIM


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


class CuCIMPatches:
    """Regions of one slide through cuCIM's ``CuImage`` (CPU decoding), white outside the slide.

    Raises:
        DataError: naming the slide, when cuCIM is missing or cannot open it.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        try:
            from cucim import CuImage
        except ImportError as err:
            raise DataError(f"{self.path}: {READER_ENV}=cucim but cuCIM is not installed ({err})") from None
        if not Path(self.path).is_file():
            raise DataError(f"{self.path}: slide file not found")
        try:
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


def open_patches(path: str | Path, reader: str | None = None) -> OpenSlidePatches | CuCIMPatches:
    """A patch reader of the slide at ``path``: ``reader`` (default :func:`requested_reader`)
    ``openslide``, ``cucim``, or ``auto``, which takes cuCIM where it opens the file with the
    pyramid OpenSlide sees (levels and their sizes) and decodes a sample region to OpenSlide's
    bytes, and OpenSlide otherwise.

    Raises:
        DataError: naming the slide, when the reader asked for cannot open it.
    """
    reader = requested_reader() if reader is None else reader
    if reader not in READERS:
        raise ValueError(f"reader must be one of {READERS}, got {reader!r}")
    if reader == "openslide":
        return OpenSlidePatches(path)
    if reader == "cucim":
        return CuCIMPatches(path)
    fallback = OpenSlidePatches(path)  # opens or refuses the file with OpenSlide's clear errors
    try:
        patches = CuCIMPatches(path)
    except DataError as err:
        log.debug("%s: reading patches with OpenSlide (%s)", path, err)
        return fallback
    problem = _disagreement(patches, fallback)
    if problem:
        log.debug("%s: reading patches with OpenSlide (%s)", path, problem)
        patches.close()
        return fallback
    fallback.close()
    return patches


def _disagreement(cucim: CuCIMPatches, openslide: OpenSlidePatches) -> str | None:
    """Why the two readers would not give the same patches of this slide, or ``None``: another
    pyramid, or other bytes for a sample at the centre of level 0 (a decoder that converts
    colours or upsamples chroma otherwise), checked once per slide so that ``auto`` never
    changes what the network sees."""
    levels = [tuple(d) for d in openslide.slide.level_dimensions]
    if cucim.dimensions != levels:
        return f"cuCIM sees levels {cucim.dimensions}, OpenSlide {levels}"
    width, height = levels[0]
    x, y = max(0, width // 2 - _SAMPLE // 2), max(0, height // 2 - _SAMPLE // 2)
    try:
        same = np.array_equal(cucim.read(x, y, 0, _SAMPLE), openslide.read(x, y, 0, _SAMPLE))
    except DataError as err:
        return str(err)
    return None if same else f"cuCIM decodes the sample at ({x}, {y}) to other bytes than OpenSlide"
