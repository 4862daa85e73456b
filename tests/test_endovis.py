"""EndoVis 2017 pipeline: label merging for the three tasks, the crop, per-frame Dice/IoU, the
synthetic generator, bad inputs, geometry of inference, and train / infer / demo through the CLI."""

from __future__ import annotations

import csv
import json
import os
import shutil

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from torch import nn

from hsmla_med.cli import main
from hsmla_med.config import merge_config, task_config
from hsmla_med.data.endovis import CROP, LoadFramed, find_frames, find_videos, instrument_type, merge_labels, read_frame, read_label
from hsmla_med.data.synthetic.endovis import ODD_FRAME_SIZE, generate_endovis
from hsmla_med.engine.segmentation import FrameSegmentationModule
from hsmla_med.errors import DataError
from hsmla_med.metrics import frame_reference_scores, frame_scores, summarize_frames
from hsmla_med.pipelines import endovis
from hsmla_med.pipelines.task import InferenceOptions
from tests.conftest import cli_error

SYNTH = {"num_videos": 2, "num_test_videos": 1, "frames_per_video": 2, "seed": 0}
TINY = {
    "data": {"size": [64, 80], "batch_size": 2, "num_workers": 0, "synthetic": SYNTH},
    "trainer": {"max_steps": 2, "check_val_every_n_epoch": 1, "accelerator": "cpu", "progress_bar": False},
}


def _png(path, array):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A tiny synthetic dataset where the pipeline's default looks for it: ``cache/endovis-synthetic``."""
    root = tmp_path_factory.mktemp("endovis")
    generate_endovis(root / "endovis-synthetic", **SYNTH)
    return root


# hand-made labels of one 3 x 4 frame: grey values 10 shaft, 20 wrist, 30 claspers (40: no part)
PROGRASP = np.array([[10, 10, 20, 30], [0, 0, 0, 0], [0, 0, 0, 40]], np.uint8)  # type 2
OTHER = np.array([[0, 0, 10, 10], [0, 10, 10, 0], [0, 0, 0, 0]], np.uint8)  # type 7
NEEDLE = np.array([[0, 0, 0, 10], [0, 0, 30, 0], [20, 0, 0, 0]], np.uint8)  # type 3; overlaps both


@pytest.fixture
def labels(tmp_path):
    truth = tmp_path / "ground_truth"
    return [
        _png(truth / "Right_Large_Needle_Driver_labels" / "frame000.png", NEEDLE),
        _png(truth / "Left_Prograsp_Forceps_labels" / "frame000.png", PROGRASP),
        _png(truth / "Other_labels" / "frame000.png", OTHER),
    ]


@pytest.mark.parametrize(
    "problem, expected",
    [
        # union of the robotic instruments; Other is not counted, value 40 is instrument
        ("binary", [[1, 1, 1, 1], [0, 0, 1, 0], [1, 0, 0, 1]]),
        # Right_... comes after Left_... in folder order and overwrites it; 40 is no part
        ("parts", [[1, 1, 2, 1], [0, 0, 3, 0], [2, 0, 0, 0]]),
        # folder order Left_Prograsp (2) < Other (7) < Right_Large_Needle_Driver (3)
        ("type", [[2, 2, 7, 3], [0, 7, 3, 0], [3, 0, 0, 2]]),
    ],
)
def test_merge_labels_per_problem_with_overlaps(labels, problem, expected):
    np.testing.assert_array_equal(merge_labels(labels, problem), np.array(expected, np.uint8))
    np.testing.assert_array_equal(merge_labels(labels[::-1], problem), np.array(expected, np.uint8))


def test_instrument_types_from_folder_names():
    names = ["Maryland_Bipolar_Forceps_labels", "Left_Prograsp_Forceps_labels", "Right_Large_Needle_Driver_labels",
             "Vessel_Sealer_labels", "Grasping_Retractor_labels", "Monopolar_Curved_Scissors_labels", "Other_labels"]
    assert [instrument_type(n) for n in names] == [1, 2, 3, 4, 5, 6, 7]
    assert endovis.PROBLEMS["type"][2] == "prograsp_forceps"
    with pytest.raises(DataError, match="Scalpel_labels: unknown instrument"):
        instrument_type("Scalpel_labels")


def test_crop_of_full_frames_and_cropped_frames(tmp_path):
    rng = np.random.default_rng(0)
    full = rng.integers(0, 256, (1080, 1920, 3), dtype=np.uint8)
    label = np.zeros((1080, 1920), np.uint8)
    label[28, 320] = 10  # first pixel inside the crop
    label[27, 320] = label[28, 319] = label[1052, 1000] = 30  # just outside it
    frame = _png(tmp_path / "v" / "left_frames" / "frame000.png", full)
    lab = _png(tmp_path / "v" / "ground_truth" / "Prograsp_Forceps_labels" / "frame000.png", label)
    out = LoadFramed("parts")({"image": str(frame), "labels": [str(lab)]})
    top, left, h, w = CROP
    assert (top, left, h, w) == (28, 320, 1024, 1280)
    np.testing.assert_array_equal((out["image"] * 255).round().byte().numpy(), full[28:1052, 320:1600].transpose(2, 0, 1))
    assert out["label"].shape == (1, 1024, 1280) and out["label"][0, 0, 0] == 1 and out["label"].sum() == 1
    # a frame of the crop's size is cropped already: used whole; other sizes need crop: null
    cropped = _png(tmp_path / "cropped.png", full[28:1052, 320:1600])
    assert LoadFramed("binary")({"image": str(cropped)})["image"].shape == (3, 1024, 1280)
    small = _png(tmp_path / "small.png", full[:100, :120])
    with pytest.raises(DataError, match="small.png: frame is 120 x 100"):
        LoadFramed("binary")({"image": str(small)})
    assert LoadFramed("binary", crop=None)({"image": str(small)})["image"].shape == (3, 100, 120)


def test_frame_dice_and_iou_against_hand_computed_values():
    pred = torch.tensor([[[0, 1, 1], [0, 0, 2]], [[0, 0, 0], [0, 0, 0]], [[0, 0, 0], [0, 0, 0]]])[:, None]
    truth = torch.tensor([[[0, 1, 0], [0, 2, 2]], [[0, 0, 0], [0, 0, 3]], [[0, 0, 0], [0, 0, 0]]])[:, None]
    dice, iou = frame_scores(pred, truth, 4)
    nan = float("nan")
    # frame 0: classes 1 and 2 each 1 shared pixel of 2 + 1 -> Dice 2/3, IoU 1/2; class 3 absent
    # frame 1: class 3 missed -> 0; frame 2: nothing anywhere -> not counted
    torch.testing.assert_close(dice, torch.tensor([[2 / 3, 2 / 3, nan], [nan, nan, 0.0], [nan, nan, nan]]), equal_nan=True)
    torch.testing.assert_close(iou, torch.tensor([[0.5, 0.5, nan], [nan, nan, 0.0], [nan, nan, nan]]), equal_nan=True)
    # per frame by the reference rule (tests/test_endovis_scoring.py): 2/3, 0, and 1 for the empty frame
    frame_dice, frame_iou = frame_reference_scores(pred, truth, 4)
    summary = summarize_frames(dice, iou, frame_dice, frame_iou, ["a", "b", "c"])
    assert summary["dice"] == pytest.approx((2 / 3 + 0 + 1) / 3) and summary["iou"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert summary["dice_per_class"] == pytest.approx({"a": 2 / 3, "b": 2 / 3, "c": 0.0})
    assert summary["iou_per_class"] == pytest.approx({"a": 0.5, "b": 0.5, "c": 0.0})
    assert summary["cases"] == 3
    # the module's records (key, per-class dice and iou, frame scores) give the same summary
    module = FrameSegmentationModule.__new__(FrameSegmentationModule)
    module.label_names = ["background", "a", "b", "c"]
    records = [{"key": k, "dice": d, "iou": i, "frame_dice": fd, "frame_iou": fi}
               for k, d, i, fd, fi in zip(range(3), dice.tolist(), iou.tolist(), frame_dice.tolist(), frame_iou.tolist())]
    got = module.summarize_records(records)
    assert set(got) == set(summary) and got["cases"] == 3
    assert (got["dice"], got["iou"]) == pytest.approx((summary["dice"], summary["iou"]))
    assert got["iou_per_class"] == pytest.approx(summary["iou_per_class"]) and got["dice_per_class"] == pytest.approx(summary["dice_per_class"])


def test_generator_layout_and_consistent_masks(cache):
    root = cache / "endovis-synthetic"
    videos = find_videos(root)
    assert [(v["video"], v["labelled"], len(v["frames"])) for v in videos] == [(1, True, 2), (2, True, 2), (3, False, 2)]
    assert not (root / "instrument_dataset_3" / "ground_truth").exists()
    top, left, h, w = CROP
    for case in videos[0]["frames"] + videos[1]["frames"]:
        frame = read_frame(case["image"])
        assert frame.shape == (1080, 1920, 3)
        assert frame[:top].max() < 10 and frame[:, : left].max() < 10  # black borders outside the crop
        greys = [read_label(p) for p in case["labels"]]
        assert all(g.shape == (1080, 1920) and set(np.unique(g)) <= {0, 10, 20, 30} for g in greys)
        assert all(g[:top].max() == 0 and g[:, :left].max() == 0 for g in greys)
        visible = np.stack([g > 0 for g in greys])
        assert visible.sum(0).max() <= 1  # each pixel labelled for one instrument at most
        shaft = np.any([g == 10 for g in greys], 0)
        tissue = ~visible.any(0)
        tissue[:top] = tissue[top + h :] = False
        tissue[:, :left] = tissue[:, left + w :] = False
        # the labels match the picture: dark grey shafts on reddish tissue
        r, g, b = (frame[..., c].astype(float) for c in range(3))
        assert np.median(r[shaft]) < 90 and abs(np.median(r[shaft]) - np.median(b[shaft])) < 15
        assert np.median(r[tissue] - g[tissue]) > 50
    # the distribution's quirks: label folders spelled without _labels and with the side after the
    # name (video 2), each read as an instrument; the test video's last frame of an odd size
    folders = sorted(p.name for p in (root / "instrument_dataset_2" / "ground_truth").iterdir())
    assert any(not f.endswith("_labels") for f in folders) and all(len(c["labels"]) == len(folders) for c in videos[1]["frames"])
    assert all(f.endswith("_labels") for f in os.listdir(root / "instrument_dataset_1" / "ground_truth"))
    odd = read_frame(videos[2]["frames"][-1]["image"])
    assert odd.shape == (*ODD_FRAME_SIZE, 3) and odd.shape[0] % 2 == odd.shape[1] % 2 == 1
    assert read_frame(videos[2]["frames"][0]["image"]).shape == (1080, 1920, 3)
    marker = root / "synthetic.json"
    stamp = marker.stat().st_mtime_ns
    generate_endovis(root, **SYNTH)  # same parameters: nothing rewritten
    assert marker.stat().st_mtime_ns == stamp


def test_generator_refuses_foreign_folders(tmp_path):
    (tmp_path / "synthetic.json").write_text(json.dumps({"name": "mine"}))
    with pytest.raises(FileExistsError):
        generate_endovis(tmp_path, 1, 0, 1)


def test_bad_inputs_name_the_file(tmp_path):
    video = tmp_path / "instrument_dataset_1"
    frame = np.full((12, 16, 3), 100, np.uint8)
    _png(video / "left_frames" / "frame000.png", frame)
    _png(video / "left_frames" / "frame001.png", frame)
    _png(video / "ground_truth" / "Prograsp_Forceps_labels" / "frame000.png", np.zeros((12, 16), np.uint8))
    with pytest.raises(DataError, match=r"frame001.png: no label .*Prograsp_Forceps_labels/frame001.png"):
        find_videos(tmp_path)
    wrong = _png(video / "ground_truth" / "Prograsp_Forceps_labels" / "frame001.png", np.zeros((10, 16), np.uint8))
    case = next(c for c in find_videos(tmp_path)[0]["frames"] if c["image"].endswith("frame001.png"))
    with pytest.raises(DataError, match=f"^{case['image']}: label {wrong} is 16 x 10 .* the frame 16 x 12"):
        LoadFramed("binary", crop=None)(case)
    # RGBA: alpha dropped; 16-bit and colour labels: refused
    rgba = np.dstack([frame, np.full((12, 16), 7, np.uint8)])
    np.testing.assert_array_equal(read_frame(_png(tmp_path / "rgba.png", rgba)), frame)
    deep = _png(tmp_path / "deep.png", np.full((12, 16), 1000, np.uint16))
    with pytest.raises(DataError, match="deep.png: 16-bit"):
        read_frame(deep)
    with pytest.raises(DataError, match="deep.png: 16-bit"):
        read_label(deep)
    colour = frame.copy()
    colour[0, 0] = (10, 20, 30)
    with pytest.raises(DataError, match="colour.png: colour label"):
        read_label(_png(tmp_path / "colour.png", colour))
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    with pytest.raises(DataError, match="broken.png: cannot read"):
        read_frame(broken)
    with pytest.raises(DataError, match="no PNG frames"):
        find_frames(tmp_path / "instrument_dataset_1" / "ground_truth")


class _RedIsInstrument(nn.Module):
    """Logits (background 0, instrument 20 * (red - 0.5)): instrument wherever red > 0.5."""

    def forward(self, x):
        return torch.stack([torch.zeros_like(x[:, 0]), 20 * (x[:, 0] - 0.5)], 1)


def test_infer_restores_frame_geometry(tmp_path):
    config = merge_config(task_config("endovis"), TINY)
    module = FrameSegmentationModule(endovis.module_config(config, {"variant": "b0"}, endovis.PROBLEMS["binary"]), network=_RedIsInstrument())
    frame = np.zeros((1080, 1920, 3), np.uint8)
    frame[28:1052, 320:1600] = 60
    frame[400:640, 800:1120] = (230, 60, 60)  # a red rectangle inside the crop
    frame[0:20, 0:300] = (230, 60, 60)  # red outside the crop: never seen by the network
    video = tmp_path / "instrument_dataset_9" / "left_frames"
    _png(video / "frame007.png", frame)
    _png(tmp_path / "flat" / "cropped.png", frame[28:1052, 320:1600])
    lines = []
    written = endovis.infer(module, [tmp_path / "instrument_dataset_9", tmp_path / "flat"], tmp_path / "out", InferenceOptions(progress=lines.append))
    assert written == [tmp_path / "out" / "instrument_dataset_9" / "frame007.png", tmp_path / "out" / "cropped.png"]
    mask = np.asarray(Image.open(written[0]))
    expected = np.zeros((1080, 1920), np.uint8)
    expected[400:640, 800:1120] = 1
    assert mask.shape == (1080, 1920) and mask.dtype == np.uint8
    # down to 64 x 80 and back up: the edges may move by up to a model pixel (16 frame pixels)
    assert (mask != expected).sum() < 2 * 16 * (240 + 320)
    assert mask[:28].max() == 0 and mask[420:620, 820:1100].min() == 1
    cropped = np.asarray(Image.open(written[1]))
    assert cropped.shape == (1024, 1280)
    np.testing.assert_array_equal(cropped, mask[28:1052, 320:1600])
    # one line per video, named, with its output folder
    assert [line.split(" frame(s)")[0] for line in lines[-2:]] == ["instrument_dataset_9: 1", "flat: 1"]
    assert lines[-2].endswith(f"-> {tmp_path / 'out' / 'instrument_dataset_9'}") and lines[-1].endswith(f"-> {tmp_path / 'out'}")
    assert all("frames/s" in line for line in lines[-2:])


def test_train_then_infer_through_the_cli(tmp_path, cache, capsys):
    data = cache / "endovis-synthetic"
    user = tmp_path / "tiny.yaml"
    user.write_text(yaml.safe_dump(TINY))
    out = tmp_path / "run"
    assert main(["train", "--task", "endovis", "--data-dir", str(data), "--config", str(user), "--output", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0.0 <= metrics["dice"] <= 1.0 and 0.0 <= metrics["iou"] <= metrics["dice"] + 1e-6
    assert metrics["cases"] == 2 and set(metrics["iou_per_class"]) == {"instrument"}
    assert "IoU" in capsys.readouterr().out
    preds = tmp_path / "preds"
    assert main(["infer", "--task", "endovis", "--checkpoint", str(out / "best.ckpt"), "--input", str(data / "instrument_dataset_3"),
                 "--output", str(preds), "--device", "cpu"]) == 0
    masks = sorted((preds / "instrument_dataset_3").glob("*.png"))
    assert [m.name for m in masks] == ["frame000.png", "frame001.png"]
    # each mask at its frame's size: frame001 is the odd one, segmented whole (the challenge
    # scores every test frame whole at its own size)
    full, odd = (np.asarray(Image.open(m)) for m in masks)
    assert full.shape == (1080, 1920) and full.max() <= 1 and full[:28].max() == 0
    assert odd.shape == ODD_FRAME_SIZE and odd.max() <= 1
    assert "frames/s" in capsys.readouterr().out
    # evaluate reproduces the best checkpoint's validation scores (its saved taus, same frames)
    assert main(["evaluate", "--task", "endovis", "--checkpoint", str(out / "best.ckpt"), "--data-dir", str(data),
                 "--config", str(user), "--output", str(tmp_path / "eval")]) == 0
    scores = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    with (out / "metrics.csv").open() as f:
        best = max(float(row["dice"]) for row in csv.DictReader(f))
    assert scores["dice"] == pytest.approx(best, abs=1e-5)


def test_missing_mask_is_one_clear_error(tmp_path, cache, capsys):
    data = tmp_path / "data"
    shutil.copytree(cache / "endovis-synthetic", data)
    label = next((data / "instrument_dataset_2" / "ground_truth").glob("*/frame001.png"))
    label.unlink()
    assert main(["train", "--task", "endovis", "--data-dir", str(data), "--output", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "frame001.png: no label" in err[0] and str(label) in err[0]


def test_demo_runs_on_a_tiny_synthetic_dataset(tmp_path, cache, capsys):
    user = tmp_path / "demo.yaml"
    user.write_text(yaml.safe_dump({**TINY, "data": {**TINY["data"], "cache_dir": str(cache)}}))
    assert main(["demo", "--task", "endovis", "--config", str(user), "--output", str(tmp_path / "demo"), "--max-steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "endovis: dice" in out
    run = tmp_path / "demo" / "endovis"
    assert (run / "best.ckpt").is_file()
    # the held-out videos: the validation video and the test video, one mask per frame
    assert len(list((run / "predictions").glob("instrument_dataset_*/frame*.png"))) == 4


def test_bench_endovis_times_rgb_models_side_by_side():
    pytest.importorskip("transformers")
    from hsmla_med.bench.models import bench_endovis

    rows = bench_endovis(runs=1, size=(64, 96), classes=4)
    assert [r["model"] for r in rows] == ["HSMLA-B0", "SegFormer-B0"]
    hsmla, segformer = rows
    assert hsmla["frames_per_s"] == pytest.approx(1e3 / hsmla["latency_ms"])
    assert hsmla["speedup_vs_segformer_b0"] == pytest.approx(segformer["latency_ms"] / hsmla["latency_ms"])
    assert segformer["speedup_vs_segformer_b0"] == pytest.approx(1.0)
    assert 0.0 < hsmla["mean_alpha"] <= 1.0  # taus calibrated: some, not all, tiles refined


def test_label_folders_without_the_labels_suffix_are_instruments(tmp_path):
    """Videos 6 and 7 of the distribution name folders ``Prograsp_Forceps`` and
    ``Left_Bipolar_Forceps``, without ``_labels``: their instruments are labels, not dropped."""
    video = tmp_path / "instrument_dataset_7"
    _png(video / "left_frames" / "frame000.png", np.full((3, 4, 3), 90, np.uint8))
    bipolar = _png(video / "ground_truth" / "Left_Bipolar_Forceps" / "frame000.png", PROGRASP)
    sealer = _png(video / "ground_truth" / "Right_Vessel_Sealer" / "frame000.png", NEEDLE)
    case = find_videos(tmp_path)[0]["frames"][0]
    assert sorted(case["labels"]) == sorted(map(str, (bipolar, sealer)))
    label = LoadFramed("type", crop=None)(case)["label"][0].numpy()
    np.testing.assert_array_equal(label, np.where(NEEDLE > 0, 4, np.where(PROGRASP > 0, 1, 0)))


def _small_videos(root, frame=np.full((12, 16, 3), 90, np.uint8)):
    label = np.zeros(frame.shape[:2], np.uint8)
    label[4:8, 5:10] = 10  # a shaft: a video without any instrument label is not scored
    for k in (1, 2):
        for j in range(2):
            _png(root / f"instrument_dataset_{k}" / "left_frames" / f"frame{j:03d}.png", frame)
            _png(root / f"instrument_dataset_{k}" / "ground_truth" / "Prograsp_Forceps_labels" / f"frame{j:03d}.png", label)
    return root


def test_a_crop_no_frame_holds_names_the_frame_and_null_uses_whole_frames(tmp_path, capsys):
    """``data.crop`` with a zero offset is a crop, not a config error: the frame it cannot be
    taken from is named; ``data.crop: null``, the way out that line gives, trains."""
    data = _small_videos(tmp_path / "data")
    user = tmp_path / "crop.yaml"
    argv = ["train", "--task", "endovis", "--data-dir", str(data), "--config", str(user), "--output", str(tmp_path / "run")]
    tiny = {**TINY, "data": {**TINY["data"], "size": [12, 16], "validation_videos": [2]}}
    user.write_text(yaml.safe_dump({**tiny, "data": {**tiny["data"], "crop": [0, 0, 5000, 5000]}}))
    line = cli_error(capsys, argv)
    assert "left_frames/frame00" in line and "frame is 16 x 12 (W x H)" in line and "crop.yaml" not in line
    user.write_text(yaml.safe_dump({**tiny, "data": {**tiny["data"], "crop": None}}))
    assert main(argv) == 0


@pytest.mark.parametrize("bad", ["16-bit", "grey", "not an image", "label of another size"])
def test_bad_frames_end_in_one_line_naming_the_frame(tmp_path, capsys, bad):
    """Training on a video with one bad frame (loader workers as by default): one line naming
    the frame, exit status 2."""
    data = _small_videos(tmp_path / "data")
    frame = data / "instrument_dataset_2" / "left_frames" / "frame001.png"
    if bad == "16-bit":
        _png(frame, np.full((12, 16), 4000, np.uint16))
    elif bad == "grey":
        _png(frame, np.full((12, 16), 90, np.uint8))
    elif bad == "not an image":
        frame.write_bytes(b"not a PNG at all")
    else:
        _png(data / "instrument_dataset_2" / "ground_truth" / "Prograsp_Forceps_labels" / "frame001.png", np.zeros((10, 16), np.uint8))
    user = tmp_path / "tiny.yaml"
    user.write_text(yaml.safe_dump({**TINY, "data": {**TINY["data"], "size": [12, 16], "num_workers": 2, "validation_videos": [2], "crop": None}}))
    line = cli_error(capsys, ["train", "--task", "endovis", "--data-dir", str(data), "--config", str(user), "--output", str(tmp_path / "run")])
    assert line.startswith(f"hsmla-med: error: {frame}: "), line
