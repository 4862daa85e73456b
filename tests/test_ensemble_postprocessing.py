"""Ensembles (``infer --checkpoint A B``: the float32 mean of the members' class probabilities
before the argmax) and post-processing chosen on validation (nnU-Net's
``determine_postprocessing`` rule: a largest-connected-component step is kept where the
foreground mean Dice rises and no class's mean Dice falls)."""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.transforms import KeepLargestConnectedComponent
from scipy import ndimage

from hsmla_med.config import merge_config, model_config, task_config
from hsmla_med.errors import DataError
from hsmla_med.inference.ensemble import ensemble
from hsmla_med.inference.postprocessing import apply_postprocessing, choose_postprocessing, read_postprocessing
from hsmla_med.pipelines import btcv, camelyon16, endovis
from hsmla_med.pipelines.task import InferenceOptions
from tests.conftest import TINY as BTCV_TINY
from tests.conftest import cli_error, phantom, write_nifti
from tests.test_inference import _oracle_module

LABELS = ["background", "disc", "bar"]
ENDOVIS_TINY = {"data": {"size": [32, 40], "num_workers": 0}}


def _module(task, overrides: dict, labels: list[str], seed: int):
    """An untrained module of ``task`` (tiny b0 network); other seeds, other weights."""
    config = merge_config(task_config(task.name), overrides)
    torch.manual_seed(seed)
    return task.module_class(task.module_config(config, model_config("b0"), labels))


def _checkpoint(path, task, overrides: dict, labels: list[str], seed: int = 0):
    """A checkpoint as ``train`` writes it (what ``Task.load`` reads), without training."""
    module = _module(task, overrides, labels, seed)
    torch.save({"hyper_parameters": module.config, "state_dict": module.state_dict(), "epoch": 0, "global_step": 0}, path)
    return path


# ----------------------------------------------------------------------------- ensembles


@pytest.mark.parametrize("tta", [False, True])
def test_ensemble_of_frame_modules_is_the_float32_mean_of_the_members(tta):
    a, b = (_module(endovis.TASK, ENDOVIS_TINY, endovis.PROBLEMS["parts"], seed).eval() for seed in (0, 1))
    both = ensemble([a, b])
    inference = InferenceOptions(tta=tta).apply(a.config["inference"])
    image = torch.rand(3, 32, 40, generator=torch.Generator().manual_seed(0))
    for module in (both, a, b):
        module.run_inference = inference  # the run's settings, as predict_cases hands them over
    with torch.no_grad():
        got = both.predict_step({"image": image})["probs"]
        pa, pb = (m.predict_step({"image": image})["probs"] for m in (a, b))
        assert not torch.allclose(pa, pb, atol=1e-3)  # the members differ: a mean that is one of them fails
        mean = (pa + pb) / 2
        torch.testing.assert_close(got, mean, rtol=0, atol=1e-7)
        assert got.dtype == torch.float32 and torch.equal(got.argmax(0), mean.argmax(0))
        # validation's path (evaluate): the same mean of each member's probabilities
        batch = image[None]
        torch.testing.assert_close(both.predict_probabilities(batch), (a.predict_probabilities(batch) + b.predict_probabilities(batch)) / 2,
                                   rtol=0, atol=1e-7)


def test_ensemble_of_patch_classifiers_averages_the_tumour_probability():
    a, b = (_module(camelyon16.TASK, {}, ["normal", "tumour"], seed).eval() for seed in (0, 1))
    size = a.config["data"]["patch_size"]
    batch = {"image": torch.randint(0, 256, (2, 3, size, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)),
             "slide_index": torch.tensor([0, 0]), "row": torch.tensor([0, 1]), "col": torch.tensor([3, 4])}
    with torch.no_grad():
        got = ensemble([a, b]).predict_step(dict(batch))
        pa, pb = (m.predict_step(dict(batch))["prob"] for m in (a, b))
    assert not torch.allclose(pa, pb, atol=1e-4)
    torch.testing.assert_close(got["prob"], (pa + pb) / 2, rtol=0, atol=1e-7)
    assert torch.equal(got["row"], torch.tensor([0, 1])) and torch.equal(got["col"], torch.tensor([3, 4]))


def test_an_ensemble_of_folds_has_trained_on_every_members_cases():
    """evaluate refuses cases a checkpoint trained on (its ``split``): an ensemble's are all its
    members' training cases, so no case of fold 0's validation is unseen by folds 0 and 1."""
    splits = [{"file": "splits_final.json", "fold": 0, "folds": 3, "train": ["c", "d", "e", "f"], "val": ["a", "b"]},
              {"file": "splits_final.json", "fold": 1, "folds": 3, "train": ["a", "b", "e", "f"], "val": ["c", "d"]}]
    config = _module(endovis.TASK, ENDOVIS_TINY, endovis.PROBLEMS["binary"], 0).config
    members = [endovis.TASK.module_class({**config, "split": split}) for split in splits]
    both = ensemble(members)
    assert both.config["split"] == {**splits[0], "train": ["a", "b", "c", "d", "e", "f"], "val": []}
    assert members[0].config["split"] == splits[0]  # the members keep their own
    assert "split" not in ensemble([members[0], endovis.TASK.module_class(config)]).config  # unknown for one: unknown


@pytest.fixture(scope="module")
def volumes(tmp_path_factory):
    """Two BTCV checkpoints (other weights) and a folder of two small volumes."""
    root = tmp_path_factory.mktemp("ens")
    rng = np.random.default_rng(0)
    for i in range(2):
        image, _ = phantom((40, 36, 6), rng)
        write_nifti(root / "in" / f"case{i}.nii.gz", image, np.diag([1.5, 1.5, 2.0, 1.0]))
    ckpts = [_checkpoint(root / f"{n}.ckpt", btcv.TASK, BTCV_TINY, LABELS, seed) for n, seed in (("a", 0), ("b", 1))]
    return ckpts, root / "in"


def _infer(checkpoints, inputs, out, *extra):
    from hsmla_med.cli import main

    return main(["infer", "--task", "btcv", "--checkpoint", *map(str, checkpoints), "--input", str(inputs), "--output", str(out),
                 "--device", "cpu", *extra])


def test_btcv_ensemble_writes_the_mean_probabilities_in_the_input_grid(volumes, tmp_path):
    (a, b), inputs = volumes
    for name, ckpts in (("a", [a]), ("b", [b]), ("ab", [a, b])):
        assert _infer(ckpts, inputs, tmp_path / name, "--save-probabilities") == 0
    for case in ("case0", "case1"):
        pa, pb, pab = (np.load(tmp_path / n / f"{case}.npz")["probabilities"].astype(np.float32) for n in ("a", "b", "ab"))
        assert pab.shape == (3, 40, 36, 6) and np.abs(pa - pb).max() > 1e-2
        # the inverse to the input's grid is linear, so it maps the mean to the mean (float16 files)
        np.testing.assert_allclose(pab, (pa + pb) / 2, atol=2e-3)
        labels = np.asanyarray(nib.load(str(tmp_path / "ab" / f"{case}.nii.gz")).dataobj)
        np.testing.assert_array_equal(labels, pab.argmax(0))
    record = json.loads((tmp_path / "ab" / "provenance.json").read_text())["model"]
    assert record["checkpoint"] == [str(a), str(b)]
    assert [m["checkpoint"] for m in record["members"]] == [str(a), str(b)]
    singles = [json.loads((tmp_path / n / "provenance.json").read_text())["model"]["sha256"] for n in ("a", "b")]
    assert [m["sha256"] for m in record["members"]] == singles and record["sha256"] not in singles


@pytest.mark.parametrize("what", ["label_names", "spatial_dims"])
def test_checkpoints_that_do_not_ensemble_are_refused(volumes, tmp_path, capsys, what):
    (a, _), inputs = volumes
    if what == "label_names":
        other = _checkpoint(tmp_path / "other.ckpt", btcv.TASK, BTCV_TINY, ["background", "spleen"])
    else:
        other = _checkpoint(tmp_path / "other.ckpt", btcv.TASK, {**BTCV_TINY, "mode": "3d"}, LABELS)
    line = cli_error(capsys, ["infer", "--task", "btcv", "--checkpoint", str(a), str(other), "--input", str(inputs),
                              "--output", str(tmp_path / "out"), "--device", "cpu"])
    assert str(a) in line and str(other) in line and what in line
    assert not (tmp_path / "out" / "case0.nii.gz").exists()


# ------------------------------------------------------------------------ post-processing


def _cube(shape, *slices) -> np.ndarray:
    mask = np.zeros(shape, bool)
    mask[slices] = True
    return mask


def _write_cases(tmp_path, cases: dict[str, tuple[np.ndarray, np.ndarray]]):
    for name, (reference, prediction) in cases.items():
        write_nifti(tmp_path / "labels" / f"{name}.nii.gz", reference.astype(np.uint8), np.eye(4))
        write_nifti(tmp_path / "pred" / f"{name}.nii.gz", prediction.astype(np.uint8), np.eye(4))
    return tmp_path / "pred", tmp_path / "labels"


def test_a_spurious_blob_is_removed_when_dice_rises(tmp_path):
    shape = (16, 16, 16)
    organ = _cube(shape, slice(2, 5), slice(2, 5), slice(2, 5))  # 27 voxels
    blob = _cube(shape, slice(10, 12), slice(10, 12), slice(10, 12))  # 8 voxels, apart from the organ
    other = _cube(shape, slice(3, 7), slice(3, 7), slice(8, 10))  # 32 voxels, predicted exactly
    pred, labels = _write_cases(tmp_path, {"c0": (organ, organ | blob), "c1": (other, other)})
    out = tmp_path / "pp" / "postprocessing.json"
    doc = choose_postprocessing(pred, labels, out)
    before = (2 * 27 / (2 * 27 + 8) + 1.0) / 2  # nnU-Net's Dice 2TP / (2TP + FP + FN), mean over the cases
    [step] = doc["tried"]  # one foreground class: no per-class steps (nnU-Net's rule)
    assert step["labels"] == [1] and step["kept"]
    assert step["dice_before"]["foreground_mean"] == pytest.approx(before) and step["dice_after"]["foreground_mean"] == pytest.approx(1.0)
    assert doc["kept"] == [{"labels": [1]}] and doc["dice"]["after"]["foreground_mean"] == pytest.approx(1.0)
    assert json.loads(out.read_text()) == doc and read_postprocessing(out) == [{"labels": [1]}]


def test_a_true_second_component_is_kept(tmp_path):
    shape = (16, 16, 8)
    kidneys = _cube(shape, slice(1, 5), slice(1, 5), slice(1, 4)) | _cube(shape, slice(10, 13), slice(10, 13), slice(1, 4))
    pred, labels = _write_cases(tmp_path, {"c0": (kidneys, kidneys)})
    doc = choose_postprocessing(pred, labels, tmp_path / "postprocessing.json")
    [step] = doc["tried"]
    assert not step["kept"] and step["dice_after"]["foreground_mean"] == pytest.approx(2 * 48 / (2 * 48 + 27)) and doc["kept"] == []
    assert doc["dice"]["after"]["foreground_mean"] == pytest.approx(1.0)


def test_a_step_that_lowers_one_class_is_rejected_although_the_foreground_mean_rises(tmp_path):
    """Class 2 touches class 1 (one joint component) and has a small true second component;
    class 1 has a spurious blob. The joint step removes both: class 1 rises more than class 2
    falls, and it is rejected all the same; per class, only class 1's step is kept."""
    shape = (16, 16, 8)
    one = _cube(shape, slice(1, 6), slice(1, 6), slice(1, 6))  # 125 voxels
    two = _cube(shape, slice(6, 9), slice(1, 6), slice(1, 6)) | _cube(shape, slice(12, 14), slice(12, 13), slice(6, 7))  # 75 + 2
    spurious = _cube(shape, slice(12, 15), slice(1, 4), slice(1, 4))  # 27, class 1
    reference = one * 1 + two * 2
    pred, labels = _write_cases(tmp_path, {"c0": (reference, reference + spurious * 1)})
    (tmp_path / "dataset.json").write_text(json.dumps({"labels": {"0": "background", "1": "liver", "2": "spleen"}}))
    doc = choose_postprocessing(pred, labels, tmp_path / "postprocessing.json", tmp_path / "dataset.json")
    joint, first, second = doc["tried"]
    dice1, dice2 = 2 * 125 / (2 * 125 + 27), 2 * 75 / (2 * 75 + 2)
    assert joint["labels"] == [1, 2] and joint["dice_before"]["mean"] == pytest.approx({"1": dice1, "2": 1.0})
    assert joint["dice_after"]["mean"] == pytest.approx({"1": 1.0, "2": dice2})
    assert joint["dice_after"]["foreground_mean"] > joint["dice_before"]["foreground_mean"] and not joint["kept"]
    assert first["labels"] == [1] and first["kept"] and second["labels"] == [2] and not second["kept"]
    assert doc["kept"] == [{"labels": [1]}] and doc["classes"] == {"1": "liver", "2": "spleen"}
    assert doc["dice"]["after"]["mean"] == pytest.approx({"1": 1.0, "2": 1.0})


def _largest_by_hand(label_map: np.ndarray, labels: list[int]) -> np.ndarray:
    """scipy's 26-connected components of the classes together; all but the largest to 0."""
    mask = np.isin(label_map, labels)
    parts, n = ndimage.label(mask, structure=np.ones((3, 3, 3)))
    sizes = np.bincount(parts.ravel())[1:]
    out = label_map.copy()
    out[mask & (parts != 1 + int(np.argmax(sizes)))] = 0
    return out


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.uint16, np.uint32, np.int64])  # NIfTI label maps of other tools
def test_apply_keeps_the_largest_component_of_the_chosen_classes(dtype):
    shape = (20, 20, 10)
    big = _cube(shape, slice(1, 4), slice(1, 4), slice(1, 4))  # class 1, 27
    small = _cube(shape, slice(8, 10), slice(1, 3), slice(1, 3))  # class 1, 8
    touching = _cube(shape, slice(10, 13), slice(1, 3), slice(1, 3))  # class 2, 12, touches `small`: 20 together
    three_a, three_b = _cube(shape, slice(15, 17), slice(15, 17), slice(1, 2)), _cube(shape, slice(15, 18), slice(10, 12), slice(5, 6))  # 4, 6
    label_map = (big | small) * 1 + touching * 2 + (three_a | three_b) * 3
    spec = {"kept": [{"labels": [1, 2]}, {"labels": [3]}]}
    got = apply_postprocessing(label_map.astype(dtype), spec)
    expected = big * 1 + three_b * 3  # hand-made: the 20-voxel joint component and the 4-voxel class 3 go
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got, _largest_by_hand(_largest_by_hand(label_map, [1, 2]), [3]))
    monai = KeepLargestConnectedComponent(applied_labels=[3])(KeepLargestConnectedComponent(applied_labels=[1, 2], independent=False)(label_map[None]))[0]
    np.testing.assert_array_equal(got, np.asarray(monai))
    np.testing.assert_array_equal(apply_postprocessing(label_map, None), label_map)


def test_infer_applies_the_postprocessing_to_the_label_maps(tmp_path):
    # the oracle labels bright voxels: two bright boxes, the smaller one goes with LCC
    shape = (40, 36, 7)
    large, small = _cube(shape, slice(5, 20), slice(5, 20), slice(1, 6)), _cube(shape, slice(28, 33), slice(26, 31), slice(1, 6))
    image = np.where(large | small, 200.0, -100.0).astype(np.float32)
    src = write_nifti(tmp_path / "case.nii.gz", image, np.diag([1.5, 1.5, 2.0, 1.0]))
    module = _oracle_module(tmp_path)
    [plain] = btcv.infer(module, src, tmp_path / "plain", InferenceOptions(progress=lambda _: None))
    [post] = btcv.infer(module, src, tmp_path / "post", InferenceOptions(progress=lambda _: None, postprocessing=[{"labels": [1]}]))
    plain, post = (np.asanyarray(nib.load(str(p)).dataobj) for p in (plain, post))
    assert (plain[small] == 1).mean() > 0.9 and (post[small] == 0).all()
    np.testing.assert_array_equal(post, apply_postprocessing(plain, [{"labels": [1]}]))
    assert json.loads((tmp_path / "post" / "provenance.json").read_text())["options"]["postprocessing"] == [{"labels": [1]}]


def test_infer_reads_postprocessing_json_beside_the_checkpoints(volumes, tmp_path, capsys):
    """cross-validate's layout: OUTPUT/fold_K/last.ckpt and OUTPUT/postprocessing.json, found for
    the ensemble of the folds and for one fold alone; ``--postprocessing none`` turns it off."""
    (a, b), inputs = volumes
    root = tmp_path / "cv"
    folds = [root / f"fold_{k}" / "last.ckpt" for k in (0, 1)]
    for fold, ckpt in zip(folds, (a, b), strict=True):
        fold.parent.mkdir(parents=True)
        fold.write_bytes(ckpt.read_bytes())
    steps = [{"labels": [1, 2]}, {"labels": [2]}]
    (root / "postprocessing.json").write_text(json.dumps({"format": 1, "kept": steps}))
    options = lambda out: json.loads((tmp_path / out / "provenance.json").read_text())["options"]  # noqa: E731
    assert _infer(folds, inputs, tmp_path / "found") == 0
    assert f"post-processing ({root / 'postprocessing.json'})" in capsys.readouterr().out
    assert options("found")["postprocessing"] == steps
    assert _infer(folds[:1], inputs, tmp_path / "one") == 0 and options("one")["postprocessing"] == steps
    assert _infer(folds, inputs, tmp_path / "none", "--postprocessing", "none") == 0 and options("none")["postprocessing"] is None
    assert _infer([a], inputs, tmp_path / "elsewhere") == 0 and options("elsewhere")["postprocessing"] is None
    for case in ("case0", "case1"):
        found, none = (np.asanyarray(nib.load(str(tmp_path / d / f"{case}.nii.gz")).dataobj) for d in ("found", "none"))
        np.testing.assert_array_equal(found, apply_postprocessing(none, steps))
    (root / "postprocessing.json").write_text(json.dumps({"format": 1, "kept": [{"labels": ["liver"]}]}))
    line = cli_error(capsys, ["infer", "--task", "btcv", "--checkpoint", *map(str, folds), "--input", str(inputs), "--output", str(tmp_path / "bad")])
    assert str(root / "postprocessing.json") in line and "labels" in line
    line = cli_error(capsys, ["infer", "--task", "endovis", "--checkpoint", str(a), "--input", str(inputs), "--output", str(tmp_path / "bad"),
                              "--postprocessing", str(root / "postprocessing.json")])
    assert "--postprocessing" in line and "endovis" in line


def test_read_postprocessing_refuses_other_files(tmp_path):
    path = tmp_path / "postprocessing.json"
    path.write_text("[1, 2]")
    with pytest.raises(DataError, match="not a postprocessing.json"):
        read_postprocessing(path)
