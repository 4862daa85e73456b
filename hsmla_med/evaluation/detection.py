"""LUNA16 nodule candidates scored as the official ``noduleCADEvaluationLUNA16.py`` scores them:
a submission CSV (``seriesuid,coordX,coordY,coordZ,probability``, LPS millimetres) against
``annotations.csv``, the irrelevant findings of ``annotations_excluded.csv`` (neither hits nor
false positives) and the scans of ``seriesuids.csv`` (the false positives are counted over all
of them), by the script's hit rule (:func:`~hsmla_med.metrics.detection.submission_matches`);
the FROC at its seven rates, the CPM, their bootstrap band
(:func:`~hsmla_med.metrics.detection.froc_band`, ``computeFROC_bootstrap``) and the FROC plot
on its axes.

The files are :mod:`hsmla_med.data.luna16`'s, found where the distribution keeps them
(:data:`~hsmla_med.data.luna16.CSV_FOLDERS`); a nodule outside its scan, which no submission
can hit, is refused where the scans are known (:func:`label_scans`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from hsmla_med.data.luna16 import (
    CSV_FOLDERS,
    csv_places,
    find_csv,
    find_scans,
    read_annotations,
    read_findings,
    read_seriesuids,
    read_submission,
)
from hsmla_med.errors import DataError
from hsmla_med.io import atomic_path, write_json
from hsmla_med.metrics.detection import FP_RATES, MAX_MARKS, froc_band, froc_curve, nodule_froc, submission_froc, submission_matches

__all__ = ["label_files", "label_scans", "plot_froc", "score_submission", "score_submission_files"]

log = logging.getLogger("hsmla_med")


def score_submission(submission: str | Path, root: str | Path) -> dict:
    """Score a submission CSV against a LUNA16 folder by the official script's rules
    (:func:`~hsmla_med.metrics.detection.submission_froc`): its annotations, excluded findings
    and the scans of ``seriesuids.csv`` (the scans found under ``root`` without one)."""
    root = Path(root)
    uids_csv = find_csv(root, "seriesuids.csv")
    uids = read_seriesuids(uids_csv) if uids_csv else list(find_scans(root))
    nodules, excluded = read_findings(root, dict.fromkeys(uids))
    return submission_froc(read_submission(submission), nodules, excluded, uids)


def score_submission_files(submission: Path, labels: Path, output: Path, options: dict, *, task: str) -> dict:
    """Score the submission CSV ``submission`` against ``labels``: an annotations.csv, or a
    LUNA16 folder (its annotations.csv, and annotations_excluded.csv and seriesuids.csv unless
    given: :func:`label_files`), with the bootstrap band of :mod:`hsmla_med.metrics.detection`.

    The scans are those of ``seriesuids.csv``; without it, those of the annotations, with a
    warning: the script divides the false positives by all the scans listed there, normal
    scans included. A nodule outside its scan, which no submission can hit, is refused naming
    the CSV's line, where the scans are known (:func:`label_scans`; ``options["skip_outside"]``:
    skipped with a warning, as training skips it). Writes ``output/summary.json`` (its
    ``"task"``: ``task``) and ``froc.png`` (:func:`plot_froc`) and returns the summary.
    ``options["seed"]`` (default 0) seeds the bootstrap.
    """
    notes, excluded_csv, uids_csv = label_files(Path(labels), options)
    candidates = read_submission(submission)  # every file is read before any warning
    scans = label_scans(Path(labels), notes, options)
    nodules = read_annotations(notes, rendered=False, scans=scans, refuse_outside=not options.get("skip_outside"))
    excluded = read_annotations(excluded_csv, excluded=True) if excluded_csv else {}
    uids, source = (read_seriesuids(uids_csv), str(uids_csv)) if uids_csv else (list(nodules), f"the series of {notes}")
    if excluded_csv is None:
        log.warning("no --excluded annotations_excluded.csv: candidates on irrelevant findings count as false positives "
                    "(the official evaluation ignores them)")
    if uids_csv is None:
        log.warning("no --seriesuids: scoring the %d scan(s) of %s; the official script counts false positives over every "
                    "scan of seriesuids.csv, so scans without nodules are missing here", len(uids), notes.name)
    scanned = set(uids)
    matches = submission_matches(candidates, nodules, excluded, uids)
    summary = {
        "task": task,
        "predictions": str(submission),
        "labels": str(notes),
        "excluded": str(excluded_csv) if excluded_csv else None,
        "scans_from": source,
        **nodule_froc(matches),
        "max_marks_per_scan": MAX_MARKS,
        "rows_not_scored": sum(len(v) for uid, v in candidates.items() if uid not in scanned),
        "bootstrap": froc_band(matches, seed=options.get("seed") or 0),
        "metric_per_case": [_scan_row(uid, m, nodules.get(uid), (scans or {}).get(uid)) for uid, m in zip(uids, matches)],
    }
    write_json(Path(output) / "summary.json", summary)
    plot_froc(matches, summary["bootstrap"], Path(output) / "froc.png")
    return summary


def _scan_row(uid: str, match, nodules: np.ndarray | None, scan: Path | None) -> dict:
    """A scan's row of ``metric_per_case``: its counts, the nodules no candidate hit (``missed``:
    x, y, z, diameter in LPS mm, as annotations.csv gives them) and its file where known (the
    report's crops of the missed nodules)."""
    missed = [] if nodules is None else nodules[np.isnan(match.nodule_probs)].tolist()
    return {"seriesuid": uid, "nodules": len(match.nodule_probs), "TP": int(np.count_nonzero(~np.isnan(match.nodule_probs))),
            "FP": len(match.fp_probs), "ignored": match.ignored, "missed": missed, "scan_file": None if scan is None else str(scan)}


def label_files(labels: Path, options: dict) -> tuple[Path, Path | None, Path | None]:
    """annotations.csv, annotations_excluded.csv and seriesuids.csv: ``--labels`` itself or, for
    a LUNA16 folder, the files found there (:data:`~hsmla_med.data.luna16.CSV_FOLDERS`);
    ``--excluded`` and ``--seriesuids`` take precedence."""
    given = {name: Path(options[key]) if options.get(key) else None
             for key, name in (("excluded", "annotations_excluded.csv"), ("seriesuids", "seriesuids.csv"))}
    for option, path in (("--excluded", given["annotations_excluded.csv"]), ("--seriesuids", given["seriesuids.csv"])):
        if path is not None and not path.is_file():
            raise DataError(f"{option} {path}: file not found")
    if not labels.is_dir():
        return labels, given["annotations_excluded.csv"], given["seriesuids.csv"]
    notes = find_csv(labels, "annotations.csv")
    if notes is None:
        raise DataError(f"--labels {labels}: annotations.csv not found ({csv_places('annotations.csv')})")
    found = {name: given[name] or find_csv(labels, name) for name in given}
    return notes, found["annotations_excluded.csv"], found["seriesuids.csv"]


def label_scans(labels: Path, notes: Path, options: dict) -> dict[str, Path] | None:
    """The scans whose geometry the annotations are checked against: those of ``--data-dir``,
    else those of the LUNA16 folder that ``--labels`` is, or holds ``annotations.csv`` where the
    distribution does (``CSVFILES/``, ``evaluationScript/annotations/``); ``None`` where there
    are none (a CSV alone is scored as it is)."""
    if options.get("data_dir"):
        return find_scans(options["data_dir"])
    places = [Path(folder).parts for folder in CSV_FOLDERS[1:]]
    root = labels if labels.is_dir() else next((notes.parents[len(p)] for p in places if notes.parent.parts[-len(p):] == p), None)
    return find_scans(root) if root is not None and any(root.rglob("*.mhd")) else None


def plot_froc(matches: list, band: dict, path: Path) -> None:
    """The FROC curve on the script's axes (log2 false positives per scan, 1/8 .. 8) with the
    bootstrap band at the seven rates; nothing without any nodule."""
    curve = froc_curve(matches)
    if curve is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r for r in FP_RATES if band["froc"][str(r)]["low"] is not None]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    grid = np.linspace(FP_RATES[0], FP_RATES[-1], 10001)  # as the script draws it: flat beyond the curve's ends
    ax.plot(grid, np.interp(grid, *curve), color="b", lw=2, label="FROC")
    ax.fill_between(rates, [band["froc"][str(r)]["low"] for r in rates], [band["froc"][str(r)]["high"] for r in rates],
                    color="b", alpha=0.15, label=f"{band['confidence']:.0%} bootstrap band")
    ax.set(xlim=(FP_RATES[0], FP_RATES[-1]), ylim=(0, 1), xlabel="Average number of false positives per scan",
           ylabel="Sensitivity")
    ax.set_xscale("log", base=2)
    ax.set_xticks(FP_RATES, [f"{r:g}" for r in FP_RATES])
    ax.grid(True, which="both")
    ax.legend(loc="lower right")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
