"""Two-process DDP on CPU (gloo): the gathered validation metrics equal one process's.

Three validation cases over two processes makes Lightning's distributed sampler repeat one
case; the module must count each case once for the two results to agree. Training under DDP,
both processes calibrate tau on the same (rank 0's) inputs and hold the same records.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pathlib import Path

import pytest

from hsmla_med.cli import main
from hsmla_med.engine.run import evaluate, load_module
from hsmla_med.engine.segmentation import SegmentationModule
from hsmla_med.pipelines import btcv
from tests.conftest import make_dataset, tiny_config, tiny_yaml

ROOT = Path(__file__).resolve().parents[1]

# Trains 3 steps on 2 CPU processes; every process appends, after each validation, its tau,
# the keys of the items it validated itself, the gathered records' keys and the summary.
FIT = """
import json, sys
from pathlib import Path

import torch
from hsmla_med.config import model_config
from hsmla_med.engine.run import fit
from hsmla_med.engine.segmentation import SegmentationModule
from hsmla_med.pipelines import btcv
from tests.conftest import tiny_config


class Recording(SegmentationModule):
    def on_validation_epoch_end(self):
        own = [r["key"] for r in self._records]
        super().on_validation_epoch_end()
        line = {"step": self.global_step, "tau": self.calibrated_tau, "own": own, "keys": [r["key"] for r in self.records], "summary": self.summary}
        with (Path(sys.argv[2]) / f"rank{self.global_rank}.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\\n")


if __name__ == "__main__":
    torch.manual_seed(0)
    config = tiny_config(Path(sys.argv[1]), Path(sys.argv[2]), max_steps=3, devices=2, strategy="ddp")
    cases = btcv.datalist(config)
    module = Recording(btcv.module_config(config, model_config("b0"), cases.label_names))
    fit(module, btcv.datamodule(config, cases), sys.argv[2], config["trainer"])
"""


# Two CPU processes whose own lists of cases differ (rank 0: two cases, rank 1: none, as when a
# case's output appears between the two looks): each writes its share of rank 0's list.
PREDICT = """
import os, sys
from pathlib import Path

import lightning as L
import torch
from hsmla_med.engine.prediction import PredictionDataModule, run_prediction


class Echo(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)

    def predict_step(self, batch, batch_idx):
        return batch


def write(item):
    path = Path(item["output"])
    path.write_text(os.environ.get("LOCAL_RANK", "0"))
    return [path]


if __name__ == "__main__":
    out = Path(sys.argv[1])
    items = [{"name": n, "output": str(out / n)} for n in ("a", "b")] if os.environ.get("LOCAL_RANK", "0") == "0" else []
    run_prediction(Echo(), PredictionDataModule(items), write, "cpu", devices=2, strategy="ddp")
"""


def test_two_processes_predict_rank_zeros_cases_whatever_their_own_lists(tmp_path):
    script = tmp_path / "predict_ddp.py"
    script.write_text(PREDICT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    try:
        result = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=ROOT, capture_output=True, text=True, env=env, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail("rank 1 decided alone that it had nothing to predict; rank 0 waited for it")
    assert result.returncode == 0, result.stderr[-3000:]
    assert {n: (tmp_path / n).read_text() for n in ("a", "b")} == {"a": "0", "b": "1"}  # each process its share


def test_a_run_whose_peers_never_come_stops_with_one_line_naming_them(tmp_path):
    """``--num-nodes 2`` launched as node 0 (``MASTER_ADDR``: Lightning's own multi-node launch)
    without a second node: rank 1 never comes. The run stops after HSMLA_MED_START_TIMEOUT
    seconds with one line naming it (it used to wait 30 minutes). (Without any launcher the run
    is refused before it starts: tests/test_bad_inputs.py.)"""
    import socket

    data = make_dataset(tmp_path / "data")
    cmd = [sys.executable, "-m", "hsmla_med.cli", "train", "--task", "btcv", "--data-dir", str(data), "--config", str(tiny_yaml(tmp_path / "tiny.yaml")),
           "--max-steps", "1", "--output", str(tmp_path / "run"), "--accelerator", "cpu", "--devices", "1", "--num-nodes", "2"]
    with socket.socket() as probe:  # a free port for node 0's rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", HSMLA_MED_START_TIMEOUT="5", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0")
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail("the run waited for a peer that never comes")
    errors = [line for line in result.stderr.splitlines() if line.startswith("hsmla-med: error:")]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(errors) == 1 and "after 5 s, rank(s) 1 of 2 never started (2 node(s) x 1 process(es))" in errors[0], errors
    assert not (tmp_path / "run" / "last.ckpt").exists()


def _evaluate_argv(tmp_path, data, config, ckpt, name, *extra) -> list:
    return ["evaluate", "--task", "btcv", "--data-dir", str(data), "--config", str(config), "--checkpoint", str(ckpt),
            "--output", str(tmp_path / name), "--accelerator", "cpu", *extra]


def _metrics(out, stdout: str) -> dict:
    assert stdout.count(f"metrics: {out / 'metrics.json'}") == 1, stdout  # the first process reports, once
    return json.loads((out / "metrics.json").read_text())


def test_two_process_gloo_matches_one_process(tmp_path, capsys):
    data = make_dataset(tmp_path / "data", cases=5, validation=3)
    config = tiny_yaml(tmp_path / "tiny.yaml")
    run = tmp_path / "run"
    assert main(["train", "--task", "btcv", "--data-dir", str(data), "--config", str(config), "--max-steps", "4", "--output", str(run)]) == 0
    capsys.readouterr()
    # one process in this one (a third interpreter would only repeat the imports), two launched
    assert main(_evaluate_argv(tmp_path, data, config, run / "last.ckpt", "one", "--devices", "1")) == 0
    one = _metrics(tmp_path / "one", capsys.readouterr().out)
    cmd = [sys.executable, "-m", "hsmla_med.cli", *_evaluate_argv(tmp_path, data, config, run / "last.ckpt", "two", "--devices", "2", "--strategy", "ddp")]
    result = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    two = _metrics(tmp_path / "two", result.stdout)
    assert one["cases"] == two["cases"] == 3
    for key in ("dice", "hd95", "ece", "brier", "nll", "samples"):  # the calibration sample too: the same voxels, whatever the processes
        assert two[key] == pytest.approx(one[key], rel=1e-6)
    assert two["dice_per_class"] == pytest.approx(one["dice_per_class"], rel=1e-6)
    assert two["step"] == one["step"] == 4


def test_two_process_training_calibrates_and_gathers_alike(tmp_path):
    data = make_dataset(tmp_path / "data", cases=5, validation=3)
    out, script = tmp_path / "run", tmp_path / "fit_ddp.py"
    out.mkdir()
    script.write_text(FIT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, str(script), str(data), str(out)], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [[json.loads(line) for line in (out / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    assert [v["step"] for v in ranks[0]] == [v["step"] for v in ranks[1]] and ranks[0][-1]["step"] == 3
    for zero, one in zip(*ranks):
        # each process validated its share (one case twice: the sampler's padding) ...
        assert len(zero["own"]) == len(one["own"]) == 2 and sorted(set(zero["own"] + one["own"])) == [0, 1, 2]
        # ... and both hold every case once, the same summary, and the tau of the same inputs
        assert zero["keys"] == one["keys"] == [0, 1, 2]
        assert zero["summary"] == one["summary"] and zero["summary"]["cases"] == 3
        assert zero["tau"] and zero["tau"] == one["tau"]
    # one process validating the saved final weights (with their calibrated tau) agrees
    config = tiny_config(data, tmp_path / "eval")
    module, meta = load_module(out / "last.ckpt", SegmentationModule)
    assert meta["step"] == 3
    single = evaluate(module, btcv.datamodule(config, btcv.datalist(config)), config["trainer"], tmp_path / "eval")
    final = ranks[0][-1]["summary"]
    assert single["cases"] == 3
    for key in ("dice", "hd95"):
        assert single[key] == pytest.approx(final[key], rel=1e-6)
    assert single["dice_per_class"] == pytest.approx(final["dice_per_class"], rel=1e-6)
