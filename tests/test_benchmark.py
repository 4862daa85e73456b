"""The benchmark's arithmetic (its figures are recorded in docs/benchmarks.md, never asserted)."""

import pytest
import torch

from hsmla_med.bench import main as bench_main
from hsmla_med.bench import models as benchmark


def test_model_table_ratios_on_a_fake_clock(monkeypatch):
    """The network table's speed-ups and the B2 variants' per-round ratio to refinement off,
    with models that advance a fake clock by fixed amounts (no timing of real work)."""
    clock = [0.0]

    class Fake(torch.nn.Module):
        def __init__(self, seconds):
            super().__init__()
            self.seconds = seconds
            self.weight = torch.nn.Parameter(torch.zeros(3))

        def forward(self, x):
            clock[0] += self.seconds
            return x

    costs = {"HSMLA-B2": 0.011, "HSMLA-B2 (refinement off)": 0.010, "HSMLA-B2 (alpha = 1)": 0.013, "HSMLA-B2 (paper head, stride 8)": 0.012, "SegFormer-B2": 0.1}
    monkeypatch.setattr(benchmark, "build_models", lambda x: {n: (lambda c=c: Fake(c)) for n, c in costs.items()})
    monkeypatch.setattr(benchmark.time, "perf_counter", lambda: clock[0])
    rows = {r["model"]: r for r in benchmark.bench_models(size=8, runs=3)}
    assert rows["HSMLA-B2"]["latency_ms"] == pytest.approx(11.0)
    assert rows["HSMLA-B2"]["speedup_vs_segformer_b2"] == pytest.approx(100 / 11)
    assert rows["HSMLA-B2"]["b2_vs_refinement_off"] == pytest.approx(1.1)
    assert rows["HSMLA-B2 (alpha = 1)"]["b2_vs_refinement_off"] == pytest.approx(1.3)
    assert rows["SegFormer-B2"]["b2_vs_refinement_off"] == ""
    assert rows["HSMLA-B2 (paper head, stride 8)"]["b2_vs_refinement_off"] == ""


def test_paired_speedup_is_the_median_of_per_round_ratios(monkeypatch):
    """Load that drifts between rounds moves the ratio of the medians, not the per-round one: the
    fake SegFormer-B2 is 10x HSMLA-B2 in two rounds of three and 5x in the third."""
    clock = [0.0]

    class Fake(torch.nn.Module):
        def __init__(self, seconds):  # per call: the FLOP count, two warm-ups, then the rounds
            super().__init__()
            self.seconds = iter(seconds)
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x):
            clock[0] += next(self.seconds)
            return x

    costs = {
        "HSMLA-B2": [1, 1, 1, 0.01, 0.04, 0.02],
        "HSMLA-B2 (refinement off)": [1, 1, 1, 0.01, 0.01, 0.01],
        "SegFormer-B2": [1, 1, 1, 0.1, 0.4, 0.1],
    }
    monkeypatch.setattr(benchmark, "build_models", lambda x: {n: (lambda c=c: Fake(c)) for n, c in costs.items()})
    monkeypatch.setattr(benchmark.time, "perf_counter", lambda: clock[0])
    b2 = next(r for r in benchmark.bench_models(size=8, runs=3) if r["model"] == "HSMLA-B2")
    assert b2["speedup_vs_segformer_b2"] == pytest.approx(0.1 / 0.02)
    assert b2["speedup_vs_segformer_b2_paired"] == pytest.approx(10.0)


def test_forward_gflops_counts_a_hand_computed_network():
    """A 3x3 convolution 2 -> 4 channels on 1 x 2 x 8 x 8 ('same' padding: 64 outputs per channel,
    2 x 9 multiply-adds each) then a 4 -> 3 linear layer on the 4 x 64 pixels: 2 x (4 x 64 x 18 +
    64 x 4 x 3) FLOP. The activation between them counts nothing."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.linear = torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.linear(torch.relu(self.conv(x)).flatten(2).transpose(1, 2))

    expected = 2 * (4 * 64 * 18 + 64 * 4 * 3)
    assert benchmark.forward_gflops(Net(), torch.randn(1, 2, 8, 8)) * 1e9 == pytest.approx(expected)


def test_bench_models_script_is_the_benchmark():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "bench_models.py"
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--only" in done.stdout and "SegFormer" in done.stdout


def test_gpu_benchmark_tables_on_the_cpu(monkeypatch, tmp_path):
    """``bench --only gpu`` end to end with toy networks (``--device cpu``): every table is written,
    its reference row has ratio 1 and the ratios are the latency/throughput quotients."""
    import csv

    from hsmla_med.bench import gpu as benchmark_gpu

    def toy(width):
        return lambda: torch.nn.Sequential(torch.nn.Conv2d(1, width, 3, padding=1), torch.nn.Conv2d(width, 14, 1))

    def toy3d(width):
        return lambda: torch.nn.Sequential(torch.nn.Conv3d(1, width, 3, padding=1), torch.nn.Conv3d(width, 14, 1))

    names = ("HSMLA-B0", "HSMLA-B1", "HSMLA-B2", "SegFormer-B0", "SegFormer-B2", "SwinUNETR-2D", "MONAI UNet")
    monkeypatch.setattr(benchmark, "build_models", lambda sample: {n: toy(4 + 4 * i) for i, n in enumerate(names)})
    monkeypatch.setattr(benchmark_gpu, "_models_3d", lambda side: {"HSMLA-B0 3D": toy3d(2), "SwinUNETR": toy3d(8)})
    argv = ["--only", "gpu", "--device", "cpu", "--size", "16", "--size-3d", "8", "--train-batch", "2",
            "--warmup", "1", "--reps", "2", "--out", str(tmp_path)]
    assert bench_main.main(argv) == 0
    read = lambda name: list(csv.DictReader((tmp_path / name).open()))  # noqa: E731
    inference, cube, training = read("gpu_inference.csv"), read("gpu_3d.csv"), read("gpu_training.csv")
    assert [r["model"] for r in inference] == list(names) and [r["model"] for r in training] == list(names)
    b2 = next(r for r in inference if r["model"] == "SegFormer-B2")
    assert float(b2["speedup_vs_segformer_b2"]) == 1.0
    for r in inference:
        assert float(r["speedup_vs_segformer_b2"]) == pytest.approx(float(b2["latency_ms"]) / float(r["latency_ms"]), rel=0.02, abs=0.01)
    assert next(float(r["speedup_vs_swinunetr"]) for r in cube if r["model"] == "SwinUNETR") == 1.0
    for r in training:
        assert float(r["images_per_s"]) == pytest.approx(2 / float(r["step_ms"]) * 1e3, rel=0.02, abs=0.1)


@pytest.mark.parametrize("argv, expected", [
    (["--size", "0"], "argument --size: must be positive, got 0"),
    (["--size", "-8"], "argument --size: must be positive, got -8"),
    (["--runs", "0"], "argument --runs: must be positive, got 0"),
    (["--threads", "0"], "argument --threads: must be positive, got 0"),
    (["--threads", "-2"], "argument --threads: must be positive, got -2"),
    (["--layer-sides", "32", "0"], "argument --layer-sides: must be positive, got 0"),
    (["--head-dim", "0"], "argument --head-dim: must be positive, got 0"),
    (["--layer-channels", "100"], "--layer-channels 100 is not a multiple of --head-dim 32"),
    (["--reps", "0"], "argument --reps: must be positive, got 0"),
    (["--warmup", "-1"], "argument --warmup: must be >= 0, got -1"),
    (["--steps", "zero"], "argument --steps: not a whole number: 'zero'"),
    (["--device", "foo"], "argument --device: not a device: 'foo'"),
    (["--out", "{file}"], "exists and is not a folder"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_options_are_one_line_and_exit_2(capsys, monkeypatch, tmp_path, argv, expected):
    def measured(*args, **kwargs):
        raise AssertionError("measured although an option was bad")

    for table in ("bench_models", "bench_layer"):
        monkeypatch.setattr(bench_main, table, measured)
    (tmp_path / "file").write_text("not a folder")
    argv = [a.replace("{file}", str(tmp_path / "file")) for a in argv]
    with pytest.raises(SystemExit) as raised:
        bench_main.main(["--out", str(tmp_path / "out"), *argv, "--only", "models"])
    err = capsys.readouterr().err
    assert raised.value.code == 2
    assert err.count("\n") == 1 and err.startswith("hsmla-med bench: error: ") and expected in err, err
    assert not (tmp_path / "out" / "models.csv").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_table_without_cuda_is_refused(capsys, tmp_path):
    """It used to exit 0 having measured nothing; --device cpu (the smoke run above) still runs."""
    with pytest.raises(SystemExit) as raised:
        bench_main.main(["--only", "gpu", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert raised.value.code == 2 and err.count("\n") == 1 and "--only gpu --device cuda: no such CUDA device" in err
    assert list(tmp_path.iterdir()) == []


def test_only_layers_writes_layers_csv(monkeypatch, tmp_path):
    """``--only NAME`` writes ``NAME.csv`` for every table (layers wrote layer_scaling.csv)."""
    import csv

    calls = []

    def fake_layers(sides, channels, head_dim):
        calls.append((sides, channels, head_dim))
        return [{"layer": "HSMLA (alpha 0.3)", "tokens": s * s, "side": s, "time_ms": 1.0, "peak_mib": 2.0} for s in sides]

    monkeypatch.setattr(bench_main, "bench_layer", fake_layers)
    assert bench_main.main(["--only", "layers", "--runs", "1", "--layer-sides", "8", "16", "--out", str(tmp_path)]) == 0
    assert calls == [([8, 16], 128, 32)]
    rows = list(csv.DictReader((tmp_path / "layers.csv").open()))
    assert [int(r["tokens"]) for r in rows] == [64, 256]


def test_learning_data_folder_that_cannot_be_written(tmp_path):
    """An unwritable home (the default folder) or --data-dir used to end in NotADirectoryError's
    traceback; the learning table names the folder in one line instead."""
    from hsmla_med.bench.learning import bench_learning
    from hsmla_med.errors import ConfigError

    (tmp_path / "home").write_text("a file, as HOME=/dev/null")
    with pytest.raises(ConfigError, match=r"--data-dir .*home/mni: cannot write the MNI dataset there \(Not a directory\)"):
        bench_learning(tmp_path / "out", steps=1, networks=["unet"], data_dir=tmp_path / "home" / "mni")


def test_dense_wsi_bench_slide_has_a_tissue_patch_per_tile(tmp_path):
    """The heatmap benchmark's dense slide: the tissue mask (as wsi-heatmap computes it) finds
    exactly its tiles x tiles tissue tiles as patches, none in the glass frame."""
    from hsmla_med.bench.wsi import _data_config, dense_slide
    from hsmla_med.pipelines import camelyon16

    tiles = 5
    slide = dense_slide(tmp_path / "dense" / "dense.tif", tiles=tiles, source=(2048, 1536))
    grid = camelyon16.slide_patches({"slide": str(slide), "annotation": None, "label": 0}, _data_config(tmp_path / "cache", 256))
    corners = {(int(x), int(y)) for x, y in grid["coords"]}
    assert corners == {(256 * (4 + c), 256 * (4 + r)) for r in range(tiles) for c in range(tiles)}
