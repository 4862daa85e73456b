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

Writes ``models.csv``, ``layers.csv`` and ``benchmarks.png`` into ``--out`` (``--only NAME``
writes ``NAME.csv``) and prints markdown tables.

    hsmla-med bench --out bench_out        (or: python -m hsmla_med.bench --out bench_out)
"""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path

import torch

from hsmla_med.bench import contention, gpu, learning
from hsmla_med.bench.common import Parser, markdown, out_folder, positive_int, write_csv
from hsmla_med.bench.layers import LAYER_KINDS, bench_layer
from hsmla_med.bench.models import bench_endovis, bench_models
from hsmla_med.errors import ConfigError
from hsmla_med.runtime import tune_cpu_allocator


def _wsi(args) -> list[dict]:
    from hsmla_med.bench.wsi import bench_wsi

    return bench_wsi(device=args.device or "cpu")  # the heatmaps run on the CPU unless --device names one


def _volume(args) -> dict[str, list[dict]]:
    from hsmla_med.bench.volume import bench_volume

    return bench_volume()


def _processes(args) -> list[dict]:
    from hsmla_med.bench.volume import bench_processes

    return bench_processes()


# --only NAME -> (what the table holds, the function making its rows); each writes NAME.csv
# (a function returning {name: rows} writes one name.csv per table: volume also volume_dicom.csv)
_TABLES = {
    "wsi": ("whole-slide heatmaps, 256 px patches at level 0, batch 32:", _wsi),
    "volume": ("btcv inference on one 512x512x300 CT, 14 classes, HSMLA-B0 (peak resident memory); the same CT as a DICOM series into a DICOM SEG:", _volume),
    "processes": ("btcv inference of 8 synthetic volumes: one process, with loader workers, two DDP processes (CPU, gloo) with hsmla-med's threads and with OMP_NUM_THREADS=2 each:", _processes),
    "endovis": ("EndoVis 2017 frames, 1024x1280 RGB (the standard crop), batch 1, 3 -> 8 channels:", lambda args: bench_endovis(args.runs)),
    "contention": ("HSMLA-B2 (eager and torch.compile), SegFormer-B2, MONAI UNet at --size^2, batch 1, called as a library (either import order), and hsmla-med infer "
                   "of a volume; quiet, beside a background hsmla-med train, beside two PyTorch processes (2 threads each, matrix products):",
                   lambda args: contention.bench_contention(args)),
    "export": ("exported ONNX under onnxruntime (CPU) vs PyTorch eager with the C kernels, batch 1, 1 -> 14 channels:", lambda args: __import__("hsmla_med.bench.export", fromlist=["bench_export"]).bench_export(args.size, args.runs, args.threads)),
}


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


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="hsmla-med bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=out_folder, default="bench_out", help="output folder (default bench_out)")
    parser.add_argument("--size", type=positive_int, default=512, help="input side for the network table (default 512)")
    parser.add_argument("--runs", type=positive_int, default=7, help="timed rounds over all models after two warm-up runs each (default 7)")
    parser.add_argument(
        "--layer-sides", type=positive_int, nargs="+", default=[32, 64, 128, 256], help="token-map sides for the layer table"
    )
    parser.add_argument("--layer-channels", type=positive_int, default=128, help="channels of the benchmarked layer (a multiple of --head-dim)")
    parser.add_argument("--head-dim", type=positive_int, default=32, help="head width of the benchmarked layer")
    parser.add_argument(
        "--only", choices=["models", "layers", "wsi", "endovis", "learning", "gpu", "volume", "processes", "export", "contention"],
        help="run one table (contention: HSMLA-B2, SegFormer-B2 and MONAI's UNet as a library and hsmla-med infer, quiet, beside a background hsmla-med train and beside 2 busy PyTorch processes; gpu: networks on a CUDA GPU, inference 2D/3D and training (scripts/bench_kernels.py: the Triton kernels); wsi: whole-slide heatmap throughput against the forward passes alone; volume: peak memory of infer on a 512x512x300 CT, and as a 300-file DICOM series into a DICOM SEG against NIfTI; processes: infer of 8 volumes in one vs two DDP processes; endovis: frames/s of HSMLA-B0 vs SegFormer-B0 on 1024x1280 RGB frames; learning: networks trained and scored on MNI152 grey/white matter; none of these is part of the default run)",
    )
    parser.add_argument("--threads", type=positive_int, default=os.cpu_count(), help="torch CPU threads")
    learning.add_arguments(parser)
    gpu.add_arguments(parser)
    contention.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.layer_channels % args.head_dim:
        parser.error(f"--layer-channels {args.layer_channels} is not a multiple of --head-dim {args.head_dim}")
    if args.only == "gpu":
        args.device = args.device or "cuda"
    if args.only in ("gpu", "wsi") and args.device:
        problem = gpu.device_problem(args.device)
        if problem:
            parser.error(f"--only {args.only} --device {args.device}: {problem}")
    torch.set_num_threads(args.threads)
    try:
        tuned = tune_cpu_allocator()
    except ConfigError as err:  # (python -m hsmla_med.bench: hsmla-med itself reports it first)
        parser.error(str(err))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{args.threads} threads, heap top pad {'on' if tuned else 'off'} (hsmla_med.runtime), "
          f"OpenMP {', '.join(f'{k}={os.environ[k]}' for k in ('GOMP_SPINCOUNT', 'OMP_WAIT_POLICY', 'OMP_NUM_THREADS') if k in os.environ) or 'defaults'}, "
          f"load average {os.getloadavg()[0]:.2f} (1 min) at the start")
    if args.only in _TABLES:
        title, table = _TABLES[args.only]
        print(title, flush=True)
        result = table(args)
        for name, rows in (result if isinstance(result, dict) else {args.only: result}).items():
            write_csv(args.out / f"{name}.csv", rows)
            print(f"\n{name}.csv:\n" + markdown(rows) + "\n")
        return 0
    if args.only == "learning":
        return learning.run(args)
    if args.only == "gpu":
        return gpu.run(args)
    models = layers = []
    if args.only != "layers":
        print(f"networks at {args.size}x{args.size}, batch 1:", flush=True)
        models = bench_models(args.size, args.runs)
        write_csv(args.out / "models.csv", models)
        print("\n" + markdown(models) + "\n")
    if args.only != "models":
        print("layer scaling:", flush=True)
        layers = bench_layer(args.layer_sides, args.layer_channels, args.head_dim)
        write_csv(args.out / "layers.csv", layers)
        print("\n" + markdown(layers) + "\n")
    if models and layers:
        plot(args.out / "benchmarks.png", models, layers)
    print(f"wrote CSV/PNG files into {args.out}; load average {os.getloadavg()[0]:.2f} (1 min) at the end")
    return 0

