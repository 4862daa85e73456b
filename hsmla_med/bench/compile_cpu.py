"""HSMLA-B2 on the CPU: the time torch.compile (inductor, frozen weights) takes for its first
call, and the eager and compiled forwards after it, interleaved (whether compiling pays on the
CPU, and after how many calls).

    OMP_NUM_THREADS=2 hsmla-med bench --only compile-cpu [--size 512] [--rounds 7]
"""

from __future__ import annotations

import statistics
import time

import torch

from hsmla_med import runtime
from hsmla_med.bench.common import own_parser, positive_int
from hsmla_med.bench.models import build_models


def main(argv: list[str]) -> int:
    parser = own_parser("compile-cpu", __doc__)
    parser.add_argument("--size", type=positive_int, default=512, help="input side (default 512)")
    parser.add_argument("--rounds", type=positive_int, default=7, help="timed rounds of both forwards (default 7)")
    args = parser.parse_args(argv)
    runtime.tune_cpu_allocator()
    x = torch.randn(1, 1, args.size, args.size)
    net = build_models(x)["HSMLA-B2"]().eval()
    with torch.no_grad():
        compiled = torch.compile(net, dynamic=False, options={"freezing": True})
        start = time.perf_counter()
        compiled(x)
        first = time.perf_counter() - start
        times = {"eager": [], "compiled": []}
        for _ in range(args.rounds):
            for name, fn in (("eager", net), ("compiled", compiled)):
                start = time.perf_counter()
                fn(x)
                times[name].append(time.perf_counter() - start)
    print(f"first compiled call (compile included) {first:.1f} s; medians of {args.rounds}: eager {statistics.median(times['eager']) * 1e3:.0f} ms, "
          f"compiled {statistics.median(times['compiled']) * 1e3:.0f} ms")
    return 0
