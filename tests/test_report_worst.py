"""The report's pictures of where a model fails (hsmla_med.report.worst): the worst volumes
through their largest error, frames with both outlines, missed LUNA16 nodules, the uncertainty
review queue, and the share of tiles each gated layer refined over a validation."""

from __future__ import annotations

import base64
import csv
import io
import json
import re

import numpy as np
import pytest
import torch
from PIL import Image

from hsmla_med.bench.report import write_nifti as _nifti
from hsmla_med.bench.report import write_volume_pairs as _dataset
from hsmla_med.evaluation import evaluate_folder
from hsmla_med.nn import GatedNetwork
from hsmla_med.report import write_report
from hsmla_med.report.inputs import mean_dice
from hsmla_med.report.worst import _canonical, _error_centre, axial_crop, image_of, missed_nodules, worst_rows
from tests.test_report import Page


def _section_images(document: str, section: str) -> list[Image.Image]:
    """The decoded pictures of one ``<section id=...>`` of a report."""
    start = document.index(f'<section id="{section}"')
    end = document.find("<section", start + 1)
    page = Page(document[start:end if end > 0 else None])
    return [Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))) for src in page.images]


def test_error_centre_is_in_the_largest_disagreement():
    """Two errors, a 3x3x3 block around (6, 7, 4) and a lone voxel: the block's centre."""
    reference = np.zeros((16, 16, 8), np.uint8)
    reference[2:12, 2:12, 1:7] = 1
    prediction = reference.copy()
    prediction[5:8, 6:9, 3:6] = 2
    prediction[14, 14, 0] = 1
    assert _error_centre(reference, prediction) == (6, 7, 4)
    assert _error_centre(reference, reference) == (6, 6, 3)  # no error: the reference's foreground (its central voxel)


def test_canonical_orders_voxels_as_ras(tmp_path):
    """A volume stored LPS (x and y flipped): the voxel of the file's (0, 0, 0) lands at the
    RAS corner, and the new affine places it at the same world point."""
    affine = np.array([[-0.7, 0, 0, 50.0], [0, -0.8, 0, 60.0], [0, 0, 2.5, -10.0], [0, 0, 0, 1]])
    data = np.zeros((5, 6, 4), np.float32)
    data[0, 0, 0] = 7
    volume, spacing, ras = _canonical(_nifti(tmp_path / "lps.nii.gz", data, affine))
    assert volume[4, 5, 0] == 7 and np.count_nonzero(volume) == 1
    assert spacing == pytest.approx([0.7, 0.8, 2.5])
    assert ras @ [4, 5, 0, 1] == pytest.approx(affine @ [0, 0, 0, 1])
    assert np.all(np.diag(ras)[:3] > 0)


def test_image_of_finds_the_dataset_pair(tmp_path):
    """MSD: the dataset JSON's pair (names unlike each other); nnU-Net: ``<case>_0000``; none: ``None``."""
    msd = tmp_path / "msd"
    image = _nifti(msd / "imagesTr" / "img0001.nii.gz", np.zeros((2, 2, 2)))
    label = _nifti(msd / "labelsTr" / "label0001.nii.gz", np.zeros((2, 2, 2), np.uint8))
    (msd / "dataset.json").write_text(json.dumps({"labels": {"0": "background"}, "training": [
        {"image": "./imagesTr/img0001.nii.gz", "label": "./labelsTr/label0001.nii.gz"}]}))
    assert image_of(label) == msd / "./imagesTr/img0001.nii.gz"
    nnunet = tmp_path / "nnunet"
    image = _nifti(nnunet / "imagesTr" / "case_007_0000.nii.gz", np.zeros((2, 2, 2)))
    assert image_of(_nifti(nnunet / "labelsTr" / "case_007.nii.gz", np.zeros((2, 2, 2), np.uint8))) == image
    assert image_of(_nifti(tmp_path / "alone" / "labels" / "x.nii.gz", np.zeros((2, 2, 2), np.uint8))) is None


def test_worst_volumes_in_the_report(tmp_path):
    """An evaluation by the real scorer of six cases: the report's "Worst cases" shows the four
    of lowest mean Dice, worst first, as the case table orders them; each a picture of three
    views that decodes. Captions and the subtitle name files without their absolute paths: the
    references and predictions outside the folder by their folder and name."""
    errors = {"c0": 10, "c1": 300, "c2": 0, "c3": 150, "c4": 40, "c5": 500}
    _dataset(tmp_path / "data", errors)
    summary = evaluate_folder(tmp_path / "data" / "predictions", tmp_path / "data" / "labelsTr", None, tmp_path / "eval", 2.0)
    by_dice = sorted(summary["metric_per_case"], key=lambda r: mean_dice([m["Dice"] for m in r["metrics"].values()]))
    assert [r["prediction_file"] for r in worst_rows(summary["metric_per_case"])] == [r["prediction_file"] for r in by_dice[:4]]
    assert [r["prediction_file"].rsplit("/", 1)[1] for r in by_dice[:4]] == ["c5.nii.gz", "c1.nii.gz", "c3.nii.gz", "c4.nii.gz"]
    document = write_report(tmp_path / "eval").read_text()
    pictures = _section_images(document, "worst")
    assert len(pictures) == 4 and all(p.width > 2 * p.height for p in pictures)  # three views side by side
    order = [document.index(f"{k}. {name}") for k, name in enumerate(["c5.nii.gz", "c1.nii.gz", "c3.nii.gz", "c4.nii.gz"], start=1)]
    assert order == sorted(order)
    captions = re.findall(r"<figcaption>(.*?)</figcaption>", document) + re.findall(r'alt="(.*?)"', document)
    subtitle = re.search(r"</h1><p class=note>(.*?)</p>", document).group(1)
    assert len(captions) > 4 and not [c for c in [*captions, subtitle] if str(tmp_path) in c or str(tmp_path.resolve()) in c]
    assert "1. c5.nii.gz: reference labelsTr/c5.nii.gz (solid), prediction predictions/c5.nii.gz (dotted), through the centre (+) of " \
           "the largest error" in captions
    assert subtitle.startswith("eval: evaluation")


def test_a_missing_prediction_is_left_out_not_fatal(tmp_path):
    _dataset(tmp_path / "data", {"c0": 50, "c1": 5})
    evaluate_folder(tmp_path / "data" / "predictions", tmp_path / "data" / "labelsTr", None, tmp_path / "eval", 2.0)
    (tmp_path / "data" / "predictions" / "c0.nii.gz").unlink()
    pictures = _section_images(write_report(tmp_path / "eval").read_text(), "worst")
    assert len(pictures) == 1


def test_axial_crop_is_centred_on_the_nodule():
    """A voxel chosen first, its LPS point from the affine: the crop's centre is that voxel,
    whatever the spacing; a nodule at the border is padded with air."""
    affine = np.array([[0.7, 0, 0, -120.0], [0, 0.8, 0, -90.0], [0, 0, 2.5, -300.0], [0, 0, 0, 1]])
    volume = np.random.default_rng(0).uniform(-900, 300, (60, 50, 12)).astype(np.float32)
    for voxel in ((30, 20, 5), (1, 48, 0)):
        ras = affine @ [*voxel, 1]
        crop = axial_crop(volume, affine, (-ras[0], -ras[1], ras[2]), half_mm=8.0)
        assert crop.shape == (2 * 12 + 1, 2 * 10 + 1)  # ceil(8 / 0.7), ceil(8 / 0.8) voxels to each side
        assert crop[12, 10] == volume[voxel]
    assert crop[0, 0] == -1000.0  # (1, 48): beyond the volume's x = 0 and y = 49


def test_missed_nodules_crops_in_the_report(tmp_path):
    """A LUNA16 summary's ``missed`` nodules with their scans: the FROC drawn from it, and under
    "Where does it fail?" one picture of the crops of those whose scan is there, largest first."""
    scan = _nifti(tmp_path / "scan.nii.gz", np.full((40, 40, 10), -800, np.int16), np.diag([0.8, 0.8, 2.0, 1.0]))
    rows = [{"seriesuid": "1.2.3", "nodules": 2, "TP": 0, "FP": 1, "ignored": 0, "missed": [[-10, -12, 8, 6.0], [-16, -16, 10, -1]],
             "scan_file": str(scan)},
            {"seriesuid": "1.2.4", "nodules": 1, "TP": 0, "FP": 0, "ignored": 0, "missed": [[0, 0, 0, 12.0]], "scan_file": str(tmp_path / "gone.mhd")}]
    assert [n for _, n in missed_nodules(rows)] == [[-10, -12, 8, 6.0], [-16, -16, 10, -1]]
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "summary.json").write_text(json.dumps({"cpm": 0.0, "froc": {"0.125": 0.0, "1": 0.0}, "metric_per_case": rows}))
    document = write_report(tmp_path / "eval").read_text()
    assert "largest first (2 of 3)" in document
    assert len(_section_images(document, "froc")) == 1 and len(_section_images(document, "missed")) == 1


def test_uncertainty_queue_in_the_report(tmp_path):
    """``infer --uncertainty``'s folder: the queue's table holds the CSV's values, each case a
    picture of its map."""
    out = tmp_path / "infer"
    rows = [("b", 0.25, 1.5, 12.0), ("a", 0.125, 0.75, 30.0)]
    out.mkdir()
    with (out / "uncertainty.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["case", "mean_foreground_uncertainty", "uncertain_volume_ml", "foreground_volume_ml"])
        writer.writerows(rows)
    for case, *_ in rows:
        values = np.zeros((12, 10, 6), np.float32)
        values[3:6, 3:6, 2] = 0.8
        _nifti(out / "uncertainty" / f"{case}_uncertainty.nii.gz", values)
        _nifti(out / f"{case}.nii.gz", (values > 0).astype(np.uint8))
    document = write_report(out).read_text()
    table = Page(document).table("case", ["mean_foreground_uncertainty"])
    assert {k: float(v["mean_foreground_uncertainty"]) for k, v in table.items()} == {"b": 0.25, "a": 0.125}
    assert len(_section_images(document, "uncertainty")) == 2


def test_refined_share_counts_every_network_call(tmp_path):
    """Over a validation's calls of the graphed network, each gated layer's share of tiles
    refined is the count of (gate > tau) over all calls (read here by forward hooks), not the
    last call's."""
    from hsmla_med.config import model_config, task_config
    from hsmla_med.engine.classification import ClassificationModule
    from hsmla_med.pipelines import camelyon16

    torch.manual_seed(0)
    module = ClassificationModule(camelyon16.module_config(task_config("camelyon16"), model_config("b0"), camelyon16.LABELS)).eval()
    assert isinstance(module.network, GatedNetwork)
    layers = module.network.hsmla_layers()
    with torch.no_grad():
        module.network.calibrate_tau(torch.randn(2, 3, 64, 64), target_alpha=0.3)  # as a validation does: tau between the gates
    seen = {name: [0, 0] for name in layers}
    maps = {name: [] for name in layers}  # per call, item 0's refined tiles

    def hook(name):
        def count(layer, inputs, output):
            seen[name][0] += int((layer.last_gate > layer.tau).sum())
            seen[name][1] += layer.last_gate.numel()
            maps[name].append((layer.last_gate[0] > layer.tau).numpy())
        return count

    handles = [layer.register_forward_hook(hook(name)) for name, layer in layers.items()]
    module._refined, module._gated = {}, layers  # as a validation starts (on_validation_epoch_start)
    inputs = [torch.randn(2, 3, size, size) for size in (64, 96, 64)]
    with torch.no_grad():
        for x in inputs:
            module.graphed()(x)
    for handle in handles:
        handle.remove()
    # the example kept: call 2 (of 1, 2, 4, ... the last made), its first item
    module._finish_gate_example()
    example = module.validation_gates
    assert (example["call"], example["calls"]) == (2, 3)
    assert np.array_equal(example["image"], inputs[1][0, 0].numpy())
    assert set(example["refined"]) == set(layers) and all(np.array_equal(example["refined"][n], maps[n][1]) for n in layers)
    shares = module.refined_per_layer()
    assert set(shares) == set(layers)
    assert shares == {name: pytest.approx(refined / tiles, abs=1e-12) for name, (refined, tiles) in seen.items()}
    assert len(set(shares.values())) > 1  # tau set for other inputs: the layers refine different shares
    module.network.set_routing("off")
    module._refined, module._gated = {}, layers
    with torch.no_grad():
        module.graphed()(torch.randn(1, 3, 64, 64))
    assert module.refined_per_layer() == {}


def test_worst_frames_show_both_outlines(tmp_path):
    """EndoVis masks scored by the real scorer: the worst frame's picture is the frame with
    the reference's outline (solid, the class colour) and the prediction's (dashes)."""
    from hsmla_med.evaluation.frames import score_frames
    from hsmla_med.io.overlays import class_colour

    video = tmp_path / "data" / "instrument_dataset_1"
    rng = np.random.default_rng(0)
    for k, shift in enumerate((0, 12)):
        name = f"frame{k:03d}.png"
        (video / "left_frames").mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 60, (48, 64, 3), dtype=np.uint8)).save(video / "left_frames" / name)
        truth = np.zeros((48, 64), np.uint8)
        truth[10:30, 10:40] = 255
        (video / "ground_truth" / "Large_Needle_Driver_labels").mkdir(parents=True, exist_ok=True)
        Image.fromarray(truth).save(video / "ground_truth" / "Large_Needle_Driver_labels" / name)
        mask = np.zeros((48, 64), np.uint8)
        mask[10 + shift:30 + shift, 10:40] = 1
        (tmp_path / "pred" / "instrument_dataset_1").mkdir(parents=True, exist_ok=True)
        Image.fromarray(mask).save(tmp_path / "pred" / "instrument_dataset_1" / name)
    score_frames(tmp_path / "pred", tmp_path / "data", tmp_path / "eval", "binary")
    document = write_report(tmp_path / "eval").read_text()
    assert document.index("1. frame001.png") < document.index("2. frame000.png")  # the shifted mask first
    pictures = _section_images(document, "worst")
    assert len(pictures) == 2
    colour = np.array(class_colour(1))
    pixels = np.asarray(pictures[0].convert("RGB")).reshape(-1, 3).astype(int)
    assert (np.abs(pixels - colour).sum(axis=1) < 40).sum() > 50  # the outlines are drawn


def _bright_quadrant(picture: np.ndarray) -> tuple[str, str]:
    """Where the bright pixels lie in a drawn slice: the slice is the largest dark region of the
    picture (its text is in small pieces); the answer is (``top``/``bottom``, ``left``/``right``)
    of the bright pixels' centre within that region."""
    from scipy import ndimage

    rgb = picture[..., :3].astype(int)
    regions, _ = ndimage.label(rgb.max(axis=2) < 140)
    largest = 1 + int(np.argmax(np.bincount(regions.ravel())[1:]))
    rows, cols = np.nonzero(regions == largest)
    top, bottom, left, right = rows.min(), rows.max(), cols.min(), cols.max()
    box = rgb[top:bottom + 1, left:right + 1]
    bright_rows, bright_cols = np.nonzero((box[..., 0] > 200) & (box[..., 1] > 200))
    return ("top" if bright_rows.mean() < box.shape[0] / 2 else "bottom", "left" if bright_cols.mean() < box.shape[1] / 2 else "right")


def test_gate_pictures_are_drawn_as_the_report_draws_volume_slices(tmp_path):
    """A volume bright at high x, low y: the report's axial view (x across, y up) shows it at
    the bottom right, and the gates' picture of that axial slice, with the tiles there refined,
    must show it there too (it was drawn as an image, rows = x downward: bottom left)."""
    from hsmla_med.config import model_config
    from hsmla_med.engine import SegmentationModule
    from hsmla_med.engine.callbacks import write_gate_example
    from hsmla_med.pipelines import btcv
    from hsmla_med.report.worst import volume_views
    from tests.conftest import tiny_config

    image = np.zeros((24, 20, 6), np.float32)
    image[15:21, 3:8, :] = 100.0
    labels = (image > 0).astype(np.uint8)
    predicted = labels.copy()
    predicted[17:19, 4:6, 2:4] = 0  # the error, and so the slice shown, inside the bright block
    _nifti(tmp_path / "imagesTr" / "c_0000.nii.gz", image, np.eye(4))
    reference = _nifti(tmp_path / "labelsTr" / "c.nii.gz", labels, np.eye(4))
    prediction = _nifti(tmp_path / "predictions" / "c.nii.gz", predicted, np.eye(4))
    views = np.asarray(Image.open(io.BytesIO(volume_views({"reference_file": str(reference), "prediction_file": str(prediction)}, "c"))))
    axial = views[:, : views.shape[1] // 3]
    assert _bright_quadrant(axial) == ("bottom", "right")

    config = tiny_config(tmp_path, tmp_path / "out")
    module = SegmentationModule(btcv.module_config(config, model_config("b0"), ["bg", "a", "b"]))
    tiles = np.zeros((6, 5), bool)  # 4 x 4 voxels a tile: the tile of the block's centre
    tiles[4, 1] = True
    module.validation_gates = {"call": 1, "calls": 1, "image": image[:, :, 3], "refined": {"layer": tiles}}
    picture = np.asarray(Image.open(write_gate_example(module, tmp_path / "out")))
    assert _bright_quadrant(picture) == _bright_quadrant(axial)
