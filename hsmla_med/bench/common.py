"""Helpers every benchmark table shares: timing, CSV and markdown output, process memory."""

from __future__ import annotations

import csv
import statistics
import time
from pathlib import Path


def median_seconds(fn, warmup: int = 2, runs: int = 5, budget_s: float = 60.0) -> float:
    """Median wall time of ``fn()`` after ``warmup`` calls; fewer runs past ``budget_s``;
    ``runs=0`` only warms up."""
    for _ in range(warmup):
        fn()
    if runs == 0:
        return 0.0
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if sum(times) > budget_s:
            break
    return statistics.median(times)


def write_csv(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


def markdown(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")
    return "\n".join(lines)



def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
