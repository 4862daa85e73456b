"""Layer scaling (``hsmla-med bench --only layers``): one HSMLA layer (inference, alpha 0.3)
against softmax SDPA over the same tokens, time and peak memory in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from hsmla_med.bench.common import median_seconds, status_kib
from hsmla_med.nn import HSMLA, calibrate_tau

LAYER_KINDS = {"hsmla": "HSMLA (alpha 0.3)", "sdpa": "softmax SDPA", "conv1x1": "1x1 conv C->3C"}


def _layer_and_input(kind: str, side: int, channels: int, head_dim: int):
    x = torch.randn(1, channels, side, side).contiguous(memory_format=torch.channels_last)
    if kind == "hsmla":
        # channels-last as inside the networks: the CPU kernels take those maps (channel-first
        # ones run the reference)
        layer = HSMLA(2, channels, head_dim=head_dim).eval().to(memory_format=torch.channels_last)
        calibrate_tau(layer, x, 0.3)
        return lambda: layer(x)
    if kind == "conv1x1":  # yardstick: how a plain linear-cost op scales on this machine
        conv = torch.nn.Conv2d(channels, 3 * channels, 1).eval()
        return lambda: conv(x)
    heads = channels // head_dim
    q, k, v = (torch.randn(1, heads, side * side, head_dim) for _ in range(3))
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)


def _peak_memory_child(kind: str, side: int, channels: int, head_dim: int) -> None:
    """Run in a fresh process: resident-set growth (MiB) of one forward beyond its inputs.

    Writing 5 to /proc/self/clear_refs resets the peak (VmHWM) to the current resident set, so
    the import-time peak does not hide the forward's.
    """
    with torch.no_grad():
        fn = _layer_and_input(kind, side, channels, head_dim)
        fn()  # first call allocates lazily initialised state (thread pools, oneDNN primitives)
        base = status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        fn()
        peak = status_kib("VmHWM")
    print(json.dumps({"peak_mib": (peak - base) / 1024}))


def peak_memory_mib(kind: str, side: int, channels: int, head_dim: int) -> float:
    cmd = [sys.executable, "-m", "hsmla_med.bench.layers", kind, str(side), str(channels), str(head_dim)]
    # A fixed glibc mmap threshold returns every large buffer to the system when freed, so the
    # measured forward cannot silently reuse memory that the warm-up call left in the heap.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    result = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(result.stdout.strip().splitlines()[-1])["peak_mib"]


def bench_layer(sides: list[int], channels: int, head_dim: int) -> list[dict]:
    rows = []
    for side in sides:
        for kind in LAYER_KINDS:
            with torch.no_grad():
                fn = _layer_and_input(kind, side, channels, head_dim)
                seconds = median_seconds(fn, runs=5, budget_s=30.0)
            rows.append(
                {
                    "layer": LAYER_KINDS[kind],
                    "tokens": side * side,
                    "side": side,
                    "time_ms": seconds * 1e3,
                    "peak_mib": peak_memory_mib(kind, side, channels, head_dim),
                }
            )
            print(f"  {rows[-1]['layer']} {side}^2: {seconds * 1e3:.1f} ms, {rows[-1]['peak_mib']:.1f} MiB", flush=True)
    return rows




if __name__ == "__main__":  # the fresh process of peak_memory_mib
    kind, *numbers = sys.argv[1:]
    _peak_memory_child(kind, *map(int, numbers))
