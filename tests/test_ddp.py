"""Two-process DDP on CPU (gloo): the gathered validation metrics equal one process's.

Three validation cases over two processes makes Lightning's distributed sampler repeat one
case; the module must count each case once for the two results to agree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hsmla_med.cli import main
from tests.conftest import make_dataset, tiny_yaml


def _evaluate(tmp_path, data, config, ckpt, name, *extra) -> dict:
    out = tmp_path / name
    cmd = [sys.executable, "-m", "hsmla_med.cli", "evaluate", "--task", "btcv", "--data-dir", str(data), "--config", str(config),
           "--checkpoint", str(ckpt), "--output", str(out), "--accelerator", "cpu", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((out / "metrics.json").read_text())


def test_two_process_gloo_matches_one_process(tmp_path):
    data = make_dataset(tmp_path / "data", cases=5, validation=3)
    config = tiny_yaml(tmp_path / "tiny.yaml")
    run = tmp_path / "run"
    assert main(["train", "--task", "btcv", "--data-dir", str(data), "--config", str(config), "--max-steps", "4", "--output", str(run)]) == 0
    one = _evaluate(tmp_path, data, config, run / "last.ckpt", "one", "--devices", "1")
    two = _evaluate(tmp_path, data, config, run / "last.ckpt", "two", "--devices", "2", "--strategy", "ddp")
    assert one["cases"] == two["cases"] == 3
    for key in ("dice", "hd95"):
        assert two[key] == pytest.approx(one[key], rel=1e-6)
    assert two["dice_per_class"] == pytest.approx(one["dice_per_class"], rel=1e-6)
    assert two["step"] == one["step"] == 4
