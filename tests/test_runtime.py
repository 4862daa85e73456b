"""The CPU allocator setting: applied on glibc unless the environment configures malloc."""

import os
import platform
import subprocess
import sys

import pytest

from hsmla_med.runtime import available_cpus, tune_cpu_allocator

_CHILD = "from hsmla_med.runtime import tune_cpu_allocator; print(tune_cpu_allocator())"


def _child(env: dict) -> str:
    return subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_applied_on_glibc_in_a_fresh_process():
    assert _child({"PATH": ""}) == "True"


def test_environment_choices_win(monkeypatch):
    monkeypatch.setenv("HSMLA_MED_MALLOC_TOP_PAD", "0")
    assert tune_cpu_allocator() is False
    monkeypatch.delenv("HSMLA_MED_MALLOC_TOP_PAD")
    for name in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES"):
        monkeypatch.setenv(name, "2")
        assert tune_cpu_allocator() is False
        assert _child({"PATH": "", name: "2"}) == "False"
        monkeypatch.delenv(name)
    assert tune_cpu_allocator(top_pad=0) is False


@pytest.mark.parametrize("value", ["abc", "1e9", "1 GiB"])
def test_a_non_numeric_top_pad_is_one_line(capsys, monkeypatch, tmp_path, value):
    """It used to end in int()'s ValueError traceback before any command ran."""
    from tests.conftest import cli_error

    monkeypatch.setenv("HSMLA_MED_MALLOC_TOP_PAD", value)
    line = cli_error(capsys, ["export", "--checkpoint", str(tmp_path / "none.ckpt"), "--format", "onnx", "--output", str(tmp_path / "out")])
    assert line == f"hsmla-med: error: HSMLA_MED_MALLOC_TOP_PAD={value!r}: not a whole number of bytes (0 keeps glibc's behaviour)"


def _cgroup(tmp_path, files: dict) -> "Path":
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize("files, quota", [
    ({"cpu.max": "150000 100000\n"}, 1.5),  # cgroup v2: 1.5 CPUs
    ({"cpu.max": "max 100000\n"}, None),  # v2, unlimited
    ({"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 0.5),  # v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1, unlimited
    ({"cpu.max": "garbage\n"}, None),
    ({}, None),
])
def test_cpus_follow_the_affinity_and_the_cgroup_quota(tmp_path, files, quota):
    import math
    import os

    from hsmla_med.runtime import _cgroup_quota, available_cpus

    root = _cgroup(tmp_path, files)
    assert _cgroup_quota(root) == quota
    affinity = len(os.sched_getaffinity(0))
    assert available_cpus(root) == (affinity if quota is None else max(1, min(affinity, math.ceil(quota))))


def test_cpu_thread_settings_respect_the_users_environment(tmp_path, monkeypatch):
    import os

    from hsmla_med.runtime import MARK, SPIN_COUNT, configure_cpu_threads

    one_cpu = _cgroup(tmp_path / "one", {"cpu.max": "100000 100000"})
    unlimited = _cgroup(tmp_path / "max", {"cpu.max": "max 100000"})
    # a 4-CPU machine whatever this one is; the affinity mask is set per case
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    env = {}
    expected = {"GOMP_SPINCOUNT": str(SPIN_COUNT), "OMP_NUM_THREADS": "1"}
    assert configure_cpu_threads(env, one_cpu) == expected
    assert env == {**expected, MARK: f"GOMP_SPINCOUNT={SPIN_COUNT};OMP_NUM_THREADS=1"}  # what it set, marked as hsmla-med's
    assert configure_cpu_threads({}, unlimited) == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}  # every CPU: torch's own count
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1, 3})  # taskset -c 1,3
    assert configure_cpu_threads({}, unlimited) == {"GOMP_SPINCOUNT": str(SPIN_COUNT), "OMP_NUM_THREADS": "2"}
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "KMP_BLOCKTIME"):  # the user decided how threads wait
        env = {name: "7", "OMP_NUM_THREADS": "3"}
        assert configure_cpu_threads(env, one_cpu) == {} and env == {name: "7", "OMP_NUM_THREADS": "3"}
    assert configure_cpu_threads({"HSMLA_MED_CPU_DEFAULTS": "0"}, one_cpu) == {}
    import torch  # noqa: F401 - loaded: too late for OpenMP's settings

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    with pytest.warns(RuntimeWarning, match="torch is already loaded"):
        assert configure_cpu_threads() == {}
    assert "GOMP_SPINCOUNT" not in os.environ


_CLI_CHILD = """
import os, sys
import hsmla_med.runtime as runtime
seen = []
original = runtime.configure_cpu_threads
runtime.configure_cpu_threads = lambda *a, **k: seen.append("torch" in sys.modules) or original(*a, **k)
from hsmla_med.cli import main
code = main(["infer", "--checkpoint", sys.argv[1], "--input", "x", "--output", sys.argv[2]])  # reads the file with torch
print(code, seen, os.environ.get("GOMP_SPINCOUNT"), "torch" in sys.modules)
"""


@pytest.mark.parametrize("user", [None, "123"])
def test_the_cli_sets_openmp_before_torch_loads(tmp_path, user):
    """``hsmla-med`` applies the thread settings before torch (libgomp) loads, and keeps a
    user's own GOMP_SPINCOUNT."""
    import os

    from hsmla_med.runtime import SPIN_COUNT

    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "KMP_BLOCKTIME")}
    if user is not None:
        env["GOMP_SPINCOUNT"] = user
    out = subprocess.run([sys.executable, "-c", _CLI_CHILD, str(tmp_path / "missing.ckpt"), str(tmp_path / "out")], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["2", "[False]", user or str(SPIN_COUNT), "True"]


def test_cpu_processes_share_the_cpus(monkeypatch):
    """ShareCPUs: N CPU processes of one node run available_cpus() // N threads each."""
    import types

    import torch
    from lightning.pytorch.accelerators import CPUAccelerator

    from hsmla_med.engine import distributed

    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(distributed, "available_cpus", lambda: 8)
    try:
        module = types.SimpleNamespace(network=torch.nn.Identity())
        distributed.ShareCPUs().setup(types.SimpleNamespace(accelerator=CPUAccelerator(), num_devices=3), module, "predict")
        assert torch.get_num_threads() == 2
        torch.set_num_threads(5)
        distributed.ShareCPUs().setup(types.SimpleNamespace(accelerator=CPUAccelerator(), num_devices=1), None, "fit")
        assert torch.get_num_threads() == 5  # one process keeps the threads it has
    finally:
        torch.set_num_threads(threads)


def test_a_child_process_tells_hsmla_meds_thread_count_from_the_users(tmp_path, monkeypatch):
    """A DDP rank that Lightning starts by running the command again inherits the OMP_NUM_THREADS
    that its launcher's hsmla-med set (a cgroup quota): it is hsmla-med's there too, so the rank
    shares the CPUs as rank 0 does; before, the rank took it for the user's and kept every CPU's
    worth of threads. A user's own value, or one changed since, stays the user's."""
    import types

    import torch
    from lightning.pytorch.accelerators import CPUAccelerator

    from hsmla_med.engine import distributed
    from hsmla_med.runtime import MARK, SPIN_COUNT, applied_variables, configure_cpu_threads

    two = _cgroup(tmp_path / "two", {"cpu.max": "200000 100000"})
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    parent = {"PATH": "/bin"}
    assert configure_cpu_threads(parent, two) == {"GOMP_SPINCOUNT": str(SPIN_COUNT), "OMP_NUM_THREADS": "2"}
    child = dict(parent)  # the rank's environment
    assert configure_cpu_threads(child, two) == {} and child == parent  # nothing set again
    assert applied_variables(child) == {"GOMP_SPINCOUNT": str(SPIN_COUNT), "OMP_NUM_THREADS": "2"}
    assert applied_variables({**child, "OMP_NUM_THREADS": "3"}) == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}  # changed: the user's
    assert applied_variables({"OMP_NUM_THREADS": "2"}) == {}
    user = {"OMP_NUM_THREADS": "2"}
    configure_cpu_threads(user, two)
    assert "OMP_NUM_THREADS" not in applied_variables(user)

    threads = torch.get_num_threads()
    monkeypatch.setattr(distributed, "available_cpus", lambda: 2)
    trainer = types.SimpleNamespace(accelerator=CPUAccelerator(), num_devices=2)
    try:
        for env, expected in ((child, 1), (user, 5)):  # the rank's: 2 CPUs over 2 ranks; the user's: left alone
            torch.set_num_threads(5)
            for name in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT", MARK):
                monkeypatch.delenv(name, raising=False)
                if name in env:
                    monkeypatch.setenv(name, env[name])
            distributed.ShareCPUs().setup(trainer, None, "fit")
            assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(threads)


def test_xdist_workers_take_their_share_of_threads(worker_threads):
    """Under pytest-xdist (scripts/test.sh), tests/conftest.py gives each worker its share of the
    CPUs as OpenMP threads before torch loads; a worker with a thread per CPU would slow the others.
    (The count when the worker's first test started: tests may set their own later.)"""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        pytest.skip("not run by pytest-xdist")
    threads = int(os.environ["OMP_NUM_THREADS"])
    assert worker_threads == threads
    if int(workers) >= available_cpus():
        assert threads == 1


def _proc(tmp_path, running: int, threads: dict[int, str]):
    """A fake ``/proc``: ``loadavg`` with ``running`` runnable tasks, and this process's threads
    as ``self/task/<tid>/stat`` lines (``tid (comm) state ...``)."""
    (tmp_path / "loadavg").write_text(f"1.52 1.20 0.98 {running}/312 4242\n")
    for tid, line in threads.items():
        (tmp_path / "self" / "task" / str(tid)).mkdir(parents=True)
        (tmp_path / "self" / "task" / str(tid) / "stat").write_text(line + "\n")
    return tmp_path


def test_runnable_others_are_the_machines_less_this_processs(tmp_path, monkeypatch):
    from hsmla_med import runtime

    # two of our threads run; one sleeps although its name holds ") R"
    proc = _proc(tmp_path, 6, {1: "1 (python) R 0 1 1", 2: "2 (odd ) R name) S 0 1 1", 3: "3 (omp) R 0 1 1"})
    assert runtime.runnable_others(proc, samples=1) == 4
    # the least of the readings: a thread of ours caught running in one of them only
    seen = iter([0, 3, 0])
    monkeypatch.setattr(runtime, "_own_running", lambda proc: next(seen))
    assert runtime.runnable_others(proc, samples=3, gap=0) == 3
    assert runtime.runnable_others(tmp_path / "absent") is None
    (tmp_path / "loadavg").write_text("garbage\n")
    assert runtime.runnable_others(proc) is None


def test_threads_give_way_to_the_others_load(tmp_path, monkeypatch):
    import torch

    from hsmla_med import runtime

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    others = {"n": 0}
    reads = []
    monkeypatch.setattr(runtime, "runnable_others", lambda proc: reads.append(1) or others["n"])
    governor = runtime.LoadAdaptiveThreads(3, interval=0.0)
    # 4 CPUs, at most 3 threads: the CPUs the others leave, at least one
    for n, expected in [(0, 3), (1, 3), (2, 2), (3, 1), (4, 1), (9, 1), (None, 3)]:
        others["n"] = n
        assert governor.choose() == expected
    threads = torch.get_num_threads()
    try:
        others["n"] = 2
        governor(None, (torch.zeros(1),))
        assert torch.get_num_threads() == 2
        others["n"] = 0
        governor(None, (torch.zeros(1),))
        assert torch.get_num_threads() == 3  # back up when the load goes
        reads.clear()
        governor(None, (torch.zeros(1, device="meta"),))  # not a CPU forward: nothing read
        assert reads == []
        slow = runtime.LoadAdaptiveThreads(3, interval=60.0)
        others["n"] = 3
        slow(None, (torch.zeros(1),))
        torch.set_num_threads(2)  # something else sets them between two forwards
        slow(None, (torch.zeros(1),))
        assert len(reads) == 1 and torch.get_num_threads() == 1  # one reading per interval, its choice kept
    finally:
        torch.set_num_threads(threads)


def test_prediction_installs_the_load_adaptive_threads(monkeypatch):
    """ShareCPUs puts the hook on the network in CPU prediction only, removes it at teardown and
    restores the threads; a user's OMP_NUM_THREADS or HSMLA_MED_ADAPTIVE_THREADS=0 keeps it off."""
    import types

    import torch
    from lightning.pytorch.accelerators import CPUAccelerator

    from hsmla_med import runtime
    from hsmla_med.engine import distributed

    trainer = types.SimpleNamespace(accelerator=CPUAccelerator(), num_devices=1)
    module = types.SimpleNamespace(network=torch.nn.Identity())
    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("HSMLA_MED_ADAPTIVE_THREADS", raising=False)
    monkeypatch.delenv("HSMLA_MED_CPU_DEFAULTS", raising=False)
    monkeypatch.setattr(runtime, "runnable_others", lambda proc: 10**6)  # a machine full of others
    try:
        for stage in ("fit", "validate"):
            distributed.ShareCPUs().setup(trainer, module, stage)
            assert not module.network._forward_pre_hooks
        share = distributed.ShareCPUs()
        share.setup(trainer, module, "predict")
        module.network(torch.zeros(1))
        assert torch.get_num_threads() == 1
        share.teardown(trainer, module, "predict")
        assert not module.network._forward_pre_hooks and torch.get_num_threads() == threads
        for name, value in [("OMP_NUM_THREADS", str(threads)), ("HSMLA_MED_ADAPTIVE_THREADS", "0"), ("HSMLA_MED_CPU_DEFAULTS", "0")]:
            monkeypatch.setenv(name, value)
            distributed.ShareCPUs().setup(trainer, module, "predict")
            assert not module.network._forward_pre_hooks
            monkeypatch.delenv(name)
    finally:
        torch.set_num_threads(threads)


def test_hsmla_networks_run_on_the_free_cpus_and_give_the_threads_back(monkeypatch):
    """A library user's call of an HSMLA network: beside a full machine its CPU
    inference forward runs on one thread and the caller's count is back after it, also after a
    forward that raises; training, HSMLA_MED_ADAPTIVE_THREADS=0 and a quiet machine keep the
    caller's count. The network deep-copies and pickles with its hooks."""
    import copy
    import pickle

    import torch

    from hsmla_med import runtime
    from hsmla_med.config import build_network, model_config
    from hsmla_med.nn import hsmla_net

    others = {"n": 10**6}
    monkeypatch.setattr(runtime, "runnable_others", lambda proc: others["n"])
    monkeypatch.setattr(hsmla_net._FREE_CPU_THREADS.free, "interval", 0.0)
    monkeypatch.setattr(hsmla_net._FREE_CPU_THREADS.free, "cpus", 2)
    monkeypatch.delenv("HSMLA_MED_ADAPTIVE_THREADS", raising=False)
    monkeypatch.delenv("HSMLA_MED_CPU_DEFAULTS", raising=False)
    net = build_network(model_config("b0"), 2, 1, 2).eval()
    seen = []

    def record(module, args):  # registered after the network's own hook: sees the count it chose
        seen.append(torch.get_num_threads())

    handle = net.register_forward_pre_hook(record)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        x = torch.randn(1, 1, 64, 64)
        with torch.no_grad():
            net(x)
            assert seen[-1] == 1 and torch.get_num_threads() == 2
            others["n"] = 0
            net(x)
            assert seen[-1] == 2  # a quiet machine: the caller's count
            others["n"] = 10**6
            monkeypatch.setenv("HSMLA_MED_ADAPTIVE_THREADS", "0")
            net(x)
            assert seen[-1] == 2
            monkeypatch.delenv("HSMLA_MED_ADAPTIVE_THREADS")
            with pytest.raises(ValueError):
                net(torch.randn(1, 3, 64, 64))  # 3 channels into a 1-channel network
            assert torch.get_num_threads() == 2
        handle.remove()
        for other in (copy.deepcopy(net), pickle.loads(pickle.dumps(net))):
            other.eval().register_forward_pre_hook(record)
            with torch.no_grad():
                other(x)
            assert seen[-1] == 1 and torch.get_num_threads() == 2
        net.register_forward_pre_hook(record)
        net.train()
        net(x)
        assert seen[-1] == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_prediction_of_a_torchscript_network_follows_the_load_per_batch(monkeypatch):
    """Regression: ``infer --checkpoint model.ts`` on the CPU with OMP_NUM_THREADS unset failed
    at set-up ("register_forward_pre_hook is not supported on ScriptModules"); the threads of a
    TorchScript network now follow the load before each prediction batch, and are put back at
    teardown."""
    import types

    import torch
    from lightning.pytorch.accelerators import CPUAccelerator

    from hsmla_med import runtime
    from hsmla_med.engine import distributed

    trainer = types.SimpleNamespace(accelerator=CPUAccelerator(), num_devices=1)
    module = types.SimpleNamespace(network=torch.jit.script(torch.nn.Linear(2, 2)))
    threads = torch.get_num_threads()
    for name in ("OMP_NUM_THREADS", "HSMLA_MED_ADAPTIVE_THREADS", "HSMLA_MED_CPU_DEFAULTS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(runtime, "runnable_others", lambda proc: 10**6)  # a machine full of others
    try:
        torch.set_num_threads(2)
        share = distributed.ShareCPUs()
        share.setup(trainer, module, "predict")
        assert torch.get_num_threads() == 2
        share.on_predict_batch_start(trainer, module, None, 0)
        assert torch.get_num_threads() == 1
        share.teardown(trainer, module, "predict")
        assert torch.get_num_threads() == 2
        share.on_predict_batch_start(trainer, module, None, 0)  # after teardown: nothing
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
