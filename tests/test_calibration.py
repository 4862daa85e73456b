"""Calibration: ECE (equal-mass bins), Brier and NLL against hand-computed cases and a brute-force
reference; temperature fitting; the temperature inside the network (checkpoints, TorchScript,
bundles, patch features); the validation sample; and ``hsmla-med calibrate`` end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from conftest import cli_error
from hsmla_med.engine.calibration import CalibrationSample, TemperatureScaled, _uniform, fit_temperature, with_temperature
from hsmla_med.errors import ConfigError
from hsmla_med.metrics.calibration import (
    brier_score, calibration_metrics, expected_calibration_error, flatten_maps, foreground, negative_log_likelihood, reliability,
)

# four samples worked out by hand: (probabilities, label) -> confidence, correct
HAND_PROBS = [[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.4, 0.6]]
HAND_LABELS = [0, 1, 1, 0]  # correct, wrong (conf 0.8), correct (0.7), wrong (0.6)


def test_ece_brier_nll_of_a_hand_computed_case():
    # sorted by confidence: 0.6 wrong, 0.7 right | 0.8 wrong, 0.9 right
    # bin 1: confidence 0.65, accuracy 0.5 -> 0.15; bin 2: 0.85, 0.5 -> 0.35; ECE = (0.15 + 0.35) / 2
    assert expected_calibration_error(HAND_PROBS, HAND_LABELS, bins=2) == pytest.approx(0.25)
    # (0.1^2 + 0.1^2) + (0.8^2 + 0.8^2) + (0.3^2 + 0.3^2) + (0.6^2 + 0.6^2) = 0.02 + 1.28 + 0.18 + 0.72
    assert brier_score(HAND_PROBS, HAND_LABELS) == pytest.approx(2.2 / 4)
    assert negative_log_likelihood(HAND_PROBS, HAND_LABELS) == pytest.approx(-(math.log(0.9) + math.log(0.2) + math.log(0.7) + math.log(0.4)) / 4)
    # a fifth sample, right at 0.55: 5 = 3 + 2, the first bin holds the extra one
    # bin 1: 0.55 right, 0.6 wrong, 0.7 right: confidence 1.85 / 3, accuracy 2 / 3; bin 2 as before
    probs, labels = HAND_PROBS + [[0.55, 0.45]], HAND_LABELS + [0]
    table = reliability(probs, labels, bins=2)
    assert table["count"].tolist() == [3, 2]
    assert table["confidence"].tolist() == pytest.approx([1.85 / 3, 0.85])
    assert expected_calibration_error(probs, labels, bins=2) == pytest.approx(3 / 5 * abs(2 / 3 - 1.85 / 3) + 2 / 5 * 0.35)
    # foreground: label or argmax not 0 -> all but the first sample
    assert foreground(HAND_PROBS, HAND_LABELS).tolist() == [False, True, True, True]
    metrics = calibration_metrics(HAND_PROBS, HAND_LABELS, bins=2)
    # foreground alone, 3 samples in 2 bins (2 + 1): {0.6 wrong, 0.7 right} -> 0.15, {0.8 wrong} -> 0.8
    assert metrics["ece_foreground"] == pytest.approx(2 / 3 * 0.15 + 1 / 3 * 0.8)
    assert (metrics["samples"], metrics["foreground_samples"], metrics["accuracy"]) == (4, 3, 0.5)


def test_nll_floors_a_zero_probability_and_empty_inputs_have_no_scores():
    assert negative_log_likelihood([[1.0, 0.0]], [1]) == pytest.approx(-math.log(torch.finfo(torch.float32).tiny))
    empty = calibration_metrics(torch.zeros(0, 3), torch.zeros(0))
    assert empty["ece"] is None and empty["brier"] is None and empty["nll"] is None and empty["samples"] == 0


def _brute_force_ece(probs: np.ndarray, labels: np.ndarray, bins: int) -> float:
    """Sample by sample: rank by confidence (ties in input order), bin k takes ranks
    [sum of the sizes before it, + its size), the first n % bins bins one larger."""
    confidence = [max(p) for p in probs.tolist()]
    correct = [int(np.argmax(p) == y) for p, y in zip(probs, labels)]
    ranked = sorted(range(len(confidence)), key=lambda i: (confidence[i], i))
    total, start = 0.0, 0
    for k in range(bins):
        size = len(ranked) // bins + (1 if k < len(ranked) % bins else 0)
        members = ranked[start : start + size]
        start += size
        if members:
            conf = sum(confidence[i] for i in members) / size
            acc = sum(correct[i] for i in members) / size
            total += size / len(ranked) * abs(acc - conf)
    return total


@pytest.mark.parametrize("n", [7, 15, 1000, 1013])
def test_ece_matches_a_brute_force_reference(n):
    rng = np.random.default_rng(n)
    probs = rng.dirichlet(np.ones(4) * 0.5, n)
    probs[: n // 3] = np.round(probs[: n // 3], 1)  # ties across bin edges
    probs /= probs.sum(1, keepdims=True)
    labels = rng.integers(0, 4, n)
    assert expected_calibration_error(probs, labels) == pytest.approx(_brute_force_ece(probs, labels, 15), abs=1e-12)


def test_flatten_maps_leaves_out_the_ignore_label():
    probs = torch.tensor([[[[0.9, 0.2], [0.5, 0.1]], [[0.1, 0.8], [0.5, 0.9]]]])  # (1, 2, 2, 2)
    labels = torch.tensor([[[[0, 1], [255, 1]]]])  # (1, 1, 2, 2), one ignored voxel
    flat_probs, flat_labels = flatten_maps(probs, labels, ignore_label=255)
    assert flat_labels.tolist() == [0, 1, 1]
    assert torch.allclose(flat_probs, torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.1, 0.9]]))


def _calibrated_logits(n: int = 20000, classes: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a perfectly calibrated model: the labels drawn from softmax(z)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, classes, generator=g, dtype=torch.float64) * 2.0
    return z, torch.multinomial(torch.softmax(z, 1), 1, generator=g)[:, 0]


def test_fitted_temperature_undoes_a_scaling_by_4_and_lowers_the_ece():
    z, labels = _calibrated_logits()
    t = fit_temperature(4 * z, labels)
    assert t.shape == (1,) and t.item() == pytest.approx(4.0, rel=0.05)
    before = expected_calibration_error(torch.softmax(4 * z, 1), labels)
    after = expected_calibration_error(torch.softmax(4 * z / t, 1), labels)
    assert after < before / 3
    per_class = fit_temperature(4 * z, labels, per_class=True)
    assert per_class.shape == (5,) and per_class.numpy() == pytest.approx(np.full(5, 4.0), rel=0.1)


def test_one_temperature_keeps_the_argmax():
    z, labels = _calibrated_logits(2000)
    t = fit_temperature(0.5 * z, labels)
    assert t.item() == pytest.approx(0.5, rel=0.1)
    assert torch.equal((0.5 * z / t).argmax(1), z.argmax(1))


def test_temperature_scaled_divides_the_logits_per_class_and_keeps_the_gates():
    from hsmla_med.config import build_network

    net = nn.Conv2d(2, 3, 1)
    x = torch.randn(2, 2, 4, 5)
    scaled = TemperatureScaled(net, [1.0, 2.0, 4.0])
    expected = torch.log_softmax(net(x), 1) / torch.tensor([1.0, 2.0, 4.0]).reshape(1, 3, 1, 1)  # per class: the log-probabilities
    assert torch.allclose(scaled(x), expected)
    assert torch.allclose(TemperatureScaled(net, 2.0)(x), net(x) / 2)
    assert set(scaled.state_dict()) == {"temperature", "network.weight", "network.bias"}
    hsmla = build_network({"variant": "b0"}, 2, 1, 3)
    assert set(with_temperature(hsmla, {"temperature": [1.5]}, 3).hsmla_layers()) == {f"network.{k}" for k in hsmla.hsmla_layers()}
    for bad in ([0.0], [1.0, 2.0], "warm", [float("nan")]):
        with pytest.raises(ConfigError, match="calibration.temperature"):
            with_temperature(net, {"temperature": bad}, 3)


def test_per_class_temperatures_applied_by_the_network_are_the_fitted_model():
    """Regression: calibrate fits per-class temperatures on log-probabilities (CalibrationSample),
    and the calibrated network divided its raw logits, whose per-sample logsumexp does not cancel
    across classes, so the network's probabilities were not the fitted ones (on the real MRI: 9
    Dice points lost where the fit promised a higher accuracy). The network's NLL must be the fit's."""
    z, labels = _calibrated_logits(4000)
    skewed = z * torch.tensor([0.3, 1.0, 3.0, 1.0, 0.5], dtype=torch.float64) + 7.0 * torch.randn(len(z), 1, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    sample = CalibrationSample()
    sample.add_logits(skewed, labels, range(len(z)))
    fitted = fit_temperature(sample.log_probs, sample.labels, per_class=True)
    assert float(fitted.max() / fitted.min()) > 1.2  # temperatures that differ, which a per-sample constant disturbs
    network = TemperatureScaled(nn.Identity(), fitted)
    applied = torch.softmax(network(skewed.float()).double(), 1)
    fit = torch.softmax(torch.log_softmax(skewed, 1) / fitted, 1)  # CalibrationSample.probabilities, in this order
    np.testing.assert_allclose(applied.numpy(), fit.numpy(), atol=1e-5)
    nll = lambda p: float(-p.gather(1, labels[:, None]).log().mean())  # noqa: E731
    assert nll(applied) < nll(torch.softmax(skewed, 1)) - 0.05


def test_patch_features_of_a_calibrated_classifier_are_the_wrapped_ones():
    from hsmla_med.engine.classification import penultimate

    net = nn.Sequential(nn.Flatten(), nn.Linear(12, 2))
    x = torch.randn(3, 3, 2, 2)
    logits, features = penultimate(TemperatureScaled(net, 2.5), x)
    assert torch.allclose(logits, net(x) / 2.5)
    assert torch.equal(features, x.flatten(1))


def test_draws_are_splitmix64():
    # SplitMix64's first output from state 0 (Steele, Lea and Flood 2014; Vigna's reference code)
    assert _uniform(np.array([0], np.uint64))[0] == (0xE220A8397B1DCDAF >> 11) * 2.0**-53


def test_sample_is_the_bottom_k_of_the_draws_whatever_the_order_and_split():
    rng = np.random.default_rng(0)
    cases = {f"case{i}": (torch.from_numpy(rng.dirichlet(np.ones(3), 60)).float().T.reshape(1, 3, 6, 10),
                          torch.from_numpy(rng.integers(0, 4, 60)).reshape(1, 1, 6, 10)) for i in range(4)}  # label 3: ignored
    whole = CalibrationSample(limit=50)
    for key, (p, y) in cases.items():
        whole.add_maps(p, y, [key], ignore_label=3)
    first, second = CalibrationSample(limit=50), CalibrationSample(limit=50)
    for key in ["case3", "case1"]:
        first.add_maps(*cases[key], [key], ignore_label=3)
    for key in ["case2", "case0", "case1"]:  # case1 twice (a distributed sampler's padding)
        second.add_maps(*cases[key], [key], ignore_label=3)
    first._merge(second.ids, second.log_probs, second.labels)
    assert len(whole) == 50 and np.array_equal(whole.ids, first.ids) and torch.equal(whole.log_probs, first.log_probs)
    # brute force: every kept voxel's draw, the 50 smallest of all of them
    from hsmla_med.engine.calibration import _item_seed

    every = []
    for key, (p, y) in cases.items():
        for v in np.flatnonzero(y.reshape(-1).numpy() != 3):
            every.append((_uniform(np.array([(_item_seed(key) + int(v)) % 2**64], np.uint64))[0], p.reshape(3, -1)[:, v], int(y.reshape(-1)[v])))
    every.sort(key=lambda e: e[0])
    chosen = {round(float(e[0]), 15): e for e in every[:50]}
    assert sorted(round(float(d), 15) for d in _uniform(whole.ids)) == sorted(chosen)
    for d, log_p, label in zip(_uniform(whole.ids), whole.log_probs, whole.labels):
        _, p, y = chosen[round(float(d), 15)]
        assert int(label) == y and torch.allclose(log_p.exp(), p)


def test_sample_of_patches_scores_their_softmax():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.5]])
    sample = CalibrationSample()
    sample.add_logits(logits, torch.tensor([0, 0, 1]), [10, 11, 12])
    sample.add_logits(logits[:1], torch.tensor([0]), [10])  # the same patch again: counted once
    probs = torch.softmax(logits.double(), 1)
    assert sample.metrics() == pytest.approx(calibration_metrics(probs, [0, 0, 1]))
    assert sample.metrics(torch.tensor([2.0]))["nll"] == pytest.approx(negative_log_likelihood(torch.softmax(logits.double() / 2, 1), [0, 0, 1]))


# --- hsmla-med calibrate on a tiny BTCV checkpoint ---------------------------------------


@pytest.fixture(scope="module")
def calibrated(tiny_btcv_checkpoint, tmp_path_factory):
    from hsmla_med.cli import main

    root = Path(tiny_btcv_checkpoint).parent.parent  # the fixture's data and config live beside the run
    output = tmp_path_factory.mktemp("calibrated")
    assert main(["calibrate", "--checkpoint", tiny_btcv_checkpoint, "--data-dir", str(root / "data"), "--config", str(root / "tiny.yaml"),
                 "--output", str(output)]) == 0
    return root, output


def test_calibrate_writes_a_checkpoint_whose_network_divides_by_the_temperature(tiny_btcv_checkpoint, calibrated):
    from hsmla_med.engine.checkpoint import read_hparams
    from hsmla_med.pipelines import get_task

    root, output = calibrated
    report = json.loads((output / "calibration.json").read_text())
    assert (output / "reliability.png").stat().st_size > 0
    t = report["temperature"]
    assert len(t) == 1 and t[0] > 0
    for when in ("before", "after"):
        assert set(report[when]) >= {"ece", "ece_foreground", "brier", "nll", "samples"}
    assert report["after"]["nll"] <= report["before"]["nll"] + 1e-9  # T = 1 is where the fit starts
    assert report["samples"] > 0 and report["split"]["val"]
    hparams = read_hparams(output / "last.ckpt")
    assert hparams["calibration"]["temperature"] == t
    task = get_task("btcv")
    original, _ = task.load(tiny_btcv_checkpoint)  # an uncalibrated checkpoint's keys still load
    module, _ = task.load(output / "last.ckpt")
    assert isinstance(module.network, TemperatureScaled) and not isinstance(original.network, TemperatureScaled)
    x = torch.randn(2, 1, 32, 32)
    with torch.no_grad():
        logits = original.network(x)
        assert torch.allclose(module.network(x), logits / t[0], atol=1e-5)
        volume = torch.randn(1, 1, 40, 36, 3)
        p_original, p_calibrated = original.predict_probabilities(volume), module.predict_probabilities(volume)
    assert torch.allclose(p_calibrated, torch.softmax(p_original.clamp_min(1e-30).log() / t[0], 1), atol=1e-5)
    assert torch.equal(p_calibrated.argmax(1), p_original.argmax(1))


def test_calibrating_a_calibrated_checkpoint_fits_anew(calibrated, tmp_path):
    """Per class on top of one temperature: the temperatures multiplied before, which is neither
    fit (the per-class model divides log-probabilities, whose per-voxel constant no longer
    cancels). Now the fit starts from the uncalibrated network, so the result is the per-class
    calibration of the original checkpoint, and the replaced temperature is on record."""
    from hsmla_med.cli import main

    root, output = calibrated
    common = ["--data-dir", str(root / "data"), "--config", str(root / "tiny.yaml"), "--per-class"]
    assert main(["calibrate", "--checkpoint", str(root / "run" / "last.ckpt"), *common, "--output", str(tmp_path / "direct")]) == 0
    assert main(["calibrate", "--checkpoint", str(output / "last.ckpt"), *common, "--output", str(tmp_path / "again")]) == 0
    direct, again = (json.loads((tmp_path / name / "calibration.json").read_text()) for name in ("direct", "again"))
    assert again["temperature"] == pytest.approx(direct["temperature"], rel=1e-6)
    assert again["replaced_temperature"] == json.loads((output / "calibration.json").read_text())["temperature"]
    assert direct["replaced_temperature"] is None and again["before"] == pytest.approx(direct["before"])


def test_evaluate_reports_the_calibrated_metrics(calibrated, capsys):
    from hsmla_med.cli import main

    root, output = calibrated
    report = json.loads((output / "calibration.json").read_text())
    assert main(["evaluate", "--task", "btcv", "--checkpoint", str(output / "last.ckpt"), "--data-dir", str(root / "data"),
                 "--config", str(root / "tiny.yaml"), "--output", str(output / "evaluate")]) == 0
    metrics = json.loads((output / "evaluate" / "metrics.json").read_text())
    # the same voxels, now through the network's own temperature
    for key in ("ece", "brier", "nll"):
        assert metrics[key] == pytest.approx(report["after"][key], abs=1e-4)
    assert metrics["dice"] == pytest.approx(report["validation"]["dice"])  # one temperature: the same label maps


def test_exported_calibrated_network_applies_the_temperature_once(calibrated, tmp_path):
    from hsmla_med.engine.checkpoint import load_exported
    from hsmla_med.engine.segmentation import SegmentationModule
    from hsmla_med.export import export_metadata, export_torchscript
    from hsmla_med.export.bundle import inference_config
    from monai.bundle import ConfigParser
    from hsmla_med.pipelines import get_task

    _, output = calibrated
    module, _ = get_task("btcv").load(output / "last.ckpt")
    export_torchscript(module.network, (32, 32), 1, tmp_path / "model.ts", export_metadata(module, (32, 32)))
    exported, _ = load_exported(tmp_path / "model.ts", SegmentationModule)
    assert "calibration" in exported.config and not isinstance(exported.network, TemperatureScaled)
    x = torch.randn(2, 1, 32, 32)
    with torch.no_grad():
        assert torch.allclose(exported.network(x), module.network(x), atol=1e-4)
    # the bundle's PyTorch network loads the calibrated state dict (models/model.pt)
    torch.save(module.network.state_dict(), tmp_path / "model.pt")
    parser = ConfigParser(inference_config("btcv", module.config, (32, 32)))
    network = parser.get_parsed_content("network_def_hsmla")
    network.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    with torch.no_grad():
        assert torch.allclose(network.eval()(x), module.network(x), atol=1e-6)


def test_calibrate_refuses_bad_input_in_one_line(tmp_path, capsys):
    line = cli_error(capsys, ["calibrate", "--checkpoint", str(tmp_path / "missing.ckpt"), "--output", str(tmp_path / "out")])
    assert "missing.ckpt" in line and "not found" in line
    torch.save({"hyper_parameters": {"task": "luna16"}, "state_dict": {}}, tmp_path / "luna.ckpt")
    line = cli_error(capsys, ["calibrate", "--checkpoint", str(tmp_path / "luna.ckpt"), "--output", str(tmp_path / "out")])
    assert "luna16" in line and "btcv, camelyon16" in line


def test_calibrate_a_patch_classifier(tmp_path):
    """camelyon16: every validation patch is a sample; the calibrated module's tumour
    probabilities are softmax(logits / T) of the original's."""
    from hsmla_med.cli import main
    from hsmla_med.data.synthetic.wsi import generate_camelyon16
    from hsmla_med.pipelines import get_task

    generate_camelyon16(tmp_path / "data", num_normal=2, num_tumor=2, num_test=0, size=(1024, 768), seed=0)
    config = tmp_path / "c16.yaml"
    config.write_text(json.dumps({"data": {"cache_dir": str(tmp_path / "cache"), "patch_size": 32, "stride": 32, "level": 1,
                                           "samples_per_epoch": 16, "batch_size": 16, "num_workers": 0},
                                  "trainer": {"accelerator": "cpu", "progress_bar": False}}))
    common = ["--data-dir", str(tmp_path / "data"), "--config", str(config)]
    assert main(["train", "--task", "camelyon16", *common, "--max-steps", "2", "--output", str(tmp_path / "run")]) == 0
    patches = json.loads((tmp_path / "run" / "metrics.json").read_text())["cases"]
    assert main(["calibrate", "--checkpoint", str(tmp_path / "run" / "last.ckpt"), *common, "--output", str(tmp_path / "cal")]) == 0
    report = json.loads((tmp_path / "cal" / "calibration.json").read_text())
    assert report["samples"] == patches and report["after"]["nll"] <= report["before"]["nll"] + 1e-9
    task = get_task("camelyon16")
    original, _ = task.load(tmp_path / "run" / "last.ckpt")
    module, _ = task.load(tmp_path / "cal" / "last.ckpt")
    batch = {"image": torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8), "slide_index": torch.zeros(4), "row": torch.arange(4),
             "col": torch.zeros(4)}
    with torch.no_grad():
        logits = original.network(batch["image"].float() / 255)
        prob = module.predict_step(batch)["prob"]
    assert torch.allclose(prob, torch.softmax(logits / report["temperature"][0], 1)[:, 1], atol=1e-6)
