"""Ctrl-C and kill: SIGINT or SIGTERM at any point of a command (in Lightning's training,
validation and predict loops, or in an export) ends it with status 130 or 143 and exactly one
``hsmla-med: interrupted`` line, and leaves no temporary and no half-written output behind; the
temporaries of a process killed outright (``kill -9``) are removed by the next command that
writes there."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hsmla_med.cli import main
from hsmla_med.config import merge_config, model_config, task_config
from hsmla_med.data.synthetic.wsi import generate_camelyon16
from hsmla_med.io import is_temporary
from hsmla_med.pipelines import get_task
from tests.conftest import make_dataset, phantom, tiny_config, tiny_yaml, write_nifti

ROOT = Path(__file__).resolve().parents[1]


def _checkpoint(path: Path, task: str, config: dict, labels: list[str]) -> Path:
    """A checkpoint as ``train`` writes it (hyper-parameters and weights), without training."""
    task = get_task(task)
    module = task.module_class(task.module_config(config, model_config("b0"), labels))
    torch.save({"hyper_parameters": dict(module.hparams), "state_dict": module.state_dict(), "epoch": 0, "global_step": 0}, path)
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    """A BTCV dataset, a config that trains on it in seconds, a volume, a slide, and checkpoints
    of both tasks."""
    root = tmp_path_factory.mktemp("signals")  # (a name that no line may contain: "interrupt")
    data = make_dataset(root / "data", cases=2)
    image, _ = phantom((40, 36, 6), np.random.default_rng(1))
    generate_camelyon16(root / "c16", num_normal=0, num_tumor=1, num_test=0, size=(1024, 768))
    return {
        "data": data,
        "tiny": tiny_yaml(root / "tiny.yaml"),
        "volume": write_nifti(root / "in" / "case7.nii.gz", image, np.diag([1.5, 1.5, 2.0, 1.0])),
        "slide": next((root / "c16").rglob("*.tif")),
        "btcv": _checkpoint(root / "btcv.ckpt", "btcv", tiny_config(data, root / "run"), ["background", "disc", "bar"]),
        "camelyon16": _checkpoint(root / "c16.ckpt", "camelyon16", merge_config(task_config("camelyon16"), {"data": {"patch_size": 64, "stride": 64}}),
                                  ["normal", "tumour"]),
    }


def _argv(command: str, inputs: dict, out: Path) -> list[str]:
    if command == "train":
        return ["train", "--task", "btcv", "--data-dir", str(inputs["data"]), "--config", str(inputs["tiny"]), "--max-steps", "2",
                "--output", str(out)]
    if command == "evaluate":
        return ["evaluate", "--checkpoint", str(inputs["btcv"]), "--data-dir", str(inputs["data"]), "--config", str(inputs["tiny"]),
                "--allow-training-cases", "--output", str(out)]
    if command == "infer":
        return ["infer", "--checkpoint", str(inputs["btcv"]), "--input", str(inputs["volume"]), "--save-probabilities", "--output", str(out)]
    if command == "export":
        return ["export", "--checkpoint", str(inputs["btcv"]), "--format", "torchscript", "--output", str(out)]
    return [command, "--checkpoint", str(inputs["camelyon16"]), "--slide", str(inputs["slide"]), "--output", str(out)]


# where each command is interrupted: a step of Lightning's loop, or (export) while its file is
# being written, between torch.jit.save into the temporary and the rename
WHERE = {
    "train": (lambda: get_task("btcv").module_class, "training_step"),
    "evaluate": (lambda: get_task("btcv").module_class, "validation_step"),
    "infer": (lambda: get_task("btcv").module_class, "predict_step"),
    "wsi-heatmap": (lambda: get_task("camelyon16").module_class, "predict_step"),
    "wsi-features": (lambda: get_task("camelyon16").module_class, "predict_step"),
    "export": (lambda: torch.jit, "load"),
}


# what a command writes as it finishes (a case, a slide, a run), none of which may be there
FINISHED = {
    "train": "last.ckpt best.ckpt metrics.json",
    "evaluate": "metrics.json",
    "infer": "case7.nii.gz case7.npz",
    "wsi-heatmap": "{slide}.json {slide}_heatmap.tif lesions/{slide}.csv",
    "wsi-features": "h5_files/{slide}.h5 pt_files/{slide}.pt",
    "export": "model.ts export.json",
}


class _Unhandled(Exception):
    pass


def _unhandled(signum, frame):
    raise _Unhandled(f"signal {signum} reached the test's handler: the command did not handle it")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("command", list(WHERE))
def test_a_signal_anywhere_ends_the_command_with_one_line(capsys, monkeypatch, tmp_path, inputs, command, signum):
    owner, name = WHERE[command]
    owner = owner()
    original = getattr(owner, name)

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signum)  # handled as soon as this call returns to Python
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, interrupted)
    # the signal as the process would get it, without ending the test session when a command
    # leaves it unhandled (SIGTERM's default ends the process)
    before = {s: signal.signal(s, _unhandled if s == signal.SIGTERM else signal.default_int_handler) for s in (signal.SIGINT, signal.SIGTERM)}
    out = tmp_path / "out"
    try:
        status = main(_argv(command, inputs, out))
        after = {s: signal.getsignal(s) for s in before}
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    err = capsys.readouterr().err
    assert status == 128 + signum, err
    assert "Traceback" not in err and [line for line in err.splitlines() if "interrupt" in line.lower()] == ["hsmla-med: interrupted"], err
    assert after == {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: _unhandled}  # handlers given back
    written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) if out.exists() else []
    assert not [p for p in written if is_temporary(p)], written
    slide = inputs["slide"].stem
    assert not set(written) & set(FINISHED[command].format(slide=slide).split()), written


# The child's predict step says it has started, then takes a minute: the parent interrupts it
# there, from outside, as a user's Ctrl-C or a scheduler's kill would.
CHILD = """
import sys, time
from pathlib import Path

from hsmla_med.pipelines import get_task

module_class, marker = get_task("btcv").module_class, Path(sys.argv[1])
step = module_class.predict_step


def slow_step(self, *args, **kwargs):
    marker.touch()
    time.sleep(60)
    return step(self, *args, **kwargs)


module_class.predict_step = slow_step
from hsmla_med.cli import main

sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_from_outside_during_prediction(tmp_path, inputs, signum):
    """Ctrl-C: Lightning's predict loop turned KeyboardInterrupt into sys.exit(1) after its own
    clean-up (exit 1, no line). kill: Lightning logs "Received SIGTERM" from the loop. Either way
    the process ends with 130 or 143 and one line."""
    marker, out = tmp_path / "predicting", tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(marker), *_argv("infer", inputs, out)], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), child.communicate()[1][-3000:] if child.poll() is not None else "the child never started predicting"
        child.send_signal(signum)
        _, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 128 + signum, err
    assert [line for line in err.splitlines() if line.strip()] == ["hsmla-med: interrupted"], err
    assert not [p for p in out.rglob("*") if is_temporary(p) or p.name.startswith("case7")] if out.exists() else True


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    return int(done.stdout)


@pytest.mark.parametrize("command", ["infer", "wsi-heatmap", "wsi-features", "export", "evaluate"])
def test_every_writing_command_sweeps_what_killed_runs_left(tmp_path, inputs, command):
    """``kill -9`` leaves the hidden temporary of the file being written (``.case7.<pid>.tmp.npz``
    of infer, ``.<slide>_heatmap.<pid>.tmp.tif`` of wsi-heatmap, one in a subfolder, a provenance
    record's); the next run of any command that writes there removes those of dead processes,
    and leaves a running process's alone."""
    out, dead, slide = tmp_path / "out", _dead_pid(), inputs["slide"].stem
    stale = [out / f".case7.{dead}.tmp.npz", out / f".{slide}_heatmap.{dead}.tmp.tif", out / "lesions" / f".{slide}.{dead}.tmp.csv",
             out / ".provenance" / f".case7.nii.gz.{dead}.tmp.json", out / "models" / f".model.{dead}.tmp.ts"]
    live = [out / f".case8.{os.getppid()}.tmp.nii.gz", out / "lesions" / f".other.{os.getppid()}.tmp.csv"]  # another process's, running
    for path in stale + live:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half")
    assert main(_argv(command, inputs, out)) == 0
    assert [p for p in stale if p.exists()] == [] and all(p.exists() for p in live)
