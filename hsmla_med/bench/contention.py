"""CPU contention (``hsmla-med bench --only contention``, issue 34): networks timed quiet and
beside 1 and 2 neighbouring PyTorch processes, under each of several OpenMP wait settings.

OpenMP reads its settings once, when torch loads, so each setting runs in its own child process
(``python -m hsmla_med.bench.contention``). A child builds HSMLA-B0/B2 (tau calibrated to
alpha 0.3), SegFormer-B2, SwinUNETR-2D and MONAI's UNet, starts two neighbours (2 threads each,
float32 matrix products in a loop, in the environment ``hsmla-med`` was given, without the
settings it adds itself) and pauses them (SIGSTOP). Each round then runs every load level
(0, 1, 2 neighbours resumed) and, at each, every network once, so load levels and networks
interleave and drift in the host's own load moves them alike. Reported per setting and network:
the median latency at each load level, the slowdown against its own quiet time, and the speed-up
over SegFormer-B2 at each level. The neighbours are killed when the child ends, also on error.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from hsmla_med import runtime

__all__ = ["add_arguments", "bench_contention", "neighbours", "settings"]

MODELS = ("HSMLA-B0", "HSMLA-B2", "SegFormer-B2", "SwinUNETR-2D", "MONAI UNet")
LOADS = (0, 1, 2)
NEIGHBOUR = "import torch\ntorch.set_num_threads(2)\na = torch.randn(1024, 1024)\nprint('ready', flush=True)\nwhile True:\n    a @ a\n"
_WAIT = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "KMP_BLOCKTIME")
_ADAPTIVE = "HSMLA_MED_ADAPTIVE_THREADS"


def add_arguments(parser) -> None:
    g = parser.add_argument_group("contention benchmark (--only contention)")
    g.add_argument("--contention-rounds", type=int, default=5, help="rounds over load levels and networks (default 5)")
    g.add_argument("--spin-counts", type=int, nargs="*", default=[runtime.SPIN_COUNT],
                   help=f"GOMP_SPINCOUNT values to compare besides libgomp's default and passive waiting (default {runtime.SPIN_COUNT}: hsmla-med's)")


def settings(spin_counts: list[int]) -> dict[str, dict[str, str]]:
    """The OpenMP wait settings compared: libgomp's default (no variable), each spin count, and
    passive waiting (``OMP_WAIT_POLICY=PASSIVE``: sleep at once). The child of hsmla-med's own spin
    count (``HSMLA_MED_ADAPTIVE_THREADS=1`` in its environment) also times every network with
    the threads giving way to the load as hsmla-med's prediction runs it
    (:class:`~hsmla_med.runtime.LoadAdaptiveThreads`), interleaved with the fixed threads."""
    spins = {f"GOMP_SPINCOUNT={n}": {"GOMP_SPINCOUNT": str(n), **({_ADAPTIVE: "1"} if n == runtime.SPIN_COUNT else {})}
             for n in spin_counts}
    return {"libgomp default": {}, **spins, "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"}}


def _given_environment() -> dict[str, str]:
    """The environment hsmla-med was started with: without the variables it set itself."""
    set_here = runtime.applied_variables()
    return {k: v for k, v in os.environ.items() if k not in set_here and k != runtime.MARK}


def bench_contention(args) -> list[dict]:
    """One child process per setting; rows of (setting, network) with latencies and ratios."""
    given = _given_environment()
    rows = []
    for name, variables in settings(args.spin_counts).items():
        env = {**{k: v for k, v in given.items() if k not in (*_WAIT, _ADAPTIVE)}, **variables}
        print(f"  {name} ...", flush=True)
        cmd = [sys.executable, "-m", "hsmla_med.bench.contention", str(args.size), str(args.contention_rounds), str(args.threads)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"contention child ({name}) failed:\n{done.stderr[-2000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        for suffix, arm in result.items():
            rows += _rows(name + suffix, arm["seconds"], arm["threads"])
    return rows


def _rows(setting: str, times: dict[str, dict[str, list[float]]], threads: dict[str, dict[str, list[int]]]) -> list[dict]:
    """Per network: median latency, slowdown and ratio to SegFormer-B2 at each load, and the
    thread count it ran with most often there."""
    median = {m: {load: statistics.median(times[m][str(load)]) for load in LOADS} for m in times}
    rows = []
    for model, by_load in median.items():
        row = {"setting": setting, "model": model}
        row.update({f"ms_{load}": round(by_load[load] * 1e3, 1) for load in LOADS})
        row.update({f"slowdown_{load}": round(by_load[load] / by_load[0], 2) for load in LOADS[1:]})
        row.update({f"x_segformer_b2_{load}": round(median["SegFormer-B2"][load] / by_load[load], 2) for load in LOADS})
        row.update({f"threads_{load}": statistics.mode(threads[model][str(load)]) for load in LOADS})
        rows.append(row)
    return rows


@contextmanager
def neighbours(count: int) -> Iterator[Callable[[int], None]]:
    """``count`` neighbouring PyTorch processes (:data:`NEIGHBOUR`), started, then paused
    (SIGSTOP) once torch has loaded in each; yields ``load(k)``, which runs the first ``k`` of
    them (SIGCONT) and pauses the others, and waits half a second for the resumed ones to get
    going. The neighbours are killed on exit, also on error."""
    procs = [subprocess.Popen([sys.executable, "-c", NEIGHBOUR], stdout=subprocess.PIPE, text=True) for _ in range(count)]
    running = [True] * count

    def switch(k: int) -> None:
        for i, p in enumerate(procs):
            if (i < k) != running[i]:
                # a signal takes effect when the process next runs: wait for the stop or the
                # continuation to have happened (each transition reports once to waitpid)
                os.kill(p.pid, signal.SIGCONT if i < k else signal.SIGSTOP)
                os.waitpid(p.pid, os.WCONTINUED if i < k else os.WUNTRACED)
                running[i] = i < k

    def load(k: int) -> None:
        switch(k)
        time.sleep(0.5)  # the resumed neighbours get going

    try:
        for p in procs:
            p.stdout.readline()  # 'ready': torch loaded, the loop starts
        switch(0)
        yield load
    finally:
        for p in procs:
            p.kill()  # (SIGKILL ends a stopped process too)
            p.wait()


def _child(size: int, rounds: int, threads: int) -> dict[str, dict[str, dict[str, dict[str, list]]]]:
    """Per arm (``""``: the threads fixed; ``" + load-adaptive threads"`` where
    ``HSMLA_MED_ADAPTIVE_THREADS=1``, run right after the fixed one), ``seconds`` (latencies) and
    ``threads`` (torch's count during each forward), per network and load level (the child
    process's work)."""
    import torch

    from hsmla_med.bench.models import build_models

    torch.set_num_threads(threads)
    runtime.tune_cpu_allocator()  # as every hsmla-med command runs (the heap top pad)
    x = torch.randn(1, 1, size, size)
    makers = build_models(x)
    models = {name: makers[name]().eval() for name in MODELS}
    # the pre-hook hsmla-med's prediction installs, called as the hook would be
    arms = {"": None, **({" + load-adaptive threads": runtime.LoadAdaptiveThreads(threads)} if os.environ.get(_ADAPTIVE) == "1" else {})}
    result = {arm: {key: {name: {str(load): [] for load in LOADS} for name in MODELS} for key in ("seconds", "threads")} for arm in arms}
    with neighbours(max(LOADS)) as set_load, torch.inference_mode():
        for model in models.values():
            model(x), model(x)
        for _ in range(rounds):
            for load in LOADS:
                set_load(load)
                for name, model in models.items():
                    for arm, hook in arms.items():
                        torch.set_num_threads(threads)
                        start = time.perf_counter()
                        if hook is not None:
                            hook(model, (x,))
                        model(x)
                        result[arm]["seconds"][name][str(load)].append(time.perf_counter() - start)
                        result[arm]["threads"][name][str(load)].append(torch.get_num_threads())
    return result


if __name__ == "__main__":
    size, rounds, threads = map(int, sys.argv[1:4])
    print(json.dumps(_child(size, rounds, threads)))
