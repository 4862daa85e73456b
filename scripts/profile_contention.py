"""Where a network's time goes beside busy neighbours (issues 34, 54): a per-operator profile quiet
and with the contention benchmark's two neighbouring PyTorch processes (2 threads of 1024^2
matrix products each, ``hsmla_med.bench.contention.NEIGHBOUR``) or its background ``hsmla-med
train`` (``--neighbour train``), in one process, interleaved.

Run it as hsmla-med runs (the OpenMP settings are read when torch loads, so they come from the
environment; ``hsmla-med`` itself would set ``GOMP_SPINCOUNT=10000``):

    GOMP_SPINCOUNT=10000 python scripts/profile_contention.py --model HSMLA-B2 --rounds 3

Prints, per operator, the self CPU time per forward quiet and busy and its share of the busy
forward's growth, and how many operators a forward runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

import torch

from hsmla_med import runtime
from hsmla_med.bench.common import markdown
from hsmla_med.bench.contention import MODELS, neighbours
from hsmla_med.bench.models import build_models


def _profile(model, x, rounds: int) -> tuple[dict[str, float], dict[str, int], float]:
    """Self CPU ms per forward and calls per forward, by operator; and the wall ms per forward."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(rounds):
            model(x)
        wall = (time.perf_counter() - start) * 1e3 / rounds
    self_ms, calls = defaultdict(float), defaultdict(int)
    for event in prof.key_averages():
        self_ms[event.key] += event.self_cpu_time_total / 1e3 / rounds
        calls[event.key] += event.count // rounds
    return self_ms, calls, wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="HSMLA-B2", choices=MODELS)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3, help="forwards profiled per load, per round (default 3)")
    parser.add_argument("--repeats", type=int, default=2, help="quiet/busy alternations (default 2)")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--neighbour", choices=["pytorch", "train"], default="pytorch",
                        help="two PyTorch processes of matrix products (default), or a background hsmla-med train --task btcv")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    runtime.tune_cpu_allocator()
    x = torch.randn(1, 1, args.size, args.size)
    model = build_models(x)[args.model]().eval()
    totals = {load: (defaultdict(float), defaultdict(int), []) for load in ("quiet", "busy")}
    with neighbours(2, train=args.neighbour == "train") as set_load, torch.inference_mode():
        model(x), model(x)
        for _ in range(args.repeats):
            for load, running in (("quiet", "quiet"), ("busy", args.neighbour)):
                set_load(running)
                self_ms, calls, wall = _profile(model, x, args.rounds)
                for key, ms in self_ms.items():
                    totals[load][0][key] += ms / args.repeats
                    totals[load][1][key] = calls[key]
                totals[load][2].append(wall)
    quiet, busy = totals["quiet"][0], totals["busy"][0]
    growth = sum(busy.values()) - sum(quiet.values())
    keys = sorted(busy, key=lambda k: busy[k] - quiet.get(k, 0.0), reverse=True)[: args.top]
    rows = [{"operator": k, "calls per forward": totals["busy"][1][k], "quiet ms": round(quiet.get(k, 0.0), 1), "busy ms": round(busy[k], 1),
             "x": round(busy[k] / quiet[k], 2) if quiet.get(k) else None, "share of growth": f"{(busy[k] - quiet.get(k, 0.0)) / growth:.0%}"}
            for k in keys]
    walls = {load: [round(w) for w in totals[load][2]] for load in totals}
    print(f"{args.model} at {args.size}^2, {args.threads} threads, {os.environ.get('GOMP_SPINCOUNT') or os.environ.get('OMP_WAIT_POLICY') or 'libgomp default'}: "
          f"wall ms per forward (profiled) quiet {walls['quiet']}, beside the {args.neighbour} neighbour(s) {walls['busy']}; "
          f"{sum(totals['busy'][1].values())} operator calls per forward; self CPU {sum(quiet.values()):.0f} -> {sum(busy.values()):.0f} ms")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
