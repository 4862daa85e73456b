"""The size, writing time and browser render time of the HTML report of a large evaluation
(issue 53): 250 cases of 13 classes as summary.json and metrics_per_case.csv, without and with 15
large noise overlays (the worst case for compression), and 250 real volume pairs scored by
``evaluate_folder`` (whose page holds the four worst cases as pictures); 3 runs each.

Render time: the page's ``load`` event in headless Chromium (navigation timing's
``loadEventStart``: parsing, layout, every inlined image decoded), read by the harness of
``tests/browser.py``, which also checks that no error was logged and every image decoded.

    PYTHONPATH=. .venv/bin/python scripts/bench_report.py
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from hsmla_med.evaluation import evaluate_folder
from hsmla_med.report import write_report
from tests.browser import chromium, load_page
from tests.test_report import _evaluation, _png
from tests.test_report_worst import _dataset

CASES = 250


def _tables(folder: Path, pictures: int) -> None:
    _evaluation(folder, cases=CASES, classes={k: f"organ_{k}" for k in range(1, 14)})
    for i in range(pictures):
        _png(folder / "heatmaps" / f"slide_{i:02d}_overlay.png", size=(1500, 1000), noise=True)


def _volumes(folder: Path) -> None:
    _dataset(folder / "data", {f"case{i:03d}": (37 * i) % 500 for i in range(CASES)})
    evaluate_folder(folder / "data" / "predictions", folder / "data" / "labelsTr", None, folder, 2.0)


def main() -> None:
    kinds = {"250 cases x 13 classes (summary.json, metrics_per_case.csv)": lambda d: _tables(d, 0),
             "the same + 15 overlays of 1500 x 1000 noise": lambda d: _tables(d, 15),
             "250 volume pairs scored by evaluate_folder (4 worst-case pictures)": _volumes}
    browser = chromium()
    for name, make in kinds.items():
        writes, renders, size, images = [], [], 0, 0
        for _ in range(3):
            with tempfile.TemporaryDirectory() as d:
                folder = Path(d) / "eval"
                folder.mkdir()
                make(folder)
                start = time.perf_counter()
                page = write_report(folder)
                writes.append(time.perf_counter() - start)
                size = page.stat().st_size
                if browser is not None:
                    found = load_page(page, Path(d) / "browser")
                    assert not found["errors"] and not found["broken"], found
                    renders.append(found["load_ms"] / 1000)
                    images = found["images"]
        render = ", ".join(f"{t:.2f}" for t in renders) if renders else "no browser"
        print(f"{name}: {size / 1e6:.2f} MB, {images} images; write {', '.join(f'{t:.2f}' for t in writes)} s; render {render} s")


if __name__ == "__main__":
    main()
