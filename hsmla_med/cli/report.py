"""``hsmla-med report``: a self-contained HTML page of a folder that a command wrote."""

from __future__ import annotations

from pathlib import Path

from hsmla_med.cli.invocation import Invocation


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="a self-contained HTML page of a run, evaluation or calibration folder",
                       description="Writes one HTML file (images inlined, no network needed) of a folder that train, evaluate, calibrate, "
                       "cross-validate, infer or wsi-heatmap wrote: scores, training curves, the per-case table (sortable, worst mean Dice "
                       "first) with box plots per class, the worst cases as pictures (volumes through their largest error, frames with both "
                       "outlines, missed nodules), slide overlays, FROC, calibration, the uncertainty review queue, the share of tiles each "
                       "gated layer refined, the configuration and plan, and provenance. train, evaluate, calibrate and cross-validate write it by themselves.")
    p.add_argument("folder", metavar="RUN_OR_EVAL_DIR", help="the folder to report on")
    p.add_argument("--output", metavar="FILE", help="the HTML file (default: RUN_OR_EVAL_DIR/report.html)")


def run(args, invocation: Invocation) -> Path:
    from hsmla_med.report import write_report

    path = write_report(Path(args.folder), Path(args.output) if args.output else None)
    print(f"report: {path}")
    return path
