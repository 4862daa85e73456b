"""Predicted tumour regions as QuPath GeoJSON and ASAP XML (hsmla_med/io/annotations.py).

Polygons are checked against hand-computed outlines and areas, against GEOS through shapely
(validity, winding, area; a test-only dependency) and against the thresholded map they came
from: the cell centres they contain, and the mask our own ASAP reader rasterises from the XML.
That the lesion CSVs of ``wsi-heatmap`` score as validation scores the same maps is
``tests/test_camelyon16_froc.py::test_wsi_heatmap_submission_scores_as_validation``.
"""

from __future__ import annotations

import json
import math
import uuid
import warnings

import numpy as np
import pytest
import shapely
from shapely.geometry import MultiPolygon, Polygon as ShapelyPolygon

from hsmla_med.config import merge_config, task_config, validate_config
from hsmla_med.data.asap import rasterise, read_asap_xml
from hsmla_med.data.synthetic.wsi import generate_camelyon16
from hsmla_med.engine.classification import ClassificationModule
from hsmla_med.errors import ConfigError
from hsmla_med.io.annotations import asap_outlines, tumour_regions, write_asap_xml, write_geojson
from hsmla_med.io.smoothing import smooth_map
from hsmla_med.pipelines import camelyon16
from hsmla_med.pipelines.task import InferenceOptions
from tests.test_camelyon16 import DarkIsTumour


def brute_smooth(prob: np.ndarray, sigma: float) -> np.ndarray:
    """Gaussian-weighted mean over the valid cells around each valid cell, the kernel written
    out (scipy's truncation at 4 sigma), one cell at a time."""
    radius = int(4 * sigma + 0.5)
    out = np.full(prob.shape, np.nan)
    for r, c in zip(*np.nonzero(~np.isnan(prob))):
        total = weight = 0.0
        for dr in range(-radius, radius + 1):
            for dc in range(-radius, radius + 1):
                rr, cc = r + dr, c + dc
                if 0 <= rr < prob.shape[0] and 0 <= cc < prob.shape[1] and not np.isnan(prob[rr, cc]):
                    w = math.exp(-(dr**2 + dc**2) / (2 * sigma**2))
                    total, weight = total + w * prob[rr, cc], weight + w
        out[r, c] = total / weight
    return out


def cell_centres_inside(regions, shape, step, size) -> np.ndarray:
    """Which grid cells have their centre inside a region's polygon (shapely), for the cells whose
    centre lies inside the slide."""
    rows, cols = np.mgrid[: shape[0], : shape[1]]
    x, y = (cols + 0.5) * step, (rows + 0.5) * step
    inside = np.zeros(shape, bool)
    for region in regions:
        inside |= shapely.contains_xy(ShapelyPolygon(region.exterior, region.holes), x, y)
    return inside


def test_smoothing_is_a_mean_over_tissue_cells():
    rng = np.random.default_rng(0)
    prob = rng.random((9, 11))
    prob[rng.random(prob.shape) < 0.3] = np.nan
    for sigma in (0.7, 1.5):
        np.testing.assert_allclose(smooth_map(prob, sigma), brute_smooth(prob, sigma), rtol=1e-12, equal_nan=True)
    np.testing.assert_array_equal(smooth_map(prob, 0), prob)


def test_a_3x3_square_is_its_cells_edges_with_hand_computed_measurements(tmp_path):
    step, mpp = 64, 0.5
    prob = np.full((6, 7), np.nan)  # off tissue
    prob[0, :] = 0.1  # tissue, normal
    prob[2:5, 1:4] = np.array([[0.6, 0.7, 0.8], [0.9, 0.95, 0.6], [0.7, 0.7, 0.6]])
    [region] = tumour_regions(prob, step, (7 * step, 6 * step), threshold=0.5, sigma=0)
    # cells rows 2..4, cols 1..3: x from 64 to 256, y from 128 to 320; counter-clockwise as (x, y)
    # (clockwise on screen), starting anywhere
    corners = {(64.0, 128.0), (256.0, 128.0), (256.0, 320.0), (64.0, 320.0)}
    assert len(region.exterior) == 5 and (region.exterior[0] == region.exterior[-1]).all()
    assert set(map(tuple, region.exterior[:-1].tolist())) == corners and region.holes == ()
    assert shapely.is_ccw(shapely.LinearRing(region.exterior))
    assert region.area == 9 * step**2
    assert region.max_probability == 0.95 and region.mean_probability == pytest.approx(6.55 / 9, rel=1e-12)

    write_geojson(tmp_path / "a.geojson", [region], mpp)
    [feature] = json.loads((tmp_path / "a.geojson").read_text(encoding="utf-8"))["features"]
    measurements = feature["properties"]["measurements"]
    assert measurements["Area µm^2"] == pytest.approx(9 * (step * mpp) ** 2, rel=1e-12)  # 9216 µm²
    assert measurements["max probability"] == 0.95 and "Area px^2" not in measurements
    write_geojson(tmp_path / "b.geojson", [region], None)  # a slide without mpp: the area in pixels
    [feature] = json.loads((tmp_path / "b.geojson").read_text(encoding="utf-8"))["features"]
    assert feature["properties"]["measurements"]["Area px^2"] == 9 * step**2
    assert "Area µm^2" not in feature["properties"]["measurements"]


def test_a_ring_of_cells_has_a_clockwise_hole(tmp_path):
    step = 10
    prob = np.zeros((7, 7))
    prob[1:6, 1:6] = 0.9
    prob[3, 3] = 0.2  # the hole
    [region] = tumour_regions(prob, step, (70, 70), threshold=0.5, sigma=0)
    assert set(map(tuple, region.exterior[:-1].tolist())) == {(10.0, 10.0), (60.0, 10.0), (60.0, 60.0), (10.0, 60.0)}
    [hole] = region.holes
    assert set(map(tuple, hole[:-1].tolist())) == {(30.0, 30.0), (40.0, 30.0), (40.0, 40.0), (30.0, 40.0)}
    assert not shapely.is_ccw(shapely.LinearRing(hole)) and (hole[0] == hole[-1]).all()
    assert region.area == 24 * step**2
    # in ASAP XML, the hole is CAMELYON16's exclusion group, cut out of the tumour when read back
    write_asap_xml(tmp_path / "ring.xml", asap_outlines([region]))
    polygons = read_asap_xml(tmp_path / "ring.xml")
    assert [p.group for p in polygons] == ["_0", "_2"]
    np.testing.assert_array_equal(rasterise(polygons, (70, 70), step), prob > 0.5)


def _map(rng: np.random.Generator, shape) -> np.ndarray:
    """A map with blobs, holes, cells touching diagonally and tissue gaps (NaN)."""
    prob = rng.random(shape) ** 2
    prob[rng.random(shape) < 0.15] = np.nan
    prob[2:8, 2:9] = 0.9
    prob[4:6, 4:6] = 0.1  # a hole
    prob[9, 9] = prob[10, 10] = 0.95  # diagonal touch
    prob[-3:, -2:] = 0.8  # reaches past the slide's corner
    return prob


@pytest.mark.parametrize("step", [64, 127.872])  # a whole and a fractional (level 1 of a .svs) step
def test_geojson_follows_rfc7946_and_qupath_and_polygons_are_valid_inside_the_slide(tmp_path, step):
    rng = np.random.default_rng(1)
    shape = (14, 17)
    prob = _map(rng, shape)
    size = (int(16.4 * step), int(13.3 * step))  # the last row and column cross the slide's edge
    regions = tumour_regions(prob, step, size, threshold=0.5, sigma=0)
    assert len(regions) >= 3 and any(r.holes for r in regions)
    path = tmp_path / "slide.geojson"
    write_geojson(path, regions, mpp=0.25)
    collection = json.loads(path.read_text(encoding="utf-8"))
    assert collection["type"] == "FeatureCollection" and len(collection["features"]) == len(regions)
    polygons = []
    for feature, region in zip(collection["features"], regions):
        assert feature["type"] == "Feature" and uuid.UUID(feature["id"]).version == 4
        geometry, properties = feature["geometry"], feature["properties"]
        assert geometry["type"] == "Polygon"
        for index, ring in enumerate(geometry["coordinates"]):
            ring = np.array(ring)
            assert ring.shape[0] >= 4 and ring.shape[1] == 2 and (ring[0] == ring[-1]).all()
            assert shapely.is_ccw(shapely.LinearRing(ring)) == (index == 0)  # RFC 7946: exterior CCW, holes CW
            assert (ring >= 0).all() and (ring[:, 0] <= size[0]).all() and (ring[:, 1] <= size[1]).all()
        polygon = ShapelyPolygon(geometry["coordinates"][0], geometry["coordinates"][1:])
        assert polygon.is_valid, shapely.validation.explain_validity(polygon)
        polygons.append(polygon)
        assert properties["objectType"] == "annotation"
        assert properties["classification"]["name"] == "Tumor" and len(properties["classification"]["color"]) == 3
        assert all(isinstance(v, int) and 0 <= v <= 255 for v in properties["classification"]["color"])
        measurements = properties["measurements"]
        assert set(measurements) == {"max probability", "mean probability", "Area µm^2"}
        assert measurements["Area µm^2"] == pytest.approx(polygon.area * 0.25**2, rel=1e-6)
        assert 0.5 < measurements["mean probability"] <= measurements["max probability"] <= 1
    assert len({f["id"] for f in collection["features"]}) == len(regions)
    assert MultiPolygon(polygons).is_valid  # the regions neither overlap nor touch
    # the polygons hold exactly the thresholded cells whose centre is inside the slide
    cols, rows = np.meshgrid((np.arange(shape[1]) + 0.5) * step, (np.arange(shape[0]) + 0.5) * step)
    in_slide = (cols < size[0]) & (rows < size[1])
    expected = np.nan_to_num(prob) > 0.5
    np.testing.assert_array_equal(cell_centres_inside(regions, shape, step, size)[in_slide], expected[in_slide])


def test_asap_round_trip_gives_the_thresholded_smoothed_map(tmp_path):
    rng = np.random.default_rng(2)
    step, shape = 64, (14, 17)
    prob = _map(rng, shape)
    size = (17 * step - 20, 14 * step - 40)
    regions = tumour_regions(prob, step, size, threshold=0.5, sigma=1.0)
    write_asap_xml(tmp_path / "slide.xml", asap_outlines(regions))
    polygons = read_asap_xml(tmp_path / "slide.xml")
    assert {p.group for p in polygons} <= {"_0", "_2"} and sum(p.group == "_0" for p in polygons) == len(regions)
    expected = np.nan_to_num(smooth_map(prob, 1.0)) > 0.5
    for factor in (1, 4):  # at the grid's scale, and at 4 raster pixels per cell, the map upsampled
        d = step / factor
        raster = rasterise(polygons, size, d)
        reference = expected.repeat(factor, 0).repeat(factor, 1)[: raster.shape[0], : raster.shape[1]]
        # within the slide: a raster pixel whose centre (rasterise's convention) lies beyond its edge is not tumour
        rows, cols = np.ogrid[: raster.shape[0], : raster.shape[1]]
        reference &= (cols * d + (d - 1) / 2 < size[0] - 0.5) & (rows * d + (d - 1) / 2 < size[1] - 0.5)
        iou = (raster & reference).sum() / (raster | reference).sum()
        assert iou >= 0.95, (factor, iou)
        if factor == 1:  # cell by cell, exactly
            np.testing.assert_array_equal(raster, reference)


def test_region_settings_are_validated_naming_the_key():
    for key, value in (("region_threshold", 1.5), ("region_threshold", -0.1), ("region_sigma", -1)):
        with pytest.raises(ConfigError, match=rf"inference\.{key} must be"):
            validate_config(merge_config(task_config("camelyon16"), {"inference": {key: value}}))


@pytest.mark.parametrize("regions", [{"region_threshold": 0.6, "region_sigma": 0.5}, {}])
def test_wsi_heatmap_writes_the_regions_beside_the_heatmap(tmp_path, monkeypatch, regions):
    """The GeoJSON and ASAP XML of a synthetic tumour slide through ``infer``: listed with the
    outputs, built from the slide's probability map with the config's settings, read back by our
    ASAP reader to that map thresholded, and holding the lesions of the challenge CSV (with the
    default settings, two detections lie where the smoothed map is below the threshold)."""
    root = generate_camelyon16(tmp_path / "data", num_normal=0, num_tumor=1, num_test=0, size=(1024, 768))
    config = merge_config(task_config("camelyon16"), {
        "data": {"data_dir": str(root), "cache_dir": str(tmp_path / "cache"), "patch_size": 64, "stride": 64, "num_workers": 0},
        "inference": regions})
    module = ClassificationModule(camelyon16.module_config(config, {"variant": "b0"}, camelyon16.LABELS), network=DarkIsTumour())
    seen = []

    def recording(prob, *args, **kwargs):
        seen.append((prob.copy(), *args))
        return tumour_regions(prob, *args, **kwargs)

    finish, written = camelyon16.SlideHeatmaps._finish, []
    monkeypatch.setattr(camelyon16.writers, "tumour_regions", recording)
    monkeypatch.setattr(camelyon16.SlideHeatmaps, "_finish", lambda self, slide: written.extend(finish(self, slide)) or written)
    slide = root / "training" / "tumor" / "tumor_001.tif"
    out = tmp_path / "heat"
    camelyon16.infer(module, slide, out, InferenceOptions(progress=lambda _: None))
    # beside the heatmap, among the paths a slide's writer reports (what a DDP process returns)
    assert {out / "tumor_001.geojson", out / "tumor_001.xml", out / "tumor_001_heatmap.tif"} <= set(written)
    [(prob, step, size, threshold, sigma)] = seen
    assert (step, tuple(size), threshold, sigma) == (64, (1023, 767), regions.get("region_threshold", 0.5), regions.get("region_sigma", 1.0))
    expected = np.nan_to_num(smooth_map(prob, sigma)) > threshold
    found = camelyon16.read_lesion_csv(out / "lesions" / "tumor_001.csv")
    assert len(found) and not regions or expected.any()  # the stub finds the metastases; by default the smoothed map does not
    expected[(found[:, 2] // step).astype(int), (found[:, 1] // step).astype(int)] = True  # patch centres: inside their cells
    features = json.loads((out / "tumor_001.geojson").read_text(encoding="utf-8"))["features"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no outline outside the slide, none skipped
        polygons = read_asap_xml(out / "tumor_001.xml")
    assert len(features) == sum(p.group == "_0" for p in polygons) >= 1
    raster = rasterise(polygons, size, step)
    assert (raster & expected).sum() / (raster | expected).sum() >= 0.95
    assert not [p for p in out.iterdir() if "tmp" in p.name]
    _one_lesion_definition(out / "lesions" / "tumor_001.csv", features, polygons)


def _inside(point, exterior, holes) -> bool:
    """Strictly inside the ring and outside every hole (a hole need not lie in the ring)."""
    return ShapelyPolygon(exterior).contains(shapely.Point(point)) and not any(ShapelyPolygon(h).covers(shapely.Point(point)) for h in holes)


def _one_lesion_definition(csv_path, features, polygons):
    """Every detection of the challenge CSV lies inside a GeoJSON polygon and inside an ASAP
    outline (outside its _2 holes), and each polygon's max probability is the highest confidence
    of the detections inside it."""
    found = camelyon16.read_lesion_csv(csv_path)
    assert len(found)
    rings = [[np.array(ring) for ring in f["geometry"]["coordinates"]] for f in features]
    best = np.full(len(features), -np.inf)
    for confidence, x, y in found:
        owners = [k for k, (exterior, *holes) in enumerate(rings) if _inside((x, y), exterior, holes)]
        assert len(owners) == 1, (confidence, x, y)
        best[owners[0]] = max(best[owners[0]], confidence)
        holes = [p.points for p in polygons if p.group == "_2"]
        assert any(_inside((x, y), p.points, holes) for p in polygons if p.group == "_0"), (confidence, x, y)
    for feature, highest in zip(features, best):
        if np.isfinite(highest):
            assert feature["properties"]["measurements"]["max probability"] == highest


@pytest.mark.parametrize("point, cells", [((150, 250), 1), ((200, 250), 2), ((200, 300), 4)])
def test_a_detection_outside_the_smoothed_regions_gets_its_own_polygon(point, cells):
    """A detection where the thresholded map has no region: its cell becomes one (two on a cell
    edge, four on a corner, where overlapping patches put their centres), holding the point
    strictly inside, with the detection's confidence as the region's max probability; a
    detection inside a region sets that region's max probability."""
    step = 100
    prob = np.full((6, 7), 0.1)
    prob[0:2, 4:6] = 0.9  # a region
    prob[2, 1] = 0.45  # below the threshold
    regions = tumour_regions(prob, step, (700, 600), threshold=0.5, sigma=0, detections=(np.array([0.7, 0.95]), np.array([point, (450, 50)])))
    assert [r.max_probability for r in regions] == [0.95, 0.7]
    lone = regions[1]
    assert lone.area == cells * step**2 and _inside(point, lone.exterior, lone.holes)
    assert lone.mean_probability == pytest.approx(prob[[2, 2, 3, 3][:cells], [1, 2, 1, 2][:cells]].mean() if cells != 2 else prob[2, 1:3].mean())
