"""hsmla-med bench --only contention: the settings compared, the neighbours' environment and
the table's arithmetic (the timing run itself is a benchmark, not a test)."""

from hsmla_med import runtime
from hsmla_med.bench import contention


def test_rows_are_medians_slowdowns_and_ratios():
    times = {"HSMLA-B2": {"0": [0.1, 0.3, 0.1], "1": [0.2, 0.2, 0.9], "2": [0.3, 0.4, 0.5]},
             "SegFormer-B2": {"0": [1.0, 1.0, 2.0], "1": [2.0, 4.0, 3.0], "2": [6.0, 6.0, 6.0]}}
    rows = {r["model"]: r for r in contention._rows("s", times)}
    b2 = rows["HSMLA-B2"]
    assert (b2["ms_0"], b2["ms_1"], b2["ms_2"]) == (100.0, 200.0, 400.0)
    assert (b2["slowdown_1"], b2["slowdown_2"]) == (2.0, 4.0)
    assert (b2["x_segformer_b2_0"], b2["x_segformer_b2_1"], b2["x_segformer_b2_2"]) == (10.0, 15.0, 15.0)
    assert rows["SegFormer-B2"]["x_segformer_b2_2"] == 1.0 and b2["setting"] == "s"


def test_settings_and_the_neighbours_environment(monkeypatch):
    assert contention.settings([100]) == {"libgomp default": {}, "GOMP_SPINCOUNT=100": {"GOMP_SPINCOUNT": "100"},
                                          "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"}}
    # what hsmla-med set itself is not the environment the user gave it
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    monkeypatch.setenv("SOME_USER_VARIABLE", "1")
    monkeypatch.setattr(runtime, "APPLIED", {"GOMP_SPINCOUNT": "10000"})
    given = contention._given_environment()
    assert "GOMP_SPINCOUNT" not in given and given["SOME_USER_VARIABLE"] == "1"
