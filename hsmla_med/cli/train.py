"""``hsmla-med train``: train a network on a task (Lightning), and the training run that
``cross-validate`` and ``demo`` repeat."""

from __future__ import annotations

import logging
from pathlib import Path

from hsmla_med.cli.invocation import Invocation, first_process
from hsmla_med.cli.options import add_training_options, run_config
from hsmla_med.pipelines import CARDS, get_task, tasks_with

log = logging.getLogger("hsmla_med")


def add_parser(sub) -> None:
    monitors = ", ".join(f"{n} {card.monitor}" for n, card in CARDS.items())
    p = sub.add_parser("train", help="train a network on a task", description="Train with Lightning; writes last.ckpt, best.ckpt (highest "
                       f"validation score: {monitors}), metrics.json, metrics.csv, logs/ and training_curve.png into --output.")
    add_training_options(p, "run folder (config: output, default runs/<task>)")
    p.add_argument("--resume", action="store_true", help="continue from OUTPUT/last.ckpt (weights, optimizer, schedule, step)")
    p.add_argument("--fold", type=int, help="cross-validation fold of splits_final.json to train (config: fold, default 0)")
    add_slide_options(p, "scored on the held-out slides (summary.json, attention/, heatmaps/: its attention as wsi-heatmap's files, with the "
                      "lesion FROC)", "held out: split test, else the slides named test_*, else the fold's validation slides")


def add_slide_options(p, scored: str, held: str) -> None:
    """``--supervision``, ``--features``, ``--labels`` and ``--mil-mode`` of ``train`` and
    ``cross-validate``: ``scored`` and ``held`` say what the command scores."""
    g = p.add_argument_group("slide labels alone (camelyon16): attention multiple-instance learning on patch features")
    g.add_argument("--supervision", choices=["patch", "slide"], default="patch", help="patch (default): a patch classifier from the lesion "
                   f"outlines; slide: MONAI's MILModel on bags of frozen patch features from each slide's diagnosis alone, {scored}")
    g.add_argument("--features", metavar="FEATS", help="with --supervision slide: the feature folder (CLAM's h5_files/<slide>.h5, as "
                   "wsi-features writes it); default: the dataset's slides encoded with config mil.features into OUTPUT/features")
    g.add_argument("--labels", metavar="CSV", help="with --supervision slide: the slides' labels, CLAM's slide_id,label[,split] or "
                   f"CAMELYON16's reference.csv; {held}; default: the dataset's slide_labels.csv")
    g.add_argument("--mil-mode", choices=["att", "att_trans"], help="with --supervision slide: MILModel's pooling (config: mil.mil_mode, default att)")


def check_patch_options(args) -> None:
    """Refuse the slide-label options without ``--supervision slide``."""
    from hsmla_med.errors import InputError

    for option in ("features", "labels", "mil_mode"):
        if getattr(args, option) is not None:
            raise InputError(f"--{option.replace('_', '-')}: an option of --supervision slide (multiple-instance learning from slide labels)")


def slide_config(args) -> dict:
    """The task config of a slide-label run (``--supervision slide``) from the command line:
    ``--mil-mode`` into ``mil``; ``mil.epochs`` unless ``--max-epochs`` or ``--max-steps``."""
    from hsmla_med.errors import InputError

    if args.task not in tasks_with("slide_labels"):
        raise InputError(f"--supervision slide: slide-label training is {', '.join(tasks_with('slide_labels'))}'s; --task {args.task} trains on its labels")
    for option in ("model", "mode"):
        if getattr(args, option) is not None:
            raise InputError(f"--{option} with --supervision slide: the model is MONAI's MILModel on patch features (--mil-mode, config mil)")
    config = run_config(args)
    if args.mil_mode is not None:
        config["mil"]["mil_mode"] = args.mil_mode
    if args.max_steps is None and args.max_epochs is None:
        config["trainer"].update(max_epochs=config["mil"]["epochs"], max_steps=None)
    return config

def run(args, invocation: Invocation) -> dict:
    if args.supervision == "slide":
        return train_slide_labels(args, invocation)
    check_patch_options(args)
    return train(run_config(args), invocation, args.resume)


def train_slide_labels(args, invocation: Invocation) -> dict:
    """``train --task camelyon16 --supervision slide`` (:func:`run_slide_labels`)."""
    from hsmla_med.config import task_config

    config = slide_config(args)
    if args.output is None and config["output"] == task_config(args.task)["output"]:  # apart from the patch classifier's run
        config["output"] = f"{config['output']}_slide"
    return run_slide_labels(config, invocation, args.features, args.labels, args.resume)


def run_slide_labels(config: dict, invocation: Invocation, features: str | None = None, labels: str | None = None, resume: bool = False) -> dict:
    """Attention MIL on patch features from the slides' labels alone into ``config["output"]``
    (:func:`~hsmla_med.pipelines.camelyon16.mil.train_slides`), its summary printed and its
    report written; the held-out summary."""
    import lightning as L

    from hsmla_med.io import write_yaml
    from hsmla_med.pipelines.camelyon16.mil import train_slides

    output = invocation.writable_folder(config["output"], "--output")
    L.seed_everything(config["seed"], workers=True, verbose=False)
    if first_process():
        write_yaml(output / "config.yaml", config)
    summary = train_slides(config, output, features, labels, resume)
    if first_process():
        print("\n" + "\n".join(slide_summary_lines(summary, output)))
    invocation.write_html_report(output)
    return summary


def slide_summary_lines(summary: dict, output: Path) -> list[str]:
    """What ``train`` and ``evaluate`` print of a slide-label summary."""
    fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
    interval = summary["auc_ci95"]
    spread = f" (95% bootstrap {fmt(interval[0])} to {fmt(interval[1])})" if interval else ""
    lesions = f"; lesion FROC {fmt(summary['froc'])} over {summary['lesions']} lesions" if summary.get("lesions") is not None else ""
    return [f"{summary['auc_slides']} held-out slides: slide AUC {fmt(summary['auc'])}{spread}, balanced accuracy "
            f"{fmt(summary['balanced_accuracy'])}{lesions}", f"summary: {output / 'summary.json'}"]


def train(config: dict, invocation: Invocation, resume: bool = False) -> dict:
    """Train the run of a validated task config into ``config["output"]``; its summary."""
    import lightning as L

    from hsmla_med.engine.run import fit
    from hsmla_med.io import write_json, write_yaml

    task = get_task(config["task"])
    output = invocation.writable_folder(config["output"], "--output")
    L.seed_everything(config["seed"], workers=True, verbose=False)
    cases = task.datalist(config)
    split = f" (fold {cases.split['fold']} of {cases.split['file']})" if cases.split else ""
    log.info("%s: %d training / %d validation cases%s, %d labels", task.name, len(cases.training), len(cases.validation), split, cases.num_classes)
    module = task.build_module(config, cases)
    if first_process():
        write_yaml(output / "config.yaml", config)
        if cases.plan is not None:  # what the data decided, before the first step
            from hsmla_med.data.plans import PLANS_FILE, plan_lines

            write_json(output / PLANS_FILE, cases.plan)
            log.info("\n".join(plan_lines(cases.plan, cases.plan["kept"], config, f"{cases.plan['fingerprint']}; {output / PLANS_FILE}")))
    summary = fit(module, task.datamodule(config, cases), output, config["trainer"], resume=resume)
    print_summary(task, summary, output)
    invocation.write_html_report(output)
    return summary


def print_summary(task, summary: dict | None, output: Path) -> None:
    if summary is None or not first_process():
        return
    print("\n" + "\n".join(task.summary_lines(summary)))
    print(f"metrics: {output / 'metrics.json'}")
