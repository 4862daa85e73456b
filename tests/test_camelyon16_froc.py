"""CAMELYON16 lesion-level FROC by the official rules: the evaluation mask grown by the
official "75 µm", isolated tumour cell (ITC) clusters counted neither way, checked on a hand-made
slide against hand-computed values and against a transcription of ``Evaluation_FROC.py``; the
submission files of ``wsi-heatmap`` scored by ``evaluate --predictions`` as validation scores them."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest
import torch
from monai.data import list_data_collate
from scipy import ndimage as nd
from skimage import measure
from torch import nn

from hsmla_med.cli import main
from hsmla_med.config import merge_config, task_config
from hsmla_med.data.asap import Polygon, rasterise, read_asap_xml
from hsmla_med.data.synthetic.wsi import generate_camelyon16
from hsmla_med.engine.classification import ClassificationModule
from hsmla_med.metrics.pathology import evaluation_mask, lesion_froc, slide_fp_tp
from hsmla_med.pipelines import camelyon16
from hsmla_med.pipelines.camelyon16 import data as camelyon16_data
from hsmla_med.pipelines.task import InferenceOptions
from tests.conftest import cli_error

LEVEL, L0 = 5, 0.243  # the official EVALUATION_MASK_LEVEL and L0_RESOLUTION
PIXEL_UM = L0 * 2**LEVEL


# --- a transcription of the official Evaluation_FROC.py (Bejnordi, 2016); the mask is given as the
# array the script reads from the ground-truth TIFF's level (255 = tumour). Its number types are
# kept: confidences are Python floats (readCSVContent's float()), a slide's true positives a
# float32 array (compute_FP_TP_Probs's TP_probs), and comparisons follow the NumPy it ran on
# (np.object, so NumPy < 1.24): a float32 scalar against a Python float compares in float64, a
# float32 array against a Python float in float32 (value-based casting). NumPy 2 compares both in
# float32, so those two places are written out. ---

def official_evaluation_mask(pixelarray, resolution, level):
    distance = nd.distance_transform_edt(255 - pixelarray)
    threshold = 75 / (resolution * pow(2, level) * 2)
    binary = distance < threshold
    filled_image = nd.binary_fill_holes(binary)
    return measure.label(filled_image, connectivity=2)


def official_itc_list(evaluation_mask, resolution, level):
    max_label = np.amax(evaluation_mask)
    properties = measure.regionprops(evaluation_mask)
    threshold = 275 / (resolution * pow(2, level))
    return [i + 1 for i in range(0, max_label) if properties[i].axis_major_length < threshold]


def official_fp_tp(ycorr, xcorr, probs, is_tumor, evaluation_mask, itc, level):
    probs = [float(p) for p in probs]  # readCSVContent: Probs.append(float(elems[0]))
    max_label = np.amax(evaluation_mask)
    fp_probs, tp_probs = [], np.zeros((max_label,), dtype=np.float32)
    if is_tumor:
        for i in range(0, len(xcorr)):
            hitted = evaluation_mask[int(ycorr[i] / pow(2, level)), int(xcorr[i] / pow(2, level))]
            if hitted == 0:
                fp_probs.append(probs[i])
            elif hitted not in itc:
                if probs[i] > float(tp_probs[hitted - 1]):  # float64, as NumPy < 1.24 compares these scalars
                    tp_probs[hitted - 1] = probs[i]
    else:
        for i in range(0, len(xcorr)):
            fp_probs.append(probs[i])
    return fp_probs, tp_probs, max_label - len(itc)


def official_froc(slides):
    """``computeFROC`` and the main block's interpolation; ``slides``: per slide (fp, tp, n)."""
    unlisted_fps = [p for s in slides for p in s[0]]
    unlisted_tps = [p for s in slides for p in s[1]]
    total_fps, total_tps = [], []
    # sorted(set(...)) of Python floats and float32 scalars: compared (and told apart) in float64
    all_probs = sorted(set(unlisted_fps + [float(p) for p in unlisted_tps]))
    for thresh in all_probs[1:]:
        total_fps.append((np.asarray(unlisted_fps) >= thresh).sum())
        # np.asarray(unlisted_TPs) is float32: a Python-float threshold is cast to float32 there
        total_tps.append((np.asarray(unlisted_tps, dtype=np.float32) >= np.float32(thresh)).sum())
    total_fps.append(0)
    total_tps.append(0)
    total_fps = np.asarray(total_fps) / float(len(slides))
    total_sensitivity = np.asarray(total_tps) / float(sum(s[2] for s in slides))
    eval_tps = np.interp([0.25, 0.5, 1, 2, 4, 8], total_fps[::-1], total_sensitivity[::-1])
    return float(np.mean(eval_tps)), eval_tps


def official_score(masks, detections):
    """The official FROC of level-5 ``masks`` (None: normal slide) and level-0 ``detections``
    ((n, 3) confidence, x, y) per slide."""
    slides = []
    for mask, found in zip(masks, detections):
        if mask is None:
            labels, itc = 0, []
        else:
            labels = official_evaluation_mask(np.where(mask, 255, 0), L0, LEVEL)
            itc = official_itc_list(labels, L0, LEVEL)
        slides.append(official_fp_tp(found[:, 2], found[:, 1], found[:, 0], mask is not None, labels, itc, LEVEL))
    return official_froc(slides)


# --- the hand-made slide: 100 x 100 pixels at level 5 (7.776 µm), lesion A a 40-pixel square,
# lesion B a 10 x 60 bar, an ITC cluster of 4 x 4 pixels (31 µm) ---

BLOCKS = {"A": (10, 50, 10, 50), "B": (70, 80, 20, 80), "ITC": (10, 14, 80, 84)}  # rows, cols at level 5


def hand_mask() -> np.ndarray:
    mask = np.zeros((100, 100), bool)
    for r0, r1, c0, c1 in BLOCKS.values():
        mask[r0:r1, c0:c1] = True
    return mask


def hand_polygons() -> list[Polygon]:
    """The blocks as level-0 outlines: level-5 pixel j has its centre at 32 j + 15.5, so edges a
    quarter pixel outside the block's centres draw exactly the block."""
    polygons = []
    for name, (r0, r1, c0, c1) in BLOCKS.items():
        x0, x1, y0, y1 = c0 * 32 - 8, c1 * 32 - 8, r0 * 32 - 8, r1 * 32 - 8
        polygons.append(Polygon(name, "Tumor", np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]], float)))
    return polygons


def at(row: float, col: float) -> tuple[int, int]:
    """Level-0 (x, y) of the centre of level-5 pixel (row, col)."""
    return int(col * 32 + 16), int(row * 32 + 16)


# tumour slide: the best hit on A, a hit on the ITC, a hit 3 pixels (23 µm, inside the official
# growth) below B's edge, a false positive, a second weaker hit on A; a normal slide with one
# detection; a normal slide with none
TUMOUR_HITS = np.array([[0.9, *at(30, 30)], [0.8, *at(12, 82)], [0.7, *at(82, 50)], [0.6, *at(60, 90)], [0.5, *at(20, 20)]], float)
NORMAL_HITS = np.array([[0.75, *at(50, 50)]], float)


def test_evaluation_mask_grows_lesions_and_finds_the_itc():
    labels, lesions = evaluation_mask(hand_mask(), PIXEL_UM)
    assert lesions == 2 and labels.max() == 3
    official = official_evaluation_mask(np.where(hand_mask(), 255, 0), L0, LEVEL)
    # the same regions (numbers aside): the ITC is numbered last here
    assert (labels > 0).sum() == (official > 0).sum() and ((labels > 0) == (official > 0)).all()
    [itc] = official_itc_list(official, L0, LEVEL)
    assert (labels == 3).sum() == (official == itc).sum() and labels[12, 82] == 3
    # the growth reaches 4 pixels (31 µm < 37.5) and not 5 beyond an edge
    assert labels[79 + 4, 50] > 0 and labels[79 + 5, 50] == 0
    truth, n, downsample = camelyon16.slide_truth(hand_polygons(), (3200, 3200), 0.243)
    assert downsample == 32 and n == 2
    np.testing.assert_array_equal(truth, labels)


def test_hand_computed_froc_itc_counts_neither_way_and_the_growth_counts():
    """By hand (3 slides, 2 lesions): false positives 0.6 and 0.75, lesions found at 0.9 (A) and
    0.7 (B, through the growth); the ITC hit (0.8) and the second hit on A (0.5) are in neither list.
    Thresholds 0.6, 0.7, 0.75, 0.9 give (FP/slide, sensitivity) (2/3, 1), (1/3, 1), (1/3, 0.5),
    (0, 0.5), then (0, 0): sensitivity 0.5 at 0.25 FP/slide, 1 from 0.5 on; FROC 5.5 / 6."""
    labels, lesions = evaluation_mask(hand_mask(), PIXEL_UM)
    hits = labels[(TUMOUR_HITS[:, 2] // 32).astype(int), (TUMOUR_HITS[:, 1] // 32).astype(int)]
    fp, tp = slide_fp_tp(TUMOUR_HITS[:, 0], hits, lesions, int(labels.max()))
    assert fp.tolist() == [0.6] and tp.dtype == np.float32 and sorted(tp.tolist()) == [0.0, np.float32(0.7), np.float32(0.9)]
    normal = slide_fp_tp(NORMAL_HITS[:, 0], [0], 0, 0)
    result = lesion_froc([(fp, tp, lesions), (*normal, 0), (np.zeros(0), np.zeros(0), 0)])
    assert result["froc"] == pytest.approx(5.5 / 6, abs=1e-12) and result["lesions"] == 2 and result["slides"] == 3
    assert result["sensitivity"] == pytest.approx({"0.25": 0.5, "0.5": 1.0, "1": 1.0, "2": 1.0, "4": 1.0, "8": 1.0})
    froc, _ = official_score([hand_mask(), None, None], [TUMOUR_HITS, NORMAL_HITS, np.zeros((0, 3))])
    assert result["froc"] == pytest.approx(froc, abs=1e-6)


def _blobs(rng: np.random.Generator) -> np.ndarray:
    """A level-5 tumour mask of a few rectangles of random sizes (ITCs and lesions both)."""
    mask = np.zeros((80, 120), bool)
    for _ in range(rng.integers(1, 6)):
        r, c = rng.integers(0, 70), rng.integers(0, 110)
        mask[r : r + rng.integers(1, 30), c : c + rng.integers(1, 40)] = True
    return mask


def test_random_slides_match_the_official_script():
    """Random tumour masks and detections (many on lesions) on eight slides, two normal: our FROC
    and the six sensitivities equal the transcription's to 1e-6."""
    rng = np.random.default_rng(7)
    for trial in range(5):
        masks = [_blobs(rng) if s < 6 else None for s in range(8)]
        detections, ours = [], []
        for mask in masks:
            points = np.column_stack([rng.integers(0, 120 * 32, 12), rng.integers(0, 80 * 32, 12)])
            if mask is not None:  # half the detections on tumour
                cells = np.argwhere(mask)[rng.integers(0, mask.sum(), 6)]
                points[:6] = cells[:, ::-1] * 32 + rng.integers(0, 32, (6, 2))
            found = np.column_stack([rng.random(12).round(3), points]).astype(float)
            detections.append(found)
            labels, lesions = evaluation_mask(mask, PIXEL_UM) if mask is not None else (np.zeros((80, 120), np.int64), 0)
            hits = labels[(found[:, 2] // 32).astype(int), (found[:, 1] // 32).astype(int)]
            ours.append((*slide_fp_tp(found[:, 0], hits, lesions, int(labels.max())), lesions))
        result = lesion_froc(ours)
        froc, sensitivities = official_score(masks, detections)
        assert result["froc"] == pytest.approx(froc, abs=1e-6), trial
        assert list(result["sensitivity"].values()) == pytest.approx(sensitivities.tolist(), abs=1e-6), trial


def _write_xml(path, polygons: list[Polygon]) -> None:
    notes = "".join(
        f'<Annotation Name="{p.name}" Type="Polygon" PartOfGroup="{p.group}"><Coordinates>'
        + "".join(f'<Coordinate Order="{i}" X="{x}" Y="{y}"/>' for i, (x, y) in enumerate(p.points))
        + "</Coordinates></Annotation>"
        for p in polygons
    )
    path.write_text(f"<ASAP_Annotations><Annotations>{notes}</Annotations></ASAP_Annotations>")


def _write_rows(path, rows: np.ndarray) -> None:
    path.write_text("".join(f"{float(p)!r},{int(x)},{int(y)}\n" for p, x, y in rows))


def test_evaluate_predictions_scores_a_submission_by_the_official_rules(tmp_path, capsys):
    """Lesion CSVs in the challenge's flat layout and a slide CSV, annotations without slides
    (the official 0.243 µm and level 5 from the outlines' extent): the hand-computed FROC."""
    subs, notes = tmp_path / "submission", tmp_path / "xml"
    subs.mkdir(), notes.mkdir()
    _write_xml(notes / "tumour_1.xml", hand_polygons())
    (notes / "normal_1.xml").write_text("")  # an empty annotation: a normal slide
    _write_rows(subs / "tumour_1.csv", TUMOUR_HITS)
    _write_rows(subs / "normal_1.csv", NORMAL_HITS)
    (subs / "normal_2.csv").write_text("")
    (subs / "slides.csv").write_text("Image,Confidence\ntumour_1,0.9\nnormal_1,0.75\nnormal_2,0.1\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the empty annotation file's warning
        assert main(["evaluate", "--task", "camelyon16", "--predictions", str(subs), "--labels", str(notes)]) == 0
    summary = json.loads((subs / "summary.json").read_text())
    assert summary["froc"] == pytest.approx(5.5 / 6, abs=1e-12) and summary["lesions"] == 2 and summary["slides"] == 3
    assert summary["auc"] == 1.0 and summary["auc_slides"] == 3
    rows = {r["slide"]: r for r in summary["metric_per_case"]}
    assert rows["tumour_1"]["itc"] == 1 and rows["tumour_1"]["detected"] == 2 and rows["tumour_1"]["false_positives"] == 1
    assert rows["normal_2"]["detections"] == 0 and not rows["normal_1"]["tumour"]
    assert "FROC 0.9167" in capsys.readouterr().out


# A true and a false positive sharing a confidence, written with many digits as a submission may
# write them. The official script keeps true positives in float32: 0.1 rounds up there, so the true
# positive ranks above the false positive of 0.1; 0.7 rounds down, yet a float32 array compares a
# threshold in float32, so it stays tied with the false positive of 0.7 and, no longer below it,
# with one of 0.70000001 (the same float32).
A_HIT, B_HIT, OFF = at(30, 30), at(75, 50), at(60, 90)
SHARED = {
    "tumour_1": [("0.1000000000000000055511151231257827", A_HIT), ("0.10000000000", OFF), ("0.9", B_HIT)],
    "tumour_2": [("0.69999999999999995559107901", A_HIT), ("0.7000000100000000", OFF)],
    "tumour_3": [("0.700000000000", A_HIT), ("0.7", OFF), ("0.3", B_HIT)],
    "normal_1": [("0.2", OFF)],
}


def test_a_confidence_shared_by_a_true_and_a_false_positive_ranks_as_officially(tmp_path):
    """By hand (4 slides, 6 lesions): thresholds 0.1, f32(0.1), 0.2, f32(0.3), f32(0.7), 0.7,
    0.70000001, f32(0.9) give (FP/slide, sensitivity) (1, 5/6), (3/4, 5/6), (3/4, 4/6), (1/2, 4/6),
    (1/2, 3/6), (1/2, 3/6), (1/4, 3/6), (0, 1/6): FROC (3/6 + 4/6 + 4 x 5/6) / 6 = 0.75. In float64
    the 0.1s tie and 0.70000001 ranks above the 0.7s: 1/6 at 0.25 FP/slide, FROC 25/36."""
    subs, notes = tmp_path / "submission", tmp_path / "xml"
    subs.mkdir(), notes.mkdir()
    masks, detections, ours = [], [], []
    for name, rows in SHARED.items():
        if name.startswith("tumour"):
            _write_xml(notes / f"{name}.xml", hand_polygons())
        (subs / f"{name}.csv").write_text("".join(f"{p},{x},{y}\n" for p, (x, y) in rows))
        found = camelyon16.read_lesion_csv(subs / f"{name}.csv")
        mask = hand_mask() if name.startswith("tumour") else None
        labels, lesions = evaluation_mask(mask, PIXEL_UM) if mask is not None else (np.zeros((100, 100), np.int64), 0)
        hits = labels[(found[:, 2] // 32).astype(int), (found[:, 1] // 32).astype(int)]
        ours.append((*slide_fp_tp(found[:, 0], hits, lesions, int(labels.max())), lesions))
        masks.append(mask)
        detections.append(found)
    froc, sensitivities = official_score(masks, detections)
    assert froc == pytest.approx(0.75, abs=1e-12)
    result = lesion_froc(ours)
    assert result["froc"] == pytest.approx(froc, abs=1e-12)
    assert list(result["sensitivity"].values()) == pytest.approx(sensitivities.tolist(), abs=1e-12)
    assert main(["evaluate", "--task", "camelyon16", "--predictions", str(subs), "--labels", str(notes)]) == 0
    assert json.loads((subs / "summary.json").read_text())["froc"] == pytest.approx(froc, abs=1e-12)


def test_a_non_numeric_row_is_one_line_naming_the_file(tmp_path, capsys):
    subs, notes = tmp_path / "submission", tmp_path / "xml"
    subs.mkdir(), notes.mkdir()
    (subs / "a.csv").write_text("0.5,100,200\n0.4,abc,3\n")
    assert main(["evaluate", "--task", "camelyon16", "--predictions", str(subs), "--labels", str(notes)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "a.csv: line 2" in err and "'abc'" in err and "Traceback" not in err


class SoftDark(nn.Module):
    """A deterministic stub classifier, tumour probability rising smoothly with darkness: it
    finds lesions, misses some and gives false positives (an FROC strictly between 0 and 1)."""

    def forward(self, x):
        darkness = 1 - x.mean(dim=(1, 2, 3))
        return torch.stack([torch.zeros_like(darkness), 25 * (darkness - 0.3)], dim=1)


SMALL = {"num_normal": 1, "num_tumor": 2, "num_test": 0, "size": (1536, 1024), "mpp": 3.888, "seed": 3}


def test_wsi_heatmap_submission_scores_as_validation(tmp_path):
    """A stub classifier's validation FROC and slide AUC (per-patch rows reduced into maps) equal
    what ``evaluate --predictions`` gives for the lesion CSVs and slide CSV that ``wsi-heatmap``
    writes for the same slides; the lesion CSVs hold integer level-0 points of the slide."""
    root = generate_camelyon16(tmp_path / "data", **SMALL)
    config = merge_config(task_config("camelyon16"), {"data": {
        "data_dir": str(root), "cache_dir": str(tmp_path / "cache"), "patch_size": 96, "stride": 96, "batch_size": 32, "num_workers": 0}})
    cases = camelyon16.find_slides(root)[0]
    module = ClassificationModule(camelyon16.module_config(config, {"variant": "b0"}, camelyon16.LABELS), network=SoftDark())
    items, reader = camelyon16_data._items(cases, config), camelyon16.ReadPatchd(uint8=True)
    records = []
    for start in range(0, len(items), 64):
        records.append(module.validation_records(list_data_collate([reader(dict(item)) for item in items[start : start + 64]])))
    validation = module.summarize_records(module.collect_records(records))
    assert 0 < validation["froc"] < 1 and validation["auc"] is not None

    slides = tmp_path / "slides"
    slides.mkdir()
    for case in cases:
        os.symlink(case["slide"], slides / os.path.basename(case["slide"]))
    out = tmp_path / "heat"
    camelyon16.infer(module, slides, out, InferenceOptions(progress=lambda _: None))
    rows = camelyon16.read_lesion_csv(out / "lesions" / "tumor_001.csv")
    assert len(rows) > 0 and (rows[:, 1:] == rows[:, 1:].round()).all() and (rows[:, 1] < 1535).all() and (rows[:, 2] < 1023).all()
    assert sorted(camelyon16.read_slide_csv(out / "slides.csv")) == ["normal_001", "tumor_001", "tumor_002"]
    assert main(["evaluate", "--task", "camelyon16", "--predictions", str(out), "--labels", str(root / "training" / "lesion_annotations"),
                 "--data-dir", str(root)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["slides"] == 3 and summary["lesions"] == sum(int(camelyon16.slide_patches(c, config["data"])["num_lesions"]) for c in cases)
    assert summary["froc"] == pytest.approx(validation["froc"], abs=1e-12)
    assert summary["sensitivity"] == pytest.approx(validation["froc_sensitivity"], abs=1e-12)
    assert summary["auc"] == pytest.approx(validation["auc"], abs=1e-12)


def test_synthetic_tumour_slides_have_an_itc_and_a_lesion_under_half_a_patch(tmp_path):
    """The default synthetic slide (4095 x 3071 at 0.972 µm) has an ITC cluster and a lesion that
    covers less than half of a 256-pixel patch, yet is one to detect."""
    root = generate_camelyon16(tmp_path, num_normal=0, num_tumor=1, num_test=0)
    polygons = read_asap_xml(root / "training" / "lesion_annotations" / "tumor_001.xml")
    truth, lesions, downsample = camelyon16.slide_truth(polygons, (4095, 3071), 0.972)
    assert downsample == 8 and truth.max() > lesions >= 2  # an ITC is numbered after the lesions
    areas = [int(rasterise([p], (4095, 3071), 1).sum()) for p in polygons if p.group != "_2"]
    assert min(areas) < 256 * 256 / 2 and sum(a < 256 * 256 / 2 for a in areas) >= 2  # the ITC and the small lesion


# --- the evaluation mask as the challenge made it: ASAP's mask of the XML, or the
# ground-truth mask TIFF itself. A 36 x 36-pixel (level 5) lesion whose edges lie 4 level-0
# pixels past pixel corners: ASAP's mask (corner samples) holds one more row and column than
# pixel centres would, so after the growth (4 pixels) column 49 is the lesion's in the official
# mask and a false positive by pixel centres. ---

EDGE_SLIDE = (60 * 32 + 10, 60 * 32 + 20)  # level 0 (width, height): 60 x 60 level-5 pixels and a partial one
EDGE_LESION = [Polygon("lesion", "_0", np.array([[316, 316], [1444, 316], [1444, 1444], [316, 1444]], float))]
EDGE_HITS = {"tumour_1": np.array([[0.9, 49 * 32 + 16, 25 * 32 + 16]]), "normal_1": np.array([[0.2, 500, 500]])}


def _mask_tiff(path, min_size: int):
    from hsmla_med.data.asap import asap_mask
    from hsmla_med.io.tiff import write_pyramidal_tiff

    level0 = asap_mask(EDGE_LESION, EDGE_SLIDE, 1).astype(np.uint8) * 255  # CAMELYON16's masks are 0/255
    write_pyramidal_tiff(path, level0, L0, tile=256, min_size=min_size, nearest=True)
    return level0


def _submission(root):
    subs, notes = root / "submission", root / "Ground_Truth" / "XML"
    subs.mkdir(parents=True), notes.mkdir(parents=True)
    _write_xml(notes / "tumour_1.xml", EDGE_LESION)
    for name, rows in EDGE_HITS.items():
        _write_rows(subs / f"{name}.csv", rows)
    return subs, notes


def test_the_evaluation_mask_is_asaps_and_the_official_mask_tiffs_are_read(tmp_path):
    """By hand: ASAP's mask makes the detection at 0.9 a true positive and the normal slide's
    0.2 the only false positive: FROC 1; by pixel centres it would miss the lesion: FROC 0. The
    official script on the ASAP-made mask TIFF's level 5 agrees; ours agrees from the XML, from
    --masks (a full pyramid, and one without level 5), and from Ground_Truth/Masks found beside
    the annotations."""
    subs, notes = _submission(tmp_path)
    level0 = _mask_tiff(tmp_path / "masks" / "tumour_1_Mask.tif", min_size=32)
    official, _ = official_score([level0[::32, ::32][:60, :60] > 0, None], list(EDGE_HITS.values()))
    by_centres, _ = official_score([rasterise(EDGE_LESION, EDGE_SLIDE, 32), None], list(EDGE_HITS.values()))
    assert official == 1.0 and by_centres == 0.0
    runs = {"xml": [], "masks": ["--masks", str(tmp_path / "masks")]}
    _mask_tiff(tmp_path / "partial" / "tumour_1_Mask.tif", min_size=256)  # levels 0..3: level 5 read from level 3
    runs["no level 5"] = ["--masks", str(tmp_path / "partial")]
    for name, extra in runs.items():
        assert main(["evaluate", "--task", "camelyon16", "--predictions", str(subs), "--labels", str(notes), *extra]) == 0, name
        summary = json.loads((subs / "summary.json").read_text())
        assert summary["froc"] == official, name
    (notes / "tumour_1.xml").unlink()  # the mask alone, found in Ground_Truth/Masks beside Ground_Truth/XML
    _mask_tiff(tmp_path / "Ground_Truth" / "Masks" / "tumour_1_Mask.tif", min_size=32)
    assert main(["evaluate", "--task", "camelyon16", "--predictions", str(subs), "--labels", str(notes)]) == 0
    summary = json.loads((subs / "summary.json").read_text())
    assert summary["froc"] == official
    assert {r["slide"]: r["reference_file"] for r in summary["metric_per_case"]}["tumour_1"].endswith("Masks/tumour_1_Mask.tif")


@pytest.mark.parametrize("row, words", [("0.9,1925,816", "last partial row or column"), ("0.9,1584.5,816", "not an integer")])
def test_detections_the_official_script_cannot_read_are_one_line(tmp_path, capsys, row, words):
    """A detection in the mask's last partial column (Evaluation_FROC.py: IndexError) and a
    coordinate with decimals (its int(): ValueError) are refused in one line naming the file."""
    subs, notes = _submission(tmp_path)
    _mask_tiff(tmp_path / "masks" / "tumour_1_Mask.tif", min_size=32)
    (subs / "tumour_1.csv").write_text(row + "\n")
    line = cli_error(capsys, ["evaluate", "--task", "camelyon16", "--predictions", str(subs), "--labels", str(notes), "--masks", str(tmp_path / "masks")])
    assert "tumour_1.csv" in line and words in line
