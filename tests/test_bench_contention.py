"""hsmla-med bench --only contention: the settings compared, the neighbours' environment and
the table's arithmetic (the timing run itself is a benchmark, not a test)."""

from hsmla_med import runtime
from hsmla_med.bench import contention


def test_rows_are_medians_slowdowns_and_ratios():
    times = {"HSMLA-B2": {"quiet": [0.1, 0.3, 0.1], "train": [0.2, 0.2, 0.9], "pytorch": [0.3, 0.4, 0.5]},
             "SegFormer-B2": {"quiet": [1.0, 1.0, 2.0], "train": [2.0, 4.0, 3.0], "pytorch": [6.0, 6.0, 6.0]}}
    threads = {"HSMLA-B2": {"quiet": [2, 2, 2], "train": [1, 2, 1], "pytorch": [1, 1, 1]},
               "SegFormer-B2": {load: [2] * 3 for load in contention.LOADS}}
    rows = {r["model"]: r for r in contention._rows("library", times, threads)}
    b2 = rows["HSMLA-B2"]
    assert (b2["ms_quiet"], b2["ms_train"], b2["ms_pytorch"]) == (100.0, 200.0, 400.0)
    assert (b2["slowdown_train"], b2["slowdown_pytorch"]) == (2.0, 4.0)
    assert (b2["x_segformer_b2_quiet"], b2["x_segformer_b2_train"], b2["x_segformer_b2_pytorch"]) == (10.0, 15.0, 15.0)
    assert rows["SegFormer-B2"]["x_segformer_b2_pytorch"] == 1.0 and b2["case"] == "library"
    assert (b2["threads_quiet"], b2["threads_train"], b2["threads_pytorch"]) == (2, 1, 1)  # the most common count
    # infer's rows have no SegFormer-B2 to compare with
    infer = contention._rows(contention.INFER, {contention.INFER: times["HSMLA-B2"]}, {contention.INFER: threads["HSMLA-B2"]})
    assert not any(k.startswith("x_segformer") for k in infer[0])


def test_the_neighbours_environment(monkeypatch):
    # what hsmla-med set itself is not the environment the user gave it
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    monkeypatch.setenv("SOME_USER_VARIABLE", "1")
    monkeypatch.setenv(runtime.MARK, "GOMP_SPINCOUNT=10000")
    given = contention._given_environment()
    assert "GOMP_SPINCOUNT" not in given and runtime.MARK not in given and given["SOME_USER_VARIABLE"] == "1"
    monkeypatch.setenv("GOMP_SPINCOUNT", "300")  # the user's own value since: kept
    assert contention._given_environment()["GOMP_SPINCOUNT"] == "300"


def test_neighbours_run_as_loaded_and_are_gone_after():
    """load(k) runs the first k neighbours and pauses the rest (their /proc state 'T'); leaving
    the block kills all of them, the paused ones too."""
    from pathlib import Path

    def state(pid: int) -> str:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    with contention.neighbours(2) as load:
        pids = [int(p) for p in _children()]
        assert len(pids) == 2 and {state(p) for p in pids} == {"T"}  # started paused
        load(1)
        states = [state(p) for p in pids]
        assert states.count("T") == 1  # one paused, the other running (R) or between steps (S)
        load("pytorch")
        assert "T" not in [state(p) for p in pids]
        load("quiet")
        assert {state(p) for p in pids} == {"T"}
    assert not _children()


def _children() -> list[str]:
    """PIDs of this process's live children running the neighbour loop."""
    import os
    from pathlib import Path

    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"a @ a" in cmdline:
            found.append(stat.parent.name)
    return found


def test_background_training_is_a_shell_job_in_our_session():
    """Regression: the background training was started in a session of its own,
    another autogroup, which the scheduler gives half the CPUs whatever its threads; a shell's
    ``hsmla-med train ... &`` stays in the caller's session, in a process group of its own."""
    import os
    import signal

    proc = contention.background(["sleep", "30"], dict(os.environ))
    try:
        assert os.getsid(proc.pid) == os.getsid(0)
        assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_the_floor_is_matrix_products_returning_its_input():
    import torch

    from hsmla_med.bench.models import MatrixProducts

    floor = MatrixProducts(count=2)
    x = torch.randn(1, 1, 8, 8)
    assert floor(x) is x and floor.matrix.shape == (1024, 1024)
    assert set(contention.FLOORS) <= set(contention.MODELS)
