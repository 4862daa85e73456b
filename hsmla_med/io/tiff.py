"""Pyramidal tiled TIFF output that OpenSlide and QuPath open: synthetic slides and heatmaps.

OpenSlide's "generic tiled TIFF" reader (``openslide-vendor-generic-tiff.c``) walks the chain of
main IFDs and keeps every *tiled* directory that is either the first one or marked
``NewSubfileType = 1`` (reduced-resolution image); it does not look at SubIFDs. Its codecs are
libtiff's. OpenSlide 4 derives ``openslide.mpp-x``/``mpp-y`` from ``XResolution``/
``YResolution`` when ``ResolutionUnit`` is centimetre or inch (no mpp without a unit); these are
the standard TIFF pixel-size tags, which Bio-Formats (QuPath's other reader) uses too. So the
file written here is:

* one main IFD per level, largest first, the others with ``NewSubfileType = 1``;
* square tiles whose side is a multiple of 16 (the TIFF 6.0 rule), edge tiles padded by
  repeating the last row/column (no dark seams after JPEG);
* ``Compression`` 8 (Adobe deflate, horizontal predictor: lossless) or 7 (JPEG, each tile a
  complete baseline JPEG stream; RGB as ``Photometric`` YCbCr with 2x2 chroma subsampling, the
  usual layout of JPEG whole-slide images such as CAMELYON16's);
* ``XResolution``/``YResolution`` in pixels per centimetre, scaled per level by its size.

The container is written here with ``struct`` rather than with tifffile: tifffile needs the
optional imagecodecs package for JPEG (and refuses pre-encoded JPEG tiles without it), whereas
zlib is in the standard library and Pillow (an openslide-python dependency) encodes JPEG.
Classic TIFF is used unless the output may exceed its 4 GiB offsets, then BigTIFF.
"""

from __future__ import annotations

import io
import math
import os
import struct
import zlib
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import numpy as np
from PIL import Image

from hsmla_med.errors import DataError
from hsmla_med.io.atomic import atomic_path

__all__ = ["COMPRESSIONS", "pyramid_shapes", "write_pyramidal_tiff"]

COMPRESSIONS = ("zlib", "jpeg")

# TIFF field types, and the tags written.
_ASCII, _SHORT, _LONG, _RATIONAL, _LONG8 = 2, 3, 4, 5, 16
_TYPE_FORMAT = {_ASCII: "s", _SHORT: "H", _LONG: "I", _RATIONAL: "I", _LONG8: "Q"}
_NEW_SUBFILE_TYPE, _IMAGE_WIDTH, _IMAGE_LENGTH, _BITS_PER_SAMPLE, _COMPRESSION = 254, 256, 257, 258, 259
_PHOTOMETRIC, _SAMPLES_PER_PIXEL, _X_RESOLUTION, _Y_RESOLUTION, _PLANAR_CONFIG = 262, 277, 282, 283, 284
_RESOLUTION_UNIT, _SOFTWARE, _PREDICTOR, _TILE_WIDTH, _TILE_LENGTH = 296, 305, 317, 322, 323
_TILE_OFFSETS, _TILE_BYTE_COUNTS, _YCBCR_SUBSAMPLING, _REFERENCE_BLACK_WHITE = 324, 325, 530, 532
_MINISBLACK, _RGB, _YCBCR = 1, 2, 6
_DEFLATE, _JPEG = 8, 7
_CENTIMETER = 3


def pyramid_shapes(height: int, width: int, min_size: int = 256) -> list[tuple[int, int]]:
    """(height, width) of each level: halved (rounded up) while the longer side is at least
    ``min_size``, and at least once when the image has more than one pixel along some side."""
    shapes = [(height, width)]
    while max(shapes[-1]) > 1 and (len(shapes) == 1 or max(shapes[-1]) >= min_size):
        h, w = shapes[-1]
        shapes.append(((h + 1) // 2, (w + 1) // 2))
    return shapes


def write_pyramidal_tiff(
    path: str | os.PathLike,
    image: np.ndarray,
    mpp: float | None,
    tile: int = 256,
    compression: str = "zlib",
    min_size: int = 256,
    quality: int = 90,
    bigtiff: bool | None = None,
) -> Path:
    """Write ``image`` as a tiled pyramidal TIFF at ``path`` (atomically) and return the path.

    Args:
        path: output file (``.tif``); its folder is created if missing.
        image: uint8 ``(H, W)`` grey (e.g. a heatmap scaled to 0..255) or ``(H, W, 3)`` RGB, the
            full level 0 in memory. Gigapixel images that do not fit in memory (streaming tile by
            tile) are out of scope.
        mpp: microns per pixel of level 0, written as the TIFF resolution (pixels per cm), or
            None to write no resolution.
        tile: tile side in pixels, a multiple of 16.
        compression: ``"zlib"`` (lossless deflate, the choice for heatmaps and masks) or
            ``"jpeg"`` (lossy, for RGB slides: several times smaller and faster to write).
        min_size: levels are added until the longer side of the last one is below this.
        quality: JPEG quality (1..95); ignored for zlib.
        bigtiff: force BigTIFF (True) or classic TIFF (False); None picks BigTIFF only when
            the file could exceed 4 GiB.

    Each level is the previous one averaged over 2x2 blocks (rounded half up; along an odd
    edge the last row/column is repeated, so an edge pixel is the mean of the pixels it covers).
    Besides ``image``, memory holds one level at a time (a quarter of the level before) plus a
    tile: at most ~1.3x the level-0 array overall.

    Raises:
        DataError: ``image`` is not a uint8 grey or RGB array (the message names ``path``).
        ValueError: a bad ``tile``, ``compression``, ``mpp``, ``quality`` or ``min_size``.
    """
    path = Path(path)
    image = np.asarray(image)
    grey_or_rgb = image.ndim == 2 or (image.ndim == 3 and image.shape[2] == 3)
    if image.dtype != np.uint8 or not grey_or_rgb or 0 in image.shape:
        raise DataError(f"{path}: expected a non-empty uint8 (H, W) or (H, W, 3) image, got {image.dtype} {image.shape}")
    if tile < 16 or tile % 16:
        raise ValueError(f"tile must be a positive multiple of 16, got {tile}")
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    if mpp is not None and not (math.isfinite(mpp) and mpp > 0):
        raise ValueError(f"mpp must be a positive number or None, got {mpp}")
    if not 1 <= quality <= 95:
        raise ValueError(f"quality must be within 1..95, got {quality}")
    if min_size < 1:
        raise ValueError(f"min_size must be positive, got {min_size}")
    if bigtiff is None:
        # Worst case: incompressible tiles (deflate adds little; JPEG of noise can grow), all levels.
        bigtiff = 2 * image.nbytes * 4 / 3 + 2**20 > 2**32

    shapes = pyramid_shapes(*image.shape[:2], min_size)
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        writer = _TiffWriter(fh, bigtiff)
        level = image
        for index, (height, width) in enumerate(shapes):
            if index:
                level = _downsample(level)
            offsets, counts = writer.write_tiles(_encoded_tiles(level, tile, compression, quality))
            tags = _level_tags(level, index, tile, compression, offsets, counts, bigtiff)
            if mpp is not None:
                per_cm_x = 1e4 / mpp * width / image.shape[1]
                per_cm_y = 1e4 / mpp * height / image.shape[0]
                tags += [
                    (_X_RESOLUTION, _RATIONAL, _rational(per_cm_x)),
                    (_Y_RESOLUTION, _RATIONAL, _rational(per_cm_y)),
                    (_RESOLUTION_UNIT, _SHORT, [_CENTIMETER]),
                ]
            writer.write_ifd(tags)
    return path


def _downsample(level: np.ndarray) -> np.ndarray:
    """The 2x2 block mean of ``level`` (uint8, rounded half up), computed in bands of rows so
    that the temporaries stay small; an odd last row/column is repeated before averaging."""
    height, width = level.shape[:2]
    out_h, out_w = (height + 1) // 2, (width + 1) // 2
    out = np.empty((out_h, out_w) + level.shape[2:], dtype=np.uint8)
    rows = max(1, 2**21 // (out_w * (level.shape[2] if level.ndim == 3 else 1)))  # output rows per band
    for r0 in range(0, out_h, rows):
        r1 = min(out_h, r0 + rows)
        band = level[2 * r0 : 2 * r1]
        pad = [(0, 2 * (r1 - r0) - band.shape[0]), (0, 2 * out_w - width)] + [(0, 0)] * (level.ndim - 2)
        if pad[0][1] or pad[1][1]:
            band = np.pad(band, pad, mode="edge")
        rows_sum = np.add(band[0::2], band[1::2], dtype=np.uint16)
        sums = rows_sum[:, 0::2] + rows_sum[:, 1::2]
        sums += 2
        out[r0:r1] = sums >> 2
    return out


def _encoded_tiles(level: np.ndarray, tile: int, compression: str, quality: int) -> Iterator[bytes]:
    """The tiles of ``level`` in TIFF order (rows of tiles, top to bottom), encoded."""
    height, width = level.shape[:2]
    for y in range(0, height, tile):
        for x in range(0, width, tile):
            block = level[y : y + tile, x : x + tile]
            if block.shape[:2] != (tile, tile):
                pad = [(0, tile - block.shape[0]), (0, tile - block.shape[1])] + [(0, 0)] * (level.ndim - 2)
                block = np.pad(block, pad, mode="edge")
            if compression == "jpeg":
                buffer = io.BytesIO()
                # RGB: 4:2:0 chroma subsampling, as YCbCrSubSampling = (2, 2) declares. Grey: no
                # option, since libtiff refuses a single component sampled 2x2.
                options = {"subsampling": "4:2:0"} if block.ndim == 3 else {}
                Image.fromarray(block).save(buffer, format="JPEG", quality=quality, **options)
                yield buffer.getvalue()
            else:
                # Horizontal differencing (TIFF predictor 2), restarting on every row of the tile.
                diff = block.copy()
                diff[:, 1:] -= block[:, :-1]
                yield zlib.compress(diff.tobytes(), 6)


def _level_tags(level, index, tile, compression, offsets, counts, bigtiff) -> list[tuple[int, int, list]]:
    """The IFD entries (tag, type, values) of one level, without the resolution."""
    samples = 3 if level.ndim == 3 else 1
    if compression == "jpeg":
        photometric = _YCBCR if samples == 3 else _MINISBLACK
    else:
        photometric = _RGB if samples == 3 else _MINISBLACK
    offset_type = _LONG8 if bigtiff else _LONG
    tags = [
        (_NEW_SUBFILE_TYPE, _LONG, [1 if index else 0]),
        (_IMAGE_WIDTH, _LONG, [level.shape[1]]),
        (_IMAGE_LENGTH, _LONG, [level.shape[0]]),
        (_BITS_PER_SAMPLE, _SHORT, [8] * samples),
        (_COMPRESSION, _SHORT, [_JPEG if compression == "jpeg" else _DEFLATE]),
        (_PHOTOMETRIC, _SHORT, [photometric]),
        (_SAMPLES_PER_PIXEL, _SHORT, [samples]),
        (_PLANAR_CONFIG, _SHORT, [1]),
        (_SOFTWARE, _ASCII, b"hsmla_med\0"),
        (_TILE_WIDTH, _LONG, [tile]),
        (_TILE_LENGTH, _LONG, [tile]),
        (_TILE_OFFSETS, offset_type, offsets),
        (_TILE_BYTE_COUNTS, offset_type, counts),
    ]
    if compression == "zlib":
        tags.append((_PREDICTOR, _SHORT, [2]))
    if photometric == _YCBCR:
        tags += [
            (_YCBCR_SUBSAMPLING, _SHORT, [2, 2]),
            (_REFERENCE_BLACK_WHITE, _RATIONAL, [0, 1, 255, 1, 128, 1, 255, 1, 128, 1, 255, 1]),
        ]
    return tags


def _rational(value: float) -> list[int]:
    """``value`` as the numerator and denominator of a TIFF RATIONAL (two uint32)."""
    limit = max(1, min(2**20, int((2**32 - 1) // (value + 1))))
    fraction = Fraction(value).limit_denominator(limit)
    return [fraction.numerator, fraction.denominator]


class _TiffWriter:
    """Little-endian TIFF (or BigTIFF) written front to back: each level's tiles, then its IFD,
    whose offset is patched into the previous IFD's next-IFD field (or the header)."""

    def __init__(self, fh, bigtiff: bool):
        self.fh, self.bigtiff = fh, bigtiff
        self.offset_format = "<Q" if bigtiff else "<I"
        header = b"II" + (struct.pack("<HHHQ", 43, 8, 0, 0) if bigtiff else struct.pack("<HI", 42, 0))
        fh.write(header)
        self.link = len(header) - struct.calcsize(self.offset_format)  # where the next IFD's offset goes

    def write_tiles(self, tiles: Iterator[bytes]) -> tuple[list[int], list[int]]:
        """Append the tiles; their offsets and byte counts."""
        offsets, counts = [], []
        for data in tiles:
            offsets.append(self.fh.tell())
            counts.append(len(data))
            self.fh.write(data)
        return offsets, counts

    def write_ifd(self, tags: list[tuple[int, int, list]]) -> None:
        """Append an IFD with ``tags`` (values that do not fit in an entry follow it) and link it."""
        entry_format, count_format, slot = ("<HHQ", "<Q", 8) if self.bigtiff else ("<HHI", "<H", 4)
        self.fh.write(b"\0" * (self.fh.tell() % 2))  # IFDs start on a word boundary
        start = self.fh.tell()
        tags = sorted(tags)
        entry_size = struct.calcsize(entry_format) + slot
        size = struct.calcsize(count_format) + len(tags) * entry_size + struct.calcsize(self.offset_format)
        entries, extra = [struct.pack(count_format, len(tags))], []
        for tag, kind, values in tags:
            if kind == _ASCII:
                data, count = bytes(values), len(values)
            else:
                data = struct.pack(f"<{len(values)}{_TYPE_FORMAT[kind]}", *values)
                count = len(values) // 2 if kind == _RATIONAL else len(values)
            if len(data) <= slot:
                field = data.ljust(slot, b"\0")
            else:
                extra_at = start + size + sum(len(e) for e in extra)
                field = struct.pack(self.offset_format, extra_at)
                extra.append(data + b"\0" * (len(data) % 2))
            entries.append(struct.pack(entry_format, tag, kind, count) + field)
        entries.append(struct.pack(self.offset_format, 0))  # no next IFD, until one is linked
        self.fh.write(b"".join(entries) + b"".join(extra))
        end = self.fh.tell()
        self.fh.seek(self.link)
        self.fh.write(struct.pack(self.offset_format, start))
        self.fh.seek(end)
        self.link = start + size - struct.calcsize(self.offset_format)
