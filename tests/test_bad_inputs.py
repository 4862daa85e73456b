"""The bad-input catalogue: every case one line naming the option or file and the problem, exit
status 2, no traceback, and nothing written where the input was refused."""

from __future__ import annotations

import json
from importlib import resources

import numpy as np
import pytest
import torch
import yaml

from hsmla_med.config import model_config, task_config
from hsmla_med.pipelines import get_task
from tests.conftest import cli_error as _error, tiny_config, tiny_yaml, write_nifti



def _checkpoint(path, task: str, config: dict, labels: list[str]):
    """A checkpoint as ``train`` writes it (hyper-parameters and weights), without training."""
    task = get_task(task)
    module = task.module_class(task.module_config(config, model_config("b0"), labels))
    torch.save({"hyper_parameters": dict(module.hparams), "state_dict": module.state_dict(), "epoch": 0, "global_step": 0}, path)
    return path


@pytest.fixture
def btcv_ckpt(tmp_path):
    return _checkpoint(tmp_path / "btcv.ckpt", "btcv", tiny_config(tmp_path, tmp_path / "run"), ["background", "a", "b"])


@pytest.fixture
def camelyon_ckpt(tmp_path):
    return _checkpoint(tmp_path / "c16.ckpt", "camelyon16", task_config("camelyon16"), ["normal", "tumour"])


def _yaml(tmp_path, text: str):
    path = tmp_path / "user.yaml"
    path.write_text(text)
    return str(path)


TRAIN_CASES = [  # extra train arguments (a {yaml} placeholder: a --config with that text) -> expected words
    (["--config", "{yaml}trainer: {check_val_every_n_epoch: forty}"], "trainer.check_val_every_n_epoch must be a number"),
    (["--config", "{yaml}data: {spacing: abc}"], "data.spacing must be auto or a list of 3 positive numbers"),
    (["--config", "{yaml}data: {spacing: [1, 0, 1]}"], "data.spacing must be auto or a list of 3 positive numbers, got [1, 0, 1]"),
    (["--config", "{yaml}optim: {lr: -1}"], "optim.lr must be > 0"),
    (["--config", "{yaml}data: {folds: 1}"], "data.folds must be >= 2"),
    (["--max-steps", "-5"], "trainer.max_steps must be >= 1"),
    (["--max-steps", "0"], "trainer.max_steps must be >= 1"),
    (["--max-epochs", "0"], "trainer.max_epochs must be >= 1"),
    (["--precision", "bogus"], "trainer.precision must be one of"),
    (["--devices", "abc"], "trainer.devices must be"),
    (["--mode", "2d", "--config", "{yaml}mode: 4d"], "mode must be one of 2d, 3d"),
    (["--model", "{model}variant: b9"], "variant must be one of"),
    (["--model", "{model}attention: {window: 6}"], "window"),
    (["--model", "{model}attention: {tau: .nan}"], "tau must be a finite number, got nan"),  # trained with no refinement
    (["--model", "{model}attention: {backend: triton}"], "model.yaml: model.attention.backend triton: the Triton kernels have no backward"),
    (["--model", "{model}attention: {backend: cpu}"], "model.attention.backend cpu: the C kernels have no backward"),
]


@pytest.mark.parametrize("extra, expected", TRAIN_CASES, ids=[e for _, e in TRAIN_CASES])
def test_train_refuses_bad_values(capsys, tmp_path, dataset, extra, expected):
    args = []
    for a in extra:
        if a.startswith("{yaml}"):
            a = _yaml(tmp_path, a.removeprefix("{yaml}"))
        elif a.startswith("{model}"):
            a = tmp_path / "model.yaml"
            a.write_text(extra[-1].removeprefix("{model}"))
        args.append(str(a))
    argv = ["train", "--task", "btcv", "--data-dir", str(dataset), "--output", str(tmp_path / "run")]
    if "--config" not in args:
        argv += ["--config", str(tiny_yaml(tmp_path / "tiny.yaml"))]
    line = _error(capsys, argv + args)
    assert expected in line
    assert not (tmp_path / "run" / "last.ckpt").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("argv, expected", [
    (["train", "--task", "btcv", "--accelerator", "gpu"], "trainer.accelerator gpu: this machine has no CUDA GPU"),
    (["infer", "--task", "btcv", "--checkpoint", "x.ckpt", "--input", "x", "--output", "out", "--device", "cuda"], "--device cuda: no such CUDA device"),
])
def test_no_gpu_refused(capsys, tmp_path, monkeypatch, argv, expected):
    monkeypatch.chdir(tmp_path)
    assert expected in _error(capsys, argv)


def test_output_that_is_a_file_or_unwritable(capsys, tmp_path, dataset, btcv_ckpt):
    afile = tmp_path / "taken"
    afile.write_text("mine")
    line = _error(capsys, ["train", "--task", "btcv", "--data-dir", str(dataset), "--output", str(afile)])
    assert f"--output {afile}: exists and is not a folder" in line
    line = _error(capsys, ["infer", "--task", "btcv", "--checkpoint", str(btcv_ckpt), "--input", str(dataset), "--output", str(afile / "sub")])
    assert "--output" in line and str(afile) in line
    assert afile.read_text() == "mine"


def test_a_failed_command_leaves_no_empty_output_folder(capsys, tmp_path, btcv_ckpt):
    """The --output folders a command created are gone after it fails with nothing written
    (export checks its checkpoint and --input-size after creating them); a folder that existed
    before, and a created one that holds a file, stay."""
    missing = tmp_path / "missing.ckpt"
    line = _error(capsys, ["export", "--checkpoint", str(missing), "--format", "onnx", "--output", str(tmp_path / "new" / "a" / "b")])
    assert "checkpoint not found" in line and not (tmp_path / "new").exists()
    (tmp_path / "existing").mkdir()
    line = _error(capsys, ["export", "--checkpoint", str(btcv_ckpt), "--format", "onnx", "--output", str(tmp_path / "existing" / "x"),
                           "--input-size", "7"])
    assert "--input-size 7" in line and (tmp_path / "existing").is_dir() and not (tmp_path / "existing" / "x").exists()
    from hsmla_med.cli.invocation import Invocation

    invocation = Invocation([])
    kept = invocation.writable_folder(tmp_path / "made" / "sub", "--output")
    (kept / "result.txt").write_text("written")
    invocation.remove_empty_created()
    assert (kept / "result.txt").read_text() == "written"


@pytest.mark.parametrize("extra, expected", [
    (["--overlap", "1.5"], "--overlap must lie in [0, 1)"),
    (["--device", "tpu"], "--device 'tpu'"),
])
def test_infer_option_ranges(capsys, tmp_path, btcv_ckpt, extra, expected):
    argv = ["infer", "--task", "btcv", "--checkpoint", str(btcv_ckpt), "--input", str(tmp_path), "--output", str(tmp_path / "out")]
    assert expected in _error(capsys, argv + extra)


def test_checkpoint_of_another_task_is_named(capsys, tmp_path, btcv_ckpt, camelyon_ckpt):
    line = _error(capsys, ["infer", "--task", "endovis", "--checkpoint", str(btcv_ckpt), "--input", str(tmp_path), "--output", str(tmp_path / "o")])
    assert "a btcv checkpoint, not one of task endovis" in line and "--task btcv" in line
    line = _error(capsys, ["wsi-heatmap", "--checkpoint", str(btcv_ckpt), "--slide", str(tmp_path), "--output", str(tmp_path / "o")])
    assert "a btcv checkpoint, not one of task camelyon16" in line
    line = _error(capsys, ["infer", "--task", "btcv", "--checkpoint", str(camelyon_ckpt), "--input", str(tmp_path), "--output", str(tmp_path / "o")])
    assert "a camelyon16 checkpoint" in line


def test_checkpoint_missing_keys(capsys, tmp_path, btcv_ckpt):
    ckpt = torch.load(btcv_ckpt, weights_only=True)
    del ckpt["hyper_parameters"]["inference"]["roi_size"], ckpt["hyper_parameters"]["data"]
    torch.save(ckpt, tmp_path / "partial.ckpt")
    case = write_nifti(tmp_path / "in" / "a.nii.gz", np.zeros((8, 8, 4), np.float32), np.eye(4))
    line = _error(capsys, ["infer", "--task", "btcv", "--checkpoint", str(tmp_path / "partial.ckpt"), "--input", str(case), "--output", str(tmp_path / "o")])
    assert "partial.ckpt" in line and "hyper-parameters" in line


@pytest.mark.parametrize("extra, expected", [
    (["--batch-size", "-4"], "--batch-size must be a positive number"),
    (["--level", "-1"], "--level must be a pyramid level"),
    ([], "missing.tif: input not found"),
])
def test_wsi_heatmap_refusals(capsys, tmp_path, camelyon_ckpt, extra, expected):
    out = tmp_path / "heat"
    line = _error(capsys, ["wsi-heatmap", "--checkpoint", str(camelyon_ckpt), "--slide", str(tmp_path / "missing.tif"), "--output", str(out), *extra])
    assert expected in line
    assert not list(out.glob("*.json"))  # nothing that would make a later run skip the slide


def test_bad_slide_reader_variable_is_refused_first(capsys, tmp_path, camelyon_ckpt, monkeypatch):
    monkeypatch.setenv("HSMLA_MED_SLIDE_READER", "pillow")
    out = tmp_path / "heat"
    line = _error(capsys, ["wsi-heatmap", "--checkpoint", str(camelyon_ckpt), "--slide", str(tmp_path / "missing.tif"), "--output", str(out)])
    assert "HSMLA_MED_SLIDE_READER='pillow': not a slide reader" in line
    assert not out.exists() or not any(out.iterdir())


def test_infer_on_a_special_file_says_what_it_is(capsys, tmp_path, btcv_ckpt):
    """``--input /dev/zero`` exists: "input not found" was wrong. A device is named as one."""
    line = _error(capsys, ["infer", "--task", "btcv", "--checkpoint", str(btcv_ckpt), "--input", "/dev/zero", "--output", str(tmp_path / "o")])
    assert "/dev/zero: not a regular file or a folder (a device, pipe or socket)" in line and "not found" not in line
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_infer_on_a_2d_nifti(capsys, tmp_path, btcv_ckpt):
    flat = write_nifti(tmp_path / "in" / "flat.nii.gz", np.zeros((16, 16), np.float32), np.eye(4))
    line = _error(capsys, ["infer", "--task", "btcv", "--checkpoint", str(btcv_ckpt), "--input", str(flat), "--output", str(tmp_path / "o")])
    assert "flat.nii.gz" in line


def test_dataset_json_entry_not_a_string(capsys, tmp_path, dataset):
    spec = json.loads((dataset / "dataset.json").read_text())
    spec["training"][0]["image"] = 7
    (dataset / "dataset.json").write_text(json.dumps(spec))
    line = _error(capsys, ["train", "--task", "btcv", "--data-dir", str(dataset), "--config", str(tiny_yaml(tmp_path / "t.yaml")), "--output", str(tmp_path / "run")])
    assert "dataset.json" in line


def test_evaluate_checkpoint_with_other_labels(capsys, tmp_path, dataset):
    ckpt = _checkpoint(tmp_path / "many.ckpt", "btcv", tiny_config(dataset, tmp_path / "run"), [f"c{i}" for i in range(14)])
    line = _error(capsys, ["evaluate", "--task", "btcv", "--checkpoint", str(ckpt), "--data-dir", str(dataset),
                           "--config", str(tiny_yaml(tmp_path / "t.yaml")), "--output", str(tmp_path / "ev")])
    assert "predicts 14 classes" in line


def test_config_yaml_tags_are_refused(capsys, tmp_path):
    bad = _yaml(tmp_path, "seed: !!python/object/apply:os.system ['echo pwned']\n")
    assert "malformed YAML" in _error(capsys, ["train", "--task", "btcv", "--config", bad])


def test_user_yaml_keeps_the_common_sections(tmp_path):
    # the common sections are defined once (configs/common.yaml) and reach every task
    for name in ("btcv", "camelyon16", "endovis", "luna16"):
        config = task_config(name)
        assert {"optim", "loss", "trainer", "inference", "seed"} <= set(config)
        common = yaml.safe_load((resources.files("hsmla_med.configs") / "common.yaml").read_text())
        assert config["inference"]["target_alpha"] == common["inference"]["target_alpha"]
        assert config["loss"] == common["loss"]


def _scan(folder, name="scan", size=(8, 8, 4), spacing="1 1 1", raw_bytes=None, ndims=3, element="MET_SHORT"):
    """A MetaImage header and its voxel file, written by hand so that each can be broken."""
    folder.mkdir(parents=True, exist_ok=True)
    dims = " ".join(map(str, size))
    (folder / f"{name}.mhd").write_text(
        f"ObjectType = Image\nNDims = {ndims}\nDimSize = {dims}\nElementSpacing = {spacing}\n"
        f"ElementType = {element}\nElementDataFile = {name}.raw\n"
    )
    n = int(np.prod(size)) * 2
    (folder / f"{name}.raw").write_bytes(b"\0" * (n if raw_bytes is None else raw_bytes))
    return folder / f"{name}.mhd"


@pytest.mark.parametrize("kwargs, expected", [
    (dict(raw_bytes=100), "bytes, the header scan.mhd describes 512"),
    (dict(raw_bytes=0), "0 bytes"),
    (dict(raw_bytes=1000), "1000 bytes"),
    (dict(spacing="1 0 1"), "voxel spacing must be three positive numbers"),
    (dict(size=(8, 8), ndims=2), "a scan has three dimensions"),
    (dict(size=(8, 0, 4)), "a scan has three dimensions"),
])
def test_luna16_bad_scans_are_refused_before_itk_reads_them(tmp_path, kwargs, expected):
    from hsmla_med.data.luna16 import find_scans
    from hsmla_med.errors import DataError

    _scan(tmp_path / "subset0", **kwargs)
    with pytest.raises(DataError, match="scan") as err:
        find_scans(tmp_path)
    assert expected in str(err.value)


@pytest.mark.parametrize("content, expected", [
    (b"seriesuid,coordX,coordY,coordZ,diameter_mm\nscan,1,2,3,-4\n", "diameter_mm must not be negative"),
    (bytes(range(256)) * 4, "not a CSV text file"),
])
def test_luna16_bad_annotations(tmp_path, content, expected):
    from hsmla_med.data.luna16 import read_annotations
    from hsmla_med.errors import DataError

    (tmp_path / "annotations.csv").write_bytes(content)
    with pytest.raises(DataError, match=expected):
        read_annotations(tmp_path / "annotations.csv")


def test_luna16_training_on_a_short_scan_exits_2_without_abort(tmp_path):
    """Run as a user would (a process of its own): ITK used to abort the process (exit 134)."""
    import subprocess
    import sys

    for name in ("a", "b", "c"):
        _scan(tmp_path / "data" / "subset0", name, size=(16, 16, 8))
    (tmp_path / "data" / "annotations.csv").write_text("seriesuid,coordX,coordY,coordZ,diameter_mm\na,4,4,2,3\n")
    (tmp_path / "data" / "subset0" / "b.raw").write_bytes(b"\0" * 10)
    done = subprocess.run(
        [sys.executable, "-m", "hsmla_med.cli", "train", "--task", "luna16", "--data-dir", str(tmp_path / "data"),
         "--max-steps", "1", "--output", str(tmp_path / "run"), "--accelerator", "cpu"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "b.raw: 10 bytes" in done.stderr and "Traceback" not in done.stderr and "terminate called" not in done.stderr


def test_endovis_48_bit_frame_is_refused(tmp_path):
    import struct
    import zlib

    from hsmla_med.data.endovis import read_frame
    from hsmla_med.errors import DataError

    rgb16 = np.random.default_rng().integers(0, 65535, (6, 5, 3)).astype(">u2")
    raw = b"".join(b"\0" + row.tobytes() for row in rgb16)  # filter byte 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = tmp_path / "frame48.png"  # Pillow writes no 48-bit PNG: the chunks by hand
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 5, 6, 16, 2, 0, 0, 0))
                    + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    with pytest.raises(DataError, match="frame48.png: 16-bit image"):
        read_frame(png)


def test_endovis_values_that_are_no_part_are_reported(tmp_path, caplog):
    from PIL import Image

    from hsmla_med.data import endovis

    folder = tmp_path / "ground_truth" / "Left_Prograsp_Forceps_labels"
    folder.mkdir(parents=True)
    Image.fromarray(np.array([[10, 77], [30, 0]], np.uint8)).save(folder / "frame000.png")
    endovis._WARNED_VALUES.discard(77)
    with caplog.at_level("WARNING", logger="hsmla_med"):
        merged = endovis.merge_labels([folder / "frame000.png"], "parts")
    np.testing.assert_array_equal(merged, [[1, 0], [3, 0]])
    assert "grey value(s) 77 are no part label" in caplog.text and "frame000.png" in caplog.text


def test_checkpoint_with_foreign_objects_is_refused_without_torch_advice(capsys, tmp_path):
    import collections

    torch.save({"hyper_parameters": collections.OrderedDict(a=print), "state_dict": {}}, tmp_path / "evil.ckpt")
    line = _error(capsys, ["infer", "--task", "btcv", "--checkpoint", str(tmp_path / "evil.ckpt"), "--input", str(tmp_path), "--output", str(tmp_path / "o")])
    assert "evil.ckpt: holds objects that weights_only loading refuses (" in line and "print" in line and "could run code" in line
    assert "weights_only=False" not in line


def test_infer_ignores_temporaries_of_killed_runs(tmp_path):
    from hsmla_med.pipelines.btcv import _volume_inputs
    from hsmla_med.pipelines.task import input_files

    case = write_nifti(tmp_path / "in" / "case1.nii.gz", np.zeros((4, 4, 4), np.float32), np.eye(4))
    (tmp_path / "in" / ".case2.4242.tmp.nii.gz").write_bytes(b"half")
    assert input_files(tmp_path / "in", _volume_inputs) == [case]


def test_cache_filling_threads_have_ended_when_a_case_fails():
    """A case that fails while another thread still reads its own: the error reaches the caller
    only once that thread is done (a thread left running when the command exits aborts it)."""
    import threading
    import time

    from monai.transforms import Lambda

    from hsmla_med.engine.datamodule import CaseDataModule
    from hsmla_med.errors import DataError, find_input_error

    reading, finished = threading.Event(), []

    def read(case):
        if case["image"] == "bad":
            reading.wait(30)
            raise DataError("bad: refused")
        reading.set()
        time.sleep(0.5)  # reading a large volume, without the GIL
        finished.append(case["image"])
        return case

    transform = Lambda(read)  # a MONAI transform without randomness: applied while the cache fills
    module = CaseDataModule([{"image": "bad"}, {"image": "good"}], [{"image": "v"}], transform, transform, num_workers=2)
    with pytest.raises(RuntimeError) as raised:  # MONAI wraps what a transform raises
        module.setup("fit")
    assert str(find_input_error(raised.value)) == "bad: refused"
    assert finished == ["good"]


def test_bad_training_volume_exits_2_without_abort(tmp_path):
    """The real command in a process of its own: a 4D image among larger cases used to print its
    line, then 'terminate called without an active exception' and exit 134 (a cache-filling
    thread still in torch when Python shut down)."""
    import subprocess
    import sys

    from tests.conftest import make_dataset

    data = make_dataset(tmp_path / "data", cases=6, shape=(128, 128, 48))
    write_nifti(data / "imagesTr" / "img0001.nii.gz", np.zeros((128, 128, 48, 2), np.int16), np.diag([1.5, 1.5, 2.0, 1.0]))
    done = subprocess.run(
        [sys.executable, "-m", "hsmla_med.cli", "train", "--task", "btcv", "--data-dir", str(data), "--max-steps", "1",
         "--output", str(tmp_path / "run"), "--accelerator", "cpu"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower() or "terminate" in line]
    assert errors == [f"hsmla-med: error: {data / 'imagesTr' / 'img0001.nii.gz'}: image has 2 channel(s), the model expects 1"], done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("task, marker", [("btcv", "dataset_0.json"), ("endovis", "synthetic.json"), ("camelyon16", "synthetic.json")])
def test_foreign_dataset_in_the_synthetic_cache_is_one_line(capsys, tmp_path, task, marker):
    """A dataset the generator did not write, where it would write its own, is refused (never
    overwritten) in one line; it used to end in FileExistsError's traceback."""
    foreign = tmp_path / "cache" / f"{task}-synthetic" / marker
    foreign.parent.mkdir(parents=True)
    foreign.write_text('{"name": "my own data"}')
    config = _yaml(tmp_path, f"data: {{cache_dir: {tmp_path / 'cache'}}}\n")
    line = _error(capsys, ["train", "--task", task, "--config", config, "--max-steps", "1", "--output", str(tmp_path / "run")])
    assert line.startswith(f"hsmla-med: error: {foreign}: not written by the synthetic") and "set data.cache_dir to another folder" in line
    assert foreign.read_text() == '{"name": "my own data"}'


@pytest.mark.parametrize("damage", ["truncated", "not an archive", "other arrays"])
def test_damaged_patch_grid_cache_is_computed_again(tmp_path, caplog, damage):
    """A patch-grid cache file cut short, overwritten or holding other arrays used to end in
    numpy's traceback (BadZipFile, a pickle refusal) or a KeyError: the grid is computed again,
    equal to the first, the file replaced, and a log line names it."""
    from hsmla_med.data.synthetic.wsi import generate_camelyon16
    from hsmla_med.pipelines import camelyon16

    generate_camelyon16(tmp_path / "data", num_normal=1, num_tumor=1, num_test=0, size=(768, 512))
    config = task_config("camelyon16")["data"] | {"cache_dir": str(tmp_path / "cache"), "patch_size": 64, "stride": 64}
    case = {"slide": str(next((tmp_path / "data").rglob("tumor_*.tif"))), "annotation": None, "label": 0}
    first = camelyon16.slide_patches(case, config)
    (cache,) = (tmp_path / "cache" / "camelyon16-patches").glob("*.npz")
    if damage == "truncated":
        cache.write_bytes(cache.read_bytes()[:200])
    elif damage == "not an archive":
        cache.write_bytes(b"\x80\x04garbage")
    else:
        np.savez(cache, something=np.zeros(3))
    with caplog.at_level("WARNING", logger="hsmla_med"):
        again = camelyon16.slide_patches(case, config)
    assert f"{cache}: damaged patch-grid cache" in caplog.text
    assert set(again) == set(first)
    for key in first:
        np.testing.assert_array_equal(again[key], first[key])
    with np.load(cache) as f:
        assert set(f.files) == set(first)


def test_infer_refuses_analyze_and_a_pair_without_its_voxels_in_one_line(capsys, tmp_path, btcv_ckpt):
    import nibabel as nib

    (tmp_path / "in").mkdir()
    nib.save(nib.AnalyzeImage(np.zeros((8, 8, 4), np.float32), np.eye(4)), str(tmp_path / "in" / "old.hdr"))
    argv = ["infer", "--task", "btcv", "--checkpoint", str(btcv_ckpt), "--output", str(tmp_path / "o"), "--input"]
    line = _error(capsys, argv + [str(tmp_path / "in" / "old.hdr")])
    assert "old.hdr: an Analyze 7.5 image, not NIfTI" in line and "no orientation" in line
    nib.save(nib.Nifti1Pair(np.zeros((8, 8, 4), np.float32), np.eye(4)), str(tmp_path / "in" / "pair.hdr"))
    (tmp_path / "in" / "pair.img").unlink()
    line = _error(capsys, argv + [str(tmp_path / "in" / "pair.hdr")])
    assert "pair.hdr: the NIfTI pair's image file pair.img is missing" in line
    assert not (tmp_path / "o").exists()


def test_a_prediction_that_failed_before_its_first_output_blocks_no_later_run(capsys, tmp_path, btcv_ckpt):
    # it wrote provenance.json, then failed on the image (NaN voxels); before, the next run with other
    # options was refused: "holds outputs of other options (tta False -> True)", though it held none
    bad = np.zeros((16, 16, 4), np.float32)
    bad[3, 3, 1] = np.nan
    case = write_nifti(tmp_path / "in" / "a.nii.gz", bad, np.eye(4))
    out = tmp_path / "existing"
    out.mkdir()
    argv = ["infer", "--task", "btcv", "--checkpoint", str(btcv_ckpt), "--input", str(case), "--output", str(out)]
    assert "NaN or Inf" in _error(capsys, argv)
    assert "NaN or Inf" in _error(capsys, [*argv[:-1], str(tmp_path / "new" / "o")])
    assert not (tmp_path / "new").exists()  # a folder it created holds nothing after the failure, not even records
    write_nifti(case, np.zeros((16, 16, 4), np.float32), np.eye(4))
    from hsmla_med.cli import main

    assert main(argv + ["--tta"]) == 0
    assert (out / "a.nii.gz").is_file()


@pytest.mark.parametrize("config_task, task", [("luna16", "btcv"), ("btcv", "camelyon16"), ("endovis", "segmentation")])
def test_config_of_another_task_is_one_line_naming_both(capsys, tmp_path, config_task, task):
    """A --config whose task: differs from --task ended in a KeyError of a section the other task
    lacks ('hu_window'); it is one line naming both."""
    user = _yaml(tmp_path, f"task: {config_task}\n")
    line = _error(capsys, ["train", "--task", task, "--config", user, "--output", str(tmp_path / "run")])
    assert f"{user}: task: {config_task}" in line and f"--task {task}" in line
    assert not (tmp_path / "run").exists()


def test_config_naming_the_task_by_its_generic_name_is_the_same_task(tmp_path):
    from hsmla_med.cli import build_parser
    from hsmla_med.cli.options import run_config as _config

    user = _yaml(tmp_path, "task: segmentation\n")
    args = build_parser().parse_args(["train", "--task", "btcv", "--config", user])
    args.task_alias = None
    assert _config(args)["task"] == "btcv"


@pytest.mark.parametrize("intensity, kind", [
    ("{a_min: -100, a_max: 240}", "kind: ct_window"),
    ("{lower: 1, upper: 99}", "kind: percentile"),
    ("{a_min: -100, a_max: 240, mean: 50, std: 40}", "kind: ct_zscore"),
])
def test_a_window_without_kind_is_not_silently_replaced_by_the_plan(capsys, tmp_path, dataset, intensity, kind):
    """data.intensity with a_min/a_max but no kind kept kind auto, and the plan replaced the
    user's window with its own without a word: now one line saying so and how to keep it."""
    config = yaml.safe_load(tiny_yaml(tmp_path / "tiny.yaml").read_text())
    del config["data"]["intensity"]
    user = tmp_path / "user.yaml"
    user.write_text(yaml.safe_dump({**config, "data": {**config["data"], "intensity": yaml.safe_load(intensity)}}))
    line = _error(capsys, ["train", "--task", "btcv", "--data-dir", str(dataset), "--config", str(user), "--output", str(tmp_path / "run")])
    assert f"{user}: data.intensity" in line and "no kind" in line and kind in line
    assert not (tmp_path / "run" / "last.ckpt").exists()


def test_num_nodes_without_a_launcher_is_refused_at_once(capsys, tmp_path, dataset, btcv_ckpt, monkeypatch):
    """--num-nodes 2 without torchrun, SLURM or MASTER_ADDR waited for the other node until the
    start-up deadline (300 s): refused before any work instead."""
    import lightning as L

    for name in list(__import__("os").environ):
        if name.startswith(("SLURM_", "TORCHELASTIC_", "LSB_", "OMPI_", "PMI_")) or name in ("MASTER_ADDR", "NODE_RANK", "RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK"):
            monkeypatch.delenv(name)

    def reached(*args, **kwargs):
        raise AssertionError("the run started and would wait for the other node")

    for loop in ("fit", "validate", "predict"):
        monkeypatch.setattr(L.Trainer, loop, reached)
    line = _error(capsys, ["train", "--task", "btcv", "--data-dir", str(dataset), "--config", str(tiny_yaml(tmp_path / "t.yaml")),
                           "--num-nodes", "2", "--accelerator", "cpu", "--output", str(tmp_path / "run")])
    assert "--num-nodes 2 needs a launcher (torchrun, SLURM) on every node" in line
    case = write_nifti(tmp_path / "in" / "a.nii.gz", np.zeros((16, 16, 4), np.float32), np.eye(4))
    line = _error(capsys, ["infer", "--task", "btcv", "--checkpoint", str(btcv_ckpt), "--input", str(case), "--num-nodes", "2",
                           "--strategy", "ddp", "--output", str(tmp_path / "o")])
    assert "--num-nodes 2 needs a launcher (torchrun, SLURM) on every node" in line


def _bad_checkpoints(folder, btcv_ckpt) -> dict:
    """Files given where a checkpoint of train is needed, and what the refusal must say."""
    import os
    import pickle
    import zipfile

    class Hostile:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    folder.mkdir(exist_ok=True)
    (folder / "empty.ckpt").write_bytes(b"")
    (folder / "text.ckpt").write_text("a text file\n")
    torch.save({"hyper_parameters": Hostile(), "state_dict": {}}, folder / "hostile.ckpt")
    (folder / "hostile.pkl").write_bytes(pickle.dumps({"hyper_parameters": Hostile()}))
    whole = btcv_ckpt.read_bytes()
    (folder / "truncated.ckpt").write_bytes(whole[: len(whole) // 2])
    torch.save(torch.load(btcv_ckpt, weights_only=True)["state_dict"], folder / "model.pt")
    with zipfile.ZipFile(folder / "model.ts", "w") as archive:  # a TorchScript archive's layout
        archive.writestr("model/code/__torch__.py", "")
        archive.writestr("model/data.pkl", b"")
    (folder / "bundle" / "models").mkdir(parents=True, exist_ok=True)
    (folder / "bundle" / "models" / "model.ts").write_bytes((folder / "model.ts").read_bytes())
    return {
        "empty.ckpt": "empty (0 bytes)",
        "text.ckpt": "neither a zip archive nor a pickle",
        "hostile.ckpt": "holds objects that weights_only loading refuses (posix.system): not loaded, as it could run code",
        "hostile.pkl": "holds objects that weights_only loading refuses (posix.system): not loaded, as it could run code",
        "truncated.ckpt": "truncated",
        "model.pt": "a state dict without the hyper-parameters",
        "model.ts": "a TorchScript network of hsmla-med export, not a checkpoint; give the .ckpt file that train wrote",
        "bundle": "a MONAI bundle of hsmla-med export, not a checkpoint; give the .ckpt file that train wrote",
        "/dev/zero": "not a regular file",
    }


@pytest.mark.parametrize("command", ["export", "evaluate", "calibrate", "infer"])
def test_checkpoint_refusals_are_ours_never_pytorchs_advice(capsys, tmp_path, dataset, btcv_ckpt, command):
    """A 0-byte file said "EOFError:", a TorchScript file or a hostile pickle quoted PyTorch's advice
    to set weights_only=False, /dev/zero and a bundle folder were "not found": each is now named
    for what it is, with what to give instead."""
    cases = _bad_checkpoints(tmp_path / "bad", btcv_ckpt)
    if command in ("infer", "evaluate"):  # they run exported networks themselves
        cases = {name: expected for name, expected in cases.items() if name not in ("model.ts", "bundle")}
    for name, expected in cases.items():
        path = name if name.startswith("/") else str(tmp_path / "bad" / name)
        argv = {
            "export": ["export", "--checkpoint", path, "--format", "onnx", "--output", str(tmp_path / "o")],
            "evaluate": ["evaluate", "--task", "btcv", "--checkpoint", path, "--data-dir", str(dataset), "--output", str(tmp_path / "o")],
            "calibrate": ["calibrate", "--checkpoint", path, "--data-dir", str(dataset), "--output", str(tmp_path / "o")],
            "infer": ["infer", "--task", "btcv", "--checkpoint", path, "--input", str(tmp_path), "--output", str(tmp_path / "o")],
        }[command]
        line = _error(capsys, argv)
        assert f"{path}: " in line and expected in line, (name, line)
        assert "weights_only=False" not in line and "torch.save" not in line and "mmap" not in line and "EOFError" not in line, line


@pytest.mark.parametrize("name", ["hostile.ckpt", "model.ts", "/dev/zero"])
def test_resume_from_a_foreign_last_checkpoint_says_what_it_is(capsys, tmp_path, dataset, btcv_ckpt, name):
    import os

    cases = _bad_checkpoints(tmp_path / "bad", btcv_ckpt)
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(name if name.startswith("/") else tmp_path / "bad" / name, run / "last.ckpt")
    line = _error(capsys, ["train", "--task", "btcv", "--data-dir", str(dataset), "--config", str(tiny_yaml(tmp_path / "t.yaml")),
                           "--output", str(run), "--resume"])
    assert f"{run / 'last.ckpt'}: " in line and cases[name].split(";")[0] in line, line
    assert "truncated or damaged" not in line and "weights_only=False" not in line
