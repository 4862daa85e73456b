"""Helpers every benchmark table shares: timing, CSV and markdown output, process memory."""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from pathlib import Path


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, as every bad input of hsmla-med (not the usage block
    first): ``hsmla-med bench: error: argument --size: ...``, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def own_parser(name: str, doc: str) -> Parser:
    """The parser of a benchmark that takes options of its own: the arguments after
    ``hsmla-med bench --only NAME``, its ``--help`` showing ``doc`` (the module's docstring)."""
    return Parser(prog=f"hsmla-med bench --only {name}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def _integer(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be {'positive' if low == 1 else f'>= {low}'}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (sizes, counts, threads)."""
    return _integer(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: a whole number >= 0 (warm-up calls)."""
    return _integer(text, 0)


def device(text: str) -> str:
    """argparse type: ``cpu``, ``cuda`` or ``cuda:N`` (whether this machine has it is checked
    where a table needs it)."""
    import torch

    try:
        kind = torch.device(text).type
    except (RuntimeError, ValueError):
        kind = None
    if kind not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"not a device: {text!r}; use cpu, cuda or cuda:N")
    return text


def out_folder(text: str) -> Path:
    """argparse type: a folder for the tables, created now (a file there, or a folder that
    cannot be made, is refused before anything is measured)."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise argparse.ArgumentTypeError(f"cannot create the folder {path} ({err.strerror})") from None
    return path


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


def interleaved(fns: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each function, ``rounds`` rounds after two warm-up calls each; each
    round calls every function once, so load that changes between rounds shifts them alike."""
    for fn in fns.values():
        fn(), fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def write_csv(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


def markdown(rows: list[dict]) -> str:
    """A Markdown table of ``rows``, the columns of all of them in order of appearance (a row
    without a column leaves its cell empty)."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[k]:.3g}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys) + " |")
    return "\n".join(lines)


def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
