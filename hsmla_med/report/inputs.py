"""What a report reads from a folder that hsmla-med wrote, and the per-case tables it makes of it.

The files, by the command that writes them:

* ``train`` (and each ``fold_K`` of ``cross-validate``): ``config.yaml``, ``plans.json``,
  ``metrics.json`` (the last validation), ``metrics.csv`` (one row per validation),
  ``logs/version_N/metrics.csv`` and ``hparams.yaml`` (Lightning's CSV logger: ``train/loss``,
  ``train/gate_*``, ``val/*``, and ``lr-AdamW``, the learning rate of each logged step, in runs
  since the trainer logs it), ``*.ckpt``,
  ``validation_gates.png`` (also of ``evaluate --checkpoint``: the tiles each gated layer refined for one input);
* ``evaluate``: ``metrics.json`` (with ``checkpoint`` and ``routing``), ``summary.json`` (a
  ``metric_per_case`` list: nnU-Net's per class ``metrics`` for btcv and endovis, a flat row
  per slide or scan for camelyon16 and luna16; ``mean`` and bootstrap ``ci95`` where the task
  has them), ``metrics_per_case.csv`` (a row per case and class), ``froc.png`` (luna16);
* ``calibrate``: ``calibration.json``, ``reliability.png``;
* ``cross-validate``: ``crossval.json``, ``crossval/summary.json``;
* ``infer --uncertainty``: ``uncertainty.csv`` (the review queue), ``uncertainty/<case>_uncertainty.nii.gz``;
* ``infer`` and ``wsi-heatmap``: ``provenance.json``, ``<slide>.json``, ``<slide>_overlay.png``,
  ``<slide>_gates.png`` (also one folder down, e.g. a demo's ``predictions``).

A file that is there but cannot be read is a :class:`~hsmla_med.errors.DataError` naming it; a
file that is not there leaves its part of the report out.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from hsmla_med.errors import DataError, InputError
from hsmla_med.defaults import REVIEW_QUEUE
from hsmla_med.io import is_temporary
from hsmla_med.report.page import Value

__all__ = ["CaseTable", "Folder", "LOOKED_FOR", "MEAN_DICE", "PROVENANCE", "cases_from_rows", "flatten", "mean_dice", "read_folder"]

#: the JSON documents read, by path relative to the folder
PROVENANCE = "provenance.json"  # of infer's and wsi-heatmap's outputs
JSON_FILES = ("metrics.json", "summary.json", "calibration.json", "crossval.json", "crossval/summary.json", PROVENANCE, "plans.json",
              "command.json")  # command.json: the command line and versions of train, evaluate, calibrate, cross-validate
#: single figures, looked for in the folder itself
FIGURES = ("training_curve.png", "reliability.png", "froc.png")
#: per-slide figures, looked for in the folder and its subfolders
GALLERIES = ("*_overlay.png", "*_gates.png")
LOOKED_FOR = ", ".join([*JSON_FILES, f"*/{PROVENANCE}", "metrics.csv", "logs/version_*/metrics.csv", "metrics_per_case.csv", REVIEW_QUEUE, "config.yaml",
                        *FIGURES, *GALLERIES, "<slide>.json"])

#: the per-class scores a case table shows (IoU and the voxel counts stay in the files)
SCORES = ("Dice", "HD95", "NSD")
#: per-case entries naming files: the case's name is taken from them, they are no columns
FILE_KEYS = {"reference_file", "prediction_file", "slide_file", "label_files", "scan_file"}
NAME_KEYS = ("case", "slide", "seriesuid")
MEAN_DICE = "mean Dice"  # the column computed here, by which cases are ordered
#: keys of a ``wsi-heatmap`` ``<slide>.json`` record
SLIDE_KEYS = {"slide", "score", "patches"}
#: lists longer than this are summarised, not listed
MAX_LIST = 20


@dataclass
class CaseTable:
    """Per-case values: ``rows`` of (case name, values in ``columns`` order), from ``source``,
    ordered by the column ``sorted_by`` (ascending; ``None``: the file's order); ``per_class``:
    score -> class name -> the cases' values (nulls left out), for the plots."""

    source: str
    columns: list[str]
    rows: list[tuple[str, list[Value]]]
    sorted_by: str | None = None
    per_class: dict[str, dict[str, list[float]]] = field(default_factory=dict)


@dataclass
class Folder:
    """The readable contents of a report's folder (see the module docstring)."""

    path: Path
    docs: dict[str, dict]
    curves: list[dict[str, float]]
    curve_files: list[Path]
    config: tuple[str, str] | None
    cases: CaseTable | None
    slides: CaseTable | None
    queue: CaseTable | None  # infer --uncertainty's review queue, most uncertain first
    figures: dict[str, Path]
    galleries: dict[str, list[Path]]
    checkpoints: list[Path]

    @property
    def summary(self) -> tuple[str, dict] | None:
        return _summary(self.docs)


def _summary(docs: dict[str, dict]) -> tuple[str, dict] | None:
    """The per-case summary and its name: an evaluation's, else a cross-validation's pooled one."""
    return next(((name, docs[name]) for name in ("summary.json", "crossval/summary.json") if name in docs), None)


def _visible(path: Path, folder: Path) -> bool:
    """Not a hidden file or folder (``.provenance`` records) nor an unfinished temporary."""
    return not any(part.startswith(".") for part in path.relative_to(folder).parts) and not is_temporary(path)


def _read_json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise DataError(f"{path}: not readable as JSON ({err})") from None
    if not isinstance(doc, dict):
        raise DataError(f"{path}: a JSON {type(doc).__name__}, not the object hsmla-med writes")
    return doc


def _number(value: str) -> Value:
    """A CSV cell: an int or float where it is one (``nan`` and empty: none, as JSON's null), else the text."""
    if value is None or value.strip().lower() in ("", "nan"):
        return None
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _read_csv(path: Path, names: tuple[str, ...] = ()) -> list[dict[str, Value]]:
    """The rows of a CSV file, numbers read as such except in the columns ``names`` (kept as
    text: a case ``0011`` is no number)."""
    try:
        with path.open(newline="") as f:
            return [{k: v if k in names else _number(v) for k, v in row.items() if k is not None} for row in csv.DictReader(f)]
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise DataError(f"{path}: not readable as CSV ({err})") from None


def _logged(folder: Path, name: str) -> list[Path]:
    """The CSV logger's files ``name`` in run order (``version_2`` before ``version_10``)."""
    return sorted(folder.glob(f"logs/version_*/{name}"), key=lambda p: (len(p.parent.name), p.parent.name))


def _curves(folder: Path) -> tuple[list[dict[str, float]], list[Path]]:
    """The logged rows and their files: the CSV logger's (in run order: a resumed run adds a
    version), then ``metrics.csv``, whose per-class columns the logger lacks; of a metric that
    both hold (``val/dice`` and ``dice``) the logger's is kept."""
    files = [*_logged(folder, "metrics.csv"), *[p for p in [folder / "metrics.csv"] if p.is_file()]]
    rows: list[dict[str, float]] = []
    for path in files:
        logged = {k for row in rows for k in row}
        rows += [{k: v for k, v in row.items() if isinstance(v, (int, float)) and f"val/{k}" not in logged} for row in _read_csv(path)]
    return rows, files


def _config(folder: Path) -> tuple[str, str] | None:
    """``config.yaml``'s text, else that of the last ``hparams.yaml`` of the CSV logger."""
    found = [folder / "config.yaml"] if (folder / "config.yaml").is_file() else _logged(folder, "hparams.yaml")[-1:]
    for path in found:
        try:
            return str(path.relative_to(folder)), path.read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise DataError(f"{path}: not readable ({err})") from None
    return None


def _scalar(value) -> bool:
    return value is None or isinstance(value, (int, float, str, bool))


def _case_name(row: dict, index: int) -> tuple[str, str | None]:
    """A case's name and the key it came from (no column then)."""
    for key in (*NAME_KEYS, "prediction_file", "reference_file"):
        if isinstance(row.get(key), str):
            return Path(row[key]).name, key
    return f"#{index + 1}", None


def cases_from_rows(rows: list[dict], labels: dict[str, str], source: str) -> CaseTable:
    """The case table of ``summary.json``-style rows: a row's scalars become columns, its
    ``metrics`` (class -> scores) a column per score of :data:`SCORES` and class (named by
    ``labels``), its other dicts a column per entry; file paths and lists are left out. With
    Dice per class, a first column ``mean Dice`` (over the classes with a value) orders the cases,
    lowest first; otherwise they stay in the file's order."""
    plain: dict[str, None] = {}  # ordered sets of column names
    scored: dict[str, dict[str, None]] = {score: {} for score in SCORES}
    nested: dict[str, None] = {}
    per_class: dict[str, dict[str, list[float]]] = {}
    named = []
    for i, row in enumerate(rows):
        name, name_key = _case_name(row, i)
        values: dict[str, Value] = {}
        for key, value in row.items():
            if key == name_key or key in FILE_KEYS:
                continue
            if key == "metrics" and isinstance(value, dict):
                for cls, scores in value.items():
                    label = labels.get(cls, cls)
                    for score in SCORES:
                        if isinstance(scores, dict) and score in scores:
                            column = f"{score} {label}"
                            scored[score][column] = None
                            values[column] = scores[score]
                            if isinstance(scores[score], (int, float)) and math.isfinite(scores[score]):
                                per_class.setdefault(score, {}).setdefault(label, []).append(scores[score])
            elif isinstance(value, dict):
                for k, v in value.items():
                    if _scalar(v):
                        nested[f"{key} {k}"] = None
                        values[f"{key} {k}"] = v
            elif _scalar(value):
                plain[key] = None
                values[key] = value
        named.append((name, values))
    columns = [*plain, *(c for score in SCORES for c in scored[score]), *nested]
    table = [(name, [values.get(c) for c in columns]) for name, values in named]
    if not scored["Dice"]:
        return CaseTable(source, columns, table, None, per_class)
    dice = [columns.index(c) for c in scored["Dice"]]
    table = [(name, [mean_dice([values[i] for i in dice]), *values]) for name, values in table]
    table.sort(key=lambda row: math.inf if row[1][0] is None else row[1][0])  # stable: ties keep the file's order
    return CaseTable(source, [MEAN_DICE, *columns], table, MEAN_DICE, per_class)


def mean_dice(values: list[Value]) -> float | None:
    """The mean of a case's Dice values over the classes with one (``None`` without any): the
    order of the case table, worst first, and of the report's worst cases."""
    present = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return math.fsum(present) / len(present) if present else None


def _cases_from_csv(path: Path) -> CaseTable:
    """The case table of ``metrics_per_case.csv`` (a row per case and class: ``case``,
    ``class``, ``name``, the scores), one row per case."""
    rows = _read_csv(path, names=("case", "class", "name"))
    if rows and not {"case", "class"} <= set(rows[0]):
        raise DataError(f"{path}: no case and class columns (the metrics_per_case.csv of evaluate has them)")
    cases: dict[str, dict] = {}
    for row in rows:
        case = cases.setdefault(row["case"], {"case": row["case"], "metrics": {}})
        case["metrics"][row["class"]] = {score: row[score] for score in SCORES if score in row}
    labels = {row["class"]: row["name"] for row in rows if row.get("name")}
    return cases_from_rows(list(cases.values()), labels, path.name)


def _slides(folder: Path, docs: dict[str, dict]) -> CaseTable | None:
    """The ``<slide>.json`` records of ``wsi-heatmap`` in the folder or one folder down."""
    records, names = [], []
    for path in sorted([*folder.glob("*.json"), *folder.glob("*/*.json")]):
        name = str(path.relative_to(folder))
        if name in docs or not _visible(path, folder):
            continue
        try:
            doc = _read_json(path)
        except DataError:  # not a record of wsi-heatmap's (splits_final.json is a list): no slide of the report
            continue
        if SLIDE_KEYS <= set(doc):
            records.append(doc)
            names.append(name)
    if not records:
        return None
    source = names[0] if len(names) == 1 else f"{len(names)} files <slide>.json"
    return cases_from_rows(records, {}, source)


def read_folder(folder: Path) -> Folder:
    """Read what a report shows from ``folder`` (see the module docstring).

    Raises:
        InputError: ``folder`` is no folder, or holds none of the files looked for (one line
            naming them).
        DataError: a file is there but cannot be read.
    """
    if not folder.is_dir():
        raise InputError(f"{folder}: not a folder")
    docs = {name: _read_json(folder / name) for name in JSON_FILES if (folder / name).is_file()}
    # the provenance of predictions one folder down (a demo's predictions, an evaluation's validation)
    docs.update({str(p.relative_to(folder)): _read_json(p) for p in sorted(folder.glob(f"*/{PROVENANCE}")) if _visible(p, folder)})
    curves, curve_files = _curves(folder)
    source, summary = _summary(docs) or ("", {})
    if isinstance(summary.get("metric_per_case"), list) and summary["metric_per_case"]:
        cases = cases_from_rows([r for r in summary["metric_per_case"] if isinstance(r, dict)], summary.get("labels") or {}, source)
    elif (folder / "metrics_per_case.csv").is_file():
        cases = _cases_from_csv(folder / "metrics_per_case.csv")
    else:
        cases = None
    figures = {name: folder / name for name in FIGURES if (folder / name).is_file()}
    queue = cases_from_rows(_read_csv(folder / REVIEW_QUEUE, names=("case",)), {}, REVIEW_QUEUE) if (folder / REVIEW_QUEUE).is_file() else None
    galleries = {pattern: sorted(p for p in [*folder.glob(pattern), *folder.glob(f"*/{pattern}")] if _visible(p, folder))
                 for pattern in GALLERIES}
    contents = Folder(
        path=folder, docs=docs, curves=curves, curve_files=curve_files, config=_config(folder), cases=cases,
        slides=_slides(folder, docs), queue=queue, figures=figures, galleries={k: v for k, v in galleries.items() if v},
        checkpoints=sorted(p for p in folder.glob("*.ckpt") if _visible(p, folder)),
    )
    if not (docs or curve_files or contents.config or cases or contents.slides or contents.queue or figures or contents.galleries):
        raise InputError(f"{folder}: nothing to report; looked for {LOOKED_FOR}")
    return contents


def flatten(doc: dict, prefix: str = ""):
    """``(dotted key, value)`` of every scalar in ``doc``, nested dicts included. A list of
    at most :data:`MAX_LIST` numbers gives an entry per item (``key[i]``), a list of texts one
    joined entry (the first :data:`MAX_LIST` and their count); other lists (of objects: shown in
    tables of their own) are left out."""
    for key, value in doc.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from flatten(value, f"{name}.")
        elif isinstance(value, list):
            if all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in value) and len(value) <= MAX_LIST:
                yield from ((f"{name}[{i}]", v) for i, v in enumerate(value))
            elif all(isinstance(v, str) for v in value):
                more = f" ... ({len(value)} in all)" if len(value) > MAX_LIST else ""
                yield name, ", ".join(value[:MAX_LIST]) + more
        elif _scalar(value):
            yield name, value
