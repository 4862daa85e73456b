"""The learning rate as it ran, logged by Lightning's ``LearningRateMonitor`` (added by
``build_trainer`` whenever there are loggers) into every logger: the CSV logger's
``metrics.csv`` has an ``lr-AdamW`` column whose values are the warm-up and cosine schedule of
the run's options, and TensorBoard's event file the same values under that tag. Trainers without
loggers (evaluation) get no monitor, which would refuse to start without one."""

from __future__ import annotations

import csv
import math
import struct

import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning_utilities.core.imports import module_available

from hsmla_med.config import model_config
from hsmla_med.engine import SegmentationModule
from hsmla_med.engine.run import build_trainer, fit
from hsmla_med.pipelines import btcv
from tests.conftest import tiny_config

LR, WARMUP, STEPS = 2e-3, 2, 6
FLOOR = 0.01  # WarmupCosine's default floor, the one configure_optimizers takes


def _scheduled(step: int) -> float:
    """The schedule of :class:`~hsmla_med.engine.schedule.WarmupCosine` written out in float64:
    linear from ``LR / (WARMUP + 1)`` (the first step trains), then the cosine down to the floor."""
    if step < WARMUP:
        return LR * (step + 1) / (WARMUP + 1)
    progress = (min(step, STEPS) - WARMUP) / (STEPS - WARMUP)
    return LR * max(FLOOR, 0.5 * (1 + math.cos(math.pi * progress)))


def _events(path) -> list[tuple[str, int, float]]:
    """``(tag, step, value)`` of the scalars of a TensorBoard event file (TFRecord framing: a
    length, its CRC, the Event proto, its CRC)."""
    from tensorboardX.proto import event_pb2

    data, found, at = path.read_bytes(), [], 0
    while at < len(data):
        (length,) = struct.unpack("<Q", data[at:at + 8])
        event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
        at += 12 + length + 4
        found += [(v.tag, event.step, v.simple_value) for v in event.summary.value if v.HasField("simple_value")]
    return found


def test_the_logged_learning_rate_follows_the_schedule(tmp_path, dataset):
    torch.manual_seed(0)
    tensorboard = module_available("tensorboardX") or module_available("tensorboard")
    out = tmp_path / "run"
    config = tiny_config(dataset, out, max_steps=STEPS, log_every_n_steps=1, logger="tensorboard" if tensorboard else "csv")
    config["optim"].update(lr=LR, warmup_steps=WARMUP)
    cases = btcv.datalist(config)
    fit(SegmentationModule(btcv.module_config(config, model_config("b0"), cases.label_names)), btcv.datamodule(config, cases), out,
        config["trainer"])
    assert torch.load(out / "last.ckpt", weights_only=True)["lr_schedulers"][0]["t_total"] == STEPS  # the curve written out above
    with (out / "logs" / "version_0" / "metrics.csv").open(newline="") as f:
        logged = {int(r["step"]): float(r["lr-AdamW"]) for r in csv.DictReader(f) if r["lr-AdamW"]}
    # each step's rate as the optimizer used it (the monitor reads it before the step)
    assert sorted(logged) == list(range(STEPS))
    assert [logged[s] for s in range(STEPS)] == pytest.approx([_scheduled(s) for s in range(STEPS)], rel=1e-12, abs=0)
    assert logged[WARMUP] == LR and logged[STEPS - 1] < logged[WARMUP + 1] < LR  # the peak, then the decay
    if tensorboard:
        [events] = (out / "tensorboard" / "version_0").glob("events.out.tfevents.*")
        rates = {step: value for tag, step, value in _events(events) if tag == "lr-AdamW"}
        assert rates == {s: pytest.approx(_scheduled(s), rel=1e-6) for s in range(STEPS)}  # float32 there


def test_a_monitor_only_where_there_are_loggers(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    with_logger = build_trainer({"max_steps": 1, "accelerator": "cpu", "progress_bar": False}, tmp_path, loggers=[CSVLogger(tmp_path)])
    monitors = [c for c in with_logger.callbacks if isinstance(c, LearningRateMonitor)]
    assert len(monitors) == 1 and monitors[0].logging_interval == "step"
    evaluation = build_trainer({"accelerator": "cpu", "progress_bar": False}, tmp_path)  # as run.evaluate builds it
    assert not [c for c in evaluation.callbacks if isinstance(c, LearningRateMonitor)] and not evaluation.loggers
