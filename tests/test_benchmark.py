"""The benchmark's arithmetic (its figures are recorded in docs/benchmarks.md, never asserted)."""

import sys

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


class _Toy(torch.nn.Module):
    """A stand-in network (2D or 3D convolutions) for the GPU benchmark's tables on the CPU."""

    def __init__(self, width: int, dims: int = 2):
        super().__init__()
        conv = torch.nn.Conv2d if dims == 2 else torch.nn.Conv3d
        self.body = torch.nn.Sequential(conv(1, width, 3, padding=1), conv(width, 14, 1))

    def forward(self, x):
        return self.body(x)


def _toy_gpu_networks(monkeypatch):
    """Toy networks under every name of the GPU benchmark's 2D and 3D tables."""
    from hsmla_med.bench import gpu as benchmark_gpu

    names_2d = dict.fromkeys(benchmark_gpu.FLOOR + benchmark_gpu.INFERENCE + benchmark_gpu.TRAINING)
    monkeypatch.setattr(benchmark_gpu, "_models_2d", lambda size: {n: (lambda w=4 + 2 * i: _Toy(w)) for i, n in enumerate(names_2d)})
    monkeypatch.setattr(benchmark_gpu, "_models_3d", lambda side: {n: (lambda w=2 + 2 * i: _Toy(w, 3)) for i, n in enumerate(benchmark_gpu.CUBE)})
    return benchmark_gpu


def _gpu_csv(folder, table):
    import csv

    return list(csv.DictReader((folder / f"gpu_{table}.csv").open()))


def test_gpu_benchmark_tables_on_the_cpu(monkeypatch, tmp_path):
    """``bench --only gpu`` end to end with toy networks (``--device cpu``): every table is written
    with its columns, the modes that need CUDA are rows that say so, each reference row has ratio
    1 and the ratios are quotients of the same mode's times."""
    benchmark_gpu = _toy_gpu_networks(monkeypatch)
    argv = ["--only", "gpu", "--device", "cpu", "--size", "16", "--size-3d", "8", "--train-batch", "2",
            "--warmup", "1", "--reps", "2", "--out", str(tmp_path)]
    assert bench_main.main(argv) == 0
    machine = ["device", "torch", "triton", "commit"]
    forward = ["model", "mode", "batch", "params_m", "ms", "replay_ms", "images_per_s", "peak_mib"]
    columns = {
        "floor": forward + ["vs_segformer_b2", "replay_vs_segformer_b2", "status"],
        "inference": forward + ["vs_segformer_b2", "replay_vs_segformer_b2", "status"],
        "3d": forward + ["vs_segresnet", "vs_swinunetr", "replay_vs_segresnet", "replay_vs_swinunetr", "status"],
        "training": ["model", "mode", "batch", "params_m", "step_ms", "images_per_s", "peak_mib", "vs_segformer_b2", "vs_swinunetr_2d", "status"],
        "kernels": ["model", "mode", "batch", "gpu_kernels", "gpu_memcpy_memset", "census_kernels", "census_aten", "census_triton",
                    "host_syncs", "sync_ops", "status"],
    }
    tables = {name: _gpu_csv(tmp_path, name) for name in columns}
    for name, rows in tables.items():
        assert list(rows[0]) == columns[name] + machine, name
        assert {r["device"] for r in rows} == {"CPU (smoke run, not a benchmark)"}
        for r in rows:
            assert r["status"] == ("skipped: needs CUDA (--device cpu is a smoke run)" if r["mode"] != "eager" else
                                   ("census only: the profiler's kernel count needs CUDA" if name == "kernels" else "ok")), (name, r)
    inference = tables["inference"]
    assert [(r["model"], r["mode"], r["batch"]) for r in inference] == [
        (n, m, b) for m in benchmark_gpu.MODES for b in ("1", "16") for n in benchmark_gpu.INFERENCE]
    assert [r["model"] for r in tables["floor"] if r["mode"] == "eager"] == list(benchmark_gpu.FLOOR)
    for batch in ("1", "16"):
        eager = [r for r in inference if r["mode"] == "eager" and r["batch"] == batch]
        reference = next(float(r["ms"]) for r in eager if r["model"] == "SegFormer-B2")
        for r in eager:
            assert float(r["vs_segformer_b2"]) == pytest.approx(reference / float(r["ms"]), rel=0.01, abs=0.002)
            assert float(r["images_per_s"]) == pytest.approx(int(batch) / float(r["ms"]) * 1e3, rel=0.02, abs=0.1)
            assert r["replay_ms"] == r["replay_vs_segformer_b2"] == ""
    cube = [r for r in tables["3d"] if r["mode"] == "eager"]
    assert next(float(r["vs_swinunetr"]) for r in cube if r["model"] == "SwinUNETR") == 1.0
    assert next(float(r["vs_segresnet"]) for r in cube if r["model"] == "SegResNet") == 1.0
    training = tables["training"]
    assert {r["mode"] for r in training} == {"eager", "compiled"}  # no graph mode in training
    for r in (r for r in training if r["mode"] == "eager"):
        assert float(r["images_per_s"]) == pytest.approx(2 / float(r["step_ms"]) * 1e3, rel=0.02, abs=0.1)
    assert next(float(r["vs_swinunetr_2d"]) for r in training if r["model"] == "SwinUNETR-2D" and r["mode"] == "eager") == 1.0
    kernels = [r for r in tables["kernels"] if r["mode"] == "eager"]
    assert [r["model"] for r in kernels] == list(benchmark_gpu.KERNELS)
    for r in kernels:  # two convolutions with their biases; no host sync
        assert int(r["census_kernels"]) == int(r["census_aten"]) >= 2 and r["census_triton"] == r["host_syncs"] == "0"
        assert r["gpu_kernels"] == ""


def test_gpu_benchmark_reports_a_failed_compile_or_capture_as_a_row(monkeypatch, tmp_path):
    """The graph and compiled modes' machinery on the CPU (CPU tensors count as CUDA ones, the
    capture is faked): a network whose capture fails, and one whose compile fails, are rows whose
    status names the step and the error, and the other networks' rows and ratios are unaffected;
    ``--networks`` and ``--modes`` pick rows in their table's order and the order given."""
    from hsmla_med.inference import cuda_graph

    benchmark_gpu = _toy_gpu_networks(monkeypatch)
    toys = benchmark_gpu._models_2d(16)

    class Uncapturable(_Toy):
        pass

    def fake_capture(fn, inputs, pool):
        if isinstance(getattr(fn, "model", fn), Uncapturable):
            raise RuntimeError("operation not permitted when stream is capturing")
        outputs = fn(*inputs)
        return cuda_graph._Entry(lambda: outputs.copy_(fn(*inputs)), list(inputs), outputs)

    class FakeCompiled:
        def __init__(self, model):
            self.model = model

        def __call__(self, x):
            if isinstance(self.model, _Toy) and self.model.body[0].out_channels == 99:
                raise RuntimeError("inductor exploded")
            return self.model(x)

    monkeypatch.setattr(benchmark_gpu, "_models_2d", lambda size: {**toys, "SwinUNETR-2D": lambda: Uncapturable(6), "MONAI UNet": lambda: _Toy(99)})
    monkeypatch.setattr(benchmark_gpu, "_mode_problem", lambda mode, device: None)
    monkeypatch.setattr(benchmark_gpu, "_compile", lambda model, mode: FakeCompiled(model))
    monkeypatch.setattr(cuda_graph, "_capture", fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(cuda_graph.GraphedCallable, "graphed", lambda self, inputs: self.enabled and not self.failed and not torch.is_grad_enabled())
    argv = ["--only", "gpu", "--device", "cpu", "--tables", "inference,training", "--modes", "graph,compiled", "--batches", "1,2",
            "--networks", "MONAI UNet,SegFormer-B2,SwinUNETR-2D,HSMLA-B2", "--size", "16", "--train-batch", "2", "--warmup", "1",
            "--reps", "2", "--out", str(tmp_path)]
    assert bench_main.main(argv) == 0
    rows = _gpu_csv(tmp_path, "inference")
    order = ["HSMLA-B2", "SegFormer-B2", "SwinUNETR-2D", "MONAI UNet"]  # the table's order, not --networks'
    assert [(r["model"], r["mode"], r["batch"]) for r in rows] == [(n, m, b) for m in ("graph", "compiled") for b in ("1", "2") for n in order]
    status = {(r["model"], r["mode"], r["batch"]): r["status"] for r in rows}
    for mode in ("graph", "compiled"):
        for batch in ("1", "2"):
            failed = status[("SwinUNETR-2D", mode, batch)]
            assert failed.startswith("failed: capture: CUDA graph capture of ") and failed.endswith(
                " failed (RuntimeError: operation not permitted when stream is capturing); running it eagerly"), failed
            assert status[("HSMLA-B2", mode, batch)] == status[("SegFormer-B2", mode, batch)] == "ok"
    assert status[("MONAI UNet", "graph", "1")] == "ok"
    assert status[("MONAI UNet", "compiled", "1")] == "failed: compile: RuntimeError: inductor exploded"
    for r in rows:
        assert (r["ms"] == "") == r["status"].startswith("failed")
    segformer = {(r["mode"], r["batch"]): float(r["ms"]) for r in rows if r["model"] == "SegFormer-B2"}
    for r in (r for r in rows if r["status"] == "ok"):
        assert float(r["vs_segformer_b2"]) == pytest.approx(segformer[(r["mode"], r["batch"])] / float(r["ms"]), rel=0.01, abs=0.002)
    training = _gpu_csv(tmp_path, "training")
    assert [(r["model"], r["mode"]) for r in training] == [(n, "compiled") for n in ["HSMLA-B2", "SegFormer-B2", "SwinUNETR-2D", "MONAI UNet"]]
    assert next(r["status"] for r in training if r["model"] == "MONAI UNet") == "failed: compile: RuntimeError: inductor exploded"


@pytest.mark.parametrize("argv, expected", [
    (["--modes", "eager,fast"], "argument --modes: 'eager,fast': give a comma-separated subset of eager,graph,compiled"),
    (["--tables", "floor,4d"], "argument --tables: 'floor,4d': give a comma-separated subset of floor,inference,kernels,3d,training"),
    (["--batches", "1,0"], "argument --batches: must be positive, got 0"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_gpu_benchmark_bad_options(capsys, tmp_path, argv, expected):
    with pytest.raises(SystemExit) as raised:
        bench_main.main(["--only", "gpu", "--device", "cpu", "--out", str(tmp_path), *argv])
    err = capsys.readouterr().err
    assert raised.value.code == 2 and err.count("\n") == 1 and expected in err, err


def test_gpu_benchmark_unknown_network(tmp_path):
    from hsmla_med.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--networks: unknown network\(s\) \['SegFormer-B9'\] for --only gpu; known: HSMLA-B2 \(refinement off\)"):
        bench_main.main(["--only", "gpu", "--device", "cpu", "--networks", "HSMLA-B2,SegFormer-B9", "--out", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []


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


def _fake_wsi_runs(monkeypatch, tmp_path):
    """The heatmap benchmark with its slides and child processes faked (no generation, no
    process): every child's command line is recorded and reports 100 patches in a time per mode."""
    from hsmla_med.bench import wsi
    from hsmla_med.data.synthetic import wsi as synthetic
    from hsmla_med.pipelines import camelyon16

    def generate(root, num_normal, num_tumor, num_test, size, seed):
        (root / "training" / "tumor").mkdir(parents=True)
        (root / "training" / "tumor" / "tumor_001.tif").write_bytes(b"")
        return root

    def dense(path, *args, **kwargs):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"")
        return path

    commands = []
    seconds = {"forward": 1.0, "loop-0-tifffile": 1.5, "loop-1-openslide": 2.0}

    def run(cmd):  # each mode's time, 0.5 s more the first time (a row is the best of the rounds)
        first = cmd not in commands
        commands.append(cmd)
        return {"patches": 100, "seconds": seconds.get(cmd[-2], 1.25) + 0.5 * first, "peak_mib": 2.0}

    monkeypatch.setattr(synthetic, "generate_camelyon16", generate)
    monkeypatch.setattr(camelyon16, "slide_patches", lambda case, config: None)
    monkeypatch.setattr(wsi, "dense_slide", dense)
    monkeypatch.setattr(wsi, "_run", run)
    return wsi, commands


def test_wsi_bench_hands_its_device_to_every_child(monkeypatch, tmp_path):
    """``device`` is the last argument of every heatmap process: ``device="cpu"`` given gives the
    rows of the default (which, with no ``--only wsi --device`` on the command line, is the CPU);
    on CUDA (faked here) the default is HSMLA-B0 on the dense slide, one round, the forward and
    the loop with 8 and 4 tifffile workers."""
    wsi, commands = _fake_wsi_runs(monkeypatch, tmp_path)
    monkeypatch.setattr(sys, "argv", ["pytest", "--device", "cuda"])  # another program's --device: not the table's
    small = {"sizes": ((2048, 1536),), "modes": ("forward", "loop-0-tifffile", "loop-1-openslide")}
    default = wsi.bench_wsi(**small)
    assert {c[-1] for c in commands} == {"cpu"} and len(commands) == 2 * (3 * 3 + 3)  # 2 rounds, 3 models + B0 dense, 3 modes
    commands.clear()
    assert wsi.bench_wsi(**small, device="cpu") == default
    assert {c[-1] for c in commands} == {"cpu"}
    assert [r["mode"] for r in default[:3]] == list(small["modes"])
    assert [(r["seconds"], r["patches_per_s"], r["vs_forward"]) for r in default[:3]] == [(1.0, 100.0, 1.0), (1.5, pytest.approx(100 / 1.5), pytest.approx(1 / 1.5)), (2.0, 50.0, 0.5)]
    assert wsi.default_modes("cpu")[:3] == ("forward", "loop-0-openslide", "loop-0-tifffile")
    commands.clear()
    from hsmla_med.errors import ConfigError

    with pytest.raises(ConfigError, match=r"mode 'loop-x-tifffile': use forward or loop-W-R"):
        wsi.bench_wsi(modes=("forward", "loop-x-tifffile"), device="cpu")
    assert commands == []

    from contextlib import nullcontext

    commands.clear()
    monkeypatch.setattr(wsi, "device_problem", lambda device: None)
    monkeypatch.setattr(wsi, "_precision", lambda device: ("bf16-mixed", nullcontext))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a faked GPU")
    rows = wsi.bench_wsi(device="cuda:1")
    modes = ("forward", "loop-8-tifffile", "loop-4-tifffile") + (("loop-8-cucim",) if "loop-8-cucim" in wsi.default_modes("cuda") else ())
    assert [(c[3:5], c[-2], c[-1]) for c in commands] == [(["HSMLA-B0", commands[0][4]], m, "cuda:1") for m in modes]
    assert commands[0][4].endswith("dense.tif")
    assert [(r["model"], r["slide"], r["mode"]) for r in rows] == [("HSMLA-B0", "22528x22528 dense", m) for m in modes]


def test_wsi_bench_child_runs_each_mode_on_its_device(tmp_path, monkeypatch):
    """The child's command line (model, slide, cache, patch, batch, mode, device) on the CPU, in
    this process: the forward passes alone and the real heatmap loop count the slide's patches."""
    import contextlib
    import io
    import json

    from hsmla_med.bench import wsi
    from hsmla_med.data.patch_readers import READER_ENV
    from hsmla_med.data.synthetic.wsi import generate_camelyon16

    monkeypatch.setenv(READER_ENV, "auto")  # (the loop mode sets it)
    root = generate_camelyon16(tmp_path / "s", num_normal=0, num_tumor=1, num_test=0, size=(2048, 1536), seed=1)
    slide = str(next((root / "training" / "tumor").glob("*.tif")))
    results = {}
    for mode in ("forward", "loop-0-tifffile"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            wsi._child_main(["HSMLA-B0", slide, str(tmp_path / "cache"), "256", "4", mode, "cpu"])
        results[mode] = json.loads(out.getvalue().strip().splitlines()[-1])
    assert results["forward"]["patches"] == results["loop-0-tifffile"]["patches"] > 0
    assert all(r["seconds"] > 0 for r in results.values())


def test_wsi_bench_without_cuda_is_one_line_and_no_rows(capsys, monkeypatch, tmp_path):
    """``hsmla-med bench --only wsi --device cuda`` on a machine without that device: one line on
    stderr, exit status 2 (as ``--only gpu``), no process started, no wsi.csv; called with
    ``device="cuda"`` the function raises ConfigError."""
    from hsmla_med.bench import wsi
    from hsmla_med.errors import ConfigError

    def measured(cmd):
        raise AssertionError("measured although there is no CUDA device")

    monkeypatch.setattr(wsi, "_run", measured)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(SystemExit) as raised:
        bench_main.main(["--only", "wsi", "--device", "cuda", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert raised.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("hsmla-med bench: error: --only wsi --device cuda: no such CUDA device on this machine (0 found); nothing measured")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ConfigError, match=r"wsi benchmark on cuda:1: no such CUDA device"):
        wsi.bench_wsi(device="cuda:1")
