"""The Lightning engine: schedule, loss with gate regularisers, a short run's outputs, resume."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch

from hsmla_med.config import model_config
from hsmla_med.engine import SegmentationModule
from hsmla_med.engine.run import fit, load_module
from hsmla_med.engine.schedule import WarmupCosine
from hsmla_med.pipelines import btcv
from tests.conftest import phantom, tiny_config


def test_warmup_cosine_hand_values():
    s = WarmupCosine(warmup=4, total=14, floor=0.0)
    assert [s(i) for i in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert s(4) == pytest.approx(1.0)
    assert s(9) == pytest.approx(0.5)  # half-way through the cosine
    assert s(14) == pytest.approx(0.0) and s(100) == pytest.approx(0.0)
    assert WarmupCosine(0, 10, floor=0.1)(10) == pytest.approx(0.1)


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
    cases = btcv.datalist(config)
    make = lambda: SegmentationModule(btcv.module_config(config, model_config("b0"), cases.label_names))  # noqa: E731
    summary = fit(make(), btcv.datamodule(config, cases), out, config["trainer"])
    for name in ("last.ckpt", "best.ckpt", "metrics.json", "metrics.csv", "training_curve.png", "logs/version_0/metrics.csv"):
        assert (out / name).is_file(), name
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics) >= {"dice", "hd95", "dice_per_class", "hd95_per_class", "epoch", "step"}
    assert set(metrics["dice_per_class"]) == {"disc", "bar"}
    assert metrics["step"] == 3 and metrics == {**summary, "epoch": metrics["epoch"], "step": 3}
    ckpt = torch.load(out / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 3 and ckpt["optimizer_states"] and ckpt["lr_schedulers"]
    lr_before = ckpt["lr_schedulers"][0]["_last_lr"][0]

    config["trainer"]["max_steps"] = 5
    fit(make(), btcv.datamodule(config, cases), out, config["trainer"], resume=True)
    ckpt = torch.load(out / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 5
    # the schedule continued from step 3 rather than restarting its warm-up at step 0
    schedule = WarmupCosine(config["optim"]["warmup_steps"], ckpt["lr_schedulers"][0]["lr_lambdas"][0]["total"])
    assert ckpt["lr_schedulers"][0]["_last_lr"][0] == pytest.approx(config["optim"]["lr"] * schedule(5))
    assert ckpt["lr_schedulers"][0]["_last_lr"][0] > lr_before
    with (out / "metrics.csv").open() as f:
        steps = [int(r["step"]) for r in csv.DictReader(f)]
    assert steps[-1] == 5 and steps == sorted(set(steps))
    assert (out / "logs" / "version_1" / "metrics.csv").is_file()
    module, meta = load_module(out / "best.ckpt", SegmentationModule)
    assert meta["step"] in steps and not module.training
    assert all(math.isfinite(v) for v in metrics["hd95_per_class"].values() if v is not None)
