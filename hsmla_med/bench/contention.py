"""CPU contention (``hsmla-med bench --only contention``): networks timed quiet,
beside a background ``hsmla-med train`` and beside two plain PyTorch processes, as a library
user calls them and through ``hsmla-med infer``.

Loads (:data:`LOADS`), made by :func:`neighbours`: ``quiet``; ``train``, one ``hsmla-med train
--task btcv`` on its synthetic data, the run a user leaves going, started as a shell's ``&``
job (:func:`background`: its process group, the trainer and its loader workers, in this
session); ``pytorch``, two processes of float32 matrix products in a loop
(2 threads each). All are started once, in the environment ``hsmla-med`` was given (without the
settings it adds itself), and paused (SIGSTOP) but for the load being measured.

Cases, each in its own child process (OpenMP reads its settings when torch loads):

* ``library, hsmla_med first`` and ``library, torch first``: the networks built and called
  directly, as in a user's script, in the environment the user gave (nothing of hsmla-med's CLI);
  ``library, CPU defaults off``: the same with ``HSMLA_MED_CPU_DEFAULTS=0``, as a library user
  ran before hsmla-med set OpenMP at import and adapted its threads to the load: the pairing;
  HSMLA-B2 (tau calibrated to alpha 0.3), the same compiled by ``torch.compile`` (inductor's CPU
  code with frozen weights), SegFormer-B2, MONAI's UNet and the floor (:data:`FLOORS`: matrix
  products, perfectly parallel work, with the free-CPU threads and with all threads)
  interleaved: each round runs every load and, at each, every network once, so that drift in the
  host's own load moves them alike;
* ``hsmla-med infer``: one volume through the command line (an HSMLA-B2 checkpoint, 2D
  slice-wise), the prediction time it reports, per load.

Reported per case and network: the median latency at each load, the slowdown against its own
quiet time, the speed-up over SegFormer-B2 at each load, and the thread count torch ran with.
The neighbours are killed when a child ends, also on error.
"""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hsmla_med import runtime

__all__ = ["add_arguments", "bench_contention", "background", "neighbours", "LOADS", "MODELS", "FLOORS", "CASES"]

#: the floor: perfectly parallel work (MatrixProducts) with the thread count HSMLA networks choose
#: (the free CPUs) and with all the caller's threads: what the scheduler leaves any process of
#: as many threads beside the same neighbours, against which HSMLA-B2's slowdown is read
FLOORS = ("floor: matrix products (free-CPU threads)", "floor: matrix products (all threads)")
MODELS = ("HSMLA-B2", "HSMLA-B2 (torch.compile)", "SegFormer-B2", "MONAI UNet", *FLOORS)
COMPILED = "HSMLA-B2 (torch.compile)"  # inductor's CPU code, weights frozen: elementwise chains fused into the loops around them
LOADS = ("quiet", "train", "pytorch")
#: library cases: the module imported first, and variables added to the user's environment (the
#: last: hsmla-med's CPU settings off, as a library user had them before those settings, for pairing)
CASES = {"library, hsmla_med first": ("hsmla_med", {}), "library, torch first": ("torch", {}),
         "library, CPU defaults off": ("hsmla_med", {"HSMLA_MED_CPU_DEFAULTS": "0"})}
INFER = "hsmla-med infer"
NEIGHBOUR = "import torch\ntorch.set_num_threads(2)\na = torch.randn(1024, 1024)\nprint('ready', flush=True)\nwhile True:\n    a @ a\n"
#: seconds the background training may take to reach its steps (imports, data, the first batches)
TRAIN_START_TIMEOUT = 600
#: seconds it runs on after its first step before a measurement: data loader workers up, caches full
TRAIN_SETTLE = 10.0


def add_arguments(parser) -> None:
    g = parser.add_argument_group("contention benchmark (--only contention)")
    g.add_argument("--contention-rounds", type=int, default=3, help="rounds over loads and networks (default 3)")
    g.add_argument("--contention-volume", type=int, nargs=3, default=[512, 512, 8], metavar=("X", "Y", "Z"),
                   help="the volume infer segments per load (default 512 512 8)")


def _given_environment() -> dict[str, str]:
    """The environment hsmla-med was started with: without the variables it set itself."""
    set_here = runtime.applied_variables()
    return {k: v for k, v in os.environ.items() if k not in set_here and k != runtime.MARK}


def bench_contention(args) -> list[dict]:
    """The library cases (a child each) and the ``infer`` case; rows of (case, network)."""
    given = _given_environment()
    rows = []
    for case, (first, variables) in CASES.items():
        print(f"  {case} ...", flush=True)
        done = subprocess.run([*_case_command(first), str(args.size), str(args.contention_rounds)], env={**given, **variables},
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"contention child ({case}) failed:\n{done.stderr[-2000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        rows += _rows(case, result["seconds"], result["threads"])
    print(f"  {INFER} ...", flush=True)
    rows += _rows(INFER, *_infer_case(args.contention_volume, args.contention_rounds, given))
    return rows


def _case_command(first: str) -> list[str]:
    """The child of a library case: ``first`` (``torch`` or ``hsmla_med``) imported before
    anything else, as a user's script would (``python -m hsmla_med...`` would import hsmla_med first)."""
    return [sys.executable, "-c", f"import {first}, runpy; runpy.run_module('hsmla_med.bench.contention', run_name='__main__')"]


def _rows(case: str, times: dict[str, dict[str, list[float]]], threads: dict[str, dict[str, list[int]]]) -> list[dict]:
    """Per network: median latency, slowdown and ratio to SegFormer-B2 (where timed) at each
    load, and the thread count it ran with most often there."""
    median = {m: {load: statistics.median(times[m][load]) for load in LOADS} for m in times}
    rows = []
    for model, by_load in median.items():
        row = {"case": case, "model": model}
        row.update({f"ms_{load}": round(by_load[load] * 1e3, 1) for load in LOADS})
        row.update({f"slowdown_{load}": round(by_load[load] / by_load["quiet"], 2) for load in LOADS[1:]})
        if "SegFormer-B2" in median:
            row.update({f"x_segformer_b2_{load}": round(median["SegFormer-B2"][load] / by_load[load], 2) for load in LOADS})
        row.update({f"threads_{load}": statistics.mode(threads[model][load]) for load in LOADS})
        rows.append(row)
    return rows


def background(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    """``command`` started as a shell starts ``command &``: in a process group of its own (paused,
    resumed and killed as one, its loader workers with it) and in the caller's session. Another
    session would be another terminal's job, which Linux's autogroup scheduling
    (``/proc/sys/kernel/sched_autogroup_enabled``) gives a share of the CPUs of its own, whatever
    its thread count: the background training the bench measured before took half the CPUs at
    most, a shell's job takes a share per runnable thread."""
    return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            process_group=0)


def _start_training(folder: Path, env: dict[str, str]) -> subprocess.Popen:
    """``hsmla-med train --task btcv`` on the synthetic data into ``folder``, in its own process
    group, once it has taken its first steps (its CSV log exists) and run on for a while."""
    train = background([sys.executable, "-m", "hsmla_med.cli", "train", "--task", "btcv", "--max-steps", "1000000",
                        "--output", str(folder / "train")], env)
    deadline = time.monotonic() + TRAIN_START_TIMEOUT
    while not list((folder / "train").glob("logs/version_*/hparams.yaml")):
        if train.poll() is not None or time.monotonic() > deadline:
            train.kill()
            raise RuntimeError(f"the background hsmla-med train did not start training (exit {train.poll()}); "
                               f"try it alone: hsmla-med train --task btcv --output {folder / 'train'}")
        time.sleep(1)
    time.sleep(TRAIN_SETTLE)
    return train


@contextmanager
def neighbours(count: int = 2, train: bool = False) -> Iterator[Callable[[str], None]]:
    """The loads' neighbours: ``count`` PyTorch processes (:data:`NEIGHBOUR`) and, with
    ``train``, a background training (:func:`_start_training`), all paused once started; yields
    ``load(name)``, which runs the neighbours of load ``name`` (``quiet``: none; ``pytorch``:
    the PyTorch processes; ``train``: the training's process group; or an int ``k``: the first
    ``k`` PyTorch processes) and pauses the others, then waits half a second for them to get
    going. Every neighbour is killed on exit, also on error."""
    env = _given_environment()
    procs = [subprocess.Popen([sys.executable, "-c", NEIGHBOUR], stdout=subprocess.PIPE, text=True, env=env) for _ in range(count)]
    folder = Path(tempfile.mkdtemp(prefix="hsmla-contention-"))
    groups: dict[str, list] = {}
    running: dict[int, bool] = {}

    def signal_process(proc: subprocess.Popen, run: bool, group: bool) -> None:
        # a signal takes effect when the process next runs: wait for the stop or the
        # continuation to have happened (each transition reports once to waitpid)
        (os.killpg if group else os.kill)(proc.pid, signal.SIGCONT if run else signal.SIGSTOP)
        os.waitpid(proc.pid, os.WCONTINUED if run else os.WUNTRACED)

    def switch(active: list) -> None:
        for proc, group in [*((p, False) for p in procs), *((p, True) for p in groups.get("train", []))]:
            run = proc in active
            if running.get(proc.pid) != run:
                signal_process(proc, run, group)
                running[proc.pid] = run

    def load(name) -> None:
        active = procs[:name] if isinstance(name, int) else {"quiet": [], "pytorch": procs, "train": groups.get("train", [])}[name]
        switch(list(active))
        time.sleep(0.5)  # the resumed neighbours get going

    try:
        for p in procs:
            p.stdout.readline()  # 'ready': torch loaded, the loop starts
            running[p.pid] = True
        if train:
            groups["train"] = [_start_training(folder, env)]
            running[groups["train"][0].pid] = True
        switch([])
        yield load
    finally:
        for p in procs:
            p.kill()  # (SIGKILL ends a stopped process too)
            p.wait()
        for p in groups.get("train", []):
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        subprocess.run(["rm", "-rf", str(folder)], check=False)


def _child(size: int, rounds: int) -> dict[str, dict[str, dict[str, list]]]:
    """``seconds`` (latencies) and ``threads`` (torch's count inside each forward), per network
    and load: the child process's work, with torch imported as its case says (the caller)."""
    import torch

    from hsmla_med.bench.models import MatrixProducts, build_models

    x = torch.randn(1, 1, size, size)
    makers = build_models(x)
    models = {name: makers[name]().eval() for name in MODELS if name in makers}
    import torch._inductor.config as inductor

    from hsmla_med.nn.threads import FreeCPUThreads

    inductor.freezing = True  # the folded weights as constants of the compiled graph
    # a copy of the same network: hooks of the one compiled run inside its code (where they do
    # nothing), so the free-CPU threads go on the compiled module, as its docstring says for users
    models[COMPILED] = torch.compile(copy.deepcopy(models["HSMLA-B2"]), dynamic=False)
    FreeCPUThreads().install(models[COMPILED])
    models[FLOORS[0]], models[FLOORS[1]] = MatrixProducts().eval(), MatrixProducts().eval()
    FreeCPUThreads().install(models[FLOORS[0]])
    models = {name: models[name] for name in MODELS}
    result = {key: {name: {load: [] for load in LOADS} for name in MODELS} for key in ("seconds", "threads")}
    during = []  # the thread count inside the forward (an HSMLA network's own hooks set it, and put it back after)
    for model in models.values():
        model.register_forward_pre_hook(lambda module, args: during.append(torch.get_num_threads()))
    with neighbours(train=True) as set_load, torch.inference_mode():
        for model in models.values():
            model(x), model(x)
        for _ in range(rounds):
            for load in LOADS:
                set_load(load)
                for name, model in models.items():
                    start = time.perf_counter()
                    model(x)
                    result["seconds"][name][load].append(time.perf_counter() - start)
                    result["threads"][name][load].append(during[-1])
    return result


def _infer_case(shape: list[int], rounds: int, env: dict[str, str]) -> tuple[dict, dict]:
    """``hsmla-med infer`` of one synthetic CT volume of ``shape`` with an HSMLA-B2 checkpoint
    (2D, one training step on the synthetic BTCV data: tau calibrated as training leaves it),
    per load and round: the prediction seconds the command reports. Its threads are its own
    (the machine's CPUs, or fewer under load): recorded as the CPU count."""
    import nibabel as nib
    import numpy as np

    folder = Path(tempfile.mkdtemp(prefix="hsmla-contention-infer-"))
    cli = [sys.executable, "-m", "hsmla_med.cli"]
    try:
        (folder / "b2.yaml").write_text("model: b2\nmode: 2d\n")
        done = subprocess.run([*cli, "train", "--task", "btcv", "--config", str(folder / "b2.yaml"), "--max-steps", "1",
                               "--output", str(folder / "run")], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"hsmla-med train (the B2 checkpoint) failed:\n{done.stderr[-2000:]}")
        rng = np.random.default_rng(0)
        volume = (rng.normal(0, 40, shape) + 40).astype(np.int16)
        nib.save(nib.Nifti1Image(volume, np.diag([0.8, 0.8, 2.5, 1.0])), str(folder / "ct.nii.gz"))
        seconds = {INFER: {load: [] for load in LOADS}}
        command = [*cli, "infer", "--checkpoint", str(folder / "run" / "best.ckpt"), "--input", str(folder / "ct.nii.gz")]
        with neighbours(train=True) as set_load:
            for r in range(rounds):
                for load in LOADS:
                    set_load(load)
                    done = subprocess.run([*command, "--output", str(folder / f"out_{r}_{load}")], env=env, capture_output=True, text=True)
                    found = re.search(r"output file\(s\) in .* \(([\d.]+) s\)", done.stdout)
                    if done.returncode != 0 or found is None:
                        raise RuntimeError(f"hsmla-med infer failed:\n{done.stdout[-1000:]}\n{done.stderr[-2000:]}")
                    seconds[INFER][load].append(float(found.group(1)))
        return seconds, {INFER: {load: [os.cpu_count() or 1] for load in LOADS}}
    finally:
        subprocess.run(["rm", "-rf", str(folder)], check=False)


if __name__ == "__main__":  # a child: its case's imports were made by _case_command's -c line
    print(json.dumps(_child(int(sys.argv[1]), int(sys.argv[2]))))
