"""``hsmla_med.report``: the HTML report of a run or evaluation folder is written atomically,
opens without a network (every image a ``data:`` URI that PIL decodes), shows each number of its
files exactly (``data-value``), sorts its tables by a click, refuses a folder with nothing to show
in one line, and stays under 10 MB for a large evaluation."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from PIL import Image

from hsmla_med.bench.report import write_evaluation as _evaluation
from hsmla_med.bench.report import write_png as _png
from hsmla_med.errors import DataError, InputError
from hsmla_med.io import is_temporary
from hsmla_med.report import REPORT_FILE, write_report
from hsmla_med.report.browser import chromium, load_page
from hsmla_med.report.figures import MAX_WIDTH
from hsmla_med.report.inputs import LOOKED_FOR
from tests.browser import check_page


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
    # the curves show the logged learning rate, and say what schedule it follows
    assert "The learning-rate panel: lr-AdamW, the rate the optimizer used at each logged step; the schedule: a linear warm-up" in document
    assert 'Dice (mean over the foreground classes) <b><span class=value data-value="0.75">0.75</span></b>, no interval: one validation' in document


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


def test_the_page_opens_with_the_answer(tmp_path):
    """An evaluation: before any table, the main score (summary.json's foreground mean Dice)
    with its bootstrap interval and the number of cases, the worst case with its mean Dice, and
    whether the probabilities are calibrated; then the sections, each named for a question."""
    summary = _evaluation(tmp_path)
    document = write_report(tmp_path).read_text()
    start = document.index('<section id="answer">')
    answer = document[start:document.index("</section>", start)]
    assert start < document.index("<table")
    low, high = summary["ci95"]["foreground_mean"]["Dice"]
    assert f'Dice (mean over the foreground classes) <b><span class=value data-value="{summary["foreground_mean"]["Dice"]!r}">' in answer
    assert f'95% bootstrap interval <span class=value data-value="{low!r}">' in answer and f'data-value="{high!r}"' in answer
    assert 'over <span class=value data-value="3">3</span> cases' in answer
    cases = Page(document).table("case")
    worst = next(iter(cases))  # the case table's first: the lowest mean Dice
    assert f'{worst}: mean Dice <b><span class=value data-value="{cases[worst]["mean Dice"]}">' in answer
    assert "not calibrated (hsmla-med calibrate fits a temperature)" in answer
    (tmp_path / "calibration.json").write_text(json.dumps({"before": {"ece": 0.125}, "after": {"ece": 0.0625}}))
    document = write_report(tmp_path).read_text()
    assert 'yes, by temperature scaling: ECE <span class=value data-value="0.125">0.125</span> before, <b><span class=value ' \
           'data-value="0.0625">0.0625</span></b> after' in document
    assert re.findall(r"<h2>(.*?)</h2>", document) == ["In short", "How good is it?", "Where does it fail?", "Can the probabilities be trusted?",
                                                        "Where does the gate look?", "What produced these results?"]
    assert re.findall(r"<h3>(.*?)</h3>", document) == ["Every case, worst first", "Provenance"]


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
    # other JSON beside them is no slide record, whatever it holds (train's splits_final.json is a list)
    (tmp_path / "splits_final.json").write_text(json.dumps([{"train": ["tumor_001"], "val": ["normal_002"]}]))
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
    # LUNA16's answer: the CPM (no band for it in this summary) over its scans, the scan of most nodules missed
    assert 'CPM (mean sensitivity at 1/8 to 8 false positives per scan) <b><span class=value data-value="0.5">0.5</span></b>, ' \
           'no interval recorded over <span class=value data-value="2">2</span> scans' in document
    assert '1.2.3: <b><span class=value data-value="1">1</span></b> of <span class=value data-value="2">2</span> nodules missed, ' \
           '<span class=value data-value="3">3</span> false positives' in document


def _checkpoint(path: Path, step: int, **hparams) -> Path:
    """A checkpoint as train writes one (torch.save of a dict), its hyper-parameters ``hparams``."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"hyper_parameters": {"task": "btcv", **hparams}, "state_dict": {}, "epoch": 0, "global_step": step}, path)
    return path


def test_provenance_of_an_evaluation(tmp_path, monkeypatch):
    """``evaluate --checkpoint`` records the name as given, here relative: the report finds it
    against the working folder (command.json's ``cwd`` where recorded, else the report's own,
    the command's where it writes its report at its end) and shows its sha256, the split, data
    fingerprint and calibration it records, the fingerprint file's sha256, and the versions of
    command.json. A file that no longer holds the evaluated step is said to be another."""
    root = tmp_path.resolve()
    fingerprint = root / "data" / "dataset_fingerprint.json"
    fingerprint.parent.mkdir()
    fingerprint.write_text('{"version": 1}')
    split = {"file": str(root / "data" / "splits_final.json"), "fold": 0}
    calibration = {"temperature": [1.5], "ece_before": 0.25, "ece_after": 0.0625}
    checkpoint = _checkpoint(root / "runs" / "best.ckpt", 40, split=split, plan={"fingerprint": str(fingerprint)}, calibration=calibration)
    folder = root / "eval"
    folder.mkdir()
    metrics = {"dice": 0.5, "cases": 2, "ece": 0.125, "epoch": 0, "step": 40, "checkpoint": "runs/best.ckpt", "routing": "gate"}
    (folder / "metrics.json").write_text(json.dumps(metrics))
    versions = {"python": "3.11.7", "hsmla-med": "0.1.0", "torch": "2.5.1", "monai": "1.4.0", "lightning": "2.4.0", "numpy": None}
    command = {"command": "hsmla-med evaluate --checkpoint runs/best.ckpt --output eval", "versions": versions}
    (folder / "command.json").write_text(json.dumps(command))
    digest = {"entry": "sha256 (of the file now)", "value": hashlib.sha256(checkpoint.read_bytes()).hexdigest()}
    fingerprinted = {"entry": "sha256 (of the file now)", "value": hashlib.sha256(fingerprint.read_bytes()).hexdigest()}
    monkeypatch.chdir(root)
    page = _report(folder)
    provenance = page.rows("what the folder records of its origin")
    assert {"file": str(checkpoint), **digest} in provenance
    assert {"file": str(checkpoint), "entry": "recorded in the checkpoint: plan.fingerprint", "value": str(fingerprint)} in provenance
    assert {"file": str(checkpoint), "entry": "recorded in the checkpoint: split.fold", "value": "0"} in provenance
    assert {"file": str(fingerprint), **fingerprinted} in provenance
    assert {r["package"]: r["version"] for r in page.rows("command.json: the versions that ran the command")} == \
        {k: "" if v is None else v for k, v in versions.items()}
    document = (folder / REPORT_FILE).read_text()
    assert f"runs/best.ckpt: a relative name, resolved against the folder this report was written from ({root})" in document
    assert "yes, runs/best.ckpt carries a fitted temperature" in document and 'data-value="0.125">0.125</span></b> as evaluated' in document
    assert "not the file that was evaluated" not in document and "records no data fingerprint" not in document
    # the working folder recorded: found from anywhere
    (folder / "command.json").write_text(json.dumps({**command, "cwd": str(root)}))
    monkeypatch.chdir(folder)
    page = _report(folder)
    assert {"file": str(checkpoint), **digest} in page.rows("what the folder records of its origin")
    assert f"resolved against the command&#x27;s working folder {root} (command.json)" in (folder / REPORT_FILE).read_text()
    # another file there now, of another step and with no plan: said so
    _checkpoint(checkpoint, 50, split=split)
    document = write_report(folder).read_text()
    assert "now holds the weights of step 50, the evaluated checkpoint those of step 40: not the file that was evaluated" in document
    assert "runs/best.ckpt records no data fingerprint" in document
    # what evaluate may record itself: shown as written, the fingerprint file hashed
    (folder / "metrics.json").write_text(json.dumps({**metrics, "checkpoint_sha256": "ab" * 32, "fingerprint": str(fingerprint)}))
    provenance = _report(folder).rows("what the folder records of its origin")
    assert {"file": "metrics.json", "entry": "checkpoint_sha256", "value": "ab" * 32} in provenance
    assert {"file": "metrics.json", "entry": "fingerprint", "value": str(fingerprint)} in provenance
    assert {"file": str(fingerprint), **fingerprinted} in provenance


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
