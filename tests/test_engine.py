"""The Lightning engine: schedule, loss with gate regularisers, a short run's outputs, resume,
validation records, step limits, and best.ckpt from ModelCheckpoint alone."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import tqdm.std

from hsmla_med.config import model_config
from hsmla_med.engine import SegmentationModule
from hsmla_med.engine.base import gather_records, item_keys
from hsmla_med.engine.callbacks import StepProgressBar
from hsmla_med.engine.checkpoint import AtomicCheckpointIO
from hsmla_med.engine.run import build_trainer, fit, load_module
from hsmla_med.engine.schedule import WarmupCosine
from hsmla_med.errors import ConfigError
from hsmla_med.metrics import summarize
from hsmla_med.pipelines import btcv
from tests.conftest import TINY, phantom, tiny_config


def _lrs(schedule, steps: int) -> list[float]:
    """The learning rate of each of ``steps`` optimizer steps (read before the step, as AdamW uses it)."""
    lrs = []
    for _ in range(steps):
        lrs.append(schedule.optimizer.param_groups[0]["lr"])
        schedule.optimizer.step()
        schedule.step()
    return lrs


def _schedule(warmup: int, total: int, floor: float, lr: float = 1.0) -> WarmupCosine:
    return WarmupCosine(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr), warmup, total, floor)


def test_warmup_cosine_hand_values():
    lrs = _lrs(_schedule(warmup=4, total=14, floor=0.0, lr=2.0), 30)
    assert lrs[:4] == pytest.approx([0.4, 0.8, 1.2, 1.6])  # (step + 1) / (warmup + 1): the first step trains
    assert lrs[4] == pytest.approx(2.0)
    assert lrs[9] == pytest.approx(1.0)  # half-way through the cosine
    assert lrs[14:] == pytest.approx([0.0] * 16)  # past the total the floor holds (MONAI's cosine would rise again)
    lrs = _lrs(_schedule(warmup=0, total=10, floor=0.1), 12)
    assert lrs[5] == pytest.approx(0.5) and lrs[9] == pytest.approx(0.1) and lrs[10] == pytest.approx(0.1)  # cos clamped at the floor


def _module(tmp_path, dims=2) -> SegmentationModule:
    config = tiny_config(tmp_path, tmp_path / "out")
    config["mode"] = f"{dims}d"
    return SegmentationModule(btcv.module_config(config, model_config("b0"), ["bg", "a", "b"]))


def test_loss_adds_weighted_gate_regularisers(tmp_path):
    torch.manual_seed(0)
    module = _module(tmp_path)
    batch = {"image": torch.rand(2, 1, 32, 32), "label": torch.randint(0, 3, (2, 1, 32, 32))}
    module.log = module.log_dict = lambda *a, **k: None  # no trainer attached
    total = module.training_step(batch, 0)
    logits = module.network(batch["image"])  # train mode, no randomness: the same forward
    reg = module.network.gate_regularization()
    expected = module.loss(logits, batch["label"]) + 0.01 * reg["budget"] + 0.005 * reg["smoothness"]
    torch.testing.assert_close(total, expected)
    assert reg["budget"] > 0


@pytest.mark.parametrize("dims", [2, 3])
def test_loss_decreases_on_a_fixed_batch(tmp_path, dims):
    torch.manual_seed(0)
    module = _module(tmp_path, dims)
    module.log = module.log_dict = lambda *a, **k: None
    rng = np.random.default_rng(0)
    cases = [phantom((32, 32, 1) if dims == 2 else (24, 24, 16), rng) for _ in range(2)]
    image = torch.from_numpy(np.stack([(c[0] + 175) / 425 for c in cases])).float().unsqueeze(1)
    label = torch.from_numpy(np.stack([c[1] for c in cases])).long().unsqueeze(1)
    if dims == 2:
        image, label = image[..., 0], label[..., 0]
    batch = {"image": image, "label": label}
    optimizer = torch.optim.AdamW(module.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = module.training_step(batch, 0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    gate = [p for n, p in module.network.named_parameters() if "gate" in n]
    assert gate and all(p.grad is not None and p.grad.abs().sum() > 0 for p in gate)


def test_short_run_outputs_and_resume(tmp_path, dataset):
    torch.manual_seed(0)
    out = tmp_path / "run"
    config = tiny_config(dataset, out, max_steps=3)
    config["optim"]["warmup_steps"] = 2
    cases = btcv.datalist(config)
    make = lambda: SegmentationModule(btcv.module_config(config, model_config("b0"), cases.label_names))  # noqa: E731
    summary = fit(make(), btcv.datamodule(config, cases), out, config["trainer"])
    for name in ("last.ckpt", "best.ckpt", "metrics.json", "metrics.csv", "training_curve.png", "logs/version_0/metrics.csv",
                 "validation_gates.png"):
        assert (out / name).is_file(), name
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics) >= {"dice", "hd95", "dice_per_class", "hd95_per_class", "epoch", "step"}
    assert set(metrics["dice_per_class"]) == {"disc", "bar"}
    assert metrics["step"] == 3 and metrics == {**summary, "epoch": metrics["epoch"], "step": 3}
    # the share of tiles each gated layer refined over the validation, a column each in metrics.csv
    shares = metrics["gate_refined_per_layer"]
    assert set(shares) == set(SegmentationModule(btcv.module_config(config, model_config("b0"), cases.label_names)).network.hsmla_layers())
    assert all(0 <= v <= 1 for v in shares.values())
    with (out / "metrics.csv").open() as f:
        assert {f"gate_refined_per_layer_{name}" for name in shares} <= set(next(csv.reader(f)))
    ckpt = torch.load(out / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 3 and ckpt["optimizer_states"] and ckpt["lr_schedulers"]

    config["trainer"]["max_steps"] = 5
    fit(make(), btcv.datamodule(config, cases), out, config["trainer"], resume=True)
    ckpt = torch.load(out / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 5
    # the schedule continued from step 3 on the 5-step curve (test_resume_with_a_larger_max_steps_...)
    # and ended at its floor, 1% of the peak
    state = ckpt["lr_schedulers"][0]
    assert state["t_total"] == 5 and state["last_epoch"] == 5 and state["_last_lr"][0] == pytest.approx(0.01 * config["optim"]["lr"])
    with (out / "metrics.csv").open() as f:
        steps = [int(r["step"]) for r in csv.DictReader(f)]
    assert steps[-1] == 5 and steps == sorted(set(steps))
    assert (out / "logs" / "version_1" / "metrics.csv").is_file()
    module, meta = load_module(out / "best.ckpt", SegmentationModule)
    assert meta["step"] in steps and not module.training
    assert all(math.isfinite(v) for v in metrics["hd95_per_class"].values() if v is not None)


@pytest.mark.parametrize("mode", ["2d", "3d"])
def test_bf16_mixed_run_trains_and_validates(tmp_path, dataset, mode):
    """``--precision bf16-mixed`` (autocast) through a short run with validation, 2D and 3D: the
    3D depthwise training convolution's backward (hsmla_med/nn/conv.py) and MONAI's surface
    distances in the validation scores used to fail under autocast (the first native GPU run;
    the CPU's autocast fails the same way)."""
    torch.manual_seed(0)
    config = tiny_config(dataset, tmp_path / "run", max_steps=2, precision="bf16-mixed")
    config["mode"] = mode
    cases = btcv.datalist(config)
    module = SegmentationModule(btcv.module_config(config, model_config("b0"), cases.label_names))
    fit(module, btcv.datamodule(config, cases), tmp_path / "run", config["trainer"])
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["step"] == 2 and set(metrics["dice_per_class"]) == {"disc", "bar"}
    assert all(math.isfinite(v) for v in metrics["dice_per_class"].values())
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in module.parameters())


def test_a_step_with_non_finite_gradients_is_skipped(tmp_path, dataset, caplog):
    """One NaN (or inf) gradient: every gradient is dropped before the optimizer and clipping see
    it (the clipped norm would turn all weights NaN) and a warning names the step; finite
    gradients pass untouched."""
    import logging

    config = tiny_config(dataset, tmp_path / "run")
    module = SegmentationModule(btcv.module_config(config, model_config("b0"), ["background", "disc", "bar"]))
    params = [p for p in module.parameters() if p.requires_grad]
    for bad in (float("nan"), float("inf"), None):
        for p in params:
            p.grad = torch.randn_like(p)
        if bad is not None:
            params[len(params) // 2].grad.view(-1)[0] = bad
        kept = [p.grad.clone() for p in params]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hsmla_med"):
            module.on_before_optimizer_step(None)
        if bad is None:
            assert all(torch.equal(p.grad, k) for p, k in zip(params, kept)) and not caplog.records
        else:
            assert all(p.grad is None for p in params)
            assert "step 0: non-finite gradients" in caplog.text


def test_resume_with_a_larger_max_steps_follows_the_new_schedule(tmp_path, dataset, monkeypatch):
    """``train --max-steps 20`` then ``--resume --max-steps 40``: step 21 trains at the 40-step
    curve's rate, not at the 20-step curve's floor (the total used to be restored from the checkpoint)."""
    import yaml

    from hsmla_med.cli import main
    from hsmla_med.engine.base import GatedModule

    used = {}  # global step -> learning rate the optimizer applies in that step
    step = GatedModule.training_step

    def recording(self, batch, batch_idx):
        used[self.global_step] = self.optimizers().param_groups[0]["lr"]
        return step(self, batch, batch_idx)

    monkeypatch.setattr(GatedModule, "training_step", recording)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({**TINY, "optim": {"lr": 0.002, "warmup_steps": 4},
                                      "trainer": {**TINY["trainer"], "check_val_every_n_epoch": 1000}}))
    argv = ["train", "--task", "btcv", "--data-dir", str(dataset), "--config", str(config), "--output", str(tmp_path / "run")]
    cosine = lambda step, total: 0.002 * max(0.01, (1 + math.cos(math.pi * (step - 4) / (total - 4))) / 2)  # noqa: E731
    assert main([*argv, "--max-steps", "20"]) == 0
    assert sorted(used) == list(range(20))
    assert used[2] == pytest.approx(0.002 * 3 / 5) and used[12] == pytest.approx(cosine(12, 20))
    used.clear()
    assert main([*argv, "--max-steps", "40", "--resume"]) == 0
    assert sorted(used) == list(range(20, 40))
    # by hand: 0.002 * (1 + cos(pi * 16 / 36)) / 2 = 0.002 * 0.58682 (the old curve: its floor, 0.002 * 0.01)
    assert used[20] == pytest.approx(0.002 * 0.586824, rel=1e-5)
    assert all(used[s] == pytest.approx(cosine(s, 40)) for s in range(20, 40))


def test_gather_records_keeps_each_key_once_in_key_order():
    records = [{"key": 2, "v": 1.0}, {"key": 0, "v": 2.0}, {"key": 2, "v": 1.0}, {"key": 1, "v": 3.0}]
    assert gather_records(records) == [{"key": 0, "v": 2.0}, {"key": 1, "v": 3.0}, {"key": 2, "v": 1.0}]
    assert [r["key"] for r in gather_records([{"key": "b"}, {"key": "a"}, {"key": "b"}])] == ["a", "b"]
    assert gather_records([]) == []
    for bad in ({"v": 1.0}, {"key": 1.5}, {"key": None}, ("key", 1)):
        with pytest.raises(TypeError, match="key"):
            gather_records([bad])


def test_segmentation_records_summarize_like_the_score_tensors(tmp_path):
    module = _module(tmp_path)  # labels bg, a, b
    dice = torch.tensor([[0.5, float("nan")], [0.25, 1.0], [0.75, 0.5]])
    hd95 = torch.tensor([[2.0, float("nan")], [4.0, 1.0], [3.0, 6.0]])
    nsd = torch.tensor([[0.625, float("nan")], [0.5, 1.0], [0.875, 0.75]])
    records = [{"key": i, "dice": d, "hd95": h, "nsd": n} for i, (d, h, n) in enumerate(zip(dice.tolist(), hd95.tolist(), nsd.tolist()))]
    summary = module.summarize_records(records)
    assert summary == summarize(dice, hd95, ["a", "b"], nsd=nsd)
    assert summary["nsd_per_class"] == {"a": pytest.approx(2 / 3), "b": pytest.approx(0.875)} and summary["nsd"] == pytest.approx((2 / 3 + 0.875) / 2)
    assert module.summarize_records(records[:1] + records[1:])["cases"] == 3
    assert module.summarize_records([])["cases"] == 0


@pytest.mark.parametrize("key", ["max_steps", "max_epochs"])
@pytest.mark.parametrize("value", [0, -1, 2.5, True, "10"])
def test_step_and_epoch_limits_must_be_positive(tmp_path, key, value):
    with pytest.raises(ConfigError, match=f"trainer.{key}"):
        build_trainer({key: value, "accelerator": "cpu"}, tmp_path)


def test_step_and_epoch_limits(tmp_path):
    by_steps = build_trainer({"max_steps": 3, "max_epochs": None, "accelerator": "cpu"}, tmp_path)
    assert by_steps.max_steps == 3 and by_steps.max_epochs in (None, -1)
    by_epochs = build_trainer({"max_epochs": 2, "accelerator": "cpu"}, tmp_path)
    assert (by_epochs.max_steps, by_epochs.max_epochs) == (-1, 2)
    assert build_trainer({"accelerator": "cpu"}, tmp_path).max_epochs == 100


class Scripted(SegmentationModule):
    """Validation scores from a list instead of predictions: the test decides which step is best."""

    def __init__(self, config: dict, scores: list[float]) -> None:
        super().__init__(config)
        self.scores = list(scores)

    def validation_records(self, batch: dict) -> list[dict]:
        return [{"key": k} for k in item_keys(batch)]

    def summarize_records(self, records: list[dict]) -> dict:
        return {"dice": self.scores.pop(0), "cases": len(records)}


# 3 training cases in batches of 2: two steps per epoch. (trainer settings, scores of the
# validations, their steps, the step of best.ckpt): the best mid-run; the best at a final step
# that ends within an epoch; the best at a final epoch that the schedule does not validate.
SCHEDULES = [
    ({"max_steps": 5}, [0.2, 0.9, 0.5], [2, 4, 5], 4),
    ({"max_steps": 5}, [0.2, 0.5, 0.9], [2, 4, 5], 5),
    ({"max_steps": None, "max_epochs": 3, "check_val_every_n_epoch": 2}, [0.3, 0.8], [4, 6], 6),
]


@pytest.mark.parametrize(("trainer", "scores", "steps", "best_step"), SCHEDULES)
def test_best_checkpoint_is_written_by_model_checkpoint_alone(tmp_path, dataset, monkeypatch, capfd, trainer, scores, steps, best_step):
    saved = []
    save = AtomicCheckpointIO.save_checkpoint

    def recording_save(self, checkpoint, path, storage_options=None):
        saved.append((Path(path).name, checkpoint["global_step"]))
        return save(self, checkpoint, path, storage_options)

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", recording_save)
    out = tmp_path / "run"
    config = tiny_config(dataset, out, progress_bar=True, **trainer)
    cases = btcv.datalist(config)
    module = Scripted(btcv.module_config(config, model_config("b0"), cases.label_names), scores)
    summary = fit(module, btcv.datamodule(config, cases), out, config["trainer"])
    assert summary == {"dice": scores[-1], "cases": 1} and not module.scores  # every scheduled validation ran, and the final one
    with (out / "metrics.csv").open() as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == steps
    # best.ckpt: saved at every improvement, by ModelCheckpoint through the checkpoint IO, never copied
    improvements = [s for i, s in enumerate(steps) if scores[i] == max(scores[: i + 1])]
    assert [s for name, s in saved if name == "best.ckpt"] == improvements
    assert [s for name, s in saved if name == "last.ckpt"] == steps
    assert {name for name, _ in saved} == {"best.ckpt", "last.ckpt"}
    best = torch.load(out / "best.ckpt", weights_only=True)
    [state] = [v for k, v in best["callbacks"].items() if "val/dice" in k]
    assert best["global_step"] == best_step and float(state["best_model_score"]) == pytest.approx(max(scores))
    assert torch.load(out / "last.ckpt", weights_only=True)["global_step"] == steps[-1]
    printed = capfd.readouterr()
    bar = printed.out + printed.err
    if trainer.get("max_steps"):  # the bar counts steps up to max_steps, not epochs up to -1
        assert "5/5" in bar and "/-" not in bar


class _Tiny(L.LightningModule):
    """A one-layer module for progress-bar tests; ``clock`` (a one-item list), when given, is
    advanced by ``step`` seconds per training step plus ``start`` at each epoch's first batch (the
    wait for a loader's first batch)."""

    def __init__(self, clock: list[float] | None = None, step: float = 1.0, start: float = 0.0):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.clock, self.step, self.start = clock, step, start

    def training_step(self, batch, batch_idx):
        if self.clock is not None:
            self.clock[0] += self.step + (self.start if batch_idx == 0 else 0.0)
        loss = self.layer(batch).pow(2).mean()
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _seconds(interval: str) -> int:
    """``MM:SS`` or ``H:MM:SS`` (tqdm's ``format_interval``) in seconds."""
    return sum(int(part) * 60**i for i, part in enumerate(reversed(interval.split(":"))))


def test_progress_bar_eta_after_step_100_of_600_is_the_remaining_time(monkeypatch):
    """A 600-step run of 33-step epochs: each step takes 1 s, each epoch's first batch 10 s more.
    After step 100 (the first step of the fourth epoch) the training bar's ETA is within 25% of
    the remaining time of this schedule, and its elapsed time is the run's. Before the fix the bar
    restarted its clock at every epoch: it read 00:11 elapsed and an ETA of 1:31:40."""
    clock = [1000.0]
    monkeypatch.setattr(tqdm.std, "time", lambda: clock[0])  # tqdm's clock, read when a bar starts
    shown = []

    class Probe(StepProgressBar):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)
            if trainer.global_step == 100:
                shown.append(str(self.train_progress_bar))
                trainer.should_stop = True

    steps, per_epoch, step, start = 600, 33, 1.0, 10.0
    data = torch.utils.data.DataLoader(torch.randn(per_epoch, 2), batch_size=1)
    trainer = L.Trainer(max_steps=steps, callbacks=[Probe()], logger=False, enable_checkpointing=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(_Tiny(clock, step, start), data)
    [line] = shown
    elapsed, eta = (_seconds(t) for t in re.search(r"\[([\d:]+)<([\d:]+),", line).groups())
    epochs_begun = 100 // per_epoch + 1
    assert " 100/600 " in line and elapsed == 100 * step + epochs_begun * start
    remaining = (steps - 100) * step + (math.ceil(steps / per_epoch) - epochs_begun) * start
    assert abs(eta - remaining) <= 0.25 * remaining, line


def test_progress_bar_writes_plain_lines_to_a_pipe(capfd):
    """Output that is not a terminal (here pytest's capture) gets plain lines: no carriage
    returns or escape codes, no ``0/?`` bars; the training count never goes back at an epoch
    and ends at the run's total; each validation ends in one full count."""

    class Validated(_Tiny):
        def validation_step(self, batch, batch_idx):
            self.log("val/score", 0.5, prog_bar=True)

    data = torch.utils.data.DataLoader(torch.randn(8, 2), batch_size=2)  # 4 steps per epoch
    trainer = L.Trainer(max_steps=10, callbacks=[StepProgressBar()], logger=False, enable_checkpointing=False, enable_model_summary=False,
                        accelerator="cpu", num_sanity_val_steps=0)
    trainer.fit(Validated(), data, data)  # validates after epochs 0 and 1
    printed = capfd.readouterr()
    log = printed.out + printed.err
    assert "\r" not in log and "\x1b[" not in log and "/?" not in log
    counts = [tuple(map(int, m.groups())) for m in re.finditer(r"^Epoch \d+: +\d+% (\d+)/(\d+) ", log, re.M)]
    assert counts and {total for _, total in counts} == {10} and counts[-1][0] == 10
    assert [n for n, _ in counts] == sorted(n for n, _ in counts)
    assert len(re.findall(r"^Validation: 100% 4/4 ", log, re.M)) == 2


@pytest.mark.parametrize("written, calibrated", [("refine", False), ("light", False), ("light", True)])
def test_3d_checkpoint_of_an_earlier_default_loads(tmp_path, written, calibrated):
    """A 3D checkpoint whose hyper-parameters lack ``full_res`` (written when the 3D default was
    ``refine``, before commit 242743b, or ``light``, until commit bc6e5b4) loads with the level its
    weights hold and gives the same logits, also after ``hsmla-med calibrate`` (its weights
    under the temperature wrapper's ``network.network.`` prefix)."""
    torch.manual_seed(0)
    config = tiny_config(tmp_path, tmp_path / "out")
    config["mode"] = "3d"
    hparams = btcv.module_config(config, {**model_config("b0"), "full_res": written}, ["bg", "a", "b"])
    if calibrated:
        hparams["calibration"] = {"temperature": [2.0]}
    old = SegmentationModule(hparams).eval()
    hparams = {**hparams, "network": {k: v for k, v in hparams["network"].items() if k != "full_res"}}
    torch.save({"hyper_parameters": hparams, "state_dict": old.state_dict()}, tmp_path / "old.ckpt")
    module, _ = load_module(tmp_path / "old.ckpt", SegmentationModule)
    x = torch.randn(1, 1, 16, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(module.network(x), old.network(x))
