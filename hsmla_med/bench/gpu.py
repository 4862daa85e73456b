"""GPU benchmark (``hsmla-med bench --only gpu``): HSMLA networks against their peers on one CUDA
device, side by side in one run (issue 17).

- Inference, batch 1, float16, ``--size`` squared (1 -> 14 classes): the networks of
  :func:`hsmla_med.bench.models.build_models` (HSMLA-B0/B1/B2 with tau calibrated to alpha 0.3,
  B2 with the refinement off and with alpha 1, SegFormer-B0/B2, SwinUNETR-2D, MONAI UNet):
  median latency, peak memory, ratio to SegFormer-B2.
- 3D, batch 1, float16, ``--size-3d`` cubed: HSMLA-B0 (3D) against MONAI's SwinUNETR and SegResNet.
- Training, bf16 autocast, AdamW, batch ``--train-batch`` at ``--size``: images per second and
  peak memory of one optimizer step per iteration, for the 2D networks.

Times are CUDA-event medians after warm-up, inputs rotated among several copies so that no
call finds its input in the L2 cache. ``--device cpu`` runs the same code with wall-clock
timers (the smoke test does, at toy sizes); its figures are not the CPU benchmark's
(``hsmla-med bench --only models``). The Triton kernel table is ``scripts/bench_kernels.py``.
Writes ``gpu_inference.csv``, ``gpu_3d.csv`` and ``gpu_training.csv`` into ``--out``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hsmla_med.bench.common import device, non_negative_int, positive_int
from hsmla_med.config import build_network, model_config
from hsmla_med.nn import calibrate_tau

__all__ = ["add_arguments", "run", "bench_inference", "bench_3d", "bench_training"]

OUT_CHANNELS = 14
COPIES = 4  # input copies rotated through the timed calls


def add_arguments(parser) -> None:
    g = parser.add_argument_group("GPU benchmark (--only gpu)")
    g.add_argument("--device", type=device, default="cuda", help="cuda (default) | cuda:N | cpu (a smoke run of the same code)")
    g.add_argument("--size-3d", type=positive_int, default=96, help="cube side of the 3D table (default 96)")
    g.add_argument("--train-batch", type=positive_int, default=8, help="images per training step (default 8)")
    g.add_argument("--warmup", type=non_negative_int, default=5, help="untimed calls per model (default 5)")
    g.add_argument("--reps", type=positive_int, default=30, help="timed calls per model (default 30)")


def device_problem(name: str) -> str | None:
    """Why ``--device`` cannot run the tables on this machine (a CUDA device it lacks), or ``None``."""
    index = torch.device(name).index or 0
    if torch.device(name).type == "cuda" and index >= torch.cuda.device_count():
        return f"no such CUDA device on this machine ({torch.cuda.device_count()} found); nothing measured (--device cpu runs a smoke test)"
    return None


def _timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
    """Milliseconds of one call: CUDA events on a GPU, the wall clock elsewhere."""
    if device.type == "cuda":
        def cuda_ms(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        return cuda_ms

    def wall_ms(fn):
        tic = time.perf_counter()
        fn()
        return (time.perf_counter() - tic) * 1e3
    return wall_ms


def _measure(fn: Callable[[torch.Tensor], object], inputs: list[torch.Tensor], warmup: int, reps: int, device: torch.device) -> tuple[float, float]:
    """Median milliseconds of ``fn(inputs[i % len(inputs)])`` and peak memory in MiB (CUDA only)."""
    timer = _timer(device)
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = [timer(lambda i=i: fn(inputs[i % len(inputs)])) for i in range(reps)]
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")
    return statistics.median(times), peak


def _inputs(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(shape, device=device, dtype=dtype) for _ in range(COPIES)]


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _inference_rows(makers: dict, inputs: list[torch.Tensor], dtype: torch.dtype, warmup: int, reps: int, device: torch.device) -> list[dict]:
    """Per network (built one at a time, freed before the next): parameters, latency, peak memory."""
    rows = []
    for name, make in makers.items():
        model = make().eval().to(device, dtype)
        with torch.inference_mode():
            ms, peak = _measure(model, inputs, warmup, reps, device)
        rows.append({"model": name, "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
                     "latency_ms": round(ms, 3), "peak_mib": round(peak, 1)})
        del model
        _release(device)
    return rows


def bench_inference(size: int, device: torch.device, warmup: int, reps: int) -> list[dict]:
    """The 2D inference table; half precision on CUDA, float32 elsewhere."""
    from hsmla_med.bench.models import build_models

    dtype = torch.float16 if device.type == "cuda" else torch.float32
    sample = torch.randn(1, 1, size, size)
    inputs = _inputs((1, 1, size, size), device, dtype)
    rows = _inference_rows(build_models(sample), inputs, dtype, warmup, reps, device)
    reference = next(r["latency_ms"] for r in rows if r["model"] == "SegFormer-B2")
    for r in rows:
        r["speedup_vs_segformer_b2"] = round(reference / r["latency_ms"], 2)
    return rows


def _models_3d(side: int) -> dict[str, Callable[[], torch.nn.Module]]:
    from monai.networks.nets import SegResNet, SwinUNETR

    def hsmla():
        net = build_network(model_config("b0"), 3, 1, OUT_CHANNELS).eval()
        net.set_routing("gate")
        calibrate_tau(net, torch.randn(1, 1, side, side, side), 0.3)
        return net

    return {
        "HSMLA-B0 3D": hsmla,
        "SwinUNETR": lambda: SwinUNETR(in_channels=1, out_channels=OUT_CHANNELS, feature_size=48, spatial_dims=3),
        "SegResNet": lambda: SegResNet(spatial_dims=3, in_channels=1, out_channels=OUT_CHANNELS, init_filters=16),
    }


def bench_3d(side: int, device: torch.device, warmup: int, reps: int) -> list[dict]:
    """The 3D inference table at ``side`` cubed."""
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    inputs = _inputs((1, 1, side, side, side), device, dtype)
    rows = _inference_rows(_models_3d(side), inputs, dtype, warmup, reps, device)
    reference = next(r["latency_ms"] for r in rows if r["model"] == "SwinUNETR")
    for r in rows:
        r["speedup_vs_swinunetr"] = round(reference / r["latency_ms"], 2)
    return rows


def bench_training(size: int, batch: int, device: torch.device, warmup: int, reps: int) -> list[dict]:
    """Training throughput: one AdamW step of cross-entropy per call, bf16 autocast on CUDA."""
    from hsmla_med.bench.models import build_models

    names = ("HSMLA-B0", "HSMLA-B1", "HSMLA-B2", "SegFormer-B0", "SegFormer-B2", "SwinUNETR-2D", "MONAI UNet")
    makers = build_models(torch.randn(1, 1, size, size))
    images = _inputs((batch, 1, size, size), device, torch.float32)
    target = torch.randint(0, OUT_CHANNELS, (batch, size, size), device=device)
    rows = []
    for name in names:
        model = makers[name]().train().to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(x):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = torch.nn.functional.cross_entropy(model(x).float(), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        ms, peak = _measure(step, images, warmup, reps, device)
        rows.append({"model": name, "batch": batch, "step_ms": round(ms, 2), "images_per_s": round(batch / ms * 1e3, 1),
                     "peak_mib": round(peak, 1)})
        del model, optimizer
        _release(device)
    reference = next(r["images_per_s"] for r in rows if r["model"] == "SwinUNETR-2D")
    for r in rows:
        r["vs_swinunetr_2d"] = round(r["images_per_s"] / reference, 2)
    return rows


def run(args) -> int:
    """``hsmla-med bench --only gpu``: the three tables, CSVs into ``args.out``."""
    from hsmla_med.bench.common import markdown, write_csv

    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke run, not a benchmark)"
    print(f"GPU benchmark on {name}, torch {torch.__version__}, {args.warmup} warm-up + {args.reps} timed calls, {COPIES} inputs rotated")
    tables = {
        "gpu_inference.csv": (f"inference, batch 1, {args.size}x{args.size}", lambda: bench_inference(args.size, device, args.warmup, args.reps)),
        "gpu_3d.csv": (f"3D inference, batch 1, {args.size_3d}^3", lambda: bench_3d(args.size_3d, device, args.warmup, args.reps)),
        "gpu_training.csv": (f"training, batch {args.train_batch}, {args.size}x{args.size}, bf16 autocast",
                              lambda: bench_training(args.size, args.train_batch, device, args.warmup, args.reps)),
    }
    for file, (title, table) in tables.items():
        print(f"{title}:", flush=True)
        rows = table()
        write_csv(Path(args.out) / file, rows)
        print("\n" + markdown(rows) + "\n", flush=True)
    print(f"wrote {', '.join(tables)} into {args.out}")
    return 0
