"""The size and writing time of the HTML report of a large evaluation (issue 53): 250 cases of 13
classes, without and with 15 large noise overlays (the worst case for compression), 3 runs each.

    PYTHONPATH=. .venv/bin/python scripts/bench_report.py
"""
import time, tempfile, statistics
from pathlib import Path
from tests.test_report import _evaluation, _png
from hsmla_med.report import write_report
for pictures in (0, 15):
    times, sizes = [], []
    for run in range(3):
        with tempfile.TemporaryDirectory() as d:
            d = Path(d)
            _evaluation(d, cases=250, classes={k: f"organ_{k}" for k in range(1, 14)})
            for i in range(pictures):
                _png(d / "heatmaps" / f"slide_{i:02d}_overlay.png", size=(1500, 1000), noise=True)
            t = time.perf_counter(); path = write_report(d); times.append(time.perf_counter() - t); sizes.append(path.stat().st_size)
    print(f"250 cases x 13 classes, {pictures} overlays: {sizes[0]/1e6:.2f} MB, write {', '.join(f'{t:.2f}' for t in times)} s")
