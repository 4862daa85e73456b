"""ASAP XML annotations: reading, refusals naming the file, and rasterisation against masks computed by hand.

Outline edges sit on level-0 pixel edges (half-integers) and the triangle's hypotenuse between
pixel centres, so that no pixel centre lies on an outline and the expected masks are exact.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from hsmla_med.data.asap import Polygon, asap_mask, rasterise, read_asap_xml
from hsmla_med.errors import DataError

SLIDE = (2400, 1000)  # level-0 (width, height)


def square(x0, y0, x1, y1):
    return [(x0, y0), (x1, y0), (x1, y1), (x0, y1)]


def annotation(name, group, points, kind="Polygon", order=None):
    order = order or range(len(points))
    coords = "".join(f'<Coordinate Order="{o}" X="{x}" Y="{y}"/>' for o, (x, y) in zip(order, points))
    head = f'<Annotation Name="{name}" Type="{kind}" PartOfGroup="{group}" Color="#F4FA58">'
    return f"{head}<Coordinates>{coords}</Coordinates></Annotation>"


def asap(*annotations):
    body = "".join(annotations)
    return f'<?xml version="1.0"?><ASAP_Annotations><Annotations>{body}</Annotations></ASAP_Annotations>'


# Tumour square: level-0 pixels x 100..299, y 200..399. Points given out of order (Order restores them).
SQUARE = annotation("Annotation 0", "_0", square(99.5, 199.5, 299.5, 399.5)[::-1], kind="Rectangle", order=[3, 2, 1, 0])
# _1 outline, x 1000..1399, y 100..499, with a _2 hole x 1100..1199, y 200..299.
OUTER = annotation("Annotation 1", "_1", square(999.5, 99.5, 1399.5, 499.5), kind="Spline")
HOLE = annotation("Annotation 2", "_2", square(1099.5, 199.5, 1199.5, 299.5))
# Right triangle, x >= 2000, y >= 600, (x - 2000) + (y - 600) <= 199.25.
TRIANGLE = annotation("Annotation 3", "Tumor", [(1999.5, 599.5), (2199.75, 599.5), (1999.5, 799.75)])
XML = asap(SQUARE, OUTER, HOLE, TRIANGLE)


def write(tmp_path, text, name="tumor_001.xml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def expected_mask(d: int) -> np.ndarray:
    """The mask at downsample ``d`` (1 or 4; all edges fall on level pixel edges at both)."""
    mask = np.zeros((SLIDE[1] // d, SLIDE[0] // d), bool)
    mask[200 // d : 400 // d, 100 // d : 300 // d] = True
    mask[100 // d : 500 // d, 1000 // d : 1400 // d] = True
    mask[200 // d : 300 // d, 1100 // d : 1200 // d] = False
    # Triangle: level pixel centre of (a, b) pixels past the corner is at 2000 + a*d + (d-1)/2.
    rows, cols = np.ogrid[: mask.shape[0], : mask.shape[1]]
    a, b = cols - 2000 // d, rows - 600 // d
    mask |= (a >= 0) & (b >= 0) & ((a + b) * d + (d - 1) <= 199.25)
    return mask


def test_read(tmp_path):
    polygons = read_asap_xml(write(tmp_path, XML))
    assert [(p.name, p.group) for p in polygons] == [
        ("Annotation 0", "_0"), ("Annotation 1", "_1"), ("Annotation 2", "_2"), ("Annotation 3", "Tumor")
    ]
    assert polygons[0].points.dtype == np.float64
    np.testing.assert_array_equal(polygons[0].points, square(99.5, 199.5, 299.5, 399.5))  # sorted by Order


# square + outline - hole + triangle of k rows (k(k+1)/2 pixels), counted by hand
HAND_COUNTS = [
    (1, 200 * 200 + 400 * 400 - 100 * 100 + 200 * 201 // 2),
    (4, 50 * 50 + 100 * 100 - 25 * 25 + 50 * 51 // 2),
]


@pytest.mark.parametrize("d, tumour_pixels", HAND_COUNTS)
def test_rasterise_matches_hand_computed(tmp_path, d, tumour_pixels):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # everything is inside the slide: no warning
        mask = rasterise(read_asap_xml(write(tmp_path, XML)), SLIDE, d)
    assert mask.shape == (SLIDE[1] // d, SLIDE[0] // d) and mask.dtype == bool
    assert mask.sum() == tumour_pixels
    np.testing.assert_array_equal(mask, expected_mask(d))
    assert not mask[250 // d, 1150 // d] and mask[150 // d, 1050 // d] and mask[300 // d, 200 // d]


def test_rasterise_odd_size_rounds_up():
    poly = Polygon("p", "_0", np.array(square(-0.5, -0.5, 4.5, 4.5), float))
    mask = rasterise([poly], (10, 9), 4)  # ceil(9/4) x ceil(10/4)
    assert mask.shape == (3, 3)


def test_malformed_xml_names_file(tmp_path):
    path = write(tmp_path, XML[:-30], "broken.xml")
    with pytest.raises(DataError, match=r"broken\.xml: malformed ASAP XML"):
        read_asap_xml(path)
    with pytest.raises(DataError, match=r"other\.xml: malformed ASAP XML: root element <Annotations>"):
        read_asap_xml(write(tmp_path, '<Annotations MicronsPerPixel="0.25"/>', "other.xml"))


@pytest.mark.parametrize("value", ["abc", "", "nan", "12,5"])
def test_non_numeric_coordinate_names_file_and_annotation(tmp_path, value):
    text = asap(annotation("Bad one", "_0", [(0, 0), (10, value), (10, 10)]))
    with pytest.raises(DataError, match=r"bad\.xml: annotation 'Bad one': coordinate Y="):
        read_asap_xml(write(tmp_path, text, "bad.xml"))


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"absent\.xml: cannot read"):
        read_asap_xml(tmp_path / "absent.xml")


@pytest.mark.parametrize("text", ["", "  \n", asap(), "<ASAP_Annotations><AnnotationGroups/></ASAP_Annotations>"])
def test_empty_file_warns(tmp_path, text):
    with pytest.warns(UserWarning, match=r"empty\.xml: (empty annotation file|no tumour or exclusion outlines)"):
        assert read_asap_xml(write(tmp_path, text, "empty.xml")) == []


def test_skipped_annotations_warn(tmp_path):
    text = asap(
        SQUARE,
        annotation("Two points", "_0", [(0, 0), (5, 5)]),
        annotation("A dot", "_0", [(3, 3)], kind="Dot"),
        annotation("Lymphocytes", "Other", square(0, 0, 9, 9)),
    )
    with pytest.warns(UserWarning) as record:
        polygons = read_asap_xml(write(tmp_path, text, "mixed.xml"))
    assert [p.name for p in polygons] == ["Annotation 0"]
    messages = "\n".join(str(w.message) for w in record)
    assert "'Two points' has 2 point(s)" in messages
    assert "'A dot' is a Dot" in messages
    assert "unknown groups ignored: 'Other' (1)" in messages
    assert all(str(w.message).startswith(str(tmp_path / "mixed.xml")) for w in record)


def test_outside_slide_warns_and_clips(tmp_path):
    # x 2300..2499 on a 2400-wide slide: the columns 2300..2399 inside are kept.
    text = asap(annotation("Edge", "_0", square(2299.5, 9.5, 2499.5, 19.5)))
    polygons = read_asap_xml(write(tmp_path, text))
    with pytest.warns(UserWarning, match=r"tumor_001: annotation\(s\) 'Edge' reach outside the 2400x1000 slide"):
        mask = rasterise(polygons, SLIDE, 1, slide_name="tumor_001")
    assert mask.shape == (1000, 2400) and mask.sum() == 100 * 10
    assert mask[10:20, 2300:].all()


# --- ASAP's AnnotationToMask (annotation/AnnotationToMask.cpp), transcribed point by point: the
# reference asap_mask must equal. Coordinates are C++ floats (float32); isLeft is a float32
# expression cast to int (truncated; beyond the int range x86 gives INT_MIN); every outline is
# made clockwise first; a pixel is tested only strictly inside its outline's bounding box; groups
# are drawn _0, _1, then _2 (label 0) over them. The pyramid keeps the top-left pixel of each 2x2.

F32 = np.float32


def _is_left(p0, p1, p2) -> int:
    value = F32(F32(F32(p1[0] - p0[0]) * F32(p0[1] - p2[1])) - F32(F32(p2[0] - p0[0]) * F32(p0[1] - p1[1])))
    return -(2**31) if abs(float(value)) >= 2**31 else int(value)


def _winding(point, vertices) -> int:
    wn = 0
    for a, b in zip(vertices[:-1], vertices[1:]):
        if a[1] <= point[1]:
            if b[1] > point[1] and _is_left(a, b, point) > 0:
                wn += 1
        elif b[1] <= point[1] and _is_left(a, b, point) < 0:
            wn -= 1
    return wn


def _annotation_to_mask(polygons, width, height) -> np.ndarray:
    buffer = np.zeros((height, width), np.uint8)
    for poly in sorted(polygons, key=lambda p: ("_0", "_1", "_2").index(p.group)):
        vertices = [(F32(x), F32(y)) for x, y in poly.points]
        closed = vertices + vertices[:1]
        cwise = sum(float(F32(F32(b[0] - a[0]) * F32(b[1] + a[1]))) for a, b in zip(closed[:-1], closed[1:]))
        if not cwise < 0:
            vertices = vertices[::-1]
        low = (min(v[0] for v in vertices), min(v[1] for v in vertices))
        high = (max(v[0] for v in vertices), max(v[1] for v in vertices))
        vertices = vertices + vertices[:1]
        for y in range(height):
            if low[1] < F32(y) < high[1]:
                for x in range(width):
                    if low[0] < F32(x) < high[0] and _winding((F32(x), F32(y)), vertices) != 0:
                        buffer[y, x] = 0 if poly.group == "_2" else 1
    return buffer > 0


def test_asap_mask_is_asaps_annotation_to_mask_and_pyramid():
    """Random outlines (star-shaped and self-intersecting, either orientation, fractional and
    integer vertices: points exactly on edges, exclusions over tumour) on small slides: every level
    equals the transcription's level 0 read every d-th pixel, floor(size / d) pixels."""
    rng = np.random.default_rng(7)
    for trial in range(12):
        width, height = (int(n) for n in rng.integers(40, 80, 2))
        polygons = []
        for k in range(int(rng.integers(1, 4))):
            n = int(rng.integers(3, 9))
            angles = np.sort(rng.uniform(0, 2 * np.pi, n)) if rng.random() < 0.6 else rng.uniform(0, 2 * np.pi, n)
            points = rng.uniform([0, 0], [width, height]) + np.stack([np.cos(angles), np.sin(angles)], 1) * rng.uniform(5, 30, (n, 1))
            points = np.round(points) if rng.random() < 0.5 else points
            polygons.append(Polygon(f"a{k}", "_0" if k == 0 else str(rng.choice(["_0", "_1", "_2"])), points[::-1] if rng.random() < 0.3 else points))
        reference = _annotation_to_mask(polygons, width, height)
        for d in (1, 2, 4, 8):
            np.testing.assert_array_equal(asap_mask(polygons, (width, height), d), reference[::d, ::d][: height // d, : width // d], err_msg=f"{trial}, {d}")


def test_asap_mask_differs_from_pixel_centres_on_the_edge():
    """An edge 4 level-0 pixels past a level-5 pixel's corner: ASAP's sample (the corner) is
    inside, the pixel's centre (15.5 further) is not."""
    poly = [Polygon("a", "_0", np.array(square(316, 316, 644, 644), float))]
    asap_cols = np.nonzero(asap_mask(poly, (1000, 1000), 32).any(axis=0))[0]
    centre_cols = np.nonzero(rasterise(poly, (1000, 1000), 32).any(axis=0))[0]
    assert asap_cols.tolist() == list(range(10, 21)) and centre_cols.tolist() == list(range(10, 20))
