"""``hsmla-med report``: one self-contained HTML page of a training run, an evaluation, a
calibration, a cross-validation or a heatmap folder.

The page opens with the answer (:func:`_answer`): the task's main score with its bootstrap
interval and the number of cases it is over, the worst case, and whether the probabilities are
calibrated. Then a section per question a reader asks, holding what the folder records
(:mod:`hsmla_med.report.inputs` lists the files): how good is it (the scores, their spread per
class, the FROC), where does it fail (the per-case table, sortable, worst mean Dice first; the
worst cases, missed nodules and the uncertainty review queue as pictures), what did it predict
(slide tables and overlays), can the probabilities be trusted (the calibration before and after),
how did training go (the logged curves with the learning rate), where does the gate look (its
share of refined tiles and its pictures) and what produced these results (the command and the
versions that ran it, the checkpoints with their sha256, the data fingerprint, the options, the
configuration and plan). Every number is the one in its file, exactly, in its ``data-value``
(:mod:`hsmla_med.report.page`). Images are inlined as ``data:`` URIs and the script is inline, so
the page opens from disk without a network; it holds no date, so a report of the same folder is
the same file. Figure captions name files relative to the folder (outside it: by their folder
and name); the provenance keeps whole paths, which there are the information.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

import hsmla_med
from hsmla_med.io import atomic_path, file_sha256
from hsmla_med.report.figures import Images, class_boxes, curves, froc, learning_rate, refined_bars
from hsmla_med.report.inputs import MEAN_DICE, PROVENANCE, CaseTable, Folder, flatten, read_folder
from hsmla_med.defaults import GATE_REFINED, uncertainty_map_path
from hsmla_med.errors import DataError
from hsmla_med.report.page import details, number, page, subsection, table, text
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
PROVENANCE_KEYS = {"checkpoint", "calibrated_checkpoint", "command", "argv", "cwd", "task", "predictions", "labels", "excluded",
                   "scans_from", "epoch", "step", "seed", "fold", "data_dir", "dataset_json", "variant", "mode", "output"}
PROVENANCE_PARTS = ("sha256", "fingerprint", "version", "commit")
#: provenance entries naming a file whose digest identifies it (when it is still there)
HASHED_KEYS = ("checkpoint", "calibrated_checkpoint", "fingerprint")
#: entries naming a checkpoint whose own record (split, plan, calibration) the provenance shows
CHECKPOINT_KEYS = ("checkpoint", "calibrated_checkpoint")
#: what a calibration sample adds to an evaluation's metrics.json: shown with the calibration
CALIBRATION_KEYS = ("ece", "ece_foreground", "brier", "nll", "accuracy", "samples", "foreground_samples")
#: the main score of each kind of task (segmentation, slide classification, nodule detection), by its key: its name, and
#: in metrics.json the key that counts what it is over and what that is
MAIN_SCORES = {"dice": ("Dice (mean over the foreground classes)", "cases", "cases"), "auc": ("slide AUC", "slides", "slides"),
               "cpm": ("CPM (mean sensitivity at 1/8 to 8 false positives per scan)", "cases", "scans")}


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


@dataclass
class Named:
    """A checkpoint that a document of the folder names: the document, the name as written, the
    file it means (:func:`_located`) and what that file records now (:func:`_checkpoint_record`;
    ``None``: not there, or no checkpoint of train)."""

    source: str
    name: str
    path: Path
    record: dict | None


def _render(contents: Folder) -> str:
    images = Images()  # sections earlier on the page get the image budget first
    entries = _entries(contents)
    named = _named_checkpoints(contents)
    sections = [
        ("answer", "In short", _answer(contents, named)),
        ("scores", "How good is it?", [*_scores(contents), *_boxes(contents.cases, images),
                                       *subsection("froc", "FROC", _froc_curve(contents, images))]),
        ("failures", "Where does it fail?", [*subsection("cases", "Every case, worst first", _cases(contents.cases)),
                                             *subsection("worst", "Worst cases", _worst(contents, images)),
                                             *subsection("missed", "Missed nodules", _missed(contents, images)),
                                             *subsection("uncertainty", "Uncertainty review queue", _queue(contents, images))]),
        ("slides", "What did it predict?", _slides(contents, images)),
        ("calibration", "Can the probabilities be trusted?", _calibration(contents, images)),
        ("curves", "How did training go?", _curves(contents, images)),
        ("gate", "Where does the gate look?", _gate(contents, entries, images)),
        ("origin", "What produced these results?", [*subsection("provenance", "Provenance", _provenance(contents, entries, named)),
                                                    *subsection("configuration", "Configuration", _configuration(contents))]),
    ]
    kinds = [kind for kind, found in (("training run", contents.curve_files or contents.config is not None),
                                      ("evaluation", "summary.json" in contents.docs or "checkpoint" in contents.docs.get("metrics.json", {})),
                                      ("calibration", "calibration.json" in contents.docs),
                                      ("cross-validation", "crossval.json" in contents.docs),
                                      ("slide heatmaps", contents.slides),
                                      ("predictions", PROVENANCE in contents.docs)) if found]
    name = contents.path.resolve().name
    subtitle = f"{name}: {', '.join(kinds) or 'outputs'}; written by hsmla-med {hsmla_med.__version__}"
    return page(f"hsmla-med report: {name}", subtitle, [s for s in sections if s[2]])


def _shown_name(path: str | Path, folder: Path) -> str:
    """A file as a caption names it: relative to the report's folder, else by its folder and name."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(folder.resolve()))
    except ValueError:
        return str(Path(path.parent.name, path.name))


def _answer(contents: Folder, named: list[Named]) -> list[str]:
    """The page's first block: the main score with its interval over the cases scored, the
    worst case, and whether the probabilities are calibrated; nothing for a folder without scores."""
    score, worst = _headline(contents), _worst_case(contents)
    if score is None and worst is None and "calibration.json" not in contents.docs:
        return []
    lines = [("Score", score or "none in this folder"), ("Worst case", worst or "no per-case scores in this folder"),
             ("Calibrated?", _calibrated(contents, named))]
    return ["<dl class=answer>" + "".join(f"<dt>{text(label)}</dt><dd>{html}</dd>" for label, html in lines) + "</dl>"]


def _score(name: str, value, interval, confidence, count, unit: str, source: str, note: str | None = None) -> str:
    """A headline score: its value, its interval (else ``note``: why there is none) and the
    number of ``unit`` (plural) it is over."""
    low, high = (list(interval or []) + [None, None])[:2]
    if low is not None and high is not None:
        spread = f", {confidence:.0%} bootstrap interval" if isinstance(confidence, float) else ", interval"
        spread += f" {number(low)} to {number(high)}"
    else:
        spread = f", {text(note or 'no interval recorded')}"
    over = f" over {number(count)} {text(unit.removesuffix('s') if count == 1 else unit)}" if count is not None else ""
    return f"{text(name)} <b>{number(value)}</b>{spread}{over} <span class=note>({text(source)})</span>"


def _headline(contents: Folder) -> str | None:
    """The task's main score: of the per-case summary, with its bootstrap interval (Dice for
    volumes and frames, CPM for LUNA16, the slide AUC for CAMELYON16, its FROC score without a
    slide CSV), else of ``metrics.json`` (one validation: no interval)."""
    if contents.summary:
        name, summary = contents.summary
        rows = [r for r in summary.get("metric_per_case") or [] if isinstance(r, dict)]
        bootstrap = summary.get("bootstrap") or {}
        confidence, note = bootstrap.get("confidence"), bootstrap.get("note")
        if "cpm" in summary:
            band = bootstrap.get("cpm") or {}
            return _score(MAIN_SCORES["cpm"][0], summary["cpm"], [band.get("low"), band.get("high")], confidence, summary.get("scans", len(rows)),
                          "scans", f"{name}: cpm, bootstrap.cpm", note)
        if "auc_slides" in summary:
            if summary.get("auc") is not None:
                return _score(MAIN_SCORES["auc"][0], summary["auc"], None, None, summary["auc_slides"], "slides", f"{name}: auc")
            return _score("lesion FROC score (no slide AUC: no slide CSV was scored)", summary.get("froc"), None, None,
                          summary.get("slides", len(rows)), "slides", f"{name}: froc")
        means = summary.get("foreground_mean")
        if isinstance(means, dict) and "Dice" in means:
            interval = ((summary.get("ci95") or {}).get("foreground_mean") or {}).get("Dice")
            return _score(MAIN_SCORES["dice"][0], means["Dice"], interval, confidence, len(rows), "frames" if "problem" in summary else "cases",
                          f"{name}: foreground_mean.Dice, ci95.foreground_mean.Dice", note)
    metrics = contents.docs.get("metrics.json") or {}
    for key, (label, count, unit) in MAIN_SCORES.items():
        if key in metrics and (metrics[key] is None or isinstance(metrics[key], (int, float))):
            return _score(label, metrics[key], None, None, metrics.get(count), unit, f"metrics.json: {key}, the last validation's",
                          "no interval: one validation's score")
    return None


def _worst_case(contents: Folder) -> str | None:
    """The case of lowest mean Dice (the case table's first), else the LUNA16 scan or CAMELYON16
    slide with the most missed nodules or lesions (then the most false positives)."""
    cases = contents.cases
    if cases is not None and cases.sorted_by and cases.rows and cases.rows[0][1][0] is not None:
        name, values = cases.rows[0]
        return f"{text(name)}: {text(cases.sorted_by)} <b>{number(values[0])}</b>, the lowest of {len(cases.rows)} cases ({text(cases.source)})"
    rows = [r for r in (contents.summary or ("", {}))[1].get("metric_per_case") or [] if isinstance(r, dict)]
    for name_key, total, found, false, what in (("seriesuid", "nodules", "TP", "FP", "nodules"),
                                                ("slide", "lesions", "detected", "false_positives", "lesions")):
        scored = [r for r in rows if isinstance(r.get(total), int) and isinstance(r.get(found), int)]
        if scored:
            worst = max(scored, key=lambda r: (r[total] - r[found], r.get(false) or 0))  # the first of ties: the file's order
            return (f"{text(worst.get(name_key))}: <b>{number(worst[total] - worst[found])}</b> of {number(worst[total])} {what} missed, "
                    f"{number(worst.get(false))} false positives (the most missed of {len(scored)})")
    return None


def _calibrated(contents: Folder, named: list[Named]) -> str:
    """Whether the probabilities are calibrated: ``calibration.json``'s ECE before and after,
    else the temperature an evaluated checkpoint carries, else not, with the ECE as evaluated."""
    record = contents.docs.get("calibration.json")
    if record:
        before, after = record.get("before") or {}, record.get("after") or {}
        return (f"yes, by temperature scaling: ECE {number(before.get('ece'))} before, <b>{number(after.get('ece'))}</b> after "
                "<span class=note>(calibration.json)</span>")
    metrics = contents.docs.get("metrics.json") or {}
    evaluated = f"ECE <b>{number(metrics['ece'])}</b> as evaluated (metrics.json)" if "ece" in metrics else ""
    carried = next((n for n in named if isinstance((n.record or {}).get("calibration"), dict)), None)
    if carried is not None:
        fitted = carried.record["calibration"]
        return (f"yes, {text(carried.name)} carries a fitted temperature (ECE {number(fitted.get('ece_before'))} before, "
                f"{number(fitted.get('ece_after'))} after, when it was fitted)" + (f"; {evaluated}" if evaluated else ""))
    return "not calibrated (hsmla-med calibrate fits a temperature)" + (f": {evaluated}" if evaluated else "")


def _pairs(entries, caption: str) -> str:
    return table(["entry", "value"], [[key, value] for key, value in entries], caption)


def _scores(contents: Folder) -> list[str]:
    """The scalars of ``metrics.json``, ``summary.json`` and ``crossval.json``; per-class
    scores, class means with their intervals, and the folds, as tables of their own (a
    calibration sample's metrics go to the calibration section)."""
    parts = []
    metrics = contents.docs.get("metrics.json")
    if metrics:
        per_class = {k.removesuffix("_per_class"): v for k, v in metrics.items() if k.endswith("_per_class") and isinstance(v, dict)}
        moved = (*CALIBRATION_KEYS, GATE_REFINED) if "ece" in metrics else (GATE_REFINED,)
        parts.append(_pairs(flatten({k: v for k, v in metrics.items() if not k.endswith("_per_class") and k not in moved}), "metrics.json"))
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
    """The logged curves, the learning rate among them, with what its schedule was set to."""
    drawn = curves(contents.curves)
    if drawn is not None:
        sources = ", ".join(str(p.relative_to(contents.path)) for p in contents.curve_files)
        return [images.drawn(drawn, f"every logged quantity against the step, from {sources}"), f"<p class=note>{text(_schedule(contents))}</p>"]
    if "training_curve.png" in contents.figures:
        return [images.file(contents.figures["training_curve.png"], "training_curve.png")]
    return []


def _schedule(contents: Folder) -> str:
    """What the learning-rate panel shows, and the schedule's settings in the configuration."""
    config = {k: v for _, k, v in _config_entries(contents)}
    settings = [f"{key} = {config[key]}" for key in ("optim.lr", "optim.warmup_steps", "trainer.max_steps") if key in config]
    schedule = ("the schedule: a linear warm-up, then a cosine decay over the run's steps (hsmla_med.engine.schedule.WarmupCosine"
                + (f"; {', '.join(settings)}" if settings else "") + ")")
    rates = list(dict.fromkeys(c for row in contents.curves for c in row if learning_rate(c)))
    if rates:
        return f"The learning-rate panel: {', '.join(rates)}, the rate the optimizer used at each logged step; {schedule}."
    return f"No learning rate was logged (the trainer of this run did not log it); {schedule}."


def _cases(cases: CaseTable | None) -> list[str]:
    if cases is None:
        return []
    order = f"worst first: by {cases.sorted_by} (over the classes with a value), ascending" if cases.sorted_by else "in the file's order"
    return [f"<p class=note>{len(cases.rows)} cases from {text(cases.source)}, {order}; click a column header to sort.</p>",
            table(["case", *cases.columns], [[name, *values] for name, values in cases.rows], cases.source,
                  {MEAN_DICE: "computed here: the mean of the case's Dice values in this row"}, cases.sorted_by)]


def _boxes(cases: CaseTable | None, images: Images) -> list[str]:
    """The spread of each per-case score over the cases, per class."""
    return [images.drawn(class_boxes(score, values), f"{score} per class: box (quartiles) and every case")
            for score, values in (cases.per_class.items() if cases is not None else [])]


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
    named = lambda row, key: _shown_name(row[key], contents.path)  # noqa: E731
    if slides:
        note = f"<p class=note>The {len(slides)} slides of {text(name)} with the most missed lesions, then false positives (at most {MAX_WORST}).</p>"
        return [note, *(_picture(images, lambda r=row: slide_view(r, r["slide"]), f"{row['slide']}: {named(row, 'slide_file')}, tumour outlines "
                                 f"(green; exclusions dashed) and the detections of {named(row, 'prediction_file')}") for row in slides)]
    rows = worst_rows(summary.get("metric_per_case") or [])
    parts = []
    for rank, row in enumerate(rows, start=1):
        title = f"{rank}. {Path(row['prediction_file']).name}"
        caption = f"{title}: reference {named(row, 'reference_file')} (solid), prediction {named(row, 'prediction_file')} (dotted)"
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
    """The slides of ``wsi-heatmap`` (a row each) and their overlays."""
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


def _froc_curve(contents: Folder, images: Images) -> list[str]:
    """The FROC: the folder's ``froc.png``, else drawn from a summary."""
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
    """Crops of the nodules no candidate hit (LUNA16)."""
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
    """``calibration.json`` (before and after temperature scaling) and the reliability diagram;
    without them, the calibration metrics an evaluation measured on its own probabilities."""
    parts = []
    record = contents.docs.get("calibration.json")
    if record:
        before, after = record.get("before") or {}, record.get("after") or {}
        parts.append(table(["metric", "before", "after"], [[k, before.get(k), after.get(k)] for k in dict.fromkeys([*before, *after])],
                           "calibration.json: before and after temperature scaling"))
        parts.append(_pairs(flatten({k: v for k, v in record.items() if k not in ("before", "after")}), "calibration.json"))
    metrics = contents.docs.get("metrics.json") or {}
    if "ece" in metrics:
        parts.append(_pairs([(k, metrics[k]) for k in CALIBRATION_KEYS if k in metrics],
                            "metrics.json: the probabilities as evaluated (ECE, Brier, NLL over the samples drawn)"))
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


def _named_files(contents: Folder) -> list[tuple[str, str, str]]:
    """``(document, dotted key, name)`` of the files that the folder's documents name under
    :data:`HASHED_KEYS` (each of a list: an ensemble's checkpoints)."""
    found = []

    def walk(source: str, doc: dict, prefix: str) -> None:
        for key, value in doc.items():
            if isinstance(value, dict):
                walk(source, value, f"{prefix}{key}.")
            elif key in HASHED_KEYS:
                found.extend((source, f"{prefix}{key}", v) for v in (value if isinstance(value, list) else [value]) if isinstance(v, str))

    for source, doc in contents.docs.items():
        walk(source, doc, "")
    return found


def _located(name: str, contents: Folder) -> tuple[Path, str | None]:
    """The file that a recorded name means and, for a relative name, how it was found: against
    the working folder that ``command.json`` records (``cwd``), else against the one this report
    is written from, which is the command's own where the command writes its report at its end
    (``evaluate`` records ``--checkpoint`` as given)."""
    path = Path(name)
    if path.is_absolute():
        return path, None
    cwd = (contents.docs.get("command.json") or {}).get("cwd")
    if isinstance(cwd, str) and Path(cwd).is_absolute():
        return Path(cwd) / path, f"a relative name, resolved against the command's working folder {cwd} (command.json)"
    return Path.cwd() / path, (f"a relative name, resolved against the folder this report was written from ({Path.cwd()}): "
                               "command.json records no working folder")


def _checkpoint_record(path: Path) -> dict | None:
    """What a checkpoint of train records of its origin: its ``split``, its ``plan`` (whose
    ``fingerprint`` names the data fingerprint), the ``calibration`` that ``calibrate`` fitted,
    its ``epoch`` and ``step``; ``None`` for any other file (an exported network)."""
    from hsmla_med.engine.checkpoint import read_checkpoint  # torch: only for a folder that names a checkpoint still there

    try:
        checkpoint = read_checkpoint(path, mmap=True)
    except DataError:
        return None
    hparams = checkpoint["hyper_parameters"] if isinstance(checkpoint["hyper_parameters"], dict) else {}
    return {**{k: hparams.get(k) for k in ("split", "plan", "calibration")}, "epoch": checkpoint.get("epoch"), "step": checkpoint.get("global_step")}


def _named_checkpoints(contents: Folder) -> list[Named]:
    """The checkpoints the folder's documents name (an evaluation's, a calibration's, a
    prediction's), each read once."""
    named, records = [], {}
    for source, key, name in _named_files(contents):
        if _last_key(key) not in CHECKPOINT_KEYS:
            continue
        path = _located(name, contents)[0]
        if path.is_file() and path.resolve() not in records:
            records[path.resolve()] = _checkpoint_record(path)
        named.append(Named(source, name, path, records.get(path.resolve()) if path.is_file() else None))
    return named


def _recorded(checkpoint: Named, contents: Folder) -> tuple[list[list], list[str]]:
    """Provenance rows of what a checkpoint records (its split, data fingerprint, calibration),
    and notes: no fingerprint recorded, or a file that is not the one a document names."""
    record, rows, notes = checkpoint.record, [], []
    plan = record.get("plan") if isinstance(record.get("plan"), dict) else {}
    shown = {"split": record.get("split"), "plan": {"fingerprint": plan["fingerprint"]} if "fingerprint" in plan else None,
             "calibration": record.get("calibration")}
    rows += [[str(checkpoint.path), f"recorded in the checkpoint: {k}", v] for k, v in flatten({k: v for k, v in shown.items() if v})]
    if "fingerprint" not in plan:
        notes.append(f"{checkpoint.name} records no data fingerprint: its run planned nothing (the dataset is fingerprinted where a "
                     "planned option is auto)")
    document = contents.docs.get(checkpoint.source) or {}
    if checkpoint.source == "metrics.json" and "step" in document and document["step"] != record["step"]:
        notes.append(f"{checkpoint.name} now holds the weights of step {record['step']}, the evaluated checkpoint those of step "
                     f"{document['step']}: not the file that was evaluated")
    return rows, notes


def _provenance(contents: Folder, entries: list[tuple], named: list[Named]) -> list[str]:
    """Where the results came from: the entries that name checkpoints, data, options and
    versions; what the checkpoints they name record (split, data fingerprint, calibration); the
    sha256 of those checkpoints, of the fingerprint files and of the folder's own checkpoints,
    as the files are now (a relative name: :func:`_located`); the versions of ``command.json``."""
    rows = [[s, k, v] for s, k, v in entries if Path(s).name == PROVENANCE  # a prediction record: all of it
            or _last_key(k) in PROVENANCE_KEYS or any(part in _last_key(k) for part in PROVENANCE_PARTS)]
    notes, shown = [], set()
    for checkpoint in named:
        if checkpoint.record is not None and checkpoint.path.resolve() not in shown:
            shown.add(checkpoint.path.resolve())
            more, said = _recorded(checkpoint, contents)
            rows += more
            notes += said
    files = []
    for _, _, name in _named_files(contents):
        path, resolved = _located(name, contents)
        files.append(path)
        said = [*([resolved] if resolved else []), *([] if path.is_file() else ["not a file there now (gone, or a folder), so no sha256"])]
        notes += [f"{name}: {'; '.join(said)}"] if said else []
    files += [Path(v) for _, k, v in rows if k == "recorded in the checkpoint: plan.fingerprint" and isinstance(v, str)]
    hashed = {}
    for path in [*(p.absolute() for p in contents.checkpoints), *files]:
        if path.is_file() and path.resolve() not in hashed:
            hashed[path.resolve()] = path
    rows += [[str(path), "sha256 (of the file now)", file_sha256(path)] for path in hashed.values()]
    parts = [table(["file", "entry", "value"], rows, "what the folder records of its origin")] if rows else []
    versions = (contents.docs.get("command.json") or {}).get("versions")
    if isinstance(versions, dict) and versions:
        parts.append(table(["package", "version"], list(versions.items()), "command.json: the versions that ran the command"))
    return parts + [f"<p class=note>{text(note)}</p>" for note in dict.fromkeys(notes)]
