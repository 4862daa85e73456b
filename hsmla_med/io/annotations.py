"""Predicted tumour regions as annotations a pathologist opens beside the slide.

:func:`tumour_regions` outlines the regions of a patch-grid probability map (smoothed,
thresholded) as polygons in level-0 pixels; :func:`write_geojson` writes them as a QuPath
(>= 0.4) GeoJSON ``FeatureCollection`` and :func:`write_asap_xml` as ASAP XML, the format of
CAMELYON16's annotations (also the synthetic generator's writer, so the project has one).

Coordinates. GeoJSON and :class:`Region` use QuPath's and OpenSlide's convention: the origin
is the top-left corner of the slide, level-0 pixel ``i`` covers ``[i, i + 1)``, and the slide
spans ``[0, width] x [0, height]``. The project's ASAP reader
(:func:`~hsmla_med.data.asap.rasterise`) puts pixel centres at integers instead, so
:func:`asap_outlines` moves the outlines by half a pixel on the way to ASAP XML.

scikit-image (``find_contours``, ``label``) finds the outlines; the step from its contours
(through the midpoints between cell centres, which cut every corner) to outlines along the
cell edges is ours: shapely and rasterio, which polygonise masks, are not runtime dependencies.
"""

from __future__ import annotations

import json
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from skimage.measure import find_contours, label, regionprops

from hsmla_med.io.atomic import atomic_path
from hsmla_med.io.smoothing import smooth_map

__all__ = ["Region", "tumour_regions", "asap_outlines", "write_geojson", "write_asap_xml", "TUMOUR_COLOUR"]

TUMOUR_COLOUR = (200, 0, 0)  # QuPath's default colour of its "Tumor" class
# ASAP group colours, as CAMELYON16's files have them: yellow metastases, green exclusions
_ASAP_COLOURS = {"Tumor": "#F4FA58", "_0": "#F4FA58", "_1": "#F4FA58", "_2": "#64FE2E"}


@dataclass(frozen=True, eq=False)
class Region:
    """One predicted tumour region: an 8-connected piece of the thresholded map.

    Attributes:
        exterior: ``(n, 2)`` float64 ``(x, y)`` level-0 vertices of the outer ring, closed (first
            point repeated last), counter-clockwise as RFC 7946 reads ``(x, y)`` (positive
            shoelace area; clockwise on screen, where y points down).
        holes: the rings of the tumour-free areas inside it, each ``(m, 2)``, closed, clockwise.
        max_probability: the highest confidence of the lesion detections it holds (the
            challenge CSV's, see :func:`tumour_regions`), else the highest patch probability of
            its cells (unsmoothed).
        mean_probability: the mean patch probability of its cells (unsmoothed).
        area: level-0 pixels² inside the exterior and outside the holes, within the slide.
    """

    exterior: np.ndarray
    holes: tuple[np.ndarray, ...]
    max_probability: float
    mean_probability: float
    area: float


def _signed_area(ring: np.ndarray) -> float:
    """Shoelace area of a closed ring of ``(x, y)`` points: positive when counter-clockwise."""
    x, y = ring[:, 0], ring[:, 1]
    return 0.5 * float(np.dot(x[:-1], y[1:]) - np.dot(x[1:], y[:-1]))


def _cell_edge_ring(contour: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The closed ring along cell edges that a ``find_contours`` contour of binary ``mask`` stands for.

    The contour at 0.5 joins midpoints between cell centres; each of its segments crosses one
    2 x 2 block of cells, whose centre is a cell corner. Through that corner the outline follows
    the cell edges, except where the block is a saddle (two cells touching only diagonally):
    there the segment is kept, so that no ring touches itself or another at a point (an invalid
    polygon). Collinear points are dropped. Coordinates stay ``(row, col)`` cell-centre units of
    ``mask``, all multiples of 0.5, so the arithmetic is exact.
    """
    start, end = contour[:-1], contour[1:]
    block = np.floor((start + end) / 2).astype(np.int64)  # the top-left cell of each segment's block
    r, c = block[:, 0], block[:, 1]
    saddle = (mask[r, c] == mask[r + 1, c + 1]) & (mask[r, c + 1] == mask[r + 1, c]) & (mask[r, c] != mask[r, c + 1])
    # each contour point followed by its segment's corner, but for the saddles'
    ring = np.stack([start, block + 0.5], axis=1).reshape(-1, 2)[np.stack([np.ones_like(saddle), ~saddle], axis=1).ravel()]
    before, after = ring - np.roll(ring, 1, axis=0), np.roll(ring, -1, axis=0) - ring
    ring = ring[before[:, 0] * after[:, 1] != before[:, 1] * after[:, 0]]  # a turn: not collinear
    return np.vstack([ring, ring[:1]])


def _cells_at(points: np.ndarray, step: float, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(index, row, col)``: the grid cells whose closed square holds each level-0 point: one
    for a point inside a cell, two on a cell edge, four on a corner (a patch centre of
    overlapping patches), so that the union of its cells holds the point inside, not on its
    outline."""
    index, rows, cols = [], [], []
    for i, (x, y) in enumerate(np.asarray(points, np.float64).reshape(-1, 2)):
        row_set = {min(int(y // step), shape[0] - 1)} | ({int(y // step) - 1} if y % step == 0 and y > 0 else set())
        col_set = {min(int(x // step), shape[1] - 1)} | ({int(x // step) - 1} if x % step == 0 and x > 0 else set())
        for r in row_set:
            for c in col_set:
                index.append(i), rows.append(r), cols.append(c)
    return np.array(index, np.int64), np.array(rows, np.int64), np.array(cols, np.int64)


def tumour_regions(
    prob_map: np.ndarray, step: float, level0_size: tuple[int, int], threshold: float = 0.5, sigma: float = 1.0,
    detections: tuple[np.ndarray, np.ndarray] | None = None,
) -> list[Region]:
    """The tumour regions of a slide's probability map, as polygons in level-0 pixels.

    The map is smoothed over its tissue cells (:func:`~hsmla_med.io.smoothing.smooth_map`)
    and thresholded; each 8-connected region (scikit-image's ``label``, as the official FROC
    counts lesions) becomes one :class:`Region` whose outline follows the edges of its cells
    (grid cell ``(row, col)`` covers ``x`` in ``[col * step, (col + 1) * step)``), with a hole
    for each tumour-free area it encloses. Where two cells touch only at a corner the outline
    cuts that corner diagonally (half a cell), so polygons are valid (OGC simple features): no
    ring crosses or touches itself or another. Cells reaching past the slide's right or bottom
    edge are cut at the edge, so every vertex lies in ``[0, width] x [0, height]``.

    Args:
        prob_map: ``(H, W)`` patch probabilities on the patch grid, NaN off tissue (never tumour).
        step: the grid step in level-0 pixels (a patch stride times its level's downsample).
        level0_size: the slide's level-0 ``(width, height)``; the grid covers it, its last
            column and row starting inside (``(W - 1) * step < width <= W * step``, as for H).
        threshold: a cell is tumour where the smoothed probability is above it.
        sigma: Gaussian smoothing in grid cells (0: none).
        detections: ``(confidences (n,), points (n, 2))``, the lesions of the challenge CSV
            (level-0 ``(x, y)``). One definition of a lesion for all three outputs: the cells
            holding each point are tumour too (a polygon is made around a detection the
            smoothed map leaves out), and a region's ``max_probability`` is the highest
            confidence of the detections inside it, so the CSV, the GeoJSON and the ASAP XML
            report the same lesions at the same confidences.

    Returns:
        The regions, the most probable (``max_probability``) first.
    """
    prob = np.asarray(prob_map, dtype=np.float64)
    width, height = level0_size
    if prob.ndim != 2 or not all((n - 1) * step < side <= n * step for n, side in zip(prob.shape, (height, width))):
        raise ValueError(f"prob_map {prob.shape} with step {step} is not the grid of the {width}x{height} slide")
    with np.errstate(invalid="ignore"):  # NaN (off tissue) is never above the threshold
        tumour = smooth_map(prob, sigma) > threshold
    confidences, owner, rows, cols = np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    if detections is not None:
        confidences = np.asarray(detections[0], np.float64).reshape(-1)
        owner, rows, cols = _cells_at(detections[1], step, prob.shape)
        tumour[rows, cols] = True
    # level-0 position of each cell edge, the last ones cut at the slide's edge: a monotone map
    # per axis, so it keeps rings simple and apart, and straight segments straight
    x_edges = np.minimum(np.arange(prob.shape[1] + 1) * step, width)
    y_edges = np.minimum(np.arange(prob.shape[0] + 1) * step, height)
    regions, pieces = [], label(tumour, connectivity=2)
    best = np.full(int(pieces.max()) + 1, -np.inf)  # per region, its detections' highest confidence
    np.maximum.at(best, pieces[rows, cols], confidences[owner])
    for piece in regionprops(pieces):
        top, left = piece.bbox[:2]
        mask = np.pad(piece.image, 1)  # a region touching its box still closes
        rings = []
        for contour in find_contours(mask.astype(np.float64), 0.5, fully_connected="high"):
            ring = _cell_edge_ring(contour, mask)
            # padded cell (r, c) is grid cell (r - 1 + top, c - 1 + left), covering edges [c - 1 + left, c + left]
            x = np.interp(ring[:, 1] + left - 0.5, np.arange(len(x_edges)), x_edges)
            y = np.interp(ring[:, 0] + top - 0.5, np.arange(len(y_edges)), y_edges)
            rings.append(np.column_stack([x, y]))
        areas = [_signed_area(ring) for ring in rings]
        outer = int(np.argmax(np.abs(areas)))  # one 8-connected piece has one outer boundary
        exterior = rings[outer] if areas[outer] > 0 else rings[outer][::-1]
        holes = tuple(ring if area < 0 else ring[::-1] for i, (ring, area) in enumerate(zip(rings, areas)) if i != outer)
        area = abs(areas[outer]) - sum(abs(a) for i, a in enumerate(areas) if i != outer)
        values = prob[tuple(piece.coords.T)]  # a detection's neighbour cell may be off tissue (NaN)
        highest = best[piece.label] if np.isfinite(best[piece.label]) else np.nanmax(values)
        regions.append(Region(exterior, holes, float(highest), float(np.nanmean(values)), area))
    return sorted(regions, key=lambda region: -region.max_probability)


def write_geojson(
    path: str | Path, regions: Sequence[Region], mpp: float | None = None, name: str = "Tumor", colour: tuple[int, int, int] = TUMOUR_COLOUR
) -> None:
    """Write regions as the GeoJSON ``FeatureCollection`` QuPath (>= 0.4) imports and exports.

    Each region is a ``Feature`` with a random UUID ``id`` (QuPath's object ID), a ``Polygon``
    geometry (exterior ring, then holes; closed, RFC 7946 winding) in level-0 pixels, and the
    properties QuPath reads: ``objectType: "annotation"``, ``classification`` (``name``,
    ``color`` as ``[r, g, b]``) and ``measurements`` as a name-to-number mapping (QuPath >= 0.4;
    0.3 wrote a list): ``max probability``, ``mean probability`` and the area, ``Area µm^2``
    with ``mpp``, else ``Area px^2`` (QuPath's names). Written atomically, UTF-8.

    Args:
        path: the ``.geojson`` file.
        regions: from :func:`tumour_regions`.
        mpp: level-0 microns per pixel of the slide; ``None`` when the slide has none.
        name, colour: the QuPath class of the annotations.
    """
    area_name, area_scale = ("Area µm^2", mpp**2) if mpp else ("Area px^2", 1.0)
    features = [
        {
            "type": "Feature",
            "id": str(uuid.uuid4()),
            "geometry": {"type": "Polygon", "coordinates": [np.round(ring, 4).tolist() for ring in (region.exterior, *region.holes)]},
            "properties": {
                "objectType": "annotation",
                "classification": {"name": name, "color": [int(v) for v in colour]},
                "measurements": {
                    "max probability": region.max_probability,
                    "mean probability": region.mean_probability,
                    area_name: region.area * area_scale,
                },
            },
        }
        for region in regions
    ]
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps({"type": "FeatureCollection", "features": features}, ensure_ascii=False) + "\n", encoding="utf-8")


def asap_outlines(regions: Sequence[Region]) -> list[tuple[str, np.ndarray]]:
    """``(group, points)`` outlines of regions for :func:`write_asap_xml`, in CAMELYON16's
    convention: exteriors in group ``_0``, holes in ``_2`` (excluded from the tumour); points
    open (ASAP does not repeat the first) and moved by half a pixel to the ASAP reader's
    pixel-centre convention (see the module's docstring)."""
    outlines = []
    for region in regions:
        outlines.append(("_0", region.exterior[:-1] - 0.5))
        outlines += [("_2", hole[:-1] - 0.5) for hole in region.holes]
    return outlines


def write_asap_xml(path: str | Path, outlines: Sequence[tuple[str, np.ndarray]]) -> None:
    """Write polygons as ASAP XML, the format of CAMELYON16's lesion annotations.

    One ``<Annotation Type="Polygon">`` per outline, named as CAMELYON16's files name them
    (``_<index>`` in the ``_0``/``_1``/``_2`` groups, else ``Annotation <index>``), its points as
    ``<Coordinate Order X Y>``; one ``<Group PartOfGroup="None">`` per group used. Read back by
    :func:`~hsmla_med.data.asap.read_asap_xml`. Written atomically.

    Args:
        path: the ``.xml`` file.
        outlines: ``(group, points)`` pairs, ``points`` ``(n, 2)`` ``(x, y)`` level-0, open.
    """
    root = ET.Element("ASAP_Annotations")
    annotations = ET.SubElement(root, "Annotations")
    for index, (group, points) in enumerate(outlines):
        name = f"_{index}" if group.startswith("_") else f"Annotation {index}"
        node = ET.SubElement(annotations, "Annotation", Name=name, Type="Polygon", PartOfGroup=group, Color=_ASAP_COLOURS.get(group, "#F4FA58"))
        coordinates = ET.SubElement(node, "Coordinates")
        for order, (x, y) in enumerate(points):
            ET.SubElement(coordinates, "Coordinate", Order=str(order), X=f"{x:.4f}", Y=f"{y:.4f}")
    groups = ET.SubElement(root, "AnnotationGroups")
    for group in dict.fromkeys(g for g, _ in outlines):
        node = ET.SubElement(groups, "Group", Name=group, PartOfGroup="None", Color=_ASAP_COLOURS.get(group, "#F4FA58"))
        ET.SubElement(node, "Attributes")
    ET.indent(root, space="\t")
    with atomic_path(path) as tmp:
        ET.ElementTree(root).write(tmp, encoding="utf-8", xml_declaration=True)
