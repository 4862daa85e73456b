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

Writes ``models.csv``, ``layers.csv`` and ``benchmarks.png`` into ``--out`` and prints markdown
tables. Every other benchmark runs alone, ``--only NAME`` (the list below, from
:mod:`hsmla_med.bench.index`): those that take the options below write ``NAME.csv`` into
``--out`` (``volume`` also ``volume_dicom.csv``); the others take options of their own, given
after ``--only NAME``.

    hsmla-med bench --out bench_out        (or: python -m hsmla_med.bench --out bench_out)
    hsmla-med bench --only trust --seeds 1 --out /tmp/bench-trust
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import torch

from hsmla_med.bench import contention, gpu, learning
from hsmla_med.bench.common import Parser, markdown, out_folder, positive_int, write_csv
from hsmla_med.bench.index import BENCHMARKS
from hsmla_med.bench.layers import LAYER_KINDS, bench_layer
from hsmla_med.bench.models import bench_endovis, bench_models
from hsmla_med.errors import ConfigError
from hsmla_med.runtime import tune_cpu_allocator


def _write_tables(args, title: str, make) -> int:
    """Print ``title``, then each table of ``make()`` (``{name: rows}``) as ``name.csv`` in
    ``--out`` and as markdown."""
    print(title, flush=True)
    for name, rows in make().items():
        write_csv(args.out / f"{name}.csv", rows)
        print(f"\n{name}.csv:\n" + markdown(rows) + "\n")
    return 0


def wsi_table(args) -> int:
    from hsmla_med.bench.wsi import bench_wsi

    return _write_tables(args, "whole-slide heatmaps, 256 px patches at level 0, batch 32:",
                         lambda: {"wsi": bench_wsi(device=args.device or "cpu")})  # the heatmaps run on the CPU unless --device names one


def volume_table(args) -> int:
    from hsmla_med.bench.volume import bench_volume

    return _write_tables(args, "btcv inference on one 512x512x300 CT, 14 classes, HSMLA-B0 (peak resident memory); "
                         "the same CT as a DICOM series into a DICOM SEG:", bench_volume)


def processes_table(args) -> int:
    from hsmla_med.bench.volume import bench_processes

    return _write_tables(args, "btcv inference of 8 synthetic volumes: one process, with loader workers, two DDP processes (CPU, gloo) "
                         "with hsmla-med's threads and with OMP_NUM_THREADS=2 each:", lambda: {"processes": bench_processes()})


def endovis_table(args) -> int:
    return _write_tables(args, "EndoVis 2017 frames, 1024x1280 RGB (the standard crop), batch 1, 3 -> 8 channels:",
                         lambda: {"endovis": bench_endovis(args.runs)})


def contention_table(args) -> int:
    return _write_tables(args, "HSMLA-B2 (eager and torch.compile), SegFormer-B2, MONAI UNet at --size^2, batch 1, called as a library "
                         "(either import order), and hsmla-med infer of a volume; quiet, beside a background hsmla-med train, beside two "
                         "PyTorch processes (2 threads each, matrix products):", lambda: {"contention": contention.bench_contention(args)})


def export_table(args) -> int:
    from hsmla_med.bench.export import bench_export

    return _write_tables(args, "exported ONNX under onnxruntime (CPU) vs PyTorch eager with the C kernels, batch 1, 1 -> 14 channels:",
                         lambda: {"export": bench_export(args.size, args.runs, args.threads)})


def networks(args) -> int:
    """The default run: the network table (``models``) and the layer table (``layers``), with
    a figure of both; ``--only`` either runs it alone."""
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


def _index() -> str:
    """The benchmarks of ``--only NAME`` for ``--help``, a line each."""
    width = max(map(len, BENCHMARKS)) + 2
    lines = {True: [], False: []}
    for name, bench in BENCHMARKS.items():
        lines[bench.own_options].append(f"  {name:<{width}}{bench.summary}")
    return "\n".join(["benchmarks (--only NAME) that take the options above (without --only: models and layers):", *lines[False], "",
                      "benchmarks with options of their own (hsmla-med bench --only NAME --help; the options above do not apply):",
                      *lines[True]])


def _only(argv: list[str]) -> tuple[str | None, list[str]]:
    """The NAME of the last ``--only NAME`` (or ``--only=NAME``) in ``argv``, and ``argv``
    without it: a benchmark with options of its own takes the rest."""
    for i in reversed(range(len(argv))):
        if argv[i].startswith("--only="):
            return argv[i].split("=", 1)[1], argv[:i] + argv[i + 1:]
        if argv[i] == "--only" and i + 1 < len(argv):
            return argv[i + 1], argv[:i] + argv[i + 2:]
    return None, argv


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
    argv = sys.argv[1:] if argv is None else list(argv)
    name, rest = _only(argv)
    if name in BENCHMARKS and BENCHMARKS[name].own_options:
        return BENCHMARKS[name].function()(rest)
    # allow_abbrev=False: --only NAME is looked for above as written, so an abbreviated --only
    # must not pass for it here
    parser = Parser(prog="hsmla-med bench", description=__doc__, epilog=_index(), formatter_class=argparse.RawDescriptionHelpFormatter,
                    allow_abbrev=False)
    parser.add_argument("--out", type=out_folder, default="bench_out", help="output folder (default bench_out)")
    parser.add_argument("--size", type=positive_int, default=512, help="input side for the network table (default 512)")
    parser.add_argument("--runs", type=positive_int, default=7, help="timed rounds over all models after two warm-up runs each (default 7)")
    parser.add_argument(
        "--layer-sides", type=positive_int, nargs="+", default=[32, 64, 128, 256], help="token-map sides for the layer table"
    )
    parser.add_argument("--layer-channels", type=positive_int, default=128, help="channels of the benchmarked layer (a multiple of --head-dim)")
    parser.add_argument("--head-dim", type=positive_int, default=32, help="head width of the benchmarked layer")
    parser.add_argument("--only", choices=list(BENCHMARKS), metavar="NAME",
                        help="run one benchmark, listed below, instead of the default run (models and layers)")
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
    return BENCHMARKS[args.only].function()(args) if args.only else networks(args)
