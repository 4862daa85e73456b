"""CPU benchmark of HSMLA networks against their peers, and of one HSMLA layer against full
softmax attention, side by side in one run.

Models (batch 1, 1 -> 14 channels, default 512x512): HSMLA-B0/B1/B2 (full-resolution U-shaped
decoder) with tau calibrated to alpha = 0.3, HSMLA-B2 with the refinement off, with alpha forced
to 1, with the paper's stride-8 head and with instance normalisation, SegFormer-B0/B2 (Hugging Face ``transformers``, random
weights from a config, no downloads), MONAI's SwinUNETR in 2D (feature_size 48) and MONAI's
UNet (16..256 channels, 2 residual units). Reports parameters, median latency after warm-up and the
ratio to SegFormer-B2.

Layer scaling: one HSMLA layer (inference, alpha = 0.3) vs
``torch.nn.functional.scaled_dot_product_attention`` over the same tokens at 32^2 .. 256^2:
median time, and peak memory measured as the resident-set growth of a fresh process.

EndoVis 2017 (``--only endovis``): HSMLA-B0 vs SegFormer-B0 frames per second on one RGB frame
of the standard 1024x1280 crop, 3 -> 8 channels, interleaved rounds.

Writes ``models.csv``, ``layer_scaling.csv`` and ``benchmarks.png`` (``endovis.csv`` with
``--only endovis``) into ``--out`` and prints markdown tables.

    hsmla-med bench --out bench_out        (or: python -m hsmla_med.benchmark --out bench_out)
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from hsmla_med.config import build_network, model_config
from hsmla_med.nn import HSMLA, calibrate_tau
from hsmla_med.runtime import tune_cpu_allocator

OUT_CHANNELS = 14
LAYER_KINDS = {"hsmla": "HSMLA (alpha 0.3)", "sdpa": "softmax SDPA", "conv1x1": "1x1 conv C->3C"}


def median_seconds(fn, warmup: int = 2, runs: int = 5, budget_s: float = 60.0) -> float:
    """Median wall time of ``fn()`` after ``warmup`` calls; fewer runs past ``budget_s``;
    ``runs=0`` only warms up."""
    for _ in range(warmup):
        fn()
    if runs == 0:
        return 0.0
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if sum(times) > budget_s:
            break
    return statistics.median(times)


class _SegFormer(torch.nn.Module):
    """SegFormer logits (1/4 resolution) upsampled to the input, as a segmentation net returns."""

    def __init__(self, hidden_sizes, depths, decoder_hidden_size, in_channels: int = 1, out_channels: int = OUT_CHANNELS):
        super().__init__()
        from transformers import SegformerConfig, SegformerForSemanticSegmentation

        config = SegformerConfig(
            num_channels=in_channels,
            num_labels=out_channels,
            hidden_sizes=hidden_sizes,
            depths=depths,
            decoder_hidden_size=decoder_hidden_size,
        )
        self.model = SegformerForSemanticSegmentation(config)

    def forward(self, x):
        logits = self.model(pixel_values=x).logits
        return torch.nn.functional.interpolate(logits, size=x.shape[2:], mode="bilinear", align_corners=False)


def _hsmla(variant: str, routing: str, sample: torch.Tensor, out_channels: int = OUT_CHANNELS, **model) -> torch.nn.Module:
    net = build_network({**model_config(variant), **model}, 2, sample.shape[1], out_channels).eval()
    net.set_routing(routing)
    if routing == "gate":
        calibrate_tau(net, sample, 0.3)
    return net


def build_models(sample: torch.Tensor) -> dict[str, callable]:
    """HSMLA networks with the full-resolution U-shaped decoder (the default) and the paper's
    stride-8 head, and their peers."""
    from monai.networks.nets import SwinUNETR, UNet

    return {
        "HSMLA-B0": lambda: _hsmla("b0", "gate", sample),
        "HSMLA-B1": lambda: _hsmla("b1", "gate", sample),
        "HSMLA-B2": lambda: _hsmla("b2", "gate", sample),
        "HSMLA-B2 (refinement off)": lambda: _hsmla("b2", "off", sample),
        "HSMLA-B2 (alpha = 1)": lambda: _hsmla("b2", "all", sample),
        "HSMLA-B2 (paper head, stride 8)": lambda: _hsmla("b2", "gate", sample, decoder="fpn", head_stride=8),
        "HSMLA-B2 (instance norm)": lambda: _hsmla("b2", "gate", sample, norm="instance"),
        "SegFormer-B0": lambda: _SegFormer([32, 64, 160, 256], [2, 2, 2, 2], 256),
        "SegFormer-B2": lambda: _SegFormer([64, 128, 320, 512], [3, 4, 6, 3], 768),
        "SwinUNETR-2D": lambda: SwinUNETR(in_channels=1, out_channels=OUT_CHANNELS, feature_size=48, spatial_dims=2),
        "MONAI UNet": lambda: UNet(2, 1, OUT_CHANNELS, channels=(16, 32, 64, 128, 256), strides=(2, 2, 2, 2), num_res_units=2),
    }


_B2_ROUTINGS = ("HSMLA-B2", "HSMLA-B2 (refinement off)", "HSMLA-B2 (alpha = 1)")


def bench_models(size: int, runs: int) -> list[dict]:
    """The network table: every model of :func:`build_models` on a 1-channel ``size`` x ``size``
    input, with the speed-up over SegFormer-B2 (as the ratio of the medians, and as the median of
    the per-round ratios, which load that drifts between rounds does not move) and, for the
    HSMLA-B2 variants, the time over
    HSMLA-B2 with the refinement off as the median of the per-round ratios (each round times
    the variants back to back, so the ratio is not moved by load that changes between rounds)."""
    x = torch.randn(1, 1, size, size)
    rows, times = time_models({name: make() for name, make in build_models(x).items()}, x, runs)
    reference = next(r["latency_ms"] for r in rows if r["model"] == "SegFormer-B2")
    off, segformer = times["HSMLA-B2 (refinement off)"], times["SegFormer-B2"]
    for r in rows:
        r["speedup_vs_segformer_b2"] = reference / r["latency_ms"]
        r["speedup_vs_segformer_b2_paired"] = statistics.median(s / t for s, t in zip(segformer, times[r["model"]]))
        paired = [t / o for t, o in zip(times[r["model"]], off)] if r["model"] in _B2_ROUTINGS else None
        r["b2_vs_refinement_off"] = statistics.median(paired) if paired else ""
    return rows


def time_models(models: dict[str, torch.nn.Module], x: torch.Tensor, runs: int) -> tuple[list[dict], dict]:
    """Median latency per model on input ``x`` over ``runs`` rounds after two warm-up calls
    each; each round times every model once, so a burst of load from elsewhere on a shared
    machine hits all models alike. Returns rows (model, params_m, latency_ms, mean_alpha) and
    every round's seconds per model."""
    models = {name: model.eval() for name, model in models.items()}
    times = {name: [] for name in models}
    with torch.no_grad():
        for model in models.values():
            median_seconds(lambda: model(x), warmup=2, runs=0)
        for round_ in range(runs):
            for name, model in models.items():
                start = time.perf_counter()
                model(x)
                times[name].append(time.perf_counter() - start)
            print(f"  round {round_ + 1}/{runs}", flush=True)
    rows = []
    for name, model in models.items():
        alphas = [s["alpha"] for s in model.gate_stats().values()] if hasattr(model, "gate_stats") else []
        rows.append(
            {
                "model": name,
                "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
                "latency_ms": statistics.median(times[name]) * 1e3,
                "mean_alpha": statistics.mean(alphas) if alphas else "",
            }
        )
    return rows, times


def _wsi(args) -> list[dict]:
    from hsmla_med.benchmark_wsi import bench_wsi

    return bench_wsi()


def _volume(args) -> list[dict]:
    from hsmla_med.benchmark_volume import bench_volume

    return bench_volume()


def _processes(args) -> list[dict]:
    from hsmla_med.benchmark_volume import bench_processes

    return bench_processes()


# --only NAME -> (what the table holds, the function making its rows); each writes NAME.csv
_TABLES = {
    "wsi": ("whole-slide heatmaps, 256 px patches at level 0, batch 32:", _wsi),
    "volume": ("btcv inference on one 512x512x300 CT, 14 classes, HSMLA-B0 (peak resident memory):", _volume),
    "processes": ("btcv inference of 8 synthetic volumes, one process vs two DDP processes (CPU, gloo):", _processes),
    "endovis": ("EndoVis 2017 frames, 1024x1280 RGB (the standard crop), batch 1, 3 -> 8 channels:", lambda args: bench_endovis(args.runs)),
    "export": ("exported ONNX under onnxruntime (CPU) vs PyTorch eager with the C kernels, batch 1, 1 -> 14 channels:", lambda args: __import__("hsmla_med.benchmark_export", fromlist=["bench_export"]).bench_export(args.size, args.runs, args.threads)),
}


def bench_endovis(runs: int, size: tuple[int, int] = (1024, 1280), classes: int = 8) -> list[dict]:
    """EndoVis 2017 frame rate: HSMLA-B0 (tau calibrated to alpha 0.3) and SegFormer-B0 on one
    RGB frame of the standard crop ``size`` (H, W), 3 -> ``classes`` channels (8: the type task,
    7 instruments and background), timed in interleaved rounds; frames/s and the ratio of
    HSMLA-B0's frame rate to SegFormer-B0's."""
    x = torch.randn(1, 3, *size)
    models = {
        "HSMLA-B0": _hsmla("b0", "gate", x, classes),
        "SegFormer-B0": _SegFormer([32, 64, 160, 256], [2, 2, 2, 2], 256, in_channels=3, out_channels=classes),
    }
    rows, _ = time_models(models, x, runs)
    reference = next(r["latency_ms"] for r in rows if r["model"] == "SegFormer-B0")
    for r in rows:
        r["frames_per_s"] = 1e3 / r["latency_ms"]
        r["speedup_vs_segformer_b0"] = reference / r["latency_ms"]
    return rows


def _layer_and_input(kind: str, side: int, channels: int, head_dim: int):
    x = torch.randn(1, channels, side, side).contiguous(memory_format=torch.channels_last)
    if kind == "hsmla":
        # channels-last as inside the networks: the CPU kernels take those maps (channel-first
        # ones run the reference)
        layer = HSMLA(2, channels, head_dim=head_dim).eval().to(memory_format=torch.channels_last)
        calibrate_tau(layer, x, 0.3)
        return lambda: layer(x)
    if kind == "conv1x1":  # yardstick: how a plain linear-cost op scales on this machine
        conv = torch.nn.Conv2d(channels, 3 * channels, 1).eval()
        return lambda: conv(x)
    heads = channels // head_dim
    q, k, v = (torch.randn(1, heads, side * side, head_dim) for _ in range(3))
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _peak_memory_child(kind: str, side: int, channels: int, head_dim: int) -> None:
    """Run in a fresh process: resident-set growth (MiB) of one forward beyond its inputs.

    Writing 5 to /proc/self/clear_refs resets the peak (VmHWM) to the current resident set, so
    the import-time peak does not hide the forward's.
    """
    with torch.no_grad():
        fn = _layer_and_input(kind, side, channels, head_dim)
        fn()  # first call allocates lazily initialised state (thread pools, oneDNN primitives)
        base = _status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        fn()
        peak = _status_kib("VmHWM")
    print(json.dumps({"peak_mib": (peak - base) / 1024}))


def peak_memory_mib(kind: str, side: int, channels: int, head_dim: int) -> float:
    cmd = [sys.executable, "-m", "hsmla_med.benchmark", "--memory-child", kind, str(side), str(channels), str(head_dim)]
    # A fixed glibc mmap threshold returns every large buffer to the system when freed, so the
    # measured forward cannot silently reuse memory that the warm-up call left in the heap.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    result = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(result.stdout.strip().splitlines()[-1])["peak_mib"]


def bench_layer(sides: list[int], channels: int, head_dim: int) -> list[dict]:
    rows = []
    for side in sides:
        for kind in LAYER_KINDS:
            with torch.no_grad():
                fn = _layer_and_input(kind, side, channels, head_dim)
                seconds = median_seconds(fn, runs=5, budget_s=30.0)
            rows.append(
                {
                    "layer": LAYER_KINDS[kind],
                    "tokens": side * side,
                    "side": side,
                    "time_ms": seconds * 1e3,
                    "peak_mib": peak_memory_mib(kind, side, channels, head_dim),
                }
            )
            print(f"  {rows[-1]['layer']} {side}^2: {seconds * 1e3:.1f} ms, {rows[-1]['peak_mib']:.1f} MiB", flush=True)
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


def plot(path: Path, models: list[dict], layers: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 5))
    ax1.barh([r["model"] for r in models], [r["latency_ms"] for r in models], color="tab:blue")
    ax1.set_xlabel("latency (ms, batch 1)")
    ax1.invert_yaxis()
    ax1.set_title("Segmentation networks, CPU")
    for name in LAYER_KINDS.values():
        rows = [r for r in layers if r["layer"] == name]
        ax2.loglog([r["tokens"] for r in rows], [r["time_ms"] for r in rows], "o-", label=name)
        ax3.loglog([r["tokens"] for r in rows], [max(r["peak_mib"], 0.1) for r in rows], "o-", label=name)
    ax2.set(xlabel="tokens", ylabel="time (ms)", title="One attention layer: time")
    ax3.set(xlabel="tokens", ylabel="peak memory growth (MiB)", title="One attention layer: memory")
    ax2.legend()
    ax3.legend()
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)


def markdown(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hsmla-med bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench_out"), help="output folder (default bench_out)")
    parser.add_argument("--size", type=int, default=512, help="input side for the network table (default 512)")
    parser.add_argument("--runs", type=int, default=7, help="timed rounds over all models after two warm-up runs each (default 7)")
    parser.add_argument(
        "--layer-sides", type=int, nargs="+", default=[32, 64, 128, 256], help="token-map sides for the layer table"
    )
    parser.add_argument("--layer-channels", type=int, default=128, help="channels of the benchmarked layer")
    parser.add_argument("--head-dim", type=int, default=32, help="head width of the benchmarked layer")
    parser.add_argument(
        "--only", choices=["models", "layers", "wsi", "endovis", "learning", "gpu", "volume", "processes", "export"],
        help="run one table (gpu: networks on a CUDA GPU, inference 2D/3D and training (scripts/bench_kernels.py: the Triton kernels); wsi: whole-slide heatmap throughput against the forward passes alone; volume: peak memory of infer on a 512x512x300 CT; processes: infer of 8 volumes in one vs two DDP processes; endovis: frames/s of HSMLA-B0 vs SegFormer-B0 on 1024x1280 RGB frames; learning: networks trained and scored on MNI152 grey/white matter; none of these is part of the default run)",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch CPU threads")
    parser.add_argument("--memory-child", nargs=4, help=argparse.SUPPRESS)
    from hsmla_med import benchmark_gpu, benchmark_learning

    benchmark_learning.add_arguments(parser)
    benchmark_gpu.add_arguments(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.memory_child:
        kind, *numbers = args.memory_child
        _peak_memory_child(kind, *map(int, numbers))
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    tuned = tune_cpu_allocator()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{args.threads} threads, heap top pad {'on' if tuned else 'off'} (hsmla_med.runtime)")
    if args.only in _TABLES:
        title, table = _TABLES[args.only]
        print(title, flush=True)
        rows = table(args)
        write_csv(args.out / f"{args.only}.csv", rows)
        print("\n" + markdown(rows) + "\n")
        return 0
    if args.only == "learning":
        return benchmark_learning.run(args)
    if args.only == "gpu":
        return benchmark_gpu.run(args)
    models = layers = []
    if args.only != "layers":
        print(f"networks at {args.size}x{args.size}, batch 1:", flush=True)
        models = bench_models(args.size, args.runs)
        write_csv(args.out / "models.csv", models)
        print("\n" + markdown(models) + "\n")
    if args.only != "models":
        print("layer scaling:", flush=True)
        layers = bench_layer(args.layer_sides, args.layer_channels, args.head_dim)
        write_csv(args.out / "layer_scaling.csv", layers)
        print("\n" + markdown(layers) + "\n")
    if models and layers:
        plot(args.out / "benchmarks.png", models, layers)
    print(f"wrote CSV/PNG files into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
