"""What the heap top pad of ``hsmla_med.runtime`` does to time and scaling on this CPU.

Runs one HSMLA layer (inference, alpha 0.3) and the 1x1-convolution yardstick of
``hsmla-med bench`` at 64^2, 128^2 and 256^2 tokens (128 channels), interleaved, median of 5
after 2 warm-ups, in two fresh processes: glibc's default allocator and the pad. Prints one
markdown row per setting.

    hsmla-med bench --only allocator
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from hsmla_med.bench.common import own_parser

SIDES = (64, 128, 256)


def child() -> None:
    """One setting's timings, in a fresh process whose environment sets the pad; one JSON line."""
    import torch

    from hsmla_med.bench.layers import _layer_and_input
    from hsmla_med.runtime import tune_cpu_allocator

    applied = tune_cpu_allocator()
    fns = {(kind, side): _layer_and_input(kind, side, 128, 32) for kind in ("hsmla", "conv1x1") for side in SIDES}
    times = {key: [] for key in fns}
    with torch.inference_mode():
        for fn in fns.values():
            fn(), fn()
        for _ in range(5):
            for key, fn in fns.items():
                start = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - start)
    ms = {f"{kind}@{side}": statistics.median(t) * 1e3 for (kind, side), t in times.items()}
    print(json.dumps({"pad": applied, "ms": ms}))


def main(argv: list[str]) -> int:
    own_parser("allocator", __doc__).parse_args(argv)
    print("| heap top pad | HSMLA 64² / 128² / 256² (ms) | HSMLA ×(64²→256²) | 1×1 conv 64² / 256² (ms) | 1×1 conv ×(64²→256²) |")
    print("|---|---|---|---|---|")
    for pad in ("0", str(1 << 30)):
        env = dict(os.environ, HSMLA_MED_MALLOC_TOP_PAD=pad)
        out = subprocess.run([sys.executable, "-c", "from hsmla_med.bench.allocator import child; child()"], env=env,
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        h, c = (lambda s: r["ms"][f"hsmla@{s}"]), (lambda s: r["ms"][f"conv1x1@{s}"])
        print(f"| {'on' if r['pad'] else 'off'} | {h(64):.1f} / {h(128):.1f} / {h(256):.1f} | ×{h(256) / h(64):.1f} "
              f"| {c(64):.2f} / {c(256):.1f} | ×{c(256) / c(64):.1f} |", flush=True)
    return 0
