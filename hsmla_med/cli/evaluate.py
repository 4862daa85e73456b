"""``hsmla-med evaluate``: a checkpoint's metrics on its validation cases, or any tool's
predictions scored against reference labels."""

from __future__ import annotations

import logging
from pathlib import Path

from hsmla_med.cli.invocation import Invocation, first_process
from hsmla_med.cli.options import (PREDICTIONS_TASK, add_declared_options, add_graph_option, add_task_options, add_trainer_options, checkpoint_task,
                                   declared_values, run_config)
from hsmla_med.cli.train import print_summary
from hsmla_med.pipelines import CARDS, get_task, task_name, tasks_with

log = logging.getLogger("hsmla_med")


def add_parser(sub) -> None:
    p = sub.add_parser("evaluate", help="metrics of a checkpoint on a dataset's validation cases, or of any folder of predicted label maps",
                       description="The task's validation metrics of a checkpoint (--task, --checkpoint) on the validation cases ("
                       + "; ".join(f"{n}: {card.metrics}" for n, card in CARDS.items()) + "); writes OUTPUT/metrics.json. "
                       "Or, with --predictions DIR --labels DIR, scores label maps from any tool (ours, nnU-Net's, MONAI's) against the "
                       "reference label maps of the same file names (with --dataset-json also by the image its lists name beside each "
                       "label: imgNNNN with labelNNNN), the pairs there are, as nnU-Net's compute_metrics_on_folder does, plus HD95 and "
                       "NSD in mm and bootstrap 95% intervals; writes summary.json and metrics_per_case.csv into --output (default: DIR).")
    add_task_options(p, required=False, help=f"; default with --checkpoint: the task it was trained for; with --predictions: {task_name(PREDICTIONS_TASK)}")
    p.add_argument("--checkpoint", nargs="+", metavar="CKPT", help="a checkpoint written by train; several: their ensemble (probabilities "
                   "averaged as infer does), which has trained on every member's training cases")
    p.add_argument("--output", help="folder for metrics.json (default runs/evaluate), or for summary.json with --predictions (default: that folder)")
    p.add_argument("--predictions", metavar="P", help="predictions of any tool, scored without a checkpoint: btcv (default) a folder of NIfTI / MetaImage / NRRD "
                   "label maps; luna16 a submission CSV (or the folder infer wrote it in); camelyon16 a folder of lesion CSVs and the slide CSV; endovis a folder of mask PNGs")
    p.add_argument("--labels", metavar="L", help="with --predictions, the reference: btcv a folder of label maps (same file names, same shape "
                   "and affine); luna16 annotations.csv (or a LUNA16 folder, whose CSVs are found there); camelyon16 the folder of annotation XMLs; endovis the dataset folder; "
                   "with --features, the slides' label CSV")
    p.add_argument("--features", metavar="FEATS", help="camelyon16, a checkpoint of train --supervision slide: the feature folder (CLAM's "
                   "h5_files) of the slides to score, their labels in --labels; writes summary.json, attention/ and, with --data-dir holding "
                   "the slides, heatmaps/ with the lesion FROC")
    p.add_argument("--tta", action="store_true", help="mirroring test-time augmentation")
    p.add_argument("--allow-training-cases", action="store_true", help="score validation cases the checkpoint trained on (refused by default: "
                   "the checkpoint records its fold's case IDs)")
    p.add_argument("--routing", choices=["gate", "off", "all"], help="override HSMLA routing: off = linear attention only, all = refine every tile")
    add_declared_options(p, "evaluate")
    add_graph_option(p)
    add_trainer_options(p)


def run(args, invocation: Invocation) -> dict:
    from hsmla_med.engine.calibration import CalibrationSample
    from hsmla_med.engine.callbacks import write_gate_example
    from hsmla_med.engine.run import evaluate
    from hsmla_med.errors import InputError
    from hsmla_med.io import file_sha256, write_json

    if args.predictions is not None:
        return _score_predictions(args, invocation)
    if args.checkpoint is None:
        raise InputError("evaluate needs --checkpoint, or --predictions DIR --labels DIR")
    if args.features is not None:
        return _score_slide_labels(args, invocation)
    args.task = checkpoint_task(args)  # the config of the cases to score is this task's
    if args.features is None and args.task in tasks_with("slide_labels") and _slide_labels(args.checkpoint):
        raise InputError(f"--checkpoint {' '.join(args.checkpoint)}: trained on slide labels (patch features); score it with --features FEATS --labels CSV")
    task = get_task(args.task)
    declared = declared_values(args, "evaluate", task.name)
    if args.output is None:  # the default of this mode (predictions mode writes beside the predictions)
        args.output = "runs/evaluate"
    output = invocation.writable_folder(args.output, "--output")
    module, meta = task.load(args.checkpoint, tta=args.tta)
    module.use_cuda_graphs(args.cuda_graphs)
    if args.routing:
        if not hasattr(module.network, "set_routing") or not module.network.hsmla_layers():
            raise InputError(f"--routing: {' '.join(args.checkpoint)} holds a {type(module.network).__name__}, which has no HSMLA layers")
        module.network.set_routing(args.routing)
    config, cases = scored_cases(task, module, args, [str(c) for c in args.checkpoint])
    task.evaluation_outputs(module, output, declared)
    module.calibration_sample = CalibrationSample()  # ECE, Brier, NLL where the task draws one (its card declares calibration)
    summary = evaluate(module, task.datamodule(config, cases), config["trainer"], output)
    if not first_process():  # every process holds the gathered summary; one writes and prints it
        return summary
    checkpoints = [str(c) for c in args.checkpoint]
    # what identifies the model and its data once the checkpoint has moved: the files' sha256 and
    # the fingerprint of the dataset its plan was made from (the report shows both)
    digests = [file_sha256(c) if Path(c).is_file() else None for c in checkpoints]
    one = len(checkpoints) == 1
    write_json(output / "metrics.json", {**summary, **meta, "checkpoint": checkpoints[0] if one else checkpoints,
                                         "checkpoint_sha256": digests[0] if one else digests,
                                         "fingerprint": (getattr(module, "config", {}).get("plan") or {}).get("fingerprint"),
                                         "routing": args.routing or "gate"})
    reports = task.evaluation_reports(module, output)
    write_gate_example(module, output)
    print_summary(task, summary, output)
    if reports:
        print(f"per case: {', '.join(map(str, reports))}")
    invocation.write_html_report(output)
    return summary


def _slide_labels(checkpoints: list[str]) -> bool:
    """Whether the checkpoints are of slide-label training (``train --supervision slide``)."""
    from hsmla_med.pipelines.camelyon16.mil import slide_checkpoint

    return all(map(slide_checkpoint, checkpoints))


def _score_slide_labels(args, invocation: Invocation) -> dict:
    """``evaluate --checkpoint CK --features FEATS --labels CSV``: a checkpoint of slide-label
    training on the slides of a feature folder (:func:`~hsmla_med.pipelines.camelyon16.mil.evaluate_slides`)."""
    from hsmla_med.cli.train import slide_summary_lines
    from hsmla_med.errors import InputError
    from hsmla_med.pipelines.camelyon16.mil import evaluate_slides

    (slide_task,) = tasks_with("slide_labels")
    if args.task not in (None, slide_task):
        raise InputError(f"--features: slide-label checkpoints are {slide_task}'s, not --task {args.task}'s")
    args.task = slide_task
    if args.labels is None:
        raise InputError("--features needs --labels, the slides' label CSV")
    if len(args.checkpoint) != 1 or not _slide_labels(args.checkpoint):
        raise InputError(f"--features: --checkpoint {' '.join(args.checkpoint)} is no single checkpoint of train --supervision slide")
    output = invocation.writable_folder(args.output or "runs/evaluate", "--output")
    summary = evaluate_slides(args.checkpoint[0], args.features, args.labels, output, run_config(args)["trainer"], args.data_dir,
                              args.allow_training_cases)
    if first_process():
        print("\n".join(slide_summary_lines(summary, output)))
    invocation.write_html_report(output)
    return summary


def _score_predictions(args, invocation: Invocation) -> dict:
    from hsmla_med.errors import InputError

    if args.labels is None:
        raise InputError("--predictions needs --labels, the reference files")
    if args.checkpoint is not None:
        raise InputError("--checkpoint with --predictions: the predictions are scored as they are; give one or the other")
    task = get_task(args.task or PREDICTIONS_TASK)
    options = {**declared_values(args, "evaluate", task.name), "data_dir": args.data_dir}
    predictions, labels = Path(args.predictions), Path(args.labels)
    for option, path in (("--predictions", predictions), ("--labels", labels)):
        if not path.exists():  # before the default --output would create a folder there
            raise InputError(f"{option} {path}: not found")
    default = predictions if predictions.is_dir() else predictions.parent
    output = invocation.writable_folder(args.output if args.output is not None else default, "--output")
    summary = task.score_predictions(predictions, labels, output, options)
    print("\n".join(task.score_lines(summary, output)))
    invocation.write_html_report(output)
    return summary


def scored_cases(task, module, args, checkpoints: list[str]):
    """The config and the validation cases of the split the checkpoint recorded, which
    ``evaluate`` and ``calibrate`` run it on; refused (one line) when it trained on them (unless
    ``--allow-training-cases``) or predicts other classes than the dataset has."""
    from hsmla_med.errors import InputError

    config = task.evaluation_config(run_config(args), module)
    cases = task.datalist(config)
    named = " ".join(checkpoints)
    trained = set((module.config.get("split") or {}).get("train") or [])
    seen = sorted(trained & set((cases.split or {}).get("val") or []))
    if not trained:
        log.warning("%s records no split (written before splits_final.json): cannot check that its validation cases are unseen", named)
    elif seen and not args.allow_training_cases:
        where = (f"fold {cases.split['fold']} of {cases.split['file']}" if cases.split.get("file")
                 else f"case IDs of its training split, found in {cases.split['dataset']}")
        raise InputError(f"--checkpoint {named} trained on {len(seen)} of the {len(cases.validation)} cases to score "
                         f"({where}: {', '.join(seen[:5])}{' ...' if len(seen) > 5 else ''}); "
                         "their scores would not be held-out scores; pass --allow-training-cases to score them anyway")
    if cases.label_names != module.label_names:
        raise InputError(f"--checkpoint {named} predicts {len(module.label_names)} classes {module.label_names}, "
                         f"the dataset has {len(cases.label_names)} {cases.label_names}")
    return config, cases
