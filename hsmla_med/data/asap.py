"""ASAP XML annotations (CAMELYON16 lesion outlines) and their rasterisation to tumour masks.

CAMELYON16 ships one ASAP XML file per tumour slide::

    <ASAP_Annotations><Annotations>
      <Annotation Name="_0" Type="Polygon" PartOfGroup="_0" Color="#F4FA58">
        <Coordinates><Coordinate Order="0" X="1234.5" Y="678.9"/>...</Coordinates>
      </Annotation>...

with coordinates in level-0 pixels. Groups ``_0``/``_1`` (or ``Tumor`` in some files) outline
metastases; ``_2`` outlines non-tumour regions inside them, which are cut out of the tumour.
:func:`read_asap_xml` reads the outlines and :func:`rasterise` turns them into a boolean tumour
mask at any pyramid level, so that patches can be labelled by their tumour coverage;
:func:`asap_mask` makes the mask the challenge's evaluation read, as ASAP makes it.

Input problems are reported, never silently mishandled: an unreadable file or coordinate raises a
:class:`~hsmla_med.errors.DataError` naming the file; what can be used with a caveat (too few
points, dots, unknown groups, no outlines at all, points outside the slide) gives a warning
naming the file and annotation.
"""

from __future__ import annotations

import math
import warnings
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from skimage.draw import polygon as fill_polygon

from hsmla_med.errors import DataError

__all__ = ["TUMOUR_GROUPS", "EXCLUSION_GROUPS", "Polygon", "read_asap_xml", "rasterise", "asap_mask"]

TUMOUR_GROUPS = ("_0", "_1", "Tumor")  # CAMELYON16 metastasis outlines
EXCLUSION_GROUPS = ("_2",)  # non-tumour regions inside a metastasis outline
_AREA_TYPES = ("polygon", "spline", "rectangle")  # outlines: a spline is kept as its control polygon


@dataclass(frozen=True, eq=False)
class Polygon:
    """One outline of an annotation file.

    Attributes:
        name: the annotation's ``Name`` (e.g. ``Annotation 0``).
        group: its ``PartOfGroup`` (one of :data:`TUMOUR_GROUPS` or :data:`EXCLUSION_GROUPS`).
        points: (n, 2) float64 vertices (x, y) in level-0 pixels, in ``Order``; n >= 3.
    """

    name: str
    group: str
    points: np.ndarray


def _number(text: str | None, path, name: str, axis: str) -> float:
    """A coordinate value; anything but a finite number (missing, ``abc``, ``nan``, ``1,5``) is refused.

    ASAP writes C-locale numbers; a comma is refused rather than guessed, since ``12,345`` reads
    as a decimal or as a thousands separator depending on who wrote it.
    """
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value):
        raise DataError(f"{path}: annotation {name!r}: coordinate {axis}={text!r} is not a finite number")
    return value


def read_asap_xml(path: str | Path) -> list[Polygon]:
    """The tumour and exclusion outlines of an ASAP XML file.

    Polygon, Spline and Rectangle annotations become :class:`Polygon` s with their points sorted
    by ``Order``. Skipped, with a warning naming the file: annotations with fewer than 3 points,
    other types (``Dot``, ``PointSet``, ...), and groups outside :data:`TUMOUR_GROUPS` /
    :data:`EXCLUSION_GROUPS`. A file with no outlines (an empty file included) gives a warning
    and an empty list.

    Raises:
        DataError: the file is missing, is not well-formed XML or not ``<ASAP_Annotations>``,
            or holds a coordinate or ``Order`` that is not a number.
    """
    path = Path(path)
    try:
        text = path.read_bytes()
    except OSError as err:
        raise DataError(f"{path}: cannot read annotation file ({err.strerror or err})") from None
    if not text.strip():
        warnings.warn(f"{path}: empty annotation file, no outlines", stacklevel=2)
        return []
    try:
        root = ET.fromstring(text)
    except ET.ParseError as err:
        raise DataError(f"{path}: malformed ASAP XML: {err}") from None
    if root.tag != "ASAP_Annotations":
        raise DataError(f"{path}: malformed ASAP XML: root element <{root.tag}>, expected <ASAP_Annotations>")

    polygons, unknown = [], Counter()
    for index, element in enumerate(root.iter("Annotation")):
        name = element.get("Name", f"#{index}")
        group, kind = element.get("PartOfGroup", "None"), element.get("Type", "Polygon").lower()
        if kind not in _AREA_TYPES:
            warnings.warn(f"{path}: annotation {name!r} is a {element.get('Type')}, not an outline; skipped",
                          stacklevel=2)
            continue
        if group not in TUMOUR_GROUPS + EXCLUSION_GROUPS:
            unknown[group] += 1
            continue
        coords = element.findall("./Coordinates/Coordinate")
        try:
            order = [int(c.get("Order", i)) for i, c in enumerate(coords)]
        except ValueError:
            raise DataError(f"{path}: annotation {name!r}: a coordinate's Order is not an integer") from None
        points = np.array(
            [(_number(c.get("X"), path, name, "X"), _number(c.get("Y"), path, name, "Y")) for c in coords],
            dtype=np.float64,
        ).reshape(-1, 2)
        if len(points) < 3:
            warnings.warn(
                f"{path}: annotation {name!r} has {len(points)} point(s), an outline needs 3; skipped", stacklevel=2
            )
            continue
        polygons.append(Polygon(name, group, points[np.argsort(order, kind="stable")]))
    if unknown:
        groups = ", ".join(f"{g!r} ({n})" for g, n in sorted(unknown.items()))
        warnings.warn(f"{path}: annotations of unknown groups ignored: {groups}", stacklevel=2)
    if not polygons:
        warnings.warn(f"{path}: no tumour or exclusion outlines", stacklevel=2)
    return polygons


def rasterise(
    polygons: list[Polygon], level0_size: tuple[int, int], downsample: float, slide_name: str | None = None
) -> np.ndarray:
    """Boolean tumour mask of a slide level: tumour outlines filled, exclusion outlines cut out.

    Pixel convention (ASAP's ``AnnotationToMask`` and :func:`skimage.draw.polygon`): level-0
    pixel ``i`` has its centre at coordinate ``i``. A level pixel ``j`` of downsample ``d``
    covers level-0 pixels ``j*d .. j*d + d - 1``, so its centre is at ``j*d + (d - 1)/2``; a
    level-0 point ``p`` is therefore drawn at ``(p + 0.5) / d - 0.5``, and a pixel is set when
    its centre lies inside the outline.

    Args:
        polygons: outlines from :func:`read_asap_xml`; groups outside the two known sets are
            ignored.
        level0_size: (width, height) of level 0, as OpenSlide's ``dimensions``.
        downsample: level-0 pixels per level pixel (OpenSlide's ``level_downsamples[level]``).
            Rasterising a whole CAMELYON16 slide at level 0 needs gigabytes; use >= 16.
        slide_name: names the slide in the warning about points outside it.

    Returns:
        bool (ceil(height / downsample), ceil(width / downsample)) mask. Polygons reaching
        outside the slide (vertices more than half a pixel beyond its pixels, outside
        ``[-1, width] x [-1, height]``) give one warning listing them and are clipped to the slide.
    """
    if downsample <= 0:
        raise ValueError(f"downsample must be positive, got {downsample}")
    width, height = level0_size
    shape = (math.ceil(height / downsample), math.ceil(width / downsample))
    tumour, excluded = np.zeros(shape, bool), np.zeros(shape, bool)
    outside = []
    for poly in polygons:
        target = tumour if poly.group in TUMOUR_GROUPS else excluded if poly.group in EXCLUSION_GROUPS else None
        if target is None:
            continue
        x, y = poly.points[:, 0], poly.points[:, 1]
        # the slide's pixels span [-0.5, width - 0.5]; half a pixel more is tolerated as a click on the edge
        if x.min() < -1 or y.min() < -1 or x.max() > width or y.max() > height:
            outside.append(poly.name)
        # shape= clips the filled pixels to the mask, the exact part of the outline inside the slide
        rows, cols = fill_polygon((y + 0.5) / downsample - 0.5, (x + 0.5) / downsample - 0.5, shape=shape)
        target[rows, cols] = True
    if outside:
        warnings.warn(
            f"{slide_name or 'slide'}: annotation(s) {', '.join(map(repr, outside))} reach outside the "
            f"{width}x{height} slide; clipped",
            stacklevel=2,
        )
    return tumour & ~excluded


_INT_RANGE = 2.0**31  # C++ static_cast<int> of a float beyond it gives INT_MIN on x86 (cvttss2si)
_CHUNK = 1 << 22  # (sample rows x edges) and (crossings x columns) per pass of _asap_fill


def _clockwise(points: np.ndarray) -> bool:
    """ASAP's ``Annotation::isClockwise``: the float32 shoelace terms summed in order in double."""
    closed = np.vstack([points, points[:1]])
    terms = (closed[1:, 0] - closed[:-1, 0]) * (closed[1:, 1] + closed[:-1, 1])  # float32, as ASAP's Point
    return float(np.cumsum(terms.astype(np.float64))[-1]) < 0


def _asap_fill(points: np.ndarray, shape: tuple[int, int], downsample: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows and columns of the level pixels (level-0 points ``(c d, r d)``) that ASAP's
    ``AnnotationToMask`` sets for one outline: strictly inside its bounding box, and a winding
    number (``wn_PnPoly``) other than 0. ``isLeft`` is ASAP's: float32 products truncated to int,
    so a point less than one unit of cross product from an edge's line is on it.

    Scanline form of the same test: per sample row, only the edges it crosses (half-open in y,
    ``y0 <= y < y1`` upward, ``y1 <= y < y0`` downward) count, +1 upward where the point is left
    (isLeft > 0), -1 downward where it is right (isLeft < 0)."""
    v = points.astype(np.float32)
    if not _clockwise(v):  # ASAP turns every outline clockwise before drawing
        v = v[::-1]
    lo, hi = v.min(axis=0), v.max(axis=0)
    d = float(downsample)

    def samples(low: np.float32, high: np.float32, count: int) -> np.ndarray:
        first, last = max(0, math.floor(float(low) / d)), min(count - 1, math.ceil(float(high) / d))
        index = np.arange(first, last + 1) if last >= first else np.zeros(0, np.int64)
        at = (index * downsample).astype(np.float32)  # exact below 2**24, as ASAP's float(tx + x)
        keep = (at > low) & (at < high)
        return index[keep], at[keep]

    rows, ys = samples(lo[1], hi[1], shape[0])
    cols, xs = samples(lo[0], hi[0], shape[1])
    if not rows.size or not cols.size:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    x0, y0 = v[:, 0], v[:, 1]
    x1, y1 = np.roll(x0, -1), np.roll(y0, -1)
    found_rows, found_cols = [], []
    chunk = max(1, _CHUNK // (cols.size * max(1, len(v))))  # sample rows per pass: bounded temporaries
    for start in range(0, rows.size, chunk):
        y = ys[start: start + chunk, None]
        up = (y0[None, :] <= y) & (y1[None, :] > y)
        down = (y0[None, :] > y) & (y1[None, :] <= y)
        row, edge = np.nonzero(up | down)  # the crossings, by row
        # isLeft(V[i], V[i+1], P) = int((x1 - x0) * (y0 - Py) - (Px - x0) * (y0 - y1)), in float32
        cross = ((x1[edge] - x0[edge]) * (y0[edge] - y[row, 0]))[:, None] - (xs[None, :] - x0[edge][:, None]) * (y0[edge] - y1[edge])[:, None]
        left = (cross >= 1) & (cross < _INT_RANGE)
        right = (cross <= -1) | (cross >= _INT_RANGE)
        winding = np.zeros((y.shape[0], cols.size), np.int32)
        np.add.at(winding, row, np.where(up[row, edge][:, None], left, -right.astype(np.int32)))
        r, c = np.nonzero(winding)
        found_rows.append(rows[start + r])
        found_cols.append(cols[c])
    return np.concatenate(found_rows), np.concatenate(found_cols)


def asap_mask(polygons: list[Polygon], level0_size: tuple[int, int], downsample: int) -> np.ndarray:
    """The tumour mask of CAMELYON16's ``Ground_Truth/Masks`` made from the outlines, at the
    level of ``downsample`` (a power of two), as ``Evaluation_FROC.py`` reads it.

    The challenge's masks were made by ASAP's ``AnnotationToMask`` (label map ``_0``, ``_1``: 1,
    ``_2``: 0, drawn in that order) and its pyramid writer: level-0 pixel ``(x, y)`` is tumour
    when the integer point ``(x, y)`` lies inside a tumour outline (:func:`_asap_fill`) and
    inside no exclusion outline; each level halves the previous by nearest neighbour (the
    top-left pixel of each 2 x 2) and has ``floor`` of half its size. So the level pixel
    ``(r, c)`` is level-0 point ``(c d, r d)``, not the pixel-centre test of :func:`rasterise`.
    Hand-written: no Python package implements ASAP's rasteriser.

    Args:
        polygons: outlines from :func:`read_asap_xml`.
        level0_size: (width, height) of level 0.
        downsample: ``2**level``.

    Returns:
        bool ``(height // downsample, width // downsample)`` mask.
    """
    if downsample < 1 or downsample & (downsample - 1):
        raise ValueError(f"downsample must be a power of two, got {downsample}")
    width, height = level0_size
    shape = (height // downsample, width // downsample)
    tumour, excluded = np.zeros(shape, bool), np.zeros(shape, bool)
    for poly in polygons:
        target = tumour if poly.group in TUMOUR_GROUPS else excluded if poly.group in EXCLUSION_GROUPS else None
        if target is not None:
            target[_asap_fill(poly.points, shape, downsample)] = True
    return tumour & ~excluded
