"""Benchmark the HSMLA Triton kernels against the reference path and full softmax attention.

For one HSMLA layer's attention at inference (``O = O_lin + [M > tau] * M * R``) on square maps
(cubes with ``--spatial-dims 3``), times with CUDA events (median over ``--reps`` runs after
``--warmup``, inputs rotated among enough copies to overflow the L2 cache):

- ``triton``: ``hsmla_med.kernels.linear_attention`` then ``refine_add`` into its output, the
  layer's path: three launches, no host sync (``tau`` a 0-d tensor on the device);
- ``reference``: the same from ``hsmla_med.nn.functional`` (``local_refine(..., add_to=)``);
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` over all tokens (given the
  contiguous ``(b, h, N, d)`` layout its fused backends want);
- ``refine``: ``refine_add`` alone, and its time against the same launch refining every tile
  (alpha 1): what the gate saves, since its grid covers every tile whatever the gate selects.

Where ``triton.testing.do_bench_cudagraph`` exists, the Triton path and ``refine_add`` are also
timed captured in a CUDA graph (one input set: a graph replays fixed buffers), which takes the
host's launch cost out: the columns ``*_graph_ms``, empty otherwise.

Features are laid out as the HSMLA layer makes them (views of channel-first maps). The gate is
uniform noise thresholded at its ``1 - alpha`` quantile. The linear kernel's achieved bandwidth
(``qh, kh, vh`` read, output written) is reported against a device copy of a large tensor timed
the same way. Writes a CSV and prints a markdown table; without a CUDA GPU it says so and
exits 0. ``--check`` runs every timed callable once at a small size instead (no timing, on the
CPU under Triton's interpreter where there is no GPU) and compares the Triton path with the
reference, so that the benchmark itself is exercised where it cannot measure anything.

    hsmla-med bench --only kernels [--spatial-dims 2] [--alphas 0.3 1.0] [--out bench_out/kernels.csv] [--check]
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from hsmla_med import kernels
from hsmla_med.bench.common import non_negative_int, own_parser, positive_int
from hsmla_med.kernels.refine import refine_add
from hsmla_med.nn import functional as HF

COPY_BYTES = 1 << 30  # copy-bandwidth probe: far beyond any L2 cache
MAX_COPIES = 32
EPS = 1e-6
CHECK_TOLERANCE = 1e-4  # --check: float32 under the interpreter, relative to max |reference|


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = own_parser("kernels", __doc__)
    p.add_argument("--spatial-dims", type=int, choices=[2, 3], default=2, help="2D maps (S^2 tokens) or 3D (S^3)")
    p.add_argument("--sizes", type=positive_int, nargs="+", help="map sides S (default 64 128 256 in 2D, 16 24 32 in 3D)")
    p.add_argument("--alphas", type=float, nargs="+", default=[0.1, 0.3, 1.0], help="fractions of tiles refined")
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--heads", type=positive_int, default=8)
    p.add_argument("--head-dim", type=positive_int, default=32)
    p.add_argument("--block", type=positive_int, default=8, help="gate tile size")
    p.add_argument("--window", type=positive_int, default=7, help="local window size (odd)")
    p.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    p.add_argument("--warmup", type=non_negative_int, default=10)
    p.add_argument("--reps", type=positive_int, default=50)
    p.add_argument("--out", type=Path, default=Path("bench_out/kernels.csv"), help="CSV to write")
    p.add_argument(
        "--check", action="store_true",
        help="run each timed callable once at a small size and compare with the reference, no timing "
        "(float32; without CUDA on the CPU under TRITON_INTERPRET=1)",
    )
    args = p.parse_args(argv)
    args.sizes = args.sizes or ([64, 128, 256] if args.spatial_dims == 2 else [16, 24, 32])
    return args


def time_ms(fn, inputs: list[tuple], warmup: int, reps: int) -> float:
    """Median CUDA-event time of ``fn(*inputs[i % len(inputs)])`` in milliseconds."""
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*inputs[i % len(inputs)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_ms(fn, inputs: tuple) -> float | None:
    """Median time of ``fn(*inputs)`` replayed from a CUDA graph (``triton.testing.do_bench_cudagraph``),
    or ``None`` where this triton has no such function."""
    import triton.testing

    bench = getattr(triton.testing, "do_bench_cudagraph", None)
    if bench is None:
        return None
    return bench(lambda: fn(*inputs), return_mode="median")


def copy_bandwidth(warmup: int, reps: int) -> float:
    """GB/s of a device-to-device copy of ``COPY_BYTES`` (read + write counted)."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), [()], warmup, reps)
    return 2 * COPY_BYTES / ms / 1e6


def make_inputs(args, side: int, dtype: torch.dtype, copies: int, device: str = "cuda") -> list[dict]:
    """``copies`` independent input sets: layer-layout features, contiguous SDPA inputs, gate."""
    b, h, d, dims = args.batch, args.heads, args.head_dim, args.spatial_dims
    grid = (b, *[math.ceil(side / args.block)] * dims)
    sets = []
    for _ in range(copies):
        qkv = torch.randn(b, 3, h, d, *[side] * dims, device=device, dtype=dtype).movedim(3, -1).unbind(1)
        ms = torch.randn(b, 3, h, d, *[side] * dims, device=device, dtype=dtype).movedim(3, -1).unbind(1)
        flat = tuple(t.flatten(2, 1 + dims).contiguous() for t in qkv)  # (b, h, N, d)
        sets.append(dict(qkv=qkv, ms=ms, flat=flat, gate=torch.rand(grid, device=device)))
    return sets


def set_bytes(s: dict) -> int:
    return sum(t.numel() * t.element_size() for group in ("qkv", "ms", "flat") for t in s[group])


def threshold(gate: torch.Tensor, alpha: float) -> torch.Tensor:
    """``tau`` with about ``alpha`` of the tiles strictly above it, a 0-d tensor on the gate's
    device as the layer keeps it (read when the inputs are made, not in what is timed)."""
    if alpha >= 1.0:
        return gate.new_full((), -math.inf)
    return torch.quantile(gate.flatten(), 1.0 - alpha)


def paths(block: int, window: int) -> dict:
    """The timed callables, each ``(q, k, v, qh, kh, vh, gate, tau, out)``; ``out`` is the
    buffer ``refine`` adds into (the others allocate their results)."""

    def triton_path(q, k, v, qh, kh, vh, gate, tau, out):
        o = kernels.linear_attention(qh, kh, vh, EPS)
        return refine_add(q, k, v, qh, kh, vh, gate, tau, block, window, EPS, o)

    def reference_path(q, k, v, qh, kh, vh, gate, tau, out):
        o = HF.linear_attention(qh, kh, vh, EPS)
        return HF.local_refine(q, k, v, qh, kh, vh, gate, tau, block, window, EPS, add_to=o)

    def refine_path(q, k, v, qh, kh, vh, gate, tau, out):
        return refine_add(q, k, v, qh, kh, vh, gate, tau, block, window, EPS, out)

    return dict(triton=triton_path, reference=reference_path, refine=refine_path)


def calls_for(sets: list[dict], alpha: float) -> list[tuple]:
    """Arguments of :func:`paths`' callables per input set at ``alpha``."""
    return [
        (*s["qkv"], *s["ms"], s["gate"], threshold(s["gate"], alpha), torch.zeros_like(s["ms"][0]))
        for s in sets
    ]


def bench_size(args, side: int, dtype: torch.dtype, copy_gbps: float) -> list[dict]:
    b, h, d = args.batch, args.heads, args.head_dim
    tokens = side**args.spatial_dims
    probe = make_inputs(args, side, dtype, 1)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    copies = min(MAX_COPIES, max(2, math.ceil(2 * l2 / set_bytes(probe[0]))))
    sets = probe + make_inputs(args, side, dtype, copies - 1)
    block, window = args.block, args.window
    fns = paths(block, window)

    linear_ms = time_ms(kernels.linear_attention, [s["ms"] for s in sets], args.warmup, args.reps)
    linear_gbps = 4 * b * h * tokens * d * dtype.itemsize / linear_ms / 1e6
    sdpa_ms = time_ms(F.scaled_dot_product_attention, [s["flat"] for s in sets], args.warmup, args.reps)
    dense_refine_ms = time_ms(fns["refine"], calls_for(sets, 1.0), args.warmup, args.reps)

    rows = []
    for alpha in args.alphas:
        calls = calls_for(sets, alpha)
        achieved = statistics.mean(float((c[6] > c[7]).float().mean()) for c in calls)
        out = fns["triton"](*calls[0])
        ref = fns["reference"](*calls[0])
        rel_err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        triton_ms = time_ms(fns["triton"], calls, args.warmup, args.reps)
        reference_ms = time_ms(fns["reference"], calls, args.warmup, args.reps)
        refine_ms = dense_refine_ms if alpha >= 1.0 else time_ms(fns["refine"], calls, args.warmup, args.reps)
        triton_graph = graph_ms(fns["triton"], calls[0])
        refine_graph = graph_ms(fns["refine"], calls[0])
        rows.append(
            dict(
                side=side, spatial_dims=args.spatial_dims, tokens=tokens, batch=b, heads=h, head_dim=d, block=block, window=window,
                dtype=str(dtype).removeprefix("torch."), alpha_target=alpha, alpha=round(achieved, 4),
                triton_ms=round(triton_ms, 4), reference_ms=round(reference_ms, 4), sdpa_ms=round(sdpa_ms, 4),
                speedup_vs_reference=round(reference_ms / triton_ms, 2), speedup_vs_sdpa=round(sdpa_ms / triton_ms, 2),
                refine_ms=round(refine_ms, 4), refine_vs_dense=round(refine_ms / dense_refine_ms, 3),
                triton_graph_ms="" if triton_graph is None else round(triton_graph, 4),
                refine_graph_ms="" if refine_graph is None else round(refine_graph, 4),
                linear_ms=round(linear_ms, 4), linear_gbps=round(linear_gbps, 1), copy_gbps=round(copy_gbps, 1),
                linear_bw_fraction=round(linear_gbps / copy_gbps, 3), max_rel_err=f"{rel_err:.2e}", copies=copies,
            )
        )
    return rows


def check(args) -> int:
    """``--check``: every timed callable once at a small size in float32; the Triton path and
    ``refine_add`` (at each alpha and at alpha 1) against the reference. Returns the exit status."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read at the first launch (hsmla_med.kernels defers the choice)
    small = argparse.Namespace(**{**vars(args), "batch": 1, "heads": 2, "head_dim": 8, "block": 4, "window": 3})
    side = 9 if args.spatial_dims == 2 else 5  # partial edge tiles
    fns = paths(small.block, small.window)
    (s,) = make_inputs(small, side, torch.float32, 1, device)
    F.scaled_dot_product_attention(*s["flat"])
    failed = False
    for alpha in sorted({*args.alphas, 1.0}):
        call = calls_for([s], alpha)[0]
        ref = fns["reference"](*call)
        scale = ref.abs().max().item()
        base = HF.linear_attention(*s["ms"], EPS)
        call[-1].copy_(base)
        errors = {
            "triton": (fns["triton"](*call) - ref).abs().max().item() / scale,
            "refine": (fns["refine"](*call) - ref).abs().max().item() / scale,
        }
        failed |= any(not e <= CHECK_TOLERANCE for e in errors.values())
        print(f"alpha {alpha}: " + ", ".join(f"{name} max rel err {e:.2e}" for name, e in errors.items()))
    print("check failed" if failed else f"check passed ({device}, {args.spatial_dims}D {side}^{args.spatial_dims})")
    return 1 if failed else 0


def write_csv(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")  # a crash never leaves a half-written CSV behind
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def markdown(rows: list[dict]) -> str:
    cols = [
        ("tokens", "tokens"), ("alpha", "alpha (target)"), ("triton_ms", "triton ms"), ("reference_ms", "reference ms"),
        ("sdpa_ms", "sdpa ms"), ("speedup_vs_reference", "x ref"), ("speedup_vs_sdpa", "x sdpa"),
        ("triton_graph_ms", "triton graph ms"), ("refine_ms", "refine ms"), ("refine_vs_dense", "of alpha 1"),
        ("refine_graph_ms", "refine graph ms"), ("linear_ms", "linear ms"), ("linear_gbps", "linear GB/s"),
        ("linear_bw_fraction", "of copy BW"), ("max_rel_err", "max rel err"),
    ]
    lines = ["| " + " | ".join(title for _, title in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        shown = dict(r, tokens=f"{r['side']}^{r['spatial_dims']}", alpha=f"{r['alpha']} ({r['alpha_target']})")
        cells = [str(shown[key]) for key, _ in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.check:
        with torch.inference_mode():
            return check(args)
    if not torch.cuda.is_available() or not kernels.triton_available("cuda"):
        print("--only kernels needs a CUDA GPU with triton; none found, nothing measured (--check runs without one).")
        return 0
    if os.environ.get("TRITON_INTERPRET", "0") != "0":
        print("TRITON_INTERPRET is set: unset it to time compiled kernels.", file=sys.stderr)
        return 1
    dtype = getattr(torch, args.dtype)
    with torch.inference_mode():
        copy_gbps = copy_bandwidth(args.warmup, args.reps)
        rows = [row for side in args.sizes for row in bench_size(args, side, dtype, copy_gbps)]
    write_csv(rows, args.out)
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, batch {args.batch}, {args.heads} heads x {args.head_dim}, "
          f"block {args.block}, window {args.window}; device copy {copy_gbps:.0f} GB/s")
    print(markdown(rows))
    print(f"wrote {args.out}")
    return 0
