"""Where a network's time goes beside busy neighbours, operator by operator (which operators a
shared CPU slows): a profile quiet and with the contention benchmark's two neighbouring PyTorch
processes (2 threads of 1024^2 matrix products each, ``hsmla_med.bench.contention.NEIGHBOUR``)
or its background ``hsmla-med train`` (``--neighbour train``), in one process, interleaved.

The OpenMP settings are read when torch loads: ``hsmla-med`` (and ``python -m hsmla_med.bench``)
set them as for every command, unless the environment already does:

    hsmla-med bench --only profile-contention --model HSMLA-B2 --rounds 3

Prints, per operator, the self CPU time per forward quiet and busy and its share of the busy
forward's growth, and how many operators a forward runs.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

import torch

from hsmla_med import runtime
from hsmla_med.bench.common import markdown, own_parser, positive_int
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


def main(argv: list[str]) -> int:
    parser = own_parser("profile-contention", __doc__)
    parser.add_argument("--model", default="HSMLA-B2", choices=MODELS, help="the network profiled (default HSMLA-B2)")
    parser.add_argument("--size", type=positive_int, default=512, help="input side (default 512)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="forwards profiled per load, per round (default 3)")
    parser.add_argument("--repeats", type=positive_int, default=2, help="quiet/busy alternations (default 2)")
    parser.add_argument("--top", type=positive_int, default=15, help="operators listed, by their growth (default 15)")
    parser.add_argument("--neighbour", choices=["pytorch", "train"], default="pytorch",
                        help="two PyTorch processes of matrix products (default), or a background hsmla-med train --task btcv")
    parser.add_argument("--threads", type=positive_int, default=2, help="torch threads (default 2)")
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
