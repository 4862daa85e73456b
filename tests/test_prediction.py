"""Prediction through Lightning's predict loop: shards, resume, two-process DDP on CPU (gloo),
bounded-memory inversion of volume predictions, LUNA16's per-scan files and their merge."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.data import MetaTensor
from monai.transforms import Compose, Invertd

from hsmla_med.cli import main
from hsmla_med.config import task_config
from hsmla_med.engine.prediction import Shard
from hsmla_med.errors import InputError
from hsmla_med.pipelines import btcv
from tests.conftest import make_dataset, tiny_yaml

ROOT = Path(__file__).resolve().parents[1]
# two affines: RAS at 1.5 x 1.5 x 2 mm and LPS at 1 x 1.2 x 3 mm, so the inversion reorients and resamples
AFFINES = [np.diag([1.5, 1.5, 2.0, 1.0]), np.diag([-1.0, -1.2, 3.0, 1.0])]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny BTCV checkpoint and eight volumes to predict (the dataset's images)."""
    root = tmp_path_factory.mktemp("pred")
    data = make_dataset(root / "data", cases=8, shape=(36, 32, 5), affines=AFFINES, validation=2)
    config = tiny_yaml(root / "tiny.yaml")
    assert main(["train", "--task", "btcv", "--data-dir", str(data), "--config", str(config), "--max-steps", "2", "--output", str(root / "run")]) == 0
    return root / "run" / "last.ckpt", data / "imagesTr"


def _infer(ckpt, inputs, out, *extra, subprocess_env=None) -> str:
    argv = ["infer", "--task", "btcv", "--checkpoint", str(ckpt), "--input", str(inputs), "--output", str(out), "--device", "cpu", *extra]
    if subprocess_env is None:
        assert main(argv) == 0
        return ""
    result = subprocess.run([sys.executable, "-m", "hsmla_med.cli", *argv], cwd=ROOT, capture_output=True, text=True, env=subprocess_env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


def _labels(folder: Path) -> dict[str, np.ndarray]:
    return {p.name: np.asarray(nib.load(str(p)).dataobj) for p in sorted(folder.glob("*.nii.gz"))}


@pytest.mark.parametrize("text, expected", [("0/1", (0, 1)), ("2/3", (2, 3)), (None, (0, 1))])
def test_shard_parse(text, expected):
    shard = Shard.parse(text)
    assert (shard.index, shard.count) == expected


@pytest.mark.parametrize("text", ["3/3", "-1/2", "1", "a/b", "1/0"])
def test_shard_parse_refuses(text):
    with pytest.raises(InputError, match="--shard"):
        Shard.parse(text)


def test_shards_cover_every_case_exactly_once():
    items = [{"name": f"case{i:03d}"} for i in np.random.default_rng(0).permutation(23)]
    shards = [Shard(i, 4).select(items) for i in range(4)]
    names = [item["name"] for shard in shards for item in shard]
    assert sorted(names) == sorted(item["name"] for item in items) and len(names) == len(set(names))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    with pytest.raises(InputError, match="same output 'a'"):
        Shard().select([{"name": "a"}, {"name": "a"}])


def test_labels_one_class_at_a_time_equal_the_argmax_of_every_class(tmp_path):
    """The bounded-memory inversion against MONAI's ``Invertd`` of all classes at once, then the
    argmax, on an LPS volume with anisotropic voxels (reorientation and resampling both
    inverted). The resampling differs by float rounding, so labels may differ only where the
    two best classes are within that rounding of each other."""
    data = make_dataset(tmp_path / "data", cases=1, shape=(30, 27, 7), affines=[np.diag([-1.0, -1.2, 3.0, 1.0])])
    pre = Compose(btcv.preprocessing({**task_config("btcv")["data"], "spacing": [1.5, 1.5, 2.0], "intensity": {"kind": "ct_window", "a_min": -175.0, "a_max": 250.0}}, 1, 3, keys=("image",)))
    invert = Invertd("pred", transform=pre, orig_keys="image", nearest_interp=False, to_tensor=True)
    case = pre({"image": str(data / "imagesTr" / "img0000.nii.gz")})
    probs = torch.softmax(torch.randn(3, *case["image"].shape[1:]) * 3, 0)
    probs[1, :2] = probs[2, :2] = probs[0, :2]  # ties: the lower class wins, as argmax
    case["probs"] = probs
    labels, stack = btcv.labels_in_input_geometry(case, pre, probabilities=True)
    whole = invert({"image": case["image"], "pred": MetaTensor(probs)})["pred"]
    top2 = whole.as_tensor().topk(2, dim=0).values
    near_tie = (top2[0] - top2[1] < 1e-5).numpy()
    differ = labels != whole.argmax(0).numpy()
    assert not (differ & ~near_tie).any() and differ.sum() <= 0.001 * differ.size
    assert labels.shape == (30, 27, 7) and stack.shape == (3, 30, 27, 7) and stack.dtype == np.float16
    np.testing.assert_allclose(stack, whole.numpy(), atol=1e-3)


def test_resume_shards_and_probabilities(trained, tmp_path):
    ckpt, images = trained
    whole = tmp_path / "whole"
    _infer(ckpt, images, whole)
    expected = _labels(whole)
    assert len(expected) == 8
    # two array jobs, one shard each, into one folder: every case once, the same labels
    sharded = tmp_path / "sharded"
    _infer(ckpt, images, sharded, "--shard", "0/2")
    assert len(_labels(sharded)) == 4
    _infer(ckpt, images, sharded, "--shard", "1/2")
    assert {k: v.tobytes() for k, v in _labels(sharded).items()} == {k: v.tobytes() for k, v in expected.items()}
    # a killed run: one label map missing, a temporary left behind; the rerun predicts that case only
    (sharded / "img0003.nii.gz").unlink()
    (sharded / ".img0003.nii.gz.4242.tmp").write_bytes(b"partial")
    kept = {p.name: p.stat().st_mtime_ns for p in sharded.glob("img*.nii.gz")}
    _infer(ckpt, images, sharded)
    assert {p.name: p.stat().st_mtime_ns for p in sharded.glob("img*.nii.gz") if p.name in kept} == kept
    np.testing.assert_array_equal(_labels(sharded)["img0003.nii.gz"], expected["img0003.nii.gz"])
    # probabilities in the input's grid whose argmax is the label map
    probs = tmp_path / "probs"
    _infer(ckpt, images / "img0001.nii.gz", probs, "--save-probabilities")
    stack = np.load(probs / "img0001.npz")["probabilities"]
    assert stack.shape == (3, *expected["img0001.nii.gz"].shape)
    np.testing.assert_allclose(stack.astype(np.float32).sum(0), 1.0, atol=5e-3)
    agree = (stack.argmax(0) == expected["img0001.nii.gz"]).mean()
    assert agree > 0.99  # float16 rounding may flip near-ties


def test_two_processes_write_each_case_once_and_match_one(trained, tmp_path):
    ckpt, images = trained
    one, two = tmp_path / "one", tmp_path / "two"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    _infer(ckpt, images, one, subprocess_env=env)
    out = _infer(ckpt, images, two, "--devices", "2", "--strategy", "ddp", "--precision", "32-true", subprocess_env=env)
    assert {k: v.tobytes() for k, v in _labels(two).items()} == {k: v.tobytes() for k, v in _labels(one).items()}
    # each process reports the cases it wrote: together all eight, none twice
    written = [line.split(":")[0] for line in out.splitlines() if line.startswith("img") and ".nii.gz" in line]
    assert sorted(written) == sorted(_labels(one)) and len(written) == 8
    assert "GPU available" not in out and "LeafSpec" not in out  # Lightning's set-up notes are not ours to print
    assert not [p for p in two.iterdir() if "tmp" in p.name]
    # fewer cases than processes: the second has nothing to read, and waits for the first
    single = tmp_path / "single"
    _infer(ckpt, images / "img0003.nii.gz", single, "--devices", "2", "--strategy", "ddp", "--precision", "32-true", subprocess_env=env)
    assert _labels(single)["img0003.nii.gz"].tobytes() == _labels(one)["img0003.nii.gz"].tobytes()


# mixed precision: bfloat16 autocast on the CPU here; float16 on CUDA where a GPU is lent
MIXED = [("cpu", "bf16-mixed"), pytest.param("cuda", "16-mixed", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]


@pytest.mark.parametrize("device, precision", MIXED)
def test_mixed_precision_volumes_match_float32(trained, tmp_path, device, precision):
    """Probabilities (the saved ``.npz``) within 0.05 of float32's, labels on >= 98% of voxels."""
    ckpt, images = trained
    _infer(ckpt, images, tmp_path / "f32", "--precision", "32-true", "--save-probabilities")
    _infer(ckpt, images, tmp_path / "mixed", "--device", device, "--precision", precision, "--save-probabilities")
    for name, labels in _labels(tmp_path / "f32").items():
        stem = name.removesuffix(".nii.gz")
        full, mixed = (np.load(tmp_path / run / f"{stem}.npz")["probabilities"].astype(np.float32) for run in ("f32", "mixed"))
        assert np.abs(full - mixed).max() < 0.05, stem
        assert (_labels(tmp_path / "mixed")[name] == labels).mean() >= 0.98, stem


def test_luna16_candidates_per_scan_and_merge_after_resume(tmp_path):
    """Two shard jobs into one folder: one candidate file per scan, and the second job's merge
    holds both scans, row for row the submission of one whole run."""
    from hsmla_med.config import merge_config, task_config
    from hsmla_med.data.luna16 import find_scans
    from hsmla_med.data.synthetic.luna16 import generate_luna16
    from hsmla_med.pipelines import luna16
    from hsmla_med.pipelines.task import InferenceOptions

    root = generate_luna16(tmp_path / "luna", num_scans=2, shape=(48, 48, 16), seed=1)
    config = merge_config(task_config("luna16"), {"data": {"data_dir": str(root), "roi_size_2d": [48, 48], "num_workers": 0}})
    torch.manual_seed(0)
    module = luna16.TASK.build_module(config, luna16.datalist(config))
    module.config["inference"]["candidate_threshold"] = 0.0  # an untrained network: one candidate per scan
    scans = sorted(find_scans(root).values())
    quiet = {"progress": lambda _: None}
    read = lambda path: sorted(map(tuple, csv.reader(path.open())))  # noqa: E731
    lines = []
    full = luna16.infer(module, scans, tmp_path / "full", InferenceOptions(progress=lines.append))
    files = {scan.stem: tmp_path / "full" / "candidates" / f"{scan.stem}.csv" for scan in scans}
    assert lines == [f"{stem}: {len(read(path)) - 1} candidate(s) -> {path}" for stem, path in files.items()]  # (rows below the header)
    first = luna16.infer(module, scans, tmp_path / "parts", InferenceOptions(shard=Shard(0, 2), **quiet))
    assert len(list((tmp_path / "parts" / "candidates").glob("*.csv"))) == 1 and first[-1].name == "submission.csv"
    luna16.infer(module, scans, tmp_path / "parts", InferenceOptions(shard=Shard(1, 2), **quiet))
    merged = read(tmp_path / "parts" / "submission.csv")
    assert merged == read(full[-1])
    assert {row[0] for row in merged if row[0] != "seriesuid"} == {scan.stem for scan in scans}
