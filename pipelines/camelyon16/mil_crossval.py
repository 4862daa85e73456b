"""``hsmla-med cross-validate --task camelyon16 --supervision slide``: slide-label MIL trained on
every fold of ``splits_final.json`` over the slides (folds by slide, stratified by label; the
slides the label CSV holds out, CAMELYON16's ``test_*`` or split ``test``, in none of them), and
each slide scored once, by the fold that did not train on it, the pooled validation scored as one.

Layout of the run folder (``--output``), after nnU-Net's as ``cross-validate`` writes it::

    features/                   the slides encoded once (without --features), for every fold
    fold_K/                     a slide-label run (train --supervision slide) on fold K's
                                training slides: last.ckpt, summary.json of its validation
                                slides, attention/, heatmaps/
    crossval/summary.json       the pooled validation: slide AUC (bootstrap 95% interval),
                                balanced accuracy, lesion FROC, a row per slide with its fold
    crossval/heatmaps/          every fold's attention heatmaps pooled (links) and scored by
                                the official lesion rules (its summary.json)
    crossval.json               per fold: slides, its validation summary, seconds

Resumable as ``cross-validate`` is: a fold with its ``summary.json`` is done, a fold with a
``last.ckpt`` resumes.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

from hsmla_med.errors import InputError
from hsmla_med.io import write_json
from hsmla_med.io.lesion_csv import LESIONS
from hsmla_med.metrics.pathology import auc, auc_interval, balanced_accuracy
from hsmla_med.pipelines.camelyon16.mil import HEATMAPS, slide_bags, slide_fold, train_bags

__all__ = ["cross_validate_slides"]

log = logging.getLogger("hsmla_med")


def cross_validate_slides(config: dict, features: str | Path | None = None, labels: str | Path | None = None, folds: list[int] | None = None,
                          progress=print) -> dict:
    """Run the folds (all, or ``folds``) into ``config["output"]`` and score the pooled
    validation (module docstring); returns ``crossval.json``'s document.

    Args:
        config: a validated camelyon16 task config, ``output`` the cross-validation folder;
            ``data.folds`` the folds of a splits file made now.
        features: the feature folder (CLAM's layout), or ``None`` to encode the dataset's
            slides into ``OUTPUT/features``.
        labels: the label CSV, or ``None`` for the dataset's ``slide_labels.csv``.
        folds: the folds to run (default: all); the pooled summary needs all of them.
        progress: called with a line per fold and per slide encoded.
    """
    root = Path(config["output"])
    data = slide_bags(config, root, features, labels, progress)
    count = slide_fold({**config, "fold": 0}, data)[2]["folds"]  # makes splits_final.json on first use
    wanted = list(range(count)) if folds is None else folds
    bad = [k for k in wanted if not 0 <= k < count]
    if bad:
        raise InputError(f"--folds {bad}: the splits have folds 0..{count - 1}")
    started = time.perf_counter()
    runs = []
    for k in wanted:
        progress(f"cross-validation: fold {k} of 0..{count - 1}")
        folder = root / f"fold_{k}"
        if (folder / "summary.json").is_file():
            log.info("fold %d: done before (%s)", k, folder / "summary.json")
            summary, seconds = json.loads((folder / "summary.json").read_text()), None
        else:
            begun = time.perf_counter()
            summary = train_bags({**config, "fold": k, "output": str(folder)}, folder, data, (folder / "last.ckpt").is_file(), progress, fold=True)
            seconds = round(time.perf_counter() - begun, 1)
        runs.append({"fold": k, "slides": [r["slide"] for r in summary["metric_per_case"]], "validation": _scalars(summary), "seconds": seconds})
    report = {"task": "camelyon16", "supervision": "slide", "folds": runs, "seconds": round(time.perf_counter() - started, 1)}
    if sorted(wanted) == list(range(count)):
        report["pooled"] = {"summary": str(root / "crossval" / "summary.json"), **_scalars(_pool(data, root, wanted))}
    write_json(root / "crossval.json", report)
    return report


def _scalars(summary: dict) -> dict:
    """A summary's figures, for crossval.json."""
    return {k: summary.get(k) for k in ("auc", "auc_ci95", "balanced_accuracy", "froc", "attention_top10_in_lesions")}


def _pool(data, root: Path, folds: list[int]) -> dict:
    """Every fold's validation slides scored together into ``crossval/``: slide AUC with its
    bootstrap interval and balanced accuracy over the slides' scores, the mean attention share
    in the lesions, and the lesion FROC of their attention heatmaps pooled
    (:func:`~hsmla_med.pipelines.camelyon16.pool_lesions`) where the slides were found."""
    from hsmla_med.pipelines.camelyon16 import pool_lesions

    rows, drawn = [], []
    for k in folds:
        summary = json.loads((root / f"fold_{k}" / "summary.json").read_text())
        rows += [{**row, "fold": k} for row in summary["metric_per_case"]]
        heatmaps = root / f"fold_{k}" / HEATMAPS
        drawn.append((heatmaps, [data.cases[r["slide"]] for r in summary["metric_per_case"]
                                 if (heatmaps / LESIONS / f"{r['slide']}.csv").is_file()]))
    scores, labels = [r["score"] for r in rows], [r["label"] for r in rows]
    shares = [r["attention_in_lesions"] for r in rows if r.get("attention_in_lesions") is not None]
    value = auc(scores, labels)  # NaN with one class: null in JSON
    lesions = pool_lesions(drawn, root / "crossval" / HEATMAPS, data.root) if any(cases for _, cases in drawn) else {}
    summary = {"task": "camelyon16", "supervision": "slide", "folds": folds, "auc": None if math.isnan(value) else value, "auc_ci95": auc_interval(scores, labels),
               "auc_slides": len(rows), "balanced_accuracy": balanced_accuracy(scores, labels), "froc": lesions.get("froc"),
               "sensitivity": lesions.get("sensitivity"), "lesions": lesions.get("lesions"),
               "attention_top10_in_lesions": sum(shares) / len(shares) if shares else None, "features": str(data.features),
               "labels": str(data.labels), "metric_per_case": rows}
    write_json(root / "crossval" / "summary.json", summary)
    return summary
