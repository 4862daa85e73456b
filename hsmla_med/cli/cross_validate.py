"""``hsmla-med cross-validate``: nnU-Net's workflow, every fold of splits_final.json trained,
its validation predicted, and the pooled validation scored."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from hsmla_med.cli.invocation import Invocation, first_process, report
from hsmla_med.cli.options import add_training_options, device, run_config
from hsmla_med.cli.train import add_slide_options, check_patch_options, slide_config, train
from hsmla_med.pipelines import get_task

_COUNTS = ("TP", "FP", "FN", "TN", "n_pred", "n_ref")  # voxel counts: not printed as scores


def add_parser(sub) -> None:
    p = sub.add_parser("cross-validate", help="train every fold of splits_final.json and score the pooled validation",
                       description="nnU-Net's workflow: trains each fold of splits_final.json into OUTPUT/fold_K (a started fold resumes, a "
                       "finished one is skipped), predicts fold K's validation cases with its last.ckpt into OUTPUT/fold_K/validation "
                       "(volumes: label maps and <case>.npz probabilities in the input geometry), scores them pooled (OUTPUT/crossval/"
                       "summary.json; btcv and other per-case tasks; otherwise the mean of the folds' validation summaries), chooses "
                       "OUTPUT/postprocessing.json on them (btcv), and writes OUTPUT/crossval.json. infer --checkpoint "
                       "OUTPUT/fold_*/last.ckpt then averages the folds' probabilities.")
    add_training_options(p, "cross-validation folder (default runs/<task>-cv)")
    p.add_argument("--folds", help="only these folds, e.g. 0,2 (default: all); the pooled summary needs all of them")
    add_slide_options(p, "each fold's validation slides scored by the fold that did not train on them, pooled into OUTPUT/crossval/summary.json "
                      "(slide AUC with its bootstrap interval, balanced accuracy, lesion FROC of the attention heatmaps)",
                      "the folds are over the slides it does not hold out (split test, else the slides named test_*)")


def run(args, invocation: Invocation) -> dict:
    from hsmla_med.crossval import cross_validate
    from hsmla_med.pipelines.task import InferenceOptions

    slide = args.supervision == "slide"
    if args.output is None:
        args.output = f"runs/{args.task_alias or args.task}{'_slide' if slide else ''}-cv"
    if not slide:
        check_patch_options(args)
    config = slide_config(args) if slide else run_config(args)
    folds = _folds(args.folds)
    invocation.writable_folder(config["output"], "--output")
    if slide:
        from hsmla_med.cli.train import slide_summary_lines
        from hsmla_med.pipelines.camelyon16.mil_crossval import cross_validate_slides

        result = cross_validate_slides(config, args.features, args.labels, folds, progress=report)
        lines = slide_summary_lines(json.loads(Path(result["pooled"]["summary"]).read_text()), Path(config["output"]) / "crossval") if "pooled" in result else []
    else:
        options = InferenceOptions(device=device("auto"), save_probabilities=True, overwrite=True, progress=report)
        result = cross_validate(get_task(config["task"]), config, partial(_train_fold, invocation), options, folds, progress=report)
        pooled = result.get("pooled") or {}
        means = pooled.get("foreground_mean") or pooled.get("mean_of_folds") or {}
        lines = [", ".join(f"{k} {v:.4f}" for k, v in means.items() if isinstance(v, (int, float)) and k not in _COUNTS)]
    if first_process():
        print(f"\ncross-validation of {len(result['folds'])} fold(s) in {result['seconds']:.0f} s; pooled validation: " + "\n  ".join(lines)
              + f"\n  report: {Path(config['output']) / 'crossval.json'}")
        invocation.write_html_report(Path(config["output"]))
    return result


def _folds(text: str | None) -> list[int] | None:
    """``--folds 0,2`` as fold numbers."""
    from hsmla_med.errors import InputError

    if text is None:
        return None
    try:
        return [int(k) for k in text.split(",")]
    except ValueError:
        raise InputError(f"--folds {text!r}: give fold numbers separated by commas, e.g. 0,2") from None


def _train_fold(invocation: Invocation, config: dict, resume: bool = False) -> dict:
    return train(config, invocation, resume)
