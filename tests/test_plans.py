"""Dataset fingerprints and plans: the fingerprint against NumPy on the files, the
plan's rules on hand-made fingerprints (CT, MRI, anisotropic, multi-channel), and a config's own
values kept over the plan."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from hsmla_med.config import merge_config, task_config, validate_config
from hsmla_med.data.datalist import load_datalist
from hsmla_med.data.fingerprint import FINGERPRINT_FILE, compute_fingerprint
from hsmla_med.engine.checkpoint import read_hparams
from hsmla_med.data.plans import PATCH_BUDGET, apply_plan, make_plan, plan_dataset
from hsmla_med.errors import ConfigError
from hsmla_med.pipelines import btcv
from tests.conftest import LABELS, make_dataset, write_nifti

NAMES = [LABELS[str(i)] for i in range(len(LABELS))]


def _dataset(root: Path, modality: dict | None = None) -> Path:
    """Three cases of different spacings and orientations; the third has zero-valued margins
    (a crop to the non-zero region) and is stored LPS."""
    affines = [np.diag([1.5, 1.5, 2.0, 1.0]), np.diag([0.9, 1.1, 3.0, 1.0]), np.diag([-1.2, -1.2, 2.5, 1.0])]
    make_dataset(root, cases=3, shape=(20, 18, 6), affines=affines)
    image = root / "imagesTr" / "img0002.nii.gz"
    data = np.asarray(nib.load(str(image)).dataobj).copy()
    data[:3], data[:, -2:], data[..., :1] = 0, 0, 0
    label = np.asarray(nib.load(str(root / "labelsTr" / "label0002.nii.gz")).dataobj).copy()
    label[data == 0] = 0
    write_nifti(image, data, affines[2])
    write_nifti(root / "labelsTr" / "label0002.nii.gz", label, affines[2])
    if modality is not None:
        meta = json.loads((root / "dataset.json").read_text())
        (root / "dataset.json").write_text(json.dumps({**meta, **modality}))
    return root


def _reference(root: Path) -> dict:
    """The fingerprint by hand: nibabel's voxel sizes in RAS order, the non-zero bounding box,
    every labelled voxel's intensity."""
    cases = load_datalist(root)
    spacings, shapes, values = [], [], []
    for case in cases.training + cases.validation:
        img = nib.as_closest_canonical(nib.load(case["image"]))  # RAS
        lab = np.asarray(nib.as_closest_canonical(nib.load(case["label"])).dataobj)
        data = np.asarray(img.dataobj, dtype=np.float64)
        spacings.append(list(img.header.get_zooms()[:3]))
        nz = np.argwhere(data != 0)
        shapes.append(list(nz.max(0) - nz.min(0) + 1))
        values.append(data[lab > 0])
    pooled = np.concatenate(values)
    return {"spacings": spacings, "shapes": shapes, "values": pooled}


def test_fingerprint_equals_numpy_on_the_files(tmp_path):
    root = _dataset(tmp_path / "d")
    cases = load_datalist(root)
    fp = compute_fingerprint(cases, root)
    ref = _reference(root)
    np.testing.assert_allclose(fp["spacings"], ref["spacings"], rtol=1e-6)
    assert fp["shapes_after_crop"] == ref["shapes"]
    third = next(i for i, c in enumerate(cases.training + cases.validation) if c["image"].endswith("img0002.nii.gz"))
    assert fp["shapes_after_crop"][third] == [17, 16, 5]  # the third case's zero margins cropped away
    props = fp["foreground_intensity_properties_per_channel"]["0"]
    v = ref["values"]
    expected = {"mean": v.mean(), "std": v.std(), "min": v.min(), "max": v.max(), "median": np.median(v),
                "percentile_00_5": np.percentile(v, 0.5), "percentile_99_5": np.percentile(v, 99.5)}
    for key, value in expected.items():
        assert props[key] == pytest.approx(value, rel=1e-9), key
    assert fp["median_relative_size_after_cropping"] == pytest.approx(np.median([1.0, 1.0, 17 * 16 * 5 / (20 * 18 * 6)]))


def _fingerprint(spacings, shapes, mean=50.0, std=20.0, low=-10.0, high=120.0, channels=1) -> dict:
    props = {"mean": mean, "std": std, "percentile_00_5": low, "percentile_99_5": high, "min": low - 5, "max": high + 5, "median": mean}
    return {"spacings": spacings, "shapes_after_crop": shapes,
            "foreground_intensity_properties_per_channel": {str(c): props for c in range(channels)}}


def test_ct_plan_normalises_with_the_foreground_percentiles_and_moments():
    plan = make_plan(_fingerprint([[0.8, 0.8, 2.0], [0.7, 0.7, 2.2], [0.9, 0.9, 1.8]], [[400, 380, 90]] * 3), {"0": "CT"}, 4, 10)
    assert plan["values"]["data.spacing"] == [0.8, 0.8, 2.0]  # the median per axis; 2.0 < 3 x 0.8: not anisotropic
    assert plan["median_shape"] == [400.0, 380.0, 90.0]  # per case at the target spacing, then the median
    assert plan["values"]["data.intensity"] == {"kind": "ct_zscore", "a_min": -10.0, "a_max": 120.0, "mean": 50.0, "std": 20.0}
    assert plan["values"]["mode"] == "2d"  # a CPU
    # median shape 400 x 380 -> ceil to 32s 416 x 384 -> within the CPU's 96^2: shrink the longest side by 32s
    roi = plan["values"]["data.roi_size_2d"]
    assert all(r % 32 == 0 for r in roi) and np.prod(roi) <= PATCH_BUDGET["cpu", 2] and roi == [96, 96]
    assert plan["values"]["data.batch_size"] == 2  # 8 crops of 96^2 per step / 4 crops per case
    assert plan["values"]["norm"] == "batch" and "HU" in plan["reasons"]["norm"]


def test_mri_and_unnamed_modality_are_z_scored_per_case():
    fp = _fingerprint([[1.0, 1.0, 1.0]] * 3, [[140, 170, 150]] * 3)
    for channels in ({"0": "T1"}, {}, {"0": "CT", "1": "PET"}):
        plan = make_plan(fp, channels, 4, 10)
        assert plan["values"]["data.intensity"] == {"kind": "zscore_foreground"}
        assert plan["values"]["norm"] == "instance" and "bias field" in plan["reasons"]["norm"]
    assert make_plan(fp, {"0": "CT", "1": "CT"}, 4, 10)["values"]["norm"] == "batch"  # two CT channels: HU both
    plan = make_plan(fp, {"0": "MRI"}, 4, 10)
    # 160 x 192 (the median slice in 32s) shrinks, longest side first, to the CPU's 96^2: 96 x 96
    assert plan["values"]["data.roi_size_2d"] == [96, 96]
    assert plan["values"]["data.batch_size"] == 2
    # 3D: 160 x 192 x 160 shrinks to 64^3 at most: 64 x 64 x 64 (each side in turn down to 64)
    assert plan["values"]["data.roi_size_3d"] == [64, 64, 64]
    gpu = make_plan(fp, {"0": "MRI"}, 4, 10, device="gpu", device_memory=24 * 2**30)
    assert gpu["values"]["data.roi_size_2d"] == [160, 192]  # the GPU's 512^2 holds one median slice
    assert gpu["values"]["mode"] == "3d" and np.prod(gpu["values"]["data.roi_size_3d"]) <= 128**3
    assert gpu["values"]["norm"] == "batch" and "3D" in gpu["reasons"]["norm"]  # instance norm lost 3D Dice on MRI
    assert make_plan(fp, {"0": "MRI"}, 4, 10, mode="3d")["values"]["norm"] == "batch"  # the mode a config sets
    assert gpu["values"]["data.batch_size"] == 1  # 2 crops of 128^3 per step, 4 crops per case: one case


def test_the_batch_is_planned_for_the_mode_the_config_sets():
    """``mode: 3d`` set on a CPU (planned 2d): the batch is sized for the 3D patches, 2 per step."""
    fp = _fingerprint([[1.0, 1.0, 1.0]] * 6, [[139, 164, 24]] * 6)
    planned = make_plan(fp, {"0": "T1"}, 2, 5)
    assert planned["values"]["mode"] == "2d" and planned["values"]["data.batch_size"] == 4  # 8 crops of 96^2, 2 per case
    set_3d = make_plan(fp, {"0": "T1"}, 2, 5, mode="3d")
    assert set_3d["values"]["data.roi_size_3d"] == [64, 96, 32] and set_3d["values"]["data.batch_size"] == 1
    assert "3D crops" in set_3d["reasons"]["data.batch_size"]


def test_cpu_plan_bounds_the_pixels_of_a_step_whatever_the_case_size():
    """The CPU's step is a time budget: larger cases get crops of the same budget, not longer steps."""
    for side in (100, 300, 600):
        plan = make_plan(_fingerprint([[1.0, 1.0, 1.0]] * 3, [[side, side, 40]] * 3), {"0": "T2"}, 4, 10)
        crops = plan["values"]["data.batch_size"] * 4
        assert crops * np.prod(plan["values"]["data.roi_size_2d"]) <= 8 * 96 * 96


def test_anisotropic_spacing_takes_the_tenth_percentile_of_the_coarse_axis_and_trains_2d():
    """nnU-Net's rule by hand: z median 5 mm > 3 x 0.8 mm, and z's median size (40 x 5 / 5 = 40)
    x 3 < 512: z's spacing is the 10th percentile of the z spacings."""
    z = [5.0, 5.0, 5.0, 1.5, 6.0]
    fp = _fingerprint([[0.8, 0.8, s] for s in z], [[512, 512, 40]] * 5)
    plan = make_plan(fp, {"0": "CT"}, 4, 10, device="gpu", device_memory=80 * 2**30)
    assert plan["values"]["data.spacing"][2] == pytest.approx(np.percentile(z, 10))
    assert plan["values"]["mode"] == "2d" and "anisotropic" in plan["reasons"]["mode"]
    iso = make_plan(_fingerprint([[1.0, 1.0, 1.2]] * 3, [[200, 200, 180]] * 3), {"0": "CT"}, 2, 10, device="gpu", device_memory=80 * 2**30)
    assert iso["values"]["mode"] == "3d"
    assert np.prod(iso["values"]["data.roi_size_3d"]) <= PATCH_BUDGET["gpu", 3]


def test_config_values_are_kept_and_only_auto_is_planned():
    config = merge_config(task_config("btcv"), {"data": {"spacing": [1.0, 1.0, 1.0], "batch_size": 3}})
    plan = make_plan(_fingerprint([[0.8, 0.8, 2.5]] * 3, [[400, 380, 90]] * 3), {"0": "CT"}, 4, 10)
    kept = apply_plan(config, plan)
    assert kept == ["data.spacing", "data.batch_size"]
    assert config["data"]["spacing"] == [1.0, 1.0, 1.0] and config["data"]["batch_size"] == 3
    assert config["data"]["intensity"]["kind"] == "ct_zscore" and config["mode"] == "2d"
    validate_config(config)  # the planned config is a valid config


@pytest.mark.parametrize("key, value", [("spacing", [1.0, 1.0]), ("roi_size_2d", "big"), ("batch_size", 0), ("spacing", [1.0, -1.0, 1.0])])
def test_planned_keys_take_auto_or_a_valid_value(key, value):
    validate_config(merge_config(task_config("btcv"), {}))  # the packaged auto values
    with pytest.raises(ConfigError, match=rf"user.yaml: data.{key}"):
        validate_config(merge_config(task_config("btcv"), {"data": {key: value}}), "user.yaml")


def test_ct_zscore_normalisation_is_clip_then_z_score():
    data = {"spacing": [1.5, 1.5, 2.0], "intensity": {"kind": "ct_zscore", "a_min": -100.0, "a_max": 300.0, "mean": 80.0, "std": 40.0}}
    _, items = btcv.preprocessing_items(data)
    from monai.bundle import ConfigParser

    normalise = ConfigParser({"n": items[3]}).get_parsed_content("n")
    image = torch.linspace(-1000, 1000, 41).reshape(1, 41, 1, 1)
    expected = (image.clamp(-100, 300) - 80) / 40
    torch.testing.assert_close(normalise({"image": image})["image"].as_tensor(), expected, rtol=1e-5, atol=1e-5)


def test_plan_dataset_measures_once_and_again_when_the_dataset_changes(tmp_path, monkeypatch):
    root = _dataset(tmp_path / "d", {"channel_names": {"0": "CT"}})
    config = merge_config(task_config("btcv"), {"data": {"data_dir": str(root)}, "output": str(tmp_path / "run")})
    cases = load_datalist(root)
    plan = plan_dataset(config, cases, 2)
    assert (root / FINGERPRINT_FILE).is_file() and plan["fingerprint"] == str(root / FINGERPRINT_FILE)
    assert config["data"]["intensity"]["kind"] == "ct_zscore" and config["data"]["spacing"] == plan["values"]["data.spacing"]
    calls = []
    import hsmla_med.data.plans as plans

    monkeypatch.setattr(plans, "compute_fingerprint", lambda *a, **k: calls.append(1) or compute_fingerprint(*a, **k))
    plan_dataset(merge_config(task_config("btcv"), {"output": str(tmp_path / "run")}), cases, 2)
    assert calls == []  # the file is reused
    meta = json.loads((root / "dataset.json").read_text())
    meta["validation"] = meta["validation"] + meta["training"][:1]
    meta["training"] = meta["training"][1:]
    (root / "dataset.json").write_text(json.dumps(meta))
    plan_dataset(merge_config(task_config("btcv"), {"output": str(tmp_path / "run")}), load_datalist(root), 1)
    assert calls == [1]  # another dataset JSON: measured again
    # a config that plans nothing takes no fingerprint
    fixed = {"mode": "2d", "norm": "batch", "data": {"spacing": [1.0, 1.0, 1.0], "intensity": {"kind": "ct_window"}, "roi_size_2d": [32, 32],
                                    "roi_size_3d": [32, 32, 16], "batch_size": 2}}
    assert plan_dataset(merge_config(task_config("btcv"), fixed), cases, 2) is None


def test_train_prints_the_plan_and_stores_it_in_plans_json_and_the_checkpoint(tmp_path, caplog):
    from hsmla_med.cli import main

    root = _dataset(tmp_path / "d", {"modality": {"0": "CT"}})
    caplog.set_level("INFO", logger="hsmla_med")
    assert main(["train", "--task", "btcv", "--data-dir", str(root), "--max-steps", "1", "--output", str(tmp_path / "run")]) == 0
    block = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("plan ("))
    assert "data.intensity    kind ct_zscore" in block and "nnU-Net's CT normalisation" in block
    plan = json.loads((tmp_path / "run" / "plans.json").read_text())
    stored = read_hparams(tmp_path / "run" / "last.ckpt")  # weights_only=True
    assert stored["plan"]["values"] == plan["values"]
    assert stored["data"]["spacing"] == plan["values"]["data.spacing"] and stored["data"]["intensity"]["kind"] == "ct_zscore"
    assert plan["values"]["norm"] == "batch" and stored["network"]["norm"] == "batch"  # the checkpoint records the norm built


def test_the_planned_norm_builds_the_network_and_a_model_that_names_one_keeps_it(tmp_path):
    """MRI: the plan's instance norm reaches the network and the checkpoint's record of it; a
    model mapping's own norm, a norm set in the config and a MONAI network are kept."""
    from hsmla_med.nn.blocks import InstanceNorm

    root = _dataset(tmp_path / "d", {"channel_names": {"0": "T2"}})
    cases = load_datalist(root)
    config = merge_config(task_config("btcv"), {"data": {"data_dir": str(root)}, "output": str(tmp_path / "run")})
    plan = plan_dataset(config, cases, 2)
    assert plan["values"]["norm"] == "instance" and config["norm"] == "instance"
    hp = btcv.module_config(config, {"variant": "b0", "decoder": "unet"}, NAMES)
    assert hp["network"]["norm"] == "instance"
    from hsmla_med.engine.segmentation import SegmentationModule

    assert any(isinstance(m, InstanceNorm) for m in SegmentationModule(hp).network.modules())
    assert btcv.module_config(config, {"variant": "b0", "norm": "batch"}, NAMES)["network"]["norm"] == "batch"
    unet = {"monai": "UNet", "args": {"channels": [8, 16], "strides": [2]}}
    assert btcv.module_config(config, unet, NAMES)["network"] == unet
    kept = merge_config(task_config("btcv"), {"norm": "batch", "data": {"data_dir": str(root)}, "output": str(tmp_path / "run")})
    assert "norm" in plan_dataset(kept, cases, 2)["kept"] and kept["norm"] == "batch"
    with pytest.raises(ConfigError, match="user.yaml: norm must be one of batch, instance, auto"):
        validate_config(merge_config(task_config("btcv"), {"norm": "group"}), "user.yaml")


def test_the_learning_benchmarks_planned_arm_leaves_every_planned_value_to_the_plan():
    from hsmla_med.bench.learning import ARMS_3D, NETWORKS, PLANNED_ARMS, arm, overlay
    from hsmla_med.data.plans import PLANNED, _get, _is_auto

    for name in PLANNED_ARMS:
        config = validate_config(merge_config(task_config("btcv"), overlay(NETWORKS[name], 96, 8, arm(name))))
        assert all(_is_auto(_get(config, key)) for key in PLANNED)
    for name in ARMS_3D:  # 3D: the plan's spacing, intensity and patch; the mode and 2 crops per case set
        config = validate_config(merge_config(task_config("btcv"), overlay(NETWORKS[name], 96, 8, arm(name))))
        assert config["mode"] == "3d" and config["data"]["samples_per_case"] == 2
        assert all(_is_auto(_get(config, key)) for key in ("data.spacing", "data.intensity", "data.roi_size_3d"))
    hand = merge_config(task_config("btcv"), overlay(NETWORKS["hsmla-b0-unet"], 96, 8))
    assert not any(_is_auto(_get(hand, key)) for key in ("data.spacing", "data.intensity", "mode", "data.roi_size_2d", "data.batch_size"))
