"""BTCV validation and ``evaluate --checkpoint`` score in the original geometry:
each prediction is brought back to its image file's grid as ``infer`` brings it back and scored
against the original label file at that file's spacing, so its Dice equals ``evaluate
--predictions`` on ``infer``'s outputs of the same model, case by case; HD95 at the original
(anisotropic, LPS) spacing equals MONAI's and a brute-force float64 computation."""

from __future__ import annotations

import json
import math

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.metrics import compute_hausdorff_distance
from scipy.ndimage import binary_erosion
from torch import nn

from hsmla_med.cli import main
from hsmla_med.engine import SegmentationModule
from hsmla_med.engine.run import evaluate
from hsmla_med.evaluation import evaluate_folder
from hsmla_med.pipelines import btcv
from hsmla_med.pipelines.task import InferenceOptions
from tests.conftest import LABELS, phantom, tiny_config, tiny_yaml, write_nifti

# LPS (x and y flipped relative to NIfTI's RAS), anisotropic and far from the 1.5 x 1.5 x 2 mm the
# network sees, off the origin: resampling, reorientation and the crop all have to be undone
AFFINE = np.array([[-0.7, 0, 0, 60.0], [0, -0.9, 0, 45.0], [0, 0, 3.0, -20.0], [0, 0, 0, 1]])
SPACING = (0.7, 0.9, 3.0)


def _dataset(root, cases=3, validation=2, shape=(44, 40, 8)):
    """An MSD-style dataset at :data:`AFFINE`: the conftest phantom (a disc and a bar) inside a
    border of air (-1000 HU), which the foreground crop cuts off."""
    rng = np.random.default_rng(3)
    entries = []
    for i in range(cases):
        image, label = phantom((shape[0] - 8, shape[1] - 8, shape[2]), rng)
        image = np.pad(image, ((4, 4), (4, 4), (0, 0)), constant_values=-1000)
        label = np.pad(label, ((4, 4), (4, 4), (0, 0)))
        write_nifti(root / "imagesTr" / f"img{i:04d}.nii.gz", image, AFFINE)
        write_nifti(root / "labelsTr" / f"label{i:04d}.nii.gz", label, AFFINE)
        entries.append({"image": f"imagesTr/img{i:04d}.nii.gz", "label": f"labelsTr/label{i:04d}.nii.gz"})
    (root / "dataset.json").write_text(json.dumps({"labels": LABELS, "training": entries[validation:], "validation": entries[:validation]}))
    return root, entries[:validation]


class Bands2d(nn.Module):
    """Logits of a fixed rule on the CT-windowed intensity x: the disc (x near 0.88) class 1, the
    bar (x near 0.55) class 2, the rest background; smooth, so resampling moves its borders."""

    def forward(self, x):
        return torch.cat([torch.zeros_like(x), 30 * (x - 0.72), 30 * torch.minimum(x - 0.45, 0.68 - x)], dim=1)


def _module(root, output):
    config = tiny_config(root, output)
    return config, SegmentationModule(btcv.module_config(config, {"variant": "b0"}, list(LABELS.values())), network=Bands2d()).eval()


def _validation_labels(root, entries, folder):
    """The validation cases' label files, alone in ``folder`` (``evaluate --labels``)."""
    folder.mkdir()
    for entry in entries:
        (folder / entry["label"].split("/")[-1]).symlink_to(root / entry["label"])
    return folder


def _dice_by_case(summary):
    """``{(case file name, class): Dice}`` of a ``summary.json`` document."""
    return {(c["prediction_file"].split("/")[-1], k): m["Dice"] for c in summary["metric_per_case"] for k, m in c["metrics"].items()}


def _infer_and_score(module, root, entries, tmp_path, tolerance):
    """``infer``'s label maps (and probabilities) of the validation images, scored by the folder
    evaluator (``evaluate --predictions``): the reference for validation."""
    predictions = tmp_path / "infer"
    btcv.infer(module, [root / e["image"] for e in entries], predictions, InferenceOptions(save_probabilities=True, progress=lambda _: None))
    labels = _validation_labels(root, entries, tmp_path / "labels")
    return predictions, evaluate_folder(predictions, labels, root / "dataset.json", tmp_path / "scored", nsd_tolerance=tolerance)


def test_validation_equals_evaluate_predictions_on_infer_outputs(tmp_path):
    """The module's validation (what ``train`` and ``evaluate --checkpoint`` report) and
    ``evaluate --predictions`` on ``infer``'s label maps of the same module: the same class means
    of Dice (1e-6) and HD95 (1e-4). Scoring on the resampled, cropped grid, as validation did
    before, gives other numbers (checked below, so that the comparison can fail)."""
    root, entries = _dataset(tmp_path / "data")
    config, module = _module(root, tmp_path / "run")
    cases = btcv.datalist(config)
    summary = evaluate(module, btcv.datamodule(config, cases), config["trainer"], tmp_path / "evaluate")
    _, folder = _infer_and_score(module, root, entries, tmp_path, 2.0)
    for k, name in ((1, "disc"), (2, "bar")):
        assert summary["dice_per_class"][name] == pytest.approx(folder["mean"][str(k)]["Dice"], abs=1e-6), name
        assert summary["hd95_per_class"][name] == pytest.approx(folder["mean"][str(k)]["HD95"], abs=1e-4), name
    resampled = _resampled_grid_dice(module, config, cases)
    assert max(abs(resampled[k] - summary["dice_per_class"][k]) for k in resampled) > 1e-3


def test_validation_reports_per_case_as_the_folder_evaluator(tmp_path):
    """``evaluate``'s per-case reports (summary.json, metrics_per_case.csv) and written label
    maps and probabilities: the same per-case Dice (1e-6), HD95 (1e-4), NSD and counts as
    ``evaluate --predictions`` on ``infer``'s outputs, the same files voxel for voxel."""
    root, entries = _dataset(tmp_path / "data")
    config, module = _module(root, tmp_path / "run")
    out = tmp_path / "evaluate"
    btcv.TASK.evaluation_outputs(module, out, {"nsd_tolerance": 1.5, "save_probabilities": True})
    summary = evaluate(module, btcv.datamodule(config, btcv.datalist(config)), config["trainer"], out)
    json_path, csv_path = btcv.TASK.evaluation_reports(module, out)
    validation = json.loads(json_path.read_text())
    assert csv_path.is_file() and validation["nsd_tolerance_mm"] == 1.5 and len(validation["metric_per_case"]) == 2
    predictions, folder = _infer_and_score(module, root, entries, tmp_path, 1.5)

    ours, theirs = _dice_by_case(validation), _dice_by_case(folder)
    assert ours.keys() == theirs.keys() and len(ours) == 4
    for key, dice in theirs.items():
        assert ours[key] == pytest.approx(dice, abs=1e-6), key
    for case_ours, case_theirs in zip(validation["metric_per_case"], folder["metric_per_case"], strict=True):
        for k, m in case_theirs["metrics"].items():
            mine = case_ours["metrics"][k]
            assert mine["HD95"] == pytest.approx(m["HD95"], abs=1e-4) and mine["NSD"] == pytest.approx(m["NSD"], abs=1e-6)
            assert [mine[c] for c in ("TP", "FP", "FN", "TN")] == [m[c] for c in ("TP", "FP", "FN", "TN")]
    for k, name in ((1, "disc"), (2, "bar")):
        assert summary["nsd_per_class"][name] == pytest.approx(folder["mean"][str(k)]["NSD"], abs=1e-6)

    # what evaluate wrote is what infer wrote: label maps voxel for voxel, in the input's geometry
    for entry in entries:
        image = root / entry["image"]
        name = image.name.removesuffix(".nii.gz")
        written, inferred = nib.load(out / "validation" / image.name), nib.load(predictions / image.name)
        np.testing.assert_array_equal(np.asarray(written.dataobj), np.asarray(inferred.dataobj))
        np.testing.assert_allclose(written.affine, AFFINE, atol=1e-6)
        kept = np.load(out / "validation" / f"{name}.npz")["probabilities"]
        assert kept.dtype == np.float16 and kept.shape == (3, 44, 40, 8)
        np.testing.assert_array_equal(kept, np.load(predictions / f"{name}.npz")["probabilities"])


def _resampled_grid_dice(module, config, cases) -> dict:
    """Per-class mean Dice on the network's grid (the validation transform's output), as
    validation scored before scoring moved to the original geometry."""
    from monai.metrics import compute_dice
    from monai.networks.utils import one_hot

    data = btcv.datamodule(config, cases)
    data.setup("validate")
    rows = []
    for batch in data.val_dataloader():
        with torch.no_grad():
            pred = module.predict_probabilities(batch["image"].as_tensor()).argmax(1, keepdim=True)
        rows.append(compute_dice(one_hot(pred, 3), one_hot(batch["label"].as_tensor(), 3), include_background=False)[0])
    means = torch.stack(rows).nanmean(0)
    return {"disc": float(means[0]), "bar": float(means[1])}


def _edges(mask: np.ndarray) -> np.ndarray:
    """Boundary voxels as MONAI finds them without sub-voxels: the mask minus its erosion (cross)."""
    return mask & ~binary_erosion(mask)


def _brute_force_hd95(a: np.ndarray, b: np.ndarray, spacing) -> float:
    """Symmetric HD95 in float64 from all pairwise distances between the two boundaries."""
    pa, pb = (np.argwhere(_edges(m)) * np.asarray(spacing, np.float64) for m in (a, b))
    d = np.sqrt(((pa[:, None, :] - pb[None, :, :]) ** 2).sum(-1))
    return max(np.percentile(d.min(1), 95), np.percentile(d.min(0), 95))


@pytest.mark.filterwarnings("ignore:.*always_return_as_numpy:FutureWarning")  # (MONAI 1.5-1.6, its own call)
def test_hd95_at_the_label_files_anisotropic_lps_spacing(tmp_path):
    """Scored against a label file at :data:`AFFINE` (LPS, 0.7 x 0.9 x 3 mm), HD95 is taken at
    that file's spacing: MONAI's ``compute_hausdorff_distance`` with the spacing (1e-4) and all
    pairwise distances in float64 (1e-4); the same masks at 1 mm give another number."""
    shape = (40, 36, 12)
    grid = np.meshgrid(*[np.arange(n) * s for n, s in zip(shape, SPACING, strict=True)], indexing="ij")
    ball = lambda c, r: sum((g - x) ** 2 for g, x in zip(grid, c, strict=True)) <= r**2  # noqa: E731
    truth = np.zeros(shape, np.uint8)
    truth[ball((12.0, 14.0, 16.0), 7.0)] = 1
    pred = np.zeros(shape, np.uint8)
    pred[ball((13.1, 13.0, 19.0), 6.0)] = 1
    pred[ball((22.0, 22.0, 20.0), 2.0)] = 1  # a stray island: the tail HD95 must see
    from hsmla_med.evaluation import score_prediction  # (new: imported here so the file runs on older code)

    reference = write_nifti(tmp_path / "label.nii.gz", truth, AFFINE)
    case = score_prediction(reference, pred, [1], 2.0, "pred.nii.gz")
    ours = case["metrics"][1]["HD95"]
    one_hot = lambda m: torch.from_numpy(np.stack([m == 0, m == 1]))[None].float()  # noqa: E731
    monai = float(compute_hausdorff_distance(one_hot(pred), one_hot(truth), percentile=95, spacing=list(SPACING))[0, 0])
    assert ours == pytest.approx(monai, abs=1e-4)
    assert ours == pytest.approx(_brute_force_hd95(pred == 1, truth == 1, SPACING), abs=1e-4)
    assert not math.isclose(ours, _brute_force_hd95(pred == 1, truth == 1, (1.0, 1.0, 1.0)), abs_tol=0.1)


def test_evaluate_checkpoint_writes_per_case_reports_and_agrees_with_infer(tmp_path, capsys):
    """``train`` -> ``evaluate --checkpoint --save-probabilities`` -> ``infer`` -> ``evaluate
    --predictions`` through the command line: evaluate's summary.json, label maps and
    probabilities are those of the folder evaluation of infer's outputs."""
    root, entries = _dataset(tmp_path / "data")
    argv = ["--task", "btcv", "--data-dir", str(root), "--config", str(tiny_yaml(tmp_path / "tiny.yaml"))]
    assert main(["train", *argv, "--max-steps", "2", "--output", str(tmp_path / "run")]) == 0
    checkpoint = str(tmp_path / "run" / "last.ckpt")
    out = tmp_path / "evaluate"
    assert main(["evaluate", *argv, "--checkpoint", checkpoint, "--output", str(out), "--save-probabilities", "--nsd-tolerance", "1"]) == 0
    printed = capsys.readouterr().out
    assert "NSD" in printed and str(out / "summary.json") in printed
    validation = json.loads((out / "summary.json").read_text())
    metrics = json.loads((out / "metrics.json").read_text())
    assert validation["nsd_tolerance_mm"] == 1.0 and {"dice", "hd95", "nsd", "nsd_per_class"} <= metrics.keys()
    assert sorted(p.name for p in (out / "validation").iterdir()) == ["img0000.nii.gz", "img0000.npz", "img0001.nii.gz", "img0001.npz"]

    predictions, inputs = tmp_path / "infer", tmp_path / "inputs"
    inputs.mkdir()
    images = [root / e["image"] for e in entries]
    for image in images:
        (inputs / image.name).symlink_to(image)
    assert main(["infer", "--task", "btcv", "--checkpoint", checkpoint, "--input", str(inputs), "--output", str(predictions)]) == 0
    labels = _validation_labels(root, entries, tmp_path / "labels")
    assert main(["evaluate", "--predictions", str(predictions), "--labels", str(labels), "--dataset-json", str(root / "dataset.json"),
                 "--output", str(tmp_path / "scored"), "--nsd-tolerance", "1"]) == 0
    folder = json.loads((tmp_path / "scored" / "summary.json").read_text())
    ours, theirs = _dice_by_case(validation), _dice_by_case(folder)
    assert ours.keys() == theirs.keys()
    for key, dice in theirs.items():
        assert (ours[key] is None and dice is None) or ours[key] == pytest.approx(dice, abs=1e-6), key
    for image in images:
        np.testing.assert_array_equal(np.asarray(nib.load(out / "validation" / image.name).dataobj),
                                      np.asarray(nib.load(predictions / image.name).dataobj))
