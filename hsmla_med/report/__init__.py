"""``hsmla-med report``: one self-contained HTML page of a training run, an evaluation, a
calibration, a cross-validation or a heatmap folder.

The page holds what the folder records (:mod:`hsmla_med.report.inputs` lists the files): the
scores, the training curves, the per-case table (sortable, worst mean Dice first) with box plots
per class, slide tables and overlays, the FROC, the calibration before and after, the gate's
share of refined tiles and its pictures, the configuration and plan, and the provenance (the
checkpoints with their sha256, the data fingerprint, the options). Every number is the one in its
file, exactly, in the cell's ``data-value`` (:mod:`hsmla_med.report.page`). Images are inlined as
``data:`` URIs and the script is inline, so the page opens from disk without a network; it holds
no date, so a report of the same folder is the same file.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import yaml

import hsmla_med
from hsmla_med.io import atomic_path
from hsmla_med.report.figures import Images, class_boxes, curves, froc, refined_bars
from hsmla_med.report.inputs import MEAN_DICE, PROVENANCE, CaseTable, Folder, flatten, read_folder
from hsmla_med.defaults import GATE_REFINED, uncertainty_map_path
from hsmla_med.errors import DataError
from hsmla_med.report.page import details, page, table, text
from hsmla_med.report.worst import (MAX_WORST, frame_view, label_map_of, missed_nodules, nodule_crops, slide_view, uncertainty_view, volume_views,
                                    worst_rows, worst_slides)

__all__ = ["REPORT_FILE", "write_report"]

REPORT_FILE = "report.html"
#: pictures per kind of per-slide figure; the rest are named
MAX_GALLERY = 12
#: summary entries shown in the case table and the class means table
PER_CASE_KEYS = ("metric_per_case", "mean", "foreground_mean", "labels", "ci95")
#: the means (with intervals) of a per-case summary, in this order
MEAN_SCORES = ("Dice", "IoU", "HD95", "NSD")
#: entries that say where a result came from: by their last key, or a part of it
PROVENANCE_KEYS = {"checkpoint", "calibrated_checkpoint", "command", "argv", "task", "predictions", "labels", "excluded",
                   "scans_from", "epoch", "step", "seed", "fold", "data_dir", "dataset_json", "variant", "mode", "output"}
PROVENANCE_PARTS = ("sha256", "fingerprint", "version", "commit")
#: provenance entries naming a file whose digest identifies it (when it is still there)
HASHED_KEYS = ("checkpoint", "calibrated_checkpoint", "fingerprint")


def write_report(folder: Path, output: Path | None = None) -> Path:
    """Write the HTML report of ``folder`` to ``output`` (default ``folder/report.html``),
    atomically: an interrupted run leaves the previous report, never half of one.

    Args:
        folder: a folder that ``train``, ``evaluate``, ``calibrate``, ``cross-validate``,
            ``infer`` or ``wsi-heatmap`` wrote.
        output: the HTML file.

    Returns:
        The path of the report.

    Raises:
        InputError: ``folder`` is no folder or holds none of the files a report shows (one
            line naming the folder and the files looked for).
        DataError: a file there cannot be read (one line naming it).
    """
    folder = Path(folder)
    contents = read_folder(folder)
    output = folder / REPORT_FILE if output is None else Path(output)
    document = _render(contents)
    with atomic_path(output) as tmp:
        tmp.write_text(document, encoding="utf-8")
    return output


def _render(contents: Folder) -> str:
    images = Images()  # sections earlier in this list get the image budget first
    entries = _entries(contents)
    sections = [
        ("scores", "Scores", _scores(contents)),
        ("curves", "Training curves", _curves(contents, images)),
        ("cases", "Cases", _cases(contents.cases, images)),
        ("worst", "Worst cases", _worst(contents, images)),
        ("uncertainty", "Uncertainty review queue", _queue(contents, images)),
        ("slides", "Slides", _slides(contents, images)),
        ("froc", "FROC", _froc(contents, images)),
        ("calibration", "Calibration", _calibration(contents, images)),
        ("gate", "Gate", _gate(contents, entries, images)),
        ("configuration", "Configuration", _configuration(contents)),
        ("provenance", "Provenance", _provenance(contents, entries)),
    ]
    kinds = [kind for kind, found in (("training run", contents.curve_files or contents.config is not None),
                                      ("evaluation", "summary.json" in contents.docs or "checkpoint" in contents.docs.get("metrics.json", {})),
                                      ("calibration", "calibration.json" in contents.docs),
                                      ("cross-validation", "crossval.json" in contents.docs),
                                      ("slide heatmaps", contents.slides),
                                      ("predictions", PROVENANCE in contents.docs)) if found]
    subtitle = f"{contents.path.resolve()}: {', '.join(kinds) or 'outputs'}; written by hsmla-med {hsmla_med.__version__}"
    return page(f"hsmla-med report: {contents.path.resolve().name}", subtitle, [s for s in sections if s[2]])


def _pairs(entries, caption: str) -> str:
    return table(["entry", "value"], [[key, value] for key, value in entries], caption)


def _scores(contents: Folder) -> list[str]:
    """The scalars of ``metrics.json``, ``summary.json`` and ``crossval.json``; per-class
    scores, class means with their intervals, and the folds, as tables of their own."""
    parts = []
    metrics = contents.docs.get("metrics.json")
    if metrics:
        per_class = {k.removesuffix("_per_class"): v for k, v in metrics.items() if k.endswith("_per_class") and isinstance(v, dict)}
        parts.append(_pairs(flatten({k: v for k, v in metrics.items() if not k.endswith("_per_class") and k != GATE_REFINED}), "metrics.json"))
        if per_class:
            classes = list(dict.fromkeys(c for scores in per_class.values() for c in scores))
            rows = [[c, *(per_class[m].get(c) for m in per_class)] for c in classes]
            parts.append(table(["class", *per_class], rows, "metrics.json: per class"))
    if contents.summary:
        name, summary = contents.summary
        means = _class_means(summary, name)
        # what the class means table shows is left out of the entries; the per-case rows always are
        rest = {k: v for k, v in summary.items() if k not in (PER_CASE_KEYS if means else ("metric_per_case",))}
        if means:
            intervals = {k: v for k, v in (summary.get("ci95") or {}).items() if k not in ("mean", "foreground_mean")}
            rest.update({"ci95": intervals} if intervals else {})
        parts += [*means, _pairs(flatten(rest), name)]
    crossval = contents.docs.get("crossval.json")
    if crossval:
        parts.extend(_folds(crossval))
    return parts


def _class_means(summary: dict, name: str) -> list[str]:
    """Per class and over the foreground: the mean of each score and its bootstrap interval."""
    means, intervals = summary.get("mean"), summary.get("ci95") or {}
    if not isinstance(means, dict) or not all(isinstance(m, dict) for m in means.values()):
        return []
    scores = [s for s in MEAN_SCORES if any(s in m for m in means.values())]
    columns = ["class", *(f"{s}{suffix}" for s in scores for suffix in ("", " CI low", " CI high"))]
    labels = summary.get("labels") or {}

    def row(label: str, mean: dict, ci: dict) -> list:
        return [label, *(v for s in scores for v in (mean.get(s), *((ci.get(s) or [None, None])[:2])))]

    rows = [row(labels.get(k, k), m, (intervals.get("mean") or {}).get(k) or {}) for k, m in means.items()]
    if isinstance(summary.get("foreground_mean"), dict):
        rows.append(row("foreground mean", summary["foreground_mean"], intervals.get("foreground_mean") or {}))
    confidence = (summary.get("bootstrap") or {}).get("confidence")
    return [table(columns, rows, f"{name}: means over the cases" + (f", {confidence:.0%} bootstrap intervals" if confidence else ""))]


def _folds(crossval: dict) -> list[str]:
    """``crossval.json``: a row per fold (its validation scores), and the pooled result."""
    folds = [f for f in crossval.get("folds") or [] if isinstance(f, dict)]
    validations = [f.get("validation") or {} for f in folds]
    scores = list(dict.fromkeys(k for v in validations for k, value in v.items() if not isinstance(value, (dict, list))))
    rows = [[f.get("fold"), len(f.get("cases") or []), f.get("seconds"), bool(f.get("skipped")), *(v.get(s) for s in scores)]
            for f, v in zip(folds, validations, strict=True)]
    rest = {k: v for k, v in crossval.items() if k != "folds"}
    caption = "crossval.json: folds (one done before has no scores here: see its fold_K/metrics.json)"
    return [table(["fold", "cases", "seconds", "done before", *scores], rows, caption), _pairs(flatten(rest), "crossval.json")]


def _curves(contents: Folder, images: Images) -> list[str]:
    drawn = curves(contents.curves)
    if drawn is not None:
        sources = ", ".join(str(p.relative_to(contents.path)) for p in contents.curve_files)
        return [images.drawn(drawn, f"every logged quantity against the step, from {sources}")]
    if "training_curve.png" in contents.figures:
        return [images.file(contents.figures["training_curve.png"], "training_curve.png")]
    return []


def _cases(cases: CaseTable | None, images: Images) -> list[str]:
    if cases is None:
        return []
    order = f"worst first: by {cases.sorted_by} (over the classes with a value), ascending" if cases.sorted_by else "in the file's order"
    parts = [f"<p class=note>{len(cases.rows)} cases from {text(cases.source)}, {order}; click a column header to sort.</p>",
             table(["case", *cases.columns], [[name, *values] for name, values in cases.rows], cases.source,
                   {MEAN_DICE: "computed here: the mean of the case's Dice values in this row"}, cases.sorted_by)]
    return parts + [images.drawn(class_boxes(score, values), f"{score} per class: box (quartiles) and every case")
                     for score, values in cases.per_class.items()]


def _picture(images: Images, draw, caption: str) -> str:
    """A drawn picture, or one line saying why it could not be drawn (a file gone or unreadable)."""
    try:
        return images.drawn(draw(), caption)
    except (DataError, OSError, ValueError) as err:
        return f"<p class=note>{text(caption)}: not drawn ({text(err)}).</p>"


def _worst(contents: Folder, images: Images) -> list[str]:
    """The worst cases of the per-case summary as pictures (:mod:`hsmla_med.report.worst`):
    slides with their outlines and detections, volumes through their largest error, frames with
    both outlines."""
    if not contents.summary:
        return []
    name, summary = contents.summary
    slides = worst_slides(summary.get("metric_per_case") or [])
    if slides:
        note = f"<p class=note>The {len(slides)} slides of {text(name)} with the most missed lesions, then false positives (at most {MAX_WORST}).</p>"
        return [note, *(_picture(images, lambda r=row: slide_view(r, r["slide"]), f"{row['slide']}: {row['slide_file']}, tumour outlines "
                                 f"(green; exclusions dashed) and the detections of {row['prediction_file']}") for row in slides)]
    rows = worst_rows(summary.get("metric_per_case") or [])
    parts = []
    for rank, row in enumerate(rows, start=1):
        title = f"{rank}. {Path(row['prediction_file']).name}"
        caption = f"{title}: reference {row['reference_file']} (solid), prediction {row['prediction_file']} (dotted)"
        if "label_files" in row:
            parts.append(_picture(images, lambda r=row, t=title: frame_view(r, summary.get("problem") or "binary", t), caption))
        else:
            parts.append(_picture(images, lambda r=row, t=title: volume_views(r, t), caption + ", through the centre (+) of the largest error"))
    if parts:
        parts.insert(0, f"<p class=note>The {len(rows)} cases of lowest mean Dice in {text(name)} (at most {MAX_WORST}), worst first.</p>")
    return parts


def _queue(contents: Folder, images: Images) -> list[str]:
    """``infer --uncertainty``'s review queue as a table and its first cases' maps."""
    queue = contents.queue
    if queue is None:
        return []
    parts = [table(["case", *queue.columns], [[name, *values] for name, values in queue.rows], queue.source)]
    for name, _ in queue.rows[:MAX_WORST]:
        path = uncertainty_map_path(contents.path, name)
        labels = label_map_of(contents.path, name)
        parts.append(_picture(images, lambda p=path, l=labels, n=name: uncertainty_view(p, l, n), f"{name}: {path.relative_to(contents.path)}"))
    return parts


def _gallery(contents: Folder, pattern: str, images: Images) -> list[str]:
    paths = contents.galleries.get(pattern, [])
    parts = [images.file(p, str(p.relative_to(contents.path))) for p in paths[:MAX_GALLERY]]
    if len(paths) > MAX_GALLERY:
        parts.append(f"<p class=note>{len(paths) - MAX_GALLERY} more {text(pattern)} in the folder, not shown.</p>")
    return parts


def _slides(contents: Folder, images: Images) -> list[str]:
    parts = []
    if contents.slides is not None:
        slides = contents.slides
        parts.append(table(["slide", *slides.columns], [[name, *values] for name, values in slides.rows], slides.source,
                           {"mean_alpha": "share of the HSMLA gate's tiles refined, over the slide's patches"}))
    return parts + _gallery(contents, "*_overlay.png", images)


def _froc_points(doc: dict) -> dict | None:
    """A ``{rate: sensitivity}`` entry of a summary (luna16 ``froc``, camelyon16 ``sensitivity``,
    a validation's ``froc_sensitivity``) with a value to draw."""
    for key in ("froc", "sensitivity", "froc_sensitivity"):
        value = doc.get(key)
        if isinstance(value, dict) and all(re.fullmatch(r"\d+(\.\d+)?", str(k)) for k in value) \
                and any(isinstance(v, (int, float)) for v in value.values()):
            return value
    return None


def _froc(contents: Folder, images: Images) -> list[str]:
    """The FROC (the folder's ``froc.png``, else drawn from a summary) and the crops of the
    nodules it missed."""
    return _froc_curve(contents, images) + _missed(contents, images)


def _froc_curve(contents: Folder, images: Images) -> list[str]:
    if "froc.png" in contents.figures:
        return [images.file(contents.figures["froc.png"], "froc.png")]
    for name in ("summary.json", "crossval/summary.json", "metrics.json"):
        doc = contents.docs.get(name) or {}
        points = _froc_points(doc)
        if points:
            band = (doc.get("bootstrap") or {}).get("froc")
            return [images.drawn(froc(points, band if isinstance(band, dict) else None), f"FROC from {name}")]
    return []


def _missed(contents: Folder, images: Images) -> list[str]:
    if not contents.summary:
        return []
    name, summary = contents.summary
    rows = summary.get("metric_per_case") or []
    missed = missed_nodules(rows)
    if not missed:
        return []
    count = sum(len(r.get("missed") or []) for r in rows if isinstance(r, dict))
    caption = (f"missed nodules of {name}, largest first ({len(missed)} of {count}): axial crops, lung window, "
               "the annotated diameter as a circle")
    return [_picture(images, lambda: nodule_crops(missed), caption)]


def _calibration(contents: Folder, images: Images) -> list[str]:
    parts = []
    record = contents.docs.get("calibration.json")
    if record:
        before, after = record.get("before") or {}, record.get("after") or {}
        parts.append(table(["metric", "before", "after"], [[k, before.get(k), after.get(k)] for k in dict.fromkeys([*before, *after])],
                           "calibration.json: before and after temperature scaling"))
        parts.append(_pairs(flatten({k: v for k, v in record.items() if k not in ("before", "after")}), "calibration.json"))
    if "reliability.png" in contents.figures:
        parts.append(images.file(contents.figures["reliability.png"], "reliability.png"))
    return parts


def _config_entries(contents: Folder) -> list[tuple]:
    """``(source, key, value)`` of the configuration's scalars."""
    if contents.config is None:
        return []
    name, source = contents.config
    try:
        config = yaml.safe_load(source)
    except yaml.YAMLError:  # shown as text in its block all the same
        return []
    return [(name, k, v) for k, v in flatten(config)] if isinstance(config, dict) else []


def _entries(contents: Folder) -> list[tuple]:
    """``(source, key, value)`` of every JSON document's scalars, then the configuration's."""
    return [(name, k, v) for name, doc in contents.docs.items() for k, v in flatten(doc)] + _config_entries(contents)


def _last_key(key: str) -> str:
    return re.sub(r"\[\d+\]$", "", key).rsplit(".", 1)[-1]


def _gate(contents: Folder, entries: list[tuple], images: Images) -> list[str]:
    """The gate's entries (``routing``, ``*alpha*``, ``gate_*``), the share of tiles refined per
    slide, and the gate pictures."""
    gate = [(s, k, v) for s, k, v in entries if _last_key(k) == "routing" or "alpha" in _last_key(k) or _last_key(k).startswith("gate")]
    parts = [table(["file", "entry", "value"], gate, "the gate's settings and shares of tiles refined")] if gate else []
    for name, doc in contents.docs.items():
        per_layer = doc.get(GATE_REFINED)
        if isinstance(per_layer, dict) and per_layer and all(isinstance(v, (int, float)) for v in per_layer.values()):
            parts.append(table(["layer", "share of tiles refined"], list(per_layer.items()), f"{name}: {GATE_REFINED}, over the validation's network calls"))
            parts.append(images.drawn(refined_bars(per_layer), f"share of tiles refined per HSMLA layer ({name})"))
    if contents.slides is not None and "mean_alpha" in contents.slides.columns:
        parts.append("<p class=note>Per slide: the mean_alpha column of the Slides table (share of tiles refined).</p>")
    if any(c.split("/", 1)[-1].startswith("gate") for row in contents.curves for c in row):
        parts.append("<p class=note>During training: the gate panel of the training curves.</p>")
    return parts + _gallery(contents, "*_gates.png", images)


def _configuration(contents: Folder) -> list[str]:
    parts = [details(contents.config[0], contents.config[1])] if contents.config else []
    if "plans.json" in contents.docs:
        parts.append(details("plans.json", json.dumps(contents.docs["plans.json"], indent=2)))
    return parts


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _provenance(contents: Folder, entries: list[tuple]) -> list[str]:
    """Where the results came from: the entries that name checkpoints, data, options and
    versions, and the sha256 of the checkpoints and fingerprint files they name (and of the
    folder's own checkpoints), as the files are now. Only absolute names are followed: a
    relative one was relative to a working folder that the report does not know."""
    rows = [[s, k, v] for s, k, v in entries if Path(s).name == PROVENANCE  # a prediction record: all of it
            or _last_key(k) in PROVENANCE_KEYS or any(part in _last_key(k) for part in PROVENANCE_PARTS)]
    named = [Path(v) for _, k, v in rows if isinstance(v, str) and _last_key(k) in HASHED_KEYS and Path(v).is_absolute()]
    hashed = {}
    for path in [*contents.checkpoints, *named]:
        if path.is_file() and path.resolve() not in hashed:
            hashed[path.resolve()] = path
    rows += [[str(path), "sha256 (of the file now)", _sha256(path)] for path in hashed.values()]
    return [table(["file", "entry", "value"], rows, "what the folder records of its origin")] if rows else []
