"""Whole HSMLA networks on CUDA in eval mode: ``backend="auto"`` (the Triton kernels) against the
reference path, per variant, spatial rank, routing and dtype (issue 17, item 2).

For each case one randomly initialised network (tau calibrated to alpha 0.3 for ``gate``) runs
the same input three times: ``auto`` and ``reference`` in the case's dtype, and ``reference`` in
float64 as the independent baseline. Reported: the relative error ``max|a - b| / max|b|`` of auto
against reference (same dtype) and of each against float64, and whether every layer refined the
same tiles. Tolerances (issue 3): float32 <= 1e-4, half precision <= 1e-2, on auto vs float64
relative to reference vs float64 (the kernels must be no worse than the reference path in the
same dtype, with that floor). Exits 1 if a case fails, 0 without a GPU after saying so.

    python scripts/gpu_check.py [--out gpu_check.csv]
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch

from hsmla_med.config import build_network, model_config
from hsmla_med.nn.attention import calibrate_tau

TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}
CASES = [  # variant, spatial shape, routing
    ("b0", (256, 256), "gate"),
    ("b1", (256, 256), "gate"),
    ("b2", (256, 256), "gate"),
    ("b2", (256, 256), "all"),
    ("b2", (200, 232), "gate"),  # partial edge tiles at every stride
    ("b0", (64, 64, 64), "gate"),
]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def run(net: torch.nn.Module, x: torch.Tensor, backend: str) -> tuple[torch.Tensor, list]:
    net.set_backend(backend)
    with torch.no_grad():
        y = net(x)
    alphas = [s["alpha"] for s in net.gate_stats().values()]
    return y, alphas


def check(variant: str, shape: tuple[int, ...], routing: str, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    dims = len(shape)
    net = build_network(model_config(variant), dims, 1, 14).cuda().eval()
    x = torch.randn(1, 1, *shape, device="cuda")
    net.set_routing(routing)
    if routing == "gate":
        calibrate_tau(net, x, 0.3)
    y64, _ = run(net.double(), x.double(), "reference")
    net.to(dtype)
    xd = x.to(dtype)
    y_ref, a_ref = run(net, xd, "reference")
    y_auto, a_auto = run(net, xd, "auto")
    err_ref, err_auto = relative(y_ref, y64), relative(y_auto, y64)
    bound = max(TOLERANCE[dtype], 2 * err_ref)
    return {
        "variant": variant,
        "shape": "x".join(map(str, shape)),
        "routing": routing,
        "dtype": str(dtype).removeprefix("torch."),
        "mean_alpha": sum(a_auto) / max(len(a_auto), 1),
        "same_tiles": a_ref == a_auto,
        "auto_vs_reference": relative(y_auto, y_ref),
        "reference_vs_float64": err_ref,
        "auto_vs_float64": err_auto,
        "bound": bound,
        "ok": bool(err_auto <= bound and torch.isfinite(y_auto).all()),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench_out/gpu_check.csv"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to check")
        return 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    for variant, shape, routing in CASES:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            row = check(variant, shape, routing, dtype)
            rows.append(row)
            print(", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    failed = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)}/{len(rows)} cases within tolerance")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
