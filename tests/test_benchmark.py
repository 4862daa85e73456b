"""The benchmark's arithmetic (its figures are recorded in docs/benchmarks.md, never asserted)."""

import pytest
import torch

from hsmla_med import benchmark


def test_model_table_ratios_on_a_fake_clock(monkeypatch):
    """The network table's speed-ups and the B2 variants' per-round ratio to refinement off,
    with models that advance a fake clock by fixed amounts (no timing of real work)."""
    clock = [0.0]

    class Fake(torch.nn.Module):
        def __init__(self, seconds):
            super().__init__()
            self.seconds = seconds
            self.weight = torch.nn.Parameter(torch.zeros(3))

        def forward(self, x):
            clock[0] += self.seconds
            return x

    costs = {"HSMLA-B2": 0.011, "HSMLA-B2 (refinement off)": 0.010, "HSMLA-B2 (alpha = 1)": 0.013, "HSMLA-B2 (paper head, stride 8)": 0.012, "SegFormer-B2": 0.1}
    monkeypatch.setattr(benchmark, "build_models", lambda x: {n: (lambda c=c: Fake(c)) for n, c in costs.items()})
    monkeypatch.setattr(benchmark.time, "perf_counter", lambda: clock[0])
    rows = {r["model"]: r for r in benchmark.bench_models(size=8, runs=3)}
    assert rows["HSMLA-B2"]["latency_ms"] == pytest.approx(11.0)
    assert rows["HSMLA-B2"]["speedup_vs_segformer_b2"] == pytest.approx(100 / 11)
    assert rows["HSMLA-B2"]["b2_vs_refinement_off"] == pytest.approx(1.1)
    assert rows["HSMLA-B2 (alpha = 1)"]["b2_vs_refinement_off"] == pytest.approx(1.3)
    assert rows["SegFormer-B2"]["b2_vs_refinement_off"] == ""
    assert rows["HSMLA-B2 (paper head, stride 8)"]["b2_vs_refinement_off"] == ""


def test_bench_models_script_is_the_benchmark():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "bench_models.py"
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--only" in done.stdout and "SegFormer" in done.stdout
