"""``hsmla_med.report``: the HTML report of a run or evaluation folder is written atomically,
opens without a network (every image a ``data:`` URI that PIL decodes), shows each number of its
files exactly (``data-value``), sorts its tables by a click, refuses a folder with nothing to show
in one line, and stays under 10 MB for a large evaluation."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import math
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from PIL import Image

from hsmla_med.errors import DataError, InputError
from hsmla_med.io import is_temporary
from hsmla_med.metrics.summary import summarize_cases, write_reports
from hsmla_med.report import REPORT_FILE, write_report
from hsmla_med.report.figures import MAX_WIDTH
from hsmla_med.report.inputs import LOOKED_FOR
from tests.browser import check_page, chromium, load_page

CLASSES = {1: "liver", 2: "spleen"}


class Page(HTMLParser):
    """The parts of a report a test reads: its tables (header names; per row the cells'
    ``data-value`` and text), every ``src``/``href``, the header attributes."""

    def __init__(self, document: str) -> None:
        super().__init__()
        self.tables, self.links, self.images, self.headers = [], [], [], []
        self._cell = None
        self.feed(document)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.links += [attrs[k] for k in ("src", "href") if k in attrs]
        if tag == "img":
            self.images.append(attrs["src"])
        elif tag == "table":
            self.tables.append({"caption": "", "columns": [], "rows": []})
        elif tag == "caption":
            self._cell = ["caption", ""]
        elif tag == "th":
            self.headers.append(attrs)
            self._cell = ["th", ""]
        elif tag == "tr" and self.tables:
            self._row = []
        elif tag == "td":
            self._cell = [attrs["data-value"], ""]

    def handle_data(self, data):
        if self._cell is not None:
            self._cell[1] += data

    def handle_endtag(self, tag):
        if tag == "caption":
            self.tables[-1]["caption"] = self._cell[1]
        elif tag == "th":
            self.tables[-1]["columns"].append(self._cell[1])
        elif tag == "td":
            self._row.append(tuple(self._cell))
        elif tag == "tr" and self._row:
            self.tables[-1]["rows"].append(self._row)
        if tag in ("caption", "th", "td"):
            self._cell = None

    def rows(self, caption: str) -> list[dict[str, str]]:
        """The rows of the table with ``caption``, as column -> data-value."""
        found = next(t for t in self.tables if t["caption"] == caption)
        return [dict(zip(found["columns"], (value for value, _ in row), strict=True)) for row in found["rows"]]

    def table(self, first: str, columns: list[str] | None = None) -> dict[str, dict[str, str]]:
        """The first table whose first column is ``first`` (and that has ``columns``), as row
        name -> column -> data-value."""
        found = next(t for t in self.tables if t["columns"][:1] == [first] and all(c in t["columns"] for c in columns or []))
        return {row[0][0]: dict(zip(found["columns"], (value for value, _ in row), strict=True)) for row in found["rows"]}


def _png(path: Path, size=(24, 16), noise: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8) if noise else np.full((size[1], size[0], 3), 200, np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def _case_metrics(rng: np.random.Generator, classes: dict, absent: bool = False) -> dict:
    """A case's per-class metrics as :func:`~hsmla_med.metrics.summary.case_metrics` gives them;
    ``absent``: the last class in neither the reference nor the prediction (NaN scores)."""
    out = {}
    for k in classes:
        dice = math.nan if absent and k == max(classes) else float(rng.uniform(0.4, 0.95))
        out[k] = {"Dice": dice, "IoU": dice / (2 - dice), "HD95": math.nan if math.isnan(dice) else float(rng.uniform(1, 30)),
                  "NSD": math.nan if math.isnan(dice) else float(rng.uniform(0.3, 1)), "TP": 10, "FP": 2, "FN": 3, "TN": 100,
                  "n_pred": 12, "n_ref": 13}
    return out


def _evaluation(folder: Path, cases: int = 3, classes: dict = CLASSES) -> dict:
    """``summary.json`` and ``metrics_per_case.csv`` as ``evaluate`` writes them (the real
    writer), the second case missing the last class (null scores), plus ``metrics.json``."""
    rng = np.random.default_rng(1)
    scored = [{"reference_file": f"/data/labelsTr/case{i:03d}.nii.gz", "prediction_file": f"/out/validation/case{i:03d}.nii.gz",
               "metrics": _case_metrics(rng, classes, absent=i == 1)} for i in range(cases)]
    summary = summarize_cases(scored, list(classes), classes, draws=200, nsd_tolerance_mm=2.0)
    write_reports(summary, folder)
    (folder / "metrics.json").write_text(json.dumps({"dice": 0.75, "dice_per_class": {"liver": 0.8, "spleen": 0.7}, "cases": cases,
                                                     "checkpoint": "/runs/btcv/best.ckpt", "routing": "gate"}))
    return json.loads((folder / "summary.json").read_text())


def _training_run(folder: Path) -> None:
    """A run folder as ``train`` leaves it: the CSV logger's file (two epochs), metrics.json,
    config.yaml, plans.json, a checkpoint."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.csv").write_text(
        "epoch,step,lr-AdamW,train/gate_budget,train/loss,val/dice,val/dice_liver\n"
        "0,4,0.001,0.5,1.25,,\n0,4,,,,0.5,0.625\n1,9,0.0005,0.25,0.75,,\n1,9,,,,0.75,0.8125\n")
    (folder / "metrics.json").write_text(json.dumps({"dice": 0.75, "dice_per_class": {"liver": 0.8125}, "epoch": 1, "step": 9}))
    (folder / "config.yaml").write_text(yaml.safe_dump({"task": "btcv", "seed": 0, "inference": {"target_alpha": 0.3}}))
    (folder / "plans.json").write_text(json.dumps({"values": {"norm": "batch"}, "fingerprint": "/data/dataset_fingerprint.json"}))
    (folder / "best.ckpt").write_bytes(b"weights")


def _report(folder: Path, output: Path | None = None) -> Page:
    path = write_report(folder, output)
    return Page(path.read_text(encoding="utf-8"))


def test_written_atomically_and_self_contained(tmp_path):
    _training_run(tmp_path / "run")
    _png(tmp_path / "run" / "training_curve.png")
    path = write_report(tmp_path / "run")
    assert path == tmp_path / "run" / REPORT_FILE
    assert not [p for p in (tmp_path / "run").iterdir() if is_temporary(p)]
    elsewhere = write_report(tmp_path / "run", tmp_path / "out" / "run.html")  # its folder is made
    assert elsewhere.read_text() == path.read_text()  # no date: the same folder gives the same page
    page = Page(path.read_text(encoding="utf-8"))
    assert page.images and not [link for link in page.links if link.startswith(("http://", "https://", "//"))]
    for uri in page.images:
        head, data = uri.split(",", 1)
        assert head in ("data:image/png;base64", "data:image/jpeg;base64")
        Image.open(io.BytesIO(base64.b64decode(data))).verify()
    document = path.read_text()
    assert "<script src" not in document and "<link" not in document
    assert "config.yaml" in document and "plans.json" in document
    provenance = page.rows("what the folder records of its origin")
    assert {"file": str(tmp_path / "run" / "best.ckpt"), "entry": "sha256 (of the file now)",
            "value": hashlib.sha256(b"weights").hexdigest()} in provenance
    assert {"file": "plans.json", "entry": "fingerprint", "value": "/data/dataset_fingerprint.json"} in provenance


def test_values_exact(tmp_path):
    summary = _evaluation(tmp_path)
    (tmp_path / "calibration.json").write_text(json.dumps({"temperature": [1.25], "before": {"ece": 0.1, "brier": 0.2, "nll": 0.3},
                                                           "after": {"ece": 0.05, "brier": 0.19, "nll": 0.28}}))
    _png(tmp_path / "reliability.png")
    page = _report(tmp_path)
    cases = page.table("case")
    assert len(cases) == 3
    for case in summary["metric_per_case"]:
        row = cases[Path(case["prediction_file"]).name]
        for key, metrics in case["metrics"].items():
            for score in ("Dice", "HD95", "NSD"):
                value = row[f"{score} {summary['labels'][key]}"]
                assert (value == "") if metrics[score] is None else float(value) == metrics[score]
    means = page.table("class", ["Dice CI low"])
    for key, name in summary["labels"].items():
        assert float(means[name]["Dice"]) == summary["mean"][key]["Dice"]
        assert [float(means[name]["HD95 CI low"]), float(means[name]["HD95 CI high"])] == summary["ci95"]["mean"][key]["HD95"]
    assert float(means["foreground mean"]["NSD"]) == summary["foreground_mean"]["NSD"]
    calibration = page.table("metric", ["before", "after"])
    expected = {"ece": (0.1, 0.05), "brier": (0.2, 0.19), "nll": (0.3, 0.28)}
    assert {k: (float(v["before"]), float(v["after"])) for k, v in calibration.items()} == expected
    assert len(page.images) == 4  # reliability.png and the Dice, HD95, NSD box plots


def test_table_from_csv_alone(tmp_path):
    """Without summary.json, metrics_per_case.csv's values (nan: no value)."""
    summary = _evaluation(tmp_path)
    (tmp_path / "summary.json").unlink()
    cases = _report(tmp_path).table("case")
    for case in summary["metric_per_case"]:
        for key, metrics in case["metrics"].items():
            value = cases[Path(case["prediction_file"]).name][f"Dice {summary['labels'][key]}"]
            assert (value == "") if metrics["Dice"] is None else float(value) == metrics["Dice"]


def test_sortable_worst_first(tmp_path):
    _evaluation(tmp_path)
    page = _report(tmp_path)
    document = (tmp_path / REPORT_FILE).read_text()
    assert 'querySelectorAll("th[data-sort]")' in document and "addEventListener(\"click\"" in document
    assert page.headers and all("data-sort" in h for h in page.headers)
    assert [h for h in page.headers if h.get("data-order") == "asc"]  # the case table's order, marked
    found = next(t for t in page.tables if "mean Dice" in t["columns"])
    means = [float(row[found["columns"].index("mean Dice")][0]) for row in found["rows"]]
    assert means == sorted(means)


def test_nothing_to_report(tmp_path):
    (tmp_path / "notes.txt").write_text("not a run")
    with pytest.raises(InputError) as err:
        write_report(tmp_path)
    message = str(err.value)
    assert "\n" not in message and str(tmp_path) in message and LOOKED_FOR in message and "summary.json" in message
    assert not (tmp_path / REPORT_FILE).exists()
    with pytest.raises(InputError, match="not a folder"):
        write_report(tmp_path / "missing")
    (tmp_path / "metrics.json").write_text("{broken")
    with pytest.raises(DataError, match="metrics.json: not readable as JSON"):
        write_report(tmp_path)


def test_slides_froc_gate(tmp_path):
    """A heatmap folder (wsi-heatmap's <slide>.json, overlays, gates) and a LUNA16 summary."""
    predictions = tmp_path / "predictions"
    for name, alpha in (("tumor_001", 0.25), ("normal_002", 0.125)):
        _png(predictions / f"{name}_overlay.png")
        _png(predictions / f"{name}_gates.png")
        (predictions / f"{name}.json").write_text(json.dumps({"slide": f"/slides/{name}.tif", "score": 0.5, "detections": 1,
                                                              "patches": 40, "mean_alpha": alpha}))
    (predictions / "broken_gates.png").write_bytes(b"not a png")  # named in the page, not shown
    (tmp_path / "summary.json").write_text(json.dumps({
        "task": "luna16", "cpm": 0.5, "froc": {"0.125": 0.25, "1": 0.5, "8": 0.75},
        "bootstrap": {"froc": {"0.125": {"mean": 0.25, "low": 0.1, "high": 0.4}, "1": {"mean": 0.5, "low": 0.3, "high": 0.7},
                               "8": {"mean": 0.75, "low": 0.5, "high": 0.9}}},
        "metric_per_case": [{"seriesuid": "1.2.3", "nodules": 2, "TP": 1, "FP": 3, "ignored": 0},
                            {"seriesuid": "1.2.4", "nodules": 1, "TP": 1, "FP": 0, "ignored": 1}]}))
    page = _report(tmp_path)
    slides = page.table("slide")
    assert {k: float(v["mean_alpha"]) for k, v in slides.items()} == {"tumor_001.tif": 0.25, "normal_002.tif": 0.125}
    scans = page.table("case")
    assert list(scans) == ["1.2.3", "1.2.4"] and scans["1.2.3"]["FP"] == "3"  # the file's order: no Dice to order by
    document = (tmp_path / REPORT_FILE).read_text()
    assert 'id="froc"' in document and 'id="gate"' in document and "predictions/tumor_001_gates.png" in document
    assert "predictions/broken_gates.png: not readable as an image" in document
    assert len(page.images) == 5  # 2 overlays, the FROC, 2 gate pictures


def test_crossval_folder(tmp_path):
    """cross-validate's root: the folds of crossval.json and the pooled crossval/summary.json."""
    (tmp_path / "crossval").mkdir()
    summary = _evaluation(tmp_path / "crossval")
    (tmp_path / "crossval" / "metrics.json").unlink()
    (tmp_path / "crossval.json").write_text(json.dumps({"task": "btcv", "seconds": 10.5, "folds": [
        {"fold": 0, "cases": ["a", "b"], "validation": {"dice": 0.625}, "seconds": 5.25},
        {"fold": 1, "cases": ["c"], "skipped": True}]}))
    page = _report(tmp_path)
    folds = page.table("fold")
    assert folds["0"]["dice"] == "0.625" and folds["1"]["done before"] == "true"
    assert len(page.table("case")) == len(summary["metric_per_case"])


def test_folders_of_the_real_writers(tmp_path):
    """A run folder as train's MetricsWriter leaves it (metrics.json, metrics.csv of two
    validations, per-class columns) with wsi-heatmap's pictures: curves grouped per metric, the
    per-class scores exact, every picture inlined."""
    from hsmla_med.engine.callbacks import MetricsWriter
    from hsmla_med.io.overlays import gate_overlay, heatmap_overlay

    writer = MetricsWriter(tmp_path)
    summaries = [{"dice": 0.5, "dice_per_class": {"liver": 0.625, "spleen": 0.375}, "cases": 2},
                 {"dice": 0.7, "dice_per_class": {"liver": 0.8, "spleen": 0.6}, "cases": 2}]
    for step, summary in zip((5, 10), summaries):
        trainer = SimpleNamespace(sanity_checking=False, is_global_zero=True, current_epoch=step // 5, global_step=step)
        writer.on_validation_end(trainer, SimpleNamespace(summary=summary))
    rng = np.random.default_rng(0)
    thumbnail = rng.integers(150, 256, (60, 80, 3), dtype=np.uint8)
    heatmap_overlay(tmp_path / "predictions" / "s1_overlay.png", thumbnail, rng.uniform(0, 1, (6, 8)), "s1")
    gate_overlay(tmp_path / "predictions" / "s1_gates.png", thumbnail, rng.uniform(0, 1, (6, 8)), "s1")
    page = _report(tmp_path)
    per_class = page.table("class", ["dice"])
    assert {k: float(v["dice"]) for k, v in per_class.items()} == summaries[-1]["dice_per_class"]
    assert len(page.images) == 3  # the curves (dice with dice_liver and dice_spleen), the overlay, the gates


def test_large_evaluation_under_10_mb(tmp_path):
    """250 cases of 13 classes and 15 large overlay pictures (noise, which compresses worst):
    the images are downscaled and capped, the page stays under 10 MB."""
    classes = {k: f"organ_{k}" for k in range(1, 14)}
    _evaluation(tmp_path, cases=250, classes=classes)
    for i in range(15):
        _png(tmp_path / "heatmaps" / f"slide_{i:02d}_overlay.png", size=(1500, 1000), noise=True)
    page = _report(tmp_path)
    size = (tmp_path / REPORT_FILE).stat().st_size
    assert size < 10_000_000, size
    assert len(page.table("case")) == 250
    for uri in page.images:
        assert Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))).width <= MAX_WIDTH
    assert "3 more *_overlay.png in the folder, not shown" in (tmp_path / REPORT_FILE).read_text()


# A stand-in for the few DOM calls the sorting script makes: a table of header cells and rows of
# cells with data-value, whose order is printed after each click.
_SORT_HARNESS = """
const cell = (attrs) => ({attrs, getAttribute(k) { return k in this.attrs ? this.attrs[k] : null; },
  setAttribute(k, v) { this.attrs[k] = String(v); }, removeAttribute(k) { delete this.attrs[k]; }});
const body = {rows: JSON.parse(process.argv[1]).map(r => ({cells: r.map(v => cell({"data-value": v}))})),
  appendChild(row) { this.rows.splice(this.rows.indexOf(row), 1); this.rows.push(row); }};
const heads = [0, 1].map(i => Object.assign(cell({"data-sort": ""}), {cellIndex: i, addEventListener(type, f) { this.click = f; }}));
const table = {tBodies: [body], querySelectorAll: () => heads};
heads.forEach(h => { h.closest = () => table; });
globalThis.document = {querySelectorAll: () => heads};
eval(require("fs").readFileSync(0, "utf8"));
for (const i of [1, 1, 0]) { heads[i].click(); console.log(body.rows.map(r => r.cells[0].getAttribute("data-value")).join("")); }
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="no Node.js to run the sorting script in")
def test_sort_script_sorts(tmp_path):
    """The page's script, run in Node on a stand-in DOM: numbers sort as numbers, a second click
    reverses, empty cells stay last both ways, text sorts as text."""
    _evaluation(tmp_path)
    document = write_report(tmp_path).read_text()
    script = document[document.rindex("<script>") + len("<script>"): document.rindex("</script>")]
    rows = [["a", "3"], ["b", ""], ["c", "10"], ["d", "2.5"]]
    done = subprocess.run(["node", "-e", _SORT_HARNESS, json.dumps(rows)], input=script, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["dacb", "cadb", "abcd"]


@pytest.mark.skipif(chromium() is None, reason="no headless browser that starts: neither chromium nor chromium-browser on the PATH, "
                    "nor Playwright's Chromium in ~/.cache/ms-playwright")
def test_page_loads_in_a_browser(tmp_path):
    """An evaluation's page in Chromium: no console error, every image decoded, the case table
    sorted both ways by clicks; and the harness itself sees a script error and a broken image."""
    _evaluation(tmp_path / "eval", cases=12)
    found = check_page(write_report(tmp_path / "eval"), tmp_path / "browser")
    assert found["images"] == 3 and found["sorted"]["values"] == 12  # the box plots of Dice, HD95, NSD; the mean Dice of 12 cases
    broken = tmp_path / "broken.html"
    broken.write_text('<!DOCTYPE html><html><head></head><body><img alt="bad" src="data:image/png;base64,AAAA">'
                      "<script>undefined_function()</script></body></html>")
    found = load_page(broken, tmp_path / "browser")
    assert found["broken"] == ["bad"] and any("undefined_function" in e for e in found["errors"])
