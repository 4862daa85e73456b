"""nnU-Net v2's ``dataset.json`` read in full: several input channels (``CASE_0000``,
``CASE_0001``, ...), an ``ignore`` label, region labels with ``regions_class_order``."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from conftest import cli_error, phantom, tiny_yaml, write_nifti
from hsmla_med.data.datalist import load_datalist
from hsmla_med.errors import DataError

AFFINE = np.diag([1.5, 1.5, 2.0, 1.0])


def nnunet_dataset(root: Path, cases: int = 3, channels: int = 2, labels: dict | None = None, shape=(40, 36, 6), **meta) -> Path:
    """nnU-Net v2 layout: ``imagesTr/case_k_000C.nii.gz`` per channel (channel C: the phantom's
    image scaled by C + 1), ``labelsTr/case_k.nii.gz``, no lists in the JSON."""
    rng = np.random.default_rng(0)
    for k in range(cases):
        image, label = phantom(shape, rng)
        for c in range(channels):
            write_nifti(root / "imagesTr" / f"case{k}_{c:04d}.nii.gz", (image * (c + 1)).astype(np.int16), AFFINE)
        write_nifti(root / "labelsTr" / f"case{k}.nii.gz", label, AFFINE)
    names = {str(c): f"ch{c}" for c in range(channels)}
    (root / "dataset.json").write_text(json.dumps({"channel_names": names, "labels": labels or {"background": 0, "disc": 1, "bar": 2},
                                                   "numTraining": cases, "file_ending": ".nii.gz", **meta}))
    return root


def test_channels_group_into_cases(tmp_path):
    cases = load_datalist(nnunet_dataset(tmp_path / "data"))
    assert cases.channels == 2
    assert [[Path(f).name for f in c["image"]] for c in cases.training] == [[f"case{k}_0000.nii.gz", f"case{k}_0001.nii.gz"] for k in range(3)]
    assert [Path(c["label"]).name for c in cases.training] == ["case0.nii.gz", "case1.nii.gz", "case2.nii.gz"]


def test_missing_or_odd_channel_file_refused(tmp_path):
    data = nnunet_dataset(tmp_path / "data")
    (data / "imagesTr" / "case1_0001.nii.gz").unlink()
    with pytest.raises(DataError, match=r"case1: the case has channel files case1_0000\.nii\.gz; the dataset has 2 channels"):
        load_datalist(data)
    write_nifti(data / "imagesTr" / "case1_0001.nii.gz", np.zeros((40, 36, 5), np.int16), AFFINE)
    with pytest.raises(DataError, match=r"case1_0001\.nii\.gz: channel file of shape \(40, 36, 5\), the case's first channel case1_0000\.nii\.gz has \(40, 36, 6\)"):
        load_datalist(data)
    write_nifti(data / "imagesTr" / "case1_0001.nii.gz", np.zeros((40, 36, 6), np.int16), np.diag([1.0, 1.5, 2.0, 1.0]))
    with pytest.raises(DataError, match=r"case1_0001\.nii\.gz: channel file affine .* differs from the case's first channel"):
        load_datalist(data)


def test_msd_list_entries_are_multichannel_cases(tmp_path):
    """MSD's lists: an entry's image as one file per modality."""
    data = nnunet_dataset(tmp_path / "data")
    entries = [{"image": [f"imagesTr/case{k}_0000.nii.gz", f"imagesTr/case{k}_0001.nii.gz"], "label": f"labelsTr/case{k}.nii.gz"} for k in range(3)]
    (data / "dataset.json").write_text(json.dumps({"modality": {"0": "T1", "1": "T2"}, "labels": {"0": "background", "1": "disc", "2": "bar"},
                                                   "training": entries}))
    cases = load_datalist(data)
    assert cases.channels == 2 and [len(c["image"]) for c in cases.training] == [2, 2, 2]
    entries[0]["image"] = entries[0]["image"][:1] * 3
    (data / "dataset.json").write_text(json.dumps({"modality": {"0": "T1", "1": "T2"}, "labels": {"0": "background", "1": "disc", "2": "bar"},
                                                   "training": entries}))
    with pytest.raises(DataError, match="lists 3 files, the dataset has 2 channel"):
        load_datalist(data)


def test_evaluate_pairs_a_prediction_with_the_label_of_its_channel_files(tmp_path):
    """evaluate --predictions: infer names a multi-channel case after its first channel file
    (case0), the JSON's list pairs that with its label file of another name (lab0)."""
    from hsmla_med.evaluation import evaluate_folder

    data = nnunet_dataset(tmp_path / "data", cases=1)
    labels = tmp_path / "labels"
    labels.mkdir()
    (labels / "lab0.nii.gz").write_bytes((data / "labelsTr" / "case0.nii.gz").read_bytes())
    entry = {"image": ["imagesTr/case0_0000.nii.gz", "imagesTr/case0_0001.nii.gz"], "label": "../labels/lab0.nii.gz"}
    (data / "dataset.json").write_text(json.dumps({"channel_names": {"0": "a", "1": "b"}, "labels": {"background": 0, "disc": 1, "bar": 2},
                                                   "training": [entry]}))
    predictions = tmp_path / "predictions"
    predictions.mkdir()
    (predictions / "case0.nii.gz").write_bytes((data / "labelsTr" / "case0.nii.gz").read_bytes())
    summary = evaluate_folder(predictions, labels, data / "dataset.json")
    assert summary["foreground_mean"]["Dice"] == 1.0


def test_two_channels_train_and_infer(tmp_path, capsys):
    """A 2-channel dataset trains 2 steps; the checkpoint's network takes 2 channels, and infer
    groups an input folder's CASE_000K files into cases; a channel file of another shape is one line."""
    from hsmla_med.cli import main
    from hsmla_med.pipelines import get_task

    data = nnunet_dataset(tmp_path / "data")
    run = tmp_path / "run"
    assert main(["train", "--task", "btcv", "--data-dir", str(data), "--config", str(tiny_yaml(tmp_path / "tiny.yaml")),
                 "--max-steps", "2", "--output", str(run)]) == 0
    module, _ = get_task("btcv").load(run / "last.ckpt")
    assert module.config["in_channels"] == 2
    assert module(torch.zeros(1, 2, 32, 32)).shape == (1, 3, 32, 32)  # 2D by default: 2 channels in, 3 classes out
    out = tmp_path / "pred"
    assert main(["infer", "--task", "btcv", "--checkpoint", str(run / "last.ckpt"), "--input", str(data / "imagesTr"), "--output", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.nii.gz")) == ["case0.nii.gz", "case1.nii.gz", "case2.nii.gz"]
    written = nib.load(str(out / "case1.nii.gz"))
    assert written.shape == (40, 36, 6) and np.allclose(written.affine, AFFINE)
    write_nifti(data / "imagesTr" / "case2_0001.nii.gz", np.zeros((40, 36, 5), np.int16), AFFINE)
    line = cli_error(capsys, ["infer", "--task", "btcv", "--checkpoint", str(run / "last.ckpt"), "--input", str(data / "imagesTr"),
                              "--output", str(tmp_path / "pred2")])
    assert "case2_0001.nii.gz: channel file of shape (40, 36, 5)" in line


# --- the ignore label ------------------------------------------------------------------------

def test_ignore_label_is_read_and_must_be_highest(tmp_path):
    cases = load_datalist(nnunet_dataset(tmp_path / "data", channels=1, labels={"background": 0, "disc": 1, "bar": 2, "ignore": 3}))
    assert (cases.label_names, cases.ignore_label, cases.label_values()) == (["background", "disc", "bar"], 3, [0, 1, 2, 3])
    with pytest.raises(DataError, match="the 'ignore' label must have the highest label value"):
        load_datalist(nnunet_dataset(tmp_path / "bad", channels=1, labels={"background": 0, "disc": 1, "ignore": 2, "bar": 3}))


def test_metrics_leave_ignored_voxels_out():
    """Dice and the counts by hand: a prediction under the ignore label is neither FP nor TN."""
    from hsmla_med.metrics.summary import case_metrics

    reference = np.zeros((6, 6, 3), np.int64)
    reference[1:3, 1:3] = 1  # 12 voxels of class 1
    reference[4:, :, :] = 9  # ignored: 36 voxels
    prediction = np.zeros_like(reference)
    prediction[1:3, 1:2] = 1  # 6 true positives
    prediction[4:, :, :] = 1  # 36 voxels predicted under the ignore label: not counted
    prediction[0, 0] = 1  # 3 false positives
    m = case_metrics(reference, prediction, [1], [1.0, 1.0, 1.0], 1.0, ignore_label=9)[1]
    assert (m["TP"], m["FP"], m["FN"], m["TN"]) == (6, 3, 6, 108 - 36 - 15)
    assert m["Dice"] == pytest.approx(2 * 6 / (2 * 6 + 3 + 6))
    unmasked = case_metrics(reference, prediction, [1], [1.0, 1.0, 1.0], 1.0)[1]
    assert unmasked["FP"] == 39  # without the ignore label they would count


def test_ignore_label_trains_and_evaluates(tmp_path):
    """A dataset with an ignore label trains 2 steps (the network predicts 3 classes, not 4), and
    evaluate --predictions leaves the ignored voxels out, as by hand."""
    from hsmla_med.cli import main
    from hsmla_med.evaluation import evaluate_folder
    from hsmla_med.pipelines import get_task

    labels = {"background": 0, "disc": 1, "bar": 2, "ignore": 3}
    data = nnunet_dataset(tmp_path / "data", channels=1, labels=labels)
    for k in range(3):  # an ignored rim in every label map
        path = data / "labelsTr" / f"case{k}.nii.gz"
        label = np.asanyarray(nib.load(str(path)).dataobj).copy()
        label[:4] = 3
        write_nifti(path, label, AFFINE)
    run = tmp_path / "run"
    assert main(["train", "--task", "btcv", "--data-dir", str(data), "--config", str(tiny_yaml(tmp_path / "tiny.yaml")),
                 "--max-steps", "2", "--output", str(run)]) == 0
    module, _ = get_task("btcv").load(run / "last.ckpt")
    assert module.config["ignore_label"] == 3 and module(torch.zeros(1, 1, 32, 32)).shape[1] == 3

    predictions = tmp_path / "predictions"
    truth = np.asanyarray(nib.load(str(data / "labelsTr" / "case0.nii.gz")).dataobj)
    guess = np.where(truth == 3, 1, truth).astype(np.uint8)  # right everywhere, "disc" under the ignore label
    write_nifti(predictions / "case0.nii.gz", guess, AFFINE)
    summary = evaluate_folder(predictions, _only(data, tmp_path, "case0"), data / "dataset.json")
    assert summary["mean"]["1"]["Dice"] == 1.0 and summary["metric_per_case"][0]["metrics"]["1"]["FP"] == 0


@pytest.mark.parametrize("kind", ["zscore_foreground", "ct_window"])
def test_foreground_crops_centre_on_annotated_voxels_only(tmp_path, kind):
    """Foreground-only crops (pos 1, neg 0) of a volume whose label holds a small annotated cube
    and a large ignored slab far from it: every crop holds the cube (MONAI's own sampling counts
    the ignore label as foreground and centres most crops on the slab). Background crops (pos 0)
    centre on label 0 voxels, never on the slab."""
    from monai.transforms import Compose

    from hsmla_med.data.volume_crops import crop_and_augment
    from tests.conftest import tiny_config

    config = tiny_config(tmp_path, tmp_path / "out")
    config["mode"], config["data"]["roi_size_3d"] = "3d", [16, 16, 16]
    config["data"]["intensity"] = {"kind": kind, "a_min": -175.0, "a_max": 250.0, "mean": None, "std": None}
    config["data"]["samples_per_case"] = 40
    config["data"]["augment"] = {**config["data"]["augment"], **{k: 0.0 for k in config["data"]["augment"] if k.endswith("_prob")}}
    label = torch.zeros(1, 64, 64, 64, dtype=torch.int64)
    label[0, 4:8, 4:8, 4:8] = 1  # 64 annotated voxels
    label[0, 32:, :, :] = 3  # the far half: ignored (4096 x 8 voxels)
    item = {"image": torch.rand(1, 64, 64, 64) + 1.0, "label": label}
    for pos, neg in ((1, 0), (0, 1)):
        config["data"]["pos_neg"] = [pos, neg]
        crops = Compose(crop_and_augment(config, ignore_label=3)).set_random_state(0)(dict(item))
        assert len(crops) == 40 and all(set(c) == {"image", "label"} for c in crops)
        if pos:
            assert all((c["label"] == 1).any() for c in crops)
        else:  # a 16^3 crop centred on label 0 reaches at most 8 voxels into the slab
            assert all((c["label"] == 3).sum() <= 16 * 16 * 8 for c in crops)


def _only(data: Path, tmp_path: Path, name: str) -> Path:
    """A labels folder with one case's label map."""
    folder = tmp_path / "labels"
    folder.mkdir()
    (folder / f"{name}.nii.gz").write_bytes((data / "labelsTr" / f"{name}.nii.gz").read_bytes())
    return folder


# --- region labels ----------------------------------------------------------------------------

REGIONS = {"background": 0, "whole": [1, 2, 3], "core": [2, 3], "enhancing": 3}


def test_regions_are_read(tmp_path):
    data = nnunet_dataset(tmp_path / "data", channels=1, labels={"background": 0, "object": [1, 2], "disc": 1}, regions_class_order=[2, 1])
    cases = load_datalist(data)
    assert (cases.label_names, cases.regions, cases.regions_class_order) == (["background", "object", "disc"], [[1, 2], [1]], [2, 1])
    assert cases.label_values() == [0, 1, 2]
    (data / "dataset.json").write_text(json.dumps({"labels": REGIONS, "channel_names": {"0": "MR"}}))
    with pytest.raises(DataError, match="region-based labels need 'regions_class_order', one label value per region"):
        load_datalist(data)


def test_region_masks_by_hand():
    from hsmla_med.engine.segmentation import region_masks

    label = torch.tensor([0, 1, 2, 3, 1]).reshape(1, 1, 5)
    masks = region_masks(label, [[1, 2, 3], [2, 3], [3]])
    assert masks[0].tolist() == [[1, 0, 0, 0, 0], [0, 1, 1, 1, 1], [0, 0, 1, 1, 0], [0, 0, 0, 1, 0]]


def test_label_map_from_regions_by_hand():
    """nnU-Net's rule: each region above 0.5 writes its regions_class_order value, later over earlier."""
    from monai.data import MetaTensor
    from monai.transforms import Compose, EnsureTyped

    from hsmla_med.inference.geometry import labels_in_input_geometry

    identity = Compose([EnsureTyped("image")])  # nothing to invert: the probabilities' own grid
    # voxels: nothing / whole only / whole + core / all three / core without whole
    probs = torch.tensor([[0.9, 0.1, 0.1, 0.1, 0.1],  # the background output: not a region
                          [0.2, 0.7, 0.8, 0.9, 0.3],
                          [0.1, 0.4, 0.6, 0.9, 0.7],
                          [0.1, 0.2, 0.3, 0.8, 0.1]]).reshape(4, 5, 1, 1)
    labels, _ = labels_in_input_geometry(probs, MetaTensor(torch.zeros(1, 5, 1, 1)), identity, regions_class_order=[1, 2, 3])
    assert labels[:, 0, 0].tolist() == [0, 1, 2, 3, 2]
    labels, _ = labels_in_input_geometry(probs, MetaTensor(torch.zeros(1, 5, 1, 1)), identity)
    assert labels[:, 0, 0].tolist() == [0, 1, 1, 1, 2]  # without regions: the argmax


@pytest.mark.parametrize("sigmoid", [False, True], ids=["softmax", "regions"])
def test_masked_loss_equals_monai_loss_on_the_valid_voxels(sigmoid):
    """Softmax over one-hot targets and sigmoid over region masks alike: MONAI's losses on the
    valid voxels alone (float64), no gradient into the others."""
    import torch.nn.functional as F
    from monai.losses import DiceCELoss, DiceLoss

    from hsmla_med.engine.segmentation import masked_dice_ce, region_masks

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 4, 6, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    label = torch.randint(0, 4, (1, 1, 6, 5, 4), generator=g)
    valid = torch.rand(1, 1, 6, 5, 4, generator=g) > 0.3
    target = region_masks(label, [[1, 2, 3], [2, 3], [3]]) if sigmoid else torch.nn.functional.one_hot(label[:, 0], 4).movedim(-1, 1)
    target = target.double()
    loss = masked_dice_ce(logits, target, valid, sigmoid=sigmoid)
    loss.backward()
    keep = valid[0, 0]
    x, y = logits.detach()[:, :, keep], target[:, :, keep]
    # regions: Dice + BCE per output (MONAI's DiceCELoss would take a softmax CE of several channels)
    reference = DiceLoss(sigmoid=True)(x, y) + F.binary_cross_entropy_with_logits(x, y) if sigmoid else DiceCELoss(softmax=True)(x, y)
    assert float(loss.detach()) == pytest.approx(float(reference), rel=1e-12)
    assert torch.all(logits.grad[0][:, ~keep] == 0) and torch.any(logits.grad[0][:, keep] != 0)


def test_regions_train_infer_and_score(tmp_path, capsys):
    """A region-based dataset trains 2 steps with one sigmoid output per region (and the
    background's), infer writes label values of regions_class_order, validation scores regions."""
    from hsmla_med.cli import main
    from hsmla_med.pipelines import get_task

    data = nnunet_dataset(tmp_path / "data", channels=1, labels={"background": 0, "object": [1, 2], "disc": 1}, regions_class_order=[2, 1])
    run = tmp_path / "run"
    assert main(["train", "--task", "btcv", "--data-dir", str(data), "--config", str(tiny_yaml(tmp_path / "tiny.yaml")),
                 "--max-steps", "2", "--output", str(run)]) == 0
    module, _ = get_task("btcv").load(run / "last.ckpt")
    assert module.config["regions"] == [[1, 2], [1]] and module(torch.zeros(1, 1, 32, 32)).shape[1] == 3
    out = tmp_path / "pred"
    assert main(["infer", "--task", "btcv", "--checkpoint", str(run / "last.ckpt"), "--input", str(data / "imagesTr"),
                 "--output", str(out), "--save-probabilities"]) == 0
    labels = np.asanyarray(nib.load(str(out / "case0.nii.gz")).dataobj)
    probs = np.load(out / "case0.npz")["probabilities"].astype(np.float32)
    expected = np.where(probs[2] > 0.5, 1, np.where(probs[1] > 0.5, 2, 0))  # disc (written last) over object
    assert np.array_equal(labels, expected)
    # validation and evaluate --predictions score regions: object = labels 1 or 2, by hand
    assert set(json.loads((run / "metrics.json").read_text())["dice_per_class"]) == {"object", "disc"}
    from hsmla_med.evaluation import evaluate_folder

    (out / "case1.nii.gz").unlink(), (out / "case2.nii.gz").unlink()
    summary = evaluate_folder(out, _only(data, tmp_path, "case0"), data / "dataset.json", output=tmp_path / "scores")
    truth = np.asanyarray(nib.load(str(data / "labelsTr" / "case0.nii.gz")).dataobj)
    for key, values in (("1", [1, 2]), ("2", [1])):
        a, b = np.isin(truth, values), np.isin(labels, values)
        dice = 2 * (a & b).sum() / (a.sum() + b.sum()) if a.sum() + b.sum() else None
        assert summary["metric_per_case"][0]["metrics"][key]["Dice"] == pytest.approx(dice)
    # a bundle would read one file per case and take the argmax: refused in one line
    line = cli_error(capsys, ["export", "--checkpoint", str(run / "last.ckpt"), "--format", "bundle", "--output", str(tmp_path / "b")])
    assert "--format bundle: the bundle reads one single-channel file per case and takes the argmax" in line and "predicts regions" in line


def test_cross_validate_a_multichannel_dataset(tmp_path):
    """cross-validate predicts each fold's validation cases from their channel files (a list per
    case: it raised a TypeError before) and pools them under the cases' names."""
    from hsmla_med.cli import main

    data = nnunet_dataset(tmp_path / "data")
    out = tmp_path / "cv"
    assert main(["cross-validate", "--task", "btcv", "--data-dir", str(data), "--config", str(tiny_yaml(tmp_path / "tiny.yaml")),
                 "--max-steps", "1", "--output", str(out)]) == 0
    assert sorted(p.name for p in (out / "crossval" / "predictions").iterdir()) == ["case0.nii.gz", "case1.nii.gz", "case2.nii.gz"]
    assert "foreground_mean" in json.loads((out / "crossval.json").read_text())["pooled"]
