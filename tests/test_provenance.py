"""Outputs know where they came from: ``infer`` into a folder of another checkpoint or other
options is refused (one line naming the folder and the difference) unless ``--overwrite``; the
same checkpoint and options resume; an output that would be its own input is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from hsmla_med.config import merge_config, model_config, task_config
from hsmla_med.errors import InputError
from hsmla_med.pipelines import btcv, endovis
from tests.conftest import TINY as BTCV_TINY
from tests.conftest import cli_error, phantom, write_nifti

PROVENANCE = "provenance.json"
ENDOVIS_TINY = {"data": {"size": [32, 40], "num_workers": 0}}


def _checkpoint(path, task, overrides, labels, seed=0):
    """A checkpoint of an untrained network, as ``train`` writes it (what ``load`` reads)."""
    config = merge_config(task_config(task.name), overrides)
    torch.manual_seed(seed)
    module = task.module_class(task.module_config(config, model_config("b0"), labels))
    torch.save({"hyper_parameters": module.config, "state_dict": module.state_dict(), "epoch": 0, "global_step": 0}, path)
    return path


@pytest.fixture(scope="module")
def frames(tmp_path_factory):
    """Two EndoVis checkpoints (other weights) and a folder of three small frames."""
    root = tmp_path_factory.mktemp("prov")
    folder = root / "frames"
    folder.mkdir()
    for i in range(3):
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(folder / f"f{i}.png")
    ckpts = [_checkpoint(root / f"{n}.ckpt", endovis.TASK, ENDOVIS_TINY, endovis.PROBLEMS["binary"], seed) for n, seed in (("a", 0), ("b", 1))]
    return ckpts, folder


def _infer(ckpt, inputs, out, *extra):
    from hsmla_med.cli import main

    return main(["infer", "--task", "endovis", "--checkpoint", str(ckpt), "--input", str(inputs), "--output", str(out), "--device", "cpu", *extra])


def _stamps(out):
    return {p.name: p.stat().st_mtime_ns for p in out.glob("f*.png")}


def test_another_checkpoint_or_options_refused_same_resumes_overwrite_rewrites(frames, tmp_path, capsys, monkeypatch):
    (a, b), folder = frames
    out = tmp_path / "out"
    assert _infer(a, folder, out) == 0
    first = _stamps(out)
    assert len(first) == 3
    # another checkpoint: one line naming the folder and what differs, nothing rewritten
    line = cli_error(capsys, ["infer", "--task", "endovis", "--checkpoint", str(b), "--input", str(folder), "--output", str(out), "--device", "cpu"])
    assert f"{out}: holds outputs of another checkpoint" in line and str(a) in line and str(b) in line and "--overwrite" in line
    # other options that change the masks: refused as well
    line = cli_error(capsys, ["infer", "--task", "endovis", "--checkpoint", str(a), "--input", str(folder), "--output", str(out), "--device", "cpu", "--tta"])
    assert f"{out}: holds outputs of other options (tta False -> True)" in line
    assert _stamps(out) == first
    record = json.loads((out / PROVENANCE).read_text())
    assert record["model"]["checkpoint"] == str(a) and record["options"]["tta"] is False
    # the same checkpoint and options (another file of the same weights too): every frame skipped
    copy = tmp_path / "copy.ckpt"
    copy.write_bytes(a.read_bytes())
    assert _infer(copy, folder, out) == 0
    assert _stamps(out) == first and "3 of 3 case(s) done before" in capsys.readouterr().out
    monkeypatch.chdir(out)  # outputs named relative to the working directory are no inputs
    assert _infer(a, folder, ".") == 0 and _stamps(out) == first
    monkeypatch.chdir(tmp_path)
    # --overwrite: every mask rewritten by the other checkpoint, whose outputs the folder then holds
    assert _infer(b, folder, out, "--overwrite") == 0
    assert all(_stamps(out)[name] != stamp for name, stamp in first.items())
    assert json.loads((out / PROVENANCE).read_text())["model"]["checkpoint"] == str(b)
    rewritten = _stamps(out)
    assert _infer(b, folder, out) == 0 and _stamps(out) == rewritten


def test_outputs_without_a_record_are_not_taken_for_this_runs(frames, tmp_path, capsys):
    (a, _), folder = frames
    out = tmp_path / "old"
    out.mkdir()
    Image.fromarray(np.zeros((40, 48), np.uint8)).save(out / "f1.png")  # an older program's mask
    line = cli_error(capsys, ["infer", "--task", "endovis", "--checkpoint", str(a), "--input", str(folder), "--output", str(out), "--device", "cpu"])
    assert f"{out}: holds f1.png with no provenance record" in line
    assert _infer(a, folder, out, "--overwrite") == 0
    assert np.asarray(Image.open(out / "f1.png")).shape == (40, 48) and len(_stamps(out)) == 3


def test_output_equal_to_input_is_refused(frames, tmp_path, capsys):
    (a, _), folder = frames
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    line = cli_error(capsys, ["infer", "--task", "endovis", "--checkpoint", str(a), "--input", str(folder), "--output", str(folder), "--device", "cpu"])
    assert f"--output {folder}: is the --input itself" in line
    # a frame given as the input, its folder as the output: the mask would be the frame itself
    line = cli_error(capsys, ["infer", "--task", "endovis", "--checkpoint", str(a), "--input", str(folder / "f0.png"), "--output", str(folder), "--device", "cpu"])
    assert f"{folder / 'f0.png'}: the output of f0.png would be its own input" in line
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_btcv_volume_as_its_own_output_is_refused(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path / "btcv.ckpt", btcv.TASK, BTCV_TINY, ["background", "spleen", "liver"])
    image, _ = phantom((20, 18, 4), np.random.default_rng(0))
    volume = write_nifti(tmp_path / "in" / "case1.nii.gz", image, np.eye(4))
    line = cli_error(capsys, ["infer", "--task", "btcv", "--checkpoint", str(ckpt), "--input", str(volume), "--output", str(volume.parent), "--device", "cpu"])
    assert f"{volume}: the output of case1 would be its own input" in line
    np.testing.assert_array_equal(np.asarray(__import__("nibabel").load(str(volume)).dataobj), image)


def test_claim_outputs_records_before_predicting(tmp_path):
    """The records' order and content without the command line: records of the pending outputs
    and the folder's are written before anything is predicted; a process that does not write
    leaves the folder as it is; the digest depends on the weights, not on the file."""
    from hsmla_med.engine.prediction import claim_outputs, model_digest

    items = [{"name": n, "output": tmp_path / "sub" / f"{n}.txt"} for n in ("x", "y")]
    record = {"format": 1, "model": {"sha256": "1" * 64, "checkpoint": None}, "options": {"tta": False}}
    assert claim_outputs(items, tmp_path, record, write=False) == items and not (tmp_path / PROVENANCE).exists()
    assert claim_outputs(items, tmp_path, record) == items
    assert json.loads((tmp_path / ".provenance" / "sub" / "x.txt.json").read_text()) == record
    items[0]["output"].parent.mkdir()
    items[0]["output"].write_text("done")
    assert claim_outputs(items, tmp_path, record) == items[1:]
    with pytest.raises(InputError, match="other options"):
        claim_outputs(items, tmp_path, {**record, "options": {"tta": True}})
    (tmp_path / PROVENANCE).write_text("{not json")
    with pytest.raises(InputError, match="unreadable provenance record"):
        claim_outputs(items, tmp_path, record)
    net = torch.nn.Linear(2, 2)
    digest = model_digest(net)
    with torch.no_grad():
        net.bias[0] += 1
    assert model_digest(net) != digest
