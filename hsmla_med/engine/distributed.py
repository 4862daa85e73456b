"""Multi-process runs that cannot start: refused up front where the request cannot work, and a
start-up deadline where peers never come.

``torch.distributed`` waits for every rank of the world for ``timeout`` (Lightning's default: 30
minutes), silently, and then raises a traceback that does not say which ranks are missing. The
timeout of the process group cannot be shortened for the start alone: the same timeout then
bounds every later collective, and a rank validating a long slide legitimately keeps the others
waiting for minutes. So a watchdog thread bounds only the start (until the default process group
exists) and names the ranks that never came: each process registers itself in the c10d store of
rank 0 (the one ``init_process_group`` rendezvous through) as soon as that store answers.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import lightning as L
import torch
import torch.distributed as dist

from hsmla_med.errors import ConfigError
from hsmla_med.runtime import LoadAdaptiveThreads, adaptive_threads_enabled, applied_variables, available_cpus

__all__ = ["START_TIMEOUT_ENV", "check_cpu_processes", "check_launcher", "start_up_deadline", "ShareCPUs"]

#: seconds the processes of a run wait for each other to start (default 300)
START_TIMEOUT_ENV = "HSMLA_MED_START_TIMEOUT"
_KEY = "hsmla_med/started/"


def check_cpu_processes(accelerator: str, devices, option: str = "--devices") -> None:
    """Refuse more CPU processes than this machine has cores.

    On the CPU a Lightning "device" is a process, and Lightning starts as many as asked (each one
    re-running the command, holding its own data cache and network): beyond the core count they
    only compete for cores and memory, and 99 on a small machine take the whole machine down
    before they ever meet. ``accelerator``: as configured (``auto`` is the CPU without CUDA).
    """
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    cores = available_cpus()
    if on_cpu and isinstance(devices, int) and not isinstance(devices, bool) and devices > cores:
        raise ConfigError(f"{option} {devices}: on the CPU each device is one process, and this machine has {cores} CPU core(s); "
                          f"give {option} {cores} or fewer")


def check_launcher(num_nodes, option: str = "--num-nodes") -> None:
    """Refuse a run over several nodes that no launcher started on the others.

    Without one (torchrun, SLURM, LSF or MPI, whose environment Lightning detects, or
    ``MASTER_ADDR`` set for Lightning's own multi-node launch), Lightning takes this process for
    node 0 and waits for nodes that never come, until the start-up deadline
    (:func:`start_up_deadline`, 300 s)."""
    from lightning.fabric.plugins.environments import LSFEnvironment, MPIEnvironment, SLURMEnvironment, TorchElasticEnvironment

    if num_nodes is None or int(num_nodes) <= 1 or "MASTER_ADDR" in os.environ:
        return
    if any(env.detect() for env in (TorchElasticEnvironment, SLURMEnvironment, LSFEnvironment, MPIEnvironment)):  # as Lightning chooses
        return
    raise ConfigError(f"{option} {num_nodes} needs a launcher (torchrun, SLURM) on every node; none started this process (no torchrun, "
                      f"SLURM, LSF or MPI environment, no MASTER_ADDR), so it would wait for the other nodes until the start-up deadline: "
                      f"run it under torchrun --nnodes {num_nodes} or srun on each node, or leave {option} out")


class ShareCPUs(L.Callback):
    """Several CPU processes on one node (``--devices N --strategy ddp`` on the CPU) share its
    CPUs: each runs ``available_cpus() // N`` threads, not PyTorch's default of one per CPU, so
    that processes x threads does not exceed the CPUs (N processes each spinning on every CPU
    slow all of them: each barrier waits for threads the kernel has descheduled). Applied in
    every process when the trainer sets up; an ``OMP_NUM_THREADS`` of the user's is left alone.
    DataLoader workers run one thread each (PyTorch's default in workers) beside them.

    In prediction on the CPU, the network's threads also give way to other processes' load
    (:class:`~hsmla_med.runtime.LoadAdaptiveThreads`, a forward pre-hook, removed at teardown).
    A TorchScript network (``infer --checkpoint model.ts``) takes no hooks: there the threads
    follow the load before each prediction batch instead.
    Not in training and validation, whose results should not depend on the host's load through
    the thread count (reductions change order); not where the user set ``OMP_NUM_THREADS``, ``HSMLA_MED_ADAPTIVE_THREADS=0``
    or ``HSMLA_MED_CPU_DEFAULTS=0``.
    """

    def __init__(self) -> None:
        self._hook = self._governor = None
        self._per_batch = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from lightning.pytorch.accelerators import CPUAccelerator

        # a DDP rank started by Lightning inherits the OMP_NUM_THREADS its launcher's hsmla-med set:
        # hsmla-med's (applied_variables), so shared here as on rank 0, not taken for the user's
        if not isinstance(trainer.accelerator, CPUAccelerator) or "OMP_NUM_THREADS" in os.environ and "OMP_NUM_THREADS" not in applied_variables():
            return
        if trainer.num_devices > 1:
            torch.set_num_threads(max(1, available_cpus() // trainer.num_devices))
        if stage == "predict" and adaptive_threads_enabled():
            self._threads = torch.get_num_threads()
            self._governor = LoadAdaptiveThreads(self._threads)
            network = getattr(pl_module, "network", pl_module)
            # register_forward_pre_hook "is not supported on ScriptModules"
            self._per_batch = isinstance(network, torch.jit.ScriptModule)
            if not self._per_batch:
                self._hook = network.register_forward_pre_hook(self._governor)

    def on_predict_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._per_batch:
            self._governor.apply()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._hook is not None:
            self._hook.remove()
        if self._governor is not None:
            torch.set_num_threads(self._threads)
        self._hook = self._governor = None
        self._per_batch = False


def _timeout() -> float:
    text = os.environ.get(START_TIMEOUT_ENV, "300")
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ConfigError(f"{START_TIMEOUT_ENV}={text!r}: expected the seconds to wait for a run's processes to start (> 0)")
    return seconds


def _ranks(ranks: list[int]) -> str:
    """``[2, 3, 4, 7]`` -> ``"2-4, 7"``."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def _store(address: str, port: int):
    """A client of rank 0's c10d store (``None`` while it does not answer)."""
    try:
        return dist.TCPStore(address, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=1))
    except Exception:  # not listening yet, or not reachable: the caller tries again or reports
        return None


def _report(trainer, seconds: float, registered: bool) -> None:
    """Print the missing ranks (rank 0, or a rank that never reached rank 0), stop the processes
    this one started, and exit 2 (the main thread is blocked in the C++ rendezvous, where no
    Python exception reaches it)."""
    env, rank, world = trainer.strategy.cluster_environment, trainer.global_rank, trainer.world_size
    store = _store(env.main_address, env.main_port) if registered else None
    if store is not None:
        missing = [r for r in range(world) if not store.check([f"{_KEY}{r}"])]
        line = f"rank(s) {_ranks(missing)} of {world} never started" if missing else f"the {world} processes never completed their rendezvous"
    else:
        line = f"rank 0 (at {env.main_address}:{env.main_port}) never answered rank {rank} of {world}"
    if rank == 0 or store is None:
        print(f"hsmla-med: error: distributed start-up: after {seconds:g} s, {line} ({trainer.num_nodes} node(s) x "
              f"{trainer.num_devices} process(es)); start the processes of every node (torchrun or SLURM on each), or ask for "
              f"fewer --num-nodes/--devices; {START_TIMEOUT_ENV} sets the wait", file=sys.stderr, flush=True)
    for proc in getattr(trainer.strategy.launcher, "procs", None) or []:  # the other local ranks Lightning started
        proc.kill()
    sys.stdout.flush()
    os._exit(2)


def _watch(trainer, seconds: float, stop: threading.Event) -> None:
    env, rank = trainer.strategy.cluster_environment, trainer.global_rank
    deadline, registered = time.monotonic() + seconds, False
    while not stop.wait(0.5):
        if dist.is_available() and dist.is_initialized():
            return  # every rank joined: the deadline is over
        if not registered and (store := _store(env.main_address, env.main_port)) is not None:
            store.set(f"{_KEY}{rank}", "1")
            registered = True
        if time.monotonic() > deadline:
            _report(trainer, seconds, registered)


@contextmanager
def start_up_deadline(trainer) -> Iterator[None]:
    """Around ``trainer.fit/validate/predict``: when the run has several processes and they have
    not all started within ``$HSMLA_MED_START_TIMEOUT`` seconds (default 300), print one line
    naming the missing ranks and exit with status 2, rather than wait for them indefinitely."""
    if trainer.world_size <= 1 or not dist.is_available():
        yield
        return
    stop = threading.Event()
    threading.Thread(target=_watch, args=(trainer, _timeout(), stop), name="hsmla-med-start-up", daemon=True).start()
    try:
        yield
    finally:
        stop.set()
