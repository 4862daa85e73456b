"""Nothing lost at any kill: a run killed while writing ``last.ckpt`` (with ``$TMPDIR`` on another
filesystem than the run folder) keeps the previous complete ``last.ckpt``, the next run removes
the killed run's temporary and resumes from it; an empty or truncated ``last.ckpt`` is a clear
error, not a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hsmla_med.cli import main
from hsmla_med.config import model_config
from hsmla_med.engine import SegmentationModule
from hsmla_med.engine.run import fit
from hsmla_med.errors import DataError
from hsmla_med.io import is_temporary
from hsmla_med.pipelines import btcv
from tests.conftest import tiny_config, tiny_yaml

ROOT = Path(__file__).resolve().parents[1]

# The child trains 4 steps (validations, and writes of last.ckpt, at steps 2 and 4). Every
# Python-level open() for writing a "last" checkpoint file in the run folder while a last.ckpt
# already exists (the second write, whichever file the checkpoint IO opens: a temporary beside it,
# or last.ckpt itself as fsspec's cross-filesystem move does) creates the file, signals the
# parent through the marker and hangs, as a slow disk would; the parent kills it there.
CHILD = '''
import builtins, io, os, sys, time
from pathlib import Path

out, data, marker = (Path(a).absolute() for a in sys.argv[1:4])
real_open = builtins.open


def stalling_open(file, mode="r", *args, **kwargs):
    path = Path(os.fsdecode(file)).absolute() if isinstance(file, (str, bytes, os.PathLike)) else None
    second = path is not None and (out / "last.ckpt").exists()
    f = real_open(file, mode, *args, **kwargs)
    if second and any(m in mode for m in "wax") and path.parent == out and path.suffix == ".ckpt" and "last" in path.name:
        marker.write_text(str(path))
        time.sleep(600)
    return f


builtins.open = io.open = stalling_open

import torch
from hsmla_med.config import model_config
from hsmla_med.engine import SegmentationModule
from hsmla_med.engine.run import fit
from hsmla_med.pipelines import btcv
from tests.conftest import tiny_config

torch.manual_seed(0)
config = tiny_config(data, out, max_steps=4)
cases = btcv.datalist(config)
module = SegmentationModule(btcv.module_config(config, model_config("b0"), cases.label_names))
fit(module, btcv.datamodule(config, cases), out, config["trainer"])
'''


def _other_filesystem_tmpdir(tmp_path: Path) -> Path:
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK) or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the test's temporary folder")
    return shm


def test_kill_while_writing_last_checkpoint_keeps_the_previous_one(tmp_path, dataset):
    tmpdir = _other_filesystem_tmpdir(tmp_path)
    out, marker, script = tmp_path / "run", tmp_path / "writing", tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, TMPDIR=str(tmpdir), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    with (tmp_path / "child.log").open("w") as log:
        child = subprocess.Popen([sys.executable, str(script), str(out), str(dataset), str(marker)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert marker.exists(), f"the child never wrote its second last.ckpt:\n{(tmp_path / 'child.log').read_text()[-3000:]}"
        finally:
            if child.poll() is None:
                os.kill(child.pid, signal.SIGKILL)
            child.wait()
    assert child.returncode == -signal.SIGKILL
    # the previous complete last.ckpt (step 2), and the killed write's temporary beside it
    assert torch.load(out / "last.ckpt", weights_only=True)["global_step"] == 2
    assert [p for p in out.iterdir() if is_temporary(p)], sorted(p.name for p in out.iterdir())

    torch.manual_seed(0)
    config = tiny_config(dataset, out, max_steps=4)
    cases = btcv.datalist(config)
    module = SegmentationModule(btcv.module_config(config, model_config("b0"), cases.label_names))
    summary = fit(module, btcv.datamodule(config, cases), out, config["trainer"], resume=True)
    assert summary["cases"] == 1
    assert torch.load(out / "last.ckpt", weights_only=True)["global_step"] == 4
    assert not [p.name for p in out.iterdir() if is_temporary(p)]


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 the first bytes of a zip and no more"], ids=["empty", "truncated"])
def test_resume_from_a_damaged_checkpoint_is_a_clear_error(tmp_path, dataset, capsys, content):
    out = tmp_path / "run"
    out.mkdir()
    (out / "last.ckpt").write_bytes(content)
    config = tiny_config(dataset, out, max_steps=2)
    cases = btcv.datalist(config)
    module = SegmentationModule(btcv.module_config(config, model_config("b0"), cases.label_names))
    with pytest.raises(DataError, match=r"last\.ckpt") as err:
        fit(module, btcv.datamodule(config, cases), out, config["trainer"], resume=True)
    message = str(err.value)
    assert str(out / "last.ckpt") in message and "\n" not in message
    assert ("empty" if not content else "truncated") in message

    argv = ["train", "--task", "btcv", "--data-dir", str(dataset), "--config", str(tiny_yaml(tmp_path / "tiny.yaml")),
            "--output", str(out), "--max-steps", "2", "--resume"]
    capsys.readouterr()
    assert main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hsmla-med: error")]
    assert len(errors) == 1 and str(out / "last.ckpt") in errors[0]
