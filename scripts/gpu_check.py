"""Whole HSMLA networks on CUDA in eval mode: ``backend="auto"`` (the Triton kernels) against the
reference path, per variant, spatial rank, routing and dtype, and the same network replayed from
a CUDA graph against its eager forward.

For each case one randomly initialised network (tau calibrated to alpha 0.3 for ``gate``) runs
the same input three times: ``auto`` and ``reference`` in the case's dtype, and ``reference`` in
float64 as the independent baseline. Reported: the relative error ``max|a - b| / max|b|`` of auto
against reference (same dtype) and of each against float64, and whether every layer refined the
same tiles. Tolerances: float32 <= 1e-4, half precision <= 1e-2, on auto vs float64
relative to reference vs float64 (the kernels must be no worse than the reference path in the
same dtype, with that floor).

The graph check, first: HSMLA-B2 at 512² in float32 and float16, one
:class:`~hsmla_med.inference.cuda_graph.GraphedCallable` captured on the first of three random
inputs and replayed for all three, each against the eager forward (within the dtype's
tolerance) and float64 (within the bound above); the three inputs must activate different tiles
(else the replays would not show that the graph follows the gate), and the eager forward must
hold no host sync (:func:`hsmla_med.bench.census.census`, and CUDA's sync debug mode around an
eager forward and a replay). Rows go to ``<out>_graph.csv`` beside ``--out``; both files are
rewritten after every row, so that a run cut off keeps what it checked. Exits 1 if a case
fails, 0 without a GPU after saying so.

    python scripts/gpu_check.py [--out gpu_check.csv] [--graph-only]
"""

from __future__ import annotations

import argparse
import copy
import csv
import sys
import warnings
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
GRAPH_SIDE = 512  # the graph check: HSMLA-B2 at GRAPH_SIDE², batch 1
GRAPH_INPUTS = 3  # random inputs replayed from the graph captured on the first


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


def _active(net: torch.nn.Module) -> list[torch.Tensor]:
    """Per HSMLA layer, the tiles the last forward refined (copies: a replay overwrites the gate)."""
    return [(s["gate"] > s["tau"]).clone() for s in net.gate_stats().values()]


def _sync_warnings(fn) -> int:
    """Host syncs CUDA's sync debug mode reports while ``fn()`` runs."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in seen)


def graph_check(dtype: torch.dtype) -> list[dict]:
    """HSMLA-B2 at ``GRAPH_SIDE``² in ``dtype``: one CUDA graph replayed for ``GRAPH_INPUTS`` inputs
    whose active tiles differ, against the eager forward and float64; a row per input.

    The replays run first, each read right after it (the runner puts the graph's gate buffers
    back on the layers after each replay, as in ``infer``)."""
    from hsmla_med.bench.census import census
    from hsmla_med.inference.cuda_graph import GraphedCallable, weights_version
    from hsmla_med.nn import gate_snapshot

    torch.manual_seed(0)
    net = build_network(model_config("b2"), 2, 1, 14).cuda().eval()
    net.set_routing("gate")
    shape = (1, 1, GRAPH_SIDE, GRAPH_SIDE)
    calibrate_tau(net, torch.randn(shape, device="cuda"), 0.3)
    net64, reference = copy.deepcopy(net).double(), copy.deepcopy(net).to(dtype)
    net64.set_backend("reference")
    reference.set_backend("reference")
    net.to(dtype)
    runner = GraphedCallable(net, version=lambda: weights_version(net), state=lambda: gate_snapshot(net))  # as GatedModule.graphed
    inputs = [torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(100 + i)).to(dtype)
              for i in range(GRAPH_INPUTS)]
    with torch.no_grad():
        replayed = [(runner(x), _active(net)) for x in inputs]  # captured on the first input
        eager = [(net(x), _active(net)) for x in inputs]
        _, seen = census(net, inputs[0])
        syncs = _sync_warnings(lambda: (net(inputs[0]), runner(inputs[0])))
        rows = []
        for i, (x, (y_graph, graph_tiles), (y_eager, eager_tiles)) in enumerate(zip(inputs, replayed, eager)):
            y64, y_ref = net64(x.double()), reference(x)
            err_ref, err_graph = relative(y_ref, y64), relative(y_graph, y64)
            alphas = [float(t.float().mean()) for t in graph_tiles]
            rows.append({
                "variant": "b2", "shape": f"{GRAPH_SIDE}x{GRAPH_SIDE}", "dtype": str(dtype).removeprefix("torch."), "input": i,
                "mean_alpha": sum(alphas) / len(alphas), "alphas": " ".join(f"{a:.3f}" for a in alphas),
                # the premise: each input refines other tiles than every other input (eagerly)
                "tiles_differ": all(not all(torch.equal(a, b) for a, b in zip(eager_tiles, other[1]))
                                    for j, other in enumerate(eager) if j != i),
                "same_tiles": all(torch.equal(a, b) for a, b in zip(eager_tiles, graph_tiles)),
                "graph_vs_eager": relative(y_graph, y_eager), "reference_vs_float64": err_ref, "graph_vs_float64": err_graph,
                "bound": max(TOLERANCE[dtype], 2 * err_ref), "census_syncs": len(seen.syncs), "sync_warnings": syncs,
                "captured": runner.captured,
            })
            row = rows[-1]
            row["ok"] = bool(
                torch.isfinite(y_graph).all() and row["graph_vs_eager"] <= TOLERANCE[dtype] and err_graph <= row["bound"]
                and row["tiles_differ"] and row["census_syncs"] == 0 and syncs == 0 and runner.captured == 1 and not runner.failed
            )
    return rows


def write_rows(path: Path, rows: list[dict]) -> None:
    """``rows`` as a CSV at ``path`` (replaced whole: a run cut off leaves the rows so far)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


def show(row: dict) -> None:
    print(", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench_out/gpu_check.csv"))
    p.add_argument("--graph-only", action="store_true", help="only the graph check")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to check")
        return 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    graph_rows, rows = [], []
    for dtype in (torch.float16, torch.float32):
        for row in graph_check(dtype):
            graph_rows.append(row)
            show(row)
            write_rows(args.out.with_name(args.out.stem + "_graph.csv"), graph_rows)
    graph_failed = [r for r in graph_rows if not r["ok"]]
    print(f"graph check: {len(graph_rows) - len(graph_failed)}/{len(graph_rows)} replays equal eager, in bounds, tiles differing, no host sync")
    if not args.graph_only:
        for variant, shape, routing in CASES:
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                row = check(variant, shape, routing, dtype)
                rows.append(row)
                show(row)
                write_rows(args.out, rows)
    failed = [r for r in rows if not r["ok"]]
    if rows:
        print(f"{len(rows) - len(failed)}/{len(rows)} cases within tolerance")
    return 1 if failed or graph_failed else 0


if __name__ == "__main__":
    sys.exit(main())
