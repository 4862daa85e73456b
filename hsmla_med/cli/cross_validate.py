"""``hsmla-med cross-validate``: nnU-Net's workflow, every fold of splits_final.json trained,
its validation predicted, and the pooled validation scored."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from hsmla_med.cli.invocation import Invocation, first_process, report
from hsmla_med.cli.options import add_training_options, device, run_config
from hsmla_med.cli.train import train
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


def run(args, invocation: Invocation) -> dict:
    from hsmla_med.crossval import cross_validate
    from hsmla_med.errors import InputError
    from hsmla_med.pipelines.task import InferenceOptions

    if args.output is None:
        args.output = f"runs/{args.task_alias or args.task}-cv"
    config = run_config(args)
    folds = None
    if args.folds is not None:
        try:
            folds = [int(k) for k in args.folds.split(",")]
        except ValueError:
            raise InputError(f"--folds {args.folds!r}: give fold numbers separated by commas, e.g. 0,2") from None
    task = get_task(config["task"])
    invocation.writable_folder(config["output"], "--output")
    options = InferenceOptions(device=device("auto"), save_probabilities=True, overwrite=True, progress=report)
    result = cross_validate(task, config, partial(_train_fold, invocation), options, folds, progress=report)
    if first_process():
        pooled = result.get("pooled") or {}
        means = pooled.get("foreground_mean") or pooled.get("mean_of_folds") or {}
        print(f"\ncross-validation of {len(result['folds'])} fold(s) in {result['seconds']:.0f} s; pooled validation: "
              + ", ".join(f"{k} {v:.4f}" for k, v in means.items() if isinstance(v, (int, float)) and k not in _COUNTS)
              + f"\n  report: {Path(config['output']) / 'crossval.json'}")
        invocation.write_html_report(Path(config["output"]))
    return result


def _train_fold(invocation: Invocation, config: dict, resume: bool = False) -> dict:
    return train(config, invocation, resume)
