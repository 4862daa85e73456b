"""hsmla-med bench --only contention: the settings compared, the neighbours' environment and
the table's arithmetic (the timing run itself is a benchmark, not a test)."""

from hsmla_med import runtime
from hsmla_med.bench import contention


def test_rows_are_medians_slowdowns_and_ratios():
    times = {"HSMLA-B2": {"0": [0.1, 0.3, 0.1], "1": [0.2, 0.2, 0.9], "2": [0.3, 0.4, 0.5]},
             "SegFormer-B2": {"0": [1.0, 1.0, 2.0], "1": [2.0, 4.0, 3.0], "2": [6.0, 6.0, 6.0]}}
    threads = {"HSMLA-B2": {"0": [2, 2, 2], "1": [1, 2, 1], "2": [1, 1, 1]}, "SegFormer-B2": {"0": [2] * 3, "1": [2] * 3, "2": [2] * 3}}
    rows = {r["model"]: r for r in contention._rows("s", times, threads)}
    b2 = rows["HSMLA-B2"]
    assert (b2["ms_0"], b2["ms_1"], b2["ms_2"]) == (100.0, 200.0, 400.0)
    assert (b2["slowdown_1"], b2["slowdown_2"]) == (2.0, 4.0)
    assert (b2["x_segformer_b2_0"], b2["x_segformer_b2_1"], b2["x_segformer_b2_2"]) == (10.0, 15.0, 15.0)
    assert rows["SegFormer-B2"]["x_segformer_b2_2"] == 1.0 and b2["setting"] == "s"
    assert (b2["threads_0"], b2["threads_1"], b2["threads_2"]) == (2, 1, 1)  # the most common count


def test_settings_and_the_neighbours_environment(monkeypatch):
    assert contention.settings([100, runtime.SPIN_COUNT]) == {
        "libgomp default": {}, "GOMP_SPINCOUNT=100": {"GOMP_SPINCOUNT": "100"},
        # hsmla-med's own spin count: its child also times the load-adaptive threads
        f"GOMP_SPINCOUNT={runtime.SPIN_COUNT}": {"GOMP_SPINCOUNT": str(runtime.SPIN_COUNT), "HSMLA_MED_ADAPTIVE_THREADS": "1"},
        "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"}}
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
        load(0)
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
