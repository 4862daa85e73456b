"""Synthetic CAMELYON16-format slides: layout, slides OpenSlide opens, ASAP XML outlines that
agree with the pixels, determinism and the cache."""

import json
import xml.etree.ElementTree as ET

import numpy as np
import openslide
import pytest
from scipy import ndimage as ndi
from skimage.draw import polygon as fill_polygon
from skimage.measure import points_in_poly

from hsmla_med.data.synthetic.wsi import generate_camelyon16

SIZE = (1024, 768)  # (width, height)
COUNTS = dict(num_normal=1, num_tumor=2, num_test=1)
SIZE_ODD = (1023, 767)  # the sides written: an even side loses a pixel
EXPECTED = {
    "training/normal/normal_001.tif",
    "training/tumor/tumor_001.tif",
    "training/tumor/tumor_002.tif",
    "training/lesion_annotations/tumor_001.xml",
    "training/lesion_annotations/tumor_002.xml",
    "testing/images/test_001.tif",
    "testing/lesion_annotations/test_001.xml",
    "testing/Ground_Truth/Masks/test_001_Mask.tif",
    "testing/reference.csv",
    "slide_labels.csv",
    "synthetic.json",
}
ANNOTATED = {
    "training/tumor/tumor_001.tif": "training/lesion_annotations/tumor_001.xml",
    "training/tumor/tumor_002.tif": "training/lesion_annotations/tumor_002.xml",
    "testing/images/test_001.tif": "testing/lesion_annotations/test_001.xml",
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("camelyon16")
    assert generate_camelyon16(root, size=SIZE, seed=0, **COUNTS) == root
    return root


def _pixels(path) -> np.ndarray:
    slide = openslide.OpenSlide(path)
    return np.asarray(slide.read_region((0, 0), 0, slide.dimensions))[..., :3]


def _outlines(path) -> list[tuple[str, np.ndarray]]:
    """(group, (n, 2) x/y points) of each annotation, checking the ASAP structure on the way."""
    tree = ET.parse(path).getroot()
    assert tree.tag == "ASAP_Annotations"
    result = []
    for annotation in tree.find("Annotations"):
        assert annotation.tag == "Annotation" and annotation.get("Type") == "Polygon"
        coordinates = annotation.find("Coordinates")
        assert [int(c.get("Order")) for c in coordinates] == list(range(len(coordinates)))
        points = np.array([(float(c.get("X")), float(c.get("Y"))) for c in coordinates])
        result.append((annotation.get("PartOfGroup"), points))
    groups = [g.get("Name") for g in tree.find("AnnotationGroups")]
    assert sorted(groups) == sorted({g for g, _ in result})
    assert all(g.get("PartOfGroup") == "None" for g in tree.find("AnnotationGroups"))
    return result


def _masks(outlines, shape):
    """Tumour (outlines of _0/Tumor minus _2) and exclusion masks, rasterised."""
    tumour, excluded = np.zeros(shape, bool), np.zeros(shape, bool)
    for group, points in outlines:
        rr, cc = fill_polygon(points[:, 1], points[:, 0], shape)
        (excluded if group == "_2" else tumour)[rr, cc] = True
    return tumour & ~excluded, excluded


def test_layout(root):
    files = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    assert files == EXPECTED  # no temporary files either
    assert (root / "testing" / "reference.csv").read_text() == "test_001,Tumor,Micro\n"
    # every slide's diagnosis and split, as CLAM's slide-label training reads them
    assert (root / "slide_labels.csv").read_text() == ("slide_id,label,split\nnormal_001,0,train\ntumor_001,1,train\ntumor_002,1,train\n"
                                                      "test_001,1,test\n")
    meta = json.loads((root / "synthetic.json").read_text())
    assert meta["synthetic"] is True and set(meta["files"]) == EXPECTED - {"synthetic.json"}
    assert meta["generator"]["size"] == [1023, 767] and meta["generator"]["seed"] == 0  # odd sides


def test_slides_open_as_pyramids(root):
    for path in sorted(p for p in root.rglob("*.tif") if "Masks" not in p.parts):
        slide = openslide.OpenSlide(path)
        assert slide.properties["openslide.vendor"] == "generic-tiff"
        # odd sides halved and rounded up, as in real pyramids: no level is a whole downsample
        assert slide.level_dimensions == ((1023, 767), (512, 384), (256, 192), (128, 96))
        expected = [(1023 / w + 767 / h) / 2 for w, h in slide.level_dimensions]  # OpenSlide's mean ratio
        assert slide.level_downsamples == pytest.approx(expected, rel=1e-12)
        assert all(d != round(d) for d in slide.level_downsamples[1:])
        assert float(slide.properties["openslide.mpp-x"]) == pytest.approx(0.972, rel=1e-6)


def test_annotations(root):
    for slide_rel, xml_rel in ANNOTATED.items():
        outlines = _outlines(root / xml_rel)
        groups = {g for g, _ in outlines}
        # Odd-numbered slides use the _0/_2 convention, even-numbered ones the Tumor group.
        assert groups == ({"_0", "_2"} if slide_rel.endswith("1.tif") else {"Tumor"}), slide_rel
        for _, points in outlines:
            assert len(points) >= 3
            assert (points >= 0).all() and (points[:, 0] < SIZE[0]).all() and (points[:, 1] < SIZE[1]).all()
        for group, hole in outlines:
            if group == "_2":  # inside one of the _0 outlines
                assert any(points_in_poly(hole, outer).all() for g, outer in outlines if g == "_0")


def test_pixels_agree_with_outlines(root):
    normal = _pixels(root / "training" / "normal" / "normal_001.tif").astype(float)
    glass = ndi.binary_erosion(normal.mean(-1) > 225, iterations=10)
    assert glass.mean() > 0.2 and (glass.mean() < 0.95)  # glass and tissue
    assert normal[glass].mean() > 230 and normal[glass].std() < 6  # bright, slightly noisy
    for slide_rel, xml_rel in ANNOTATED.items():
        image = _pixels(root / slide_rel).astype(float)
        tumour, excluded = _masks(_outlines(root / xml_rel), image.shape[:2])
        tissue = ndi.binary_opening(image.mean(-1) < 225, iterations=2)
        # Away from the outlines, so that blurred edges do not count.
        core = ndi.binary_erosion(tumour, iterations=3)
        healthy = ndi.binary_erosion(tissue & ~ndi.binary_dilation(tumour | excluded, iterations=5), iterations=3)
        assert core.sum() > 1000 and healthy.sum() > 10000
        assert tissue[core].mean() > 0.99  # metastases lie within the tissue
        red_tumour, red_healthy = image[core, 0].mean(), image[healthy, 0].mean()
        assert red_tumour < red_healthy - 20, slide_rel  # darker purple: more and larger nuclei
        dark = image.mean(-1) < 150  # nuclei
        assert dark[core].mean() > dark[healthy].mean() + 0.08, slide_rel
        if excluded.any():  # the cut-out looks like normal tissue, not tumour
            red_hole = image[ndi.binary_erosion(excluded, iterations=3), 0].mean()
            assert abs(red_hole - red_healthy) < abs(red_hole - red_tumour), slide_rel


def test_a_subtle_tumour_differs_from_normal_tissue_mainly_in_its_darker_nuclei(root, tmp_path):
    # the stain-shift benchmark's slides (hsmla-med bench --only stain --tumour subtle): the same tissue
    # and outlines as the default's, metastases whose nuclei are darker but nearly as sparse
    subtle = generate_camelyon16(tmp_path / "subtle", num_normal=1, num_tumor=1, num_test=0, size=SIZE, seed=0, tumour="subtle")
    normal = "training/normal/normal_001.tif"
    assert np.array_equal(_pixels(subtle / normal), _pixels(root / normal))
    xml = "training/lesion_annotations/tumor_001.xml"
    assert (subtle / xml).read_text() == (root / xml).read_text()
    image = _pixels(subtle / "training/tumor/tumor_001.tif").astype(float)
    tumour, excluded = _masks(_outlines(subtle / xml), image.shape[:2])
    tissue = ndi.binary_opening(image.mean(-1) < 225, iterations=2)
    core = ndi.binary_erosion(tumour, iterations=3)
    healthy = ndi.binary_erosion(tissue & ~ndi.binary_dilation(tumour | excluded, iterations=5), iterations=3)
    grey = image.mean(-1)
    assert np.percentile(grey[core], 5) < np.percentile(grey[healthy], 5) - 10  # darker nuclei
    dark = grey < 150
    assert dark[core].mean() < dark[healthy].mean() + 0.08  # nearly as many nuclei (the clear tumour: more than +0.08)
    assert -30 < image[core, 0].mean() - image[healthy, 0].mean() < -5  # darker overall, less than the clear tumour's -45
    with pytest.raises(ValueError, match="tumour"):
        generate_camelyon16(tmp_path / "x", size=SIZE, tumour="large")


def test_deterministic_per_seed(root, tmp_path):
    # Fewer slides with the same seed: the same first slides, pixel for pixel.
    same = generate_camelyon16(tmp_path / "same", num_normal=1, num_tumor=1, num_test=0, size=SIZE, seed=0)
    other = generate_camelyon16(tmp_path / "other", num_normal=1, num_tumor=1, num_test=0, size=SIZE, seed=1)
    assert not (same / "testing").exists()
    for rel in ("training/normal/normal_001.tif", "training/tumor/tumor_001.tif"):
        assert np.array_equal(_pixels(same / rel), _pixels(root / rel))
        assert not np.array_equal(_pixels(other / rel), _pixels(root / rel))
    xml = "training/lesion_annotations/tumor_001.xml"
    assert (same / xml).read_text() == (root / xml).read_text()


def test_cache(root, tmp_path):
    stamps = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    assert generate_camelyon16(root, size=SIZE, seed=0, **COUNTS) == root
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == stamps

    # Other parameters: written again, and slides of the old dataset that the new one lacks go.
    small = generate_camelyon16(tmp_path / "c", num_normal=1, num_tumor=1, num_test=0, size=(256, 256), seed=0)
    before = (small / "training/normal/normal_001.tif").stat().st_mtime_ns
    generate_camelyon16(small, num_normal=1, num_tumor=0, num_test=0, size=(256, 256), seed=2)
    assert (small / "training/normal/normal_001.tif").stat().st_mtime_ns != before
    assert not (small / "training/tumor/tumor_001.tif").exists()
    assert not (small / "training/lesion_annotations/tumor_001.xml").exists()
    assert json.loads((small / "synthetic.json").read_text())["generator"]["seed"] == 2


def test_refuses_foreign_folder_and_bad_arguments(tmp_path):
    (tmp_path / "synthetic.json").write_text('{"name": "my data"}')
    with pytest.raises(FileExistsError, match="synthetic.json"):
        generate_camelyon16(tmp_path, size=SIZE)
    with pytest.raises(ValueError, match="size"):
        generate_camelyon16(tmp_path / "x", size=(200, 800))
    with pytest.raises(ValueError, match="training slide"):
        generate_camelyon16(tmp_path / "x", num_normal=0, num_tumor=0, size=SIZE)
    with pytest.raises(ValueError, match="seed"):
        generate_camelyon16(tmp_path / "x", size=SIZE, seed=-1)
    assert not (tmp_path / "x").exists()


def test_test_masks_are_asaps(root):
    """The ground-truth mask of a test slide with metastases: level 0 is ASAP's rasterisation of
    its XML in 0/255, each level the previous one's top-left pixels (floor of half the size), as
    the challenge's masks; read_mask_level at any power of two gives asap_mask there."""
    from hsmla_med.data.asap import asap_mask, read_asap_xml
    from hsmla_med.data.slides import read_mask_level

    path = root / "testing" / "Ground_Truth" / "Masks" / "test_001_Mask.tif"
    slide = openslide.OpenSlide(path)
    polygons = read_asap_xml(root / "testing" / "lesion_annotations" / "test_001.xml")
    level0 = np.asarray(slide.read_region((0, 0), 0, slide.dimensions))[..., 0]
    assert set(np.unique(level0).tolist()) == {0, 255}
    np.testing.assert_array_equal(level0 > 0, asap_mask(polygons, SIZE_ODD, 1))
    assert slide.level_dimensions[:3] == ((1023, 767), (511, 383), (255, 191))
    for d in (2, 4, 8, 16):
        np.testing.assert_array_equal(read_mask_level(path, d), asap_mask(polygons, SIZE_ODD, d), err_msg=str(d))
