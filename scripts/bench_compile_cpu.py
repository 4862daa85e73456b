"""HSMLA-B2 at 512^2 on the CPU: the time torch.compile (inductor, frozen weights) takes for its
first call, and the eager and compiled forwards after it, interleaved (issue 54).

    PYTHONPATH=. OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_compile_cpu.py
"""

import statistics
import time

import torch

from hsmla_med import runtime
from hsmla_med.bench.models import build_models

runtime.tune_cpu_allocator()
x = torch.randn(1, 1, 512, 512)
net = build_models(x)["HSMLA-B2"]().eval()
with torch.no_grad():
    compiled = torch.compile(net, dynamic=False, options={"freezing": True})
    start = time.perf_counter()
    compiled(x)
    first = time.perf_counter() - start
    times = {"eager": [], "compiled": []}
    for _ in range(7):
        for name, fn in (("eager", net), ("compiled", compiled)):
            start = time.perf_counter()
            fn(x)
            times[name].append(time.perf_counter() - start)
print(f"first compiled call (compile included) {first:.1f} s; medians of 7: eager {statistics.median(times['eager']) * 1e3:.0f} ms, "
      f"compiled {statistics.median(times['compiled']) * 1e3:.0f} ms")
