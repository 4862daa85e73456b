"""``hsmla-med demo``: each task trained for a few minutes on its synthetic stand-in, its
held-out data predicted, and the metrics printed."""

from __future__ import annotations

import time
from pathlib import Path

from hsmla_med.cli.invocation import Invocation
from hsmla_med.cli.train import run_slide_labels, train
from hsmla_med.pipelines import CARDS, get_task, tasks_with


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="train on synthetic data for a few minutes, infer, print metrics", description="Generates synthetic data in each benchmark's format ("
                       + ", ".join(card.synthetic for card in CARDS.values() if card.synthetic) + "), trains a small HSMLA model on each (configs/<task>_demo.yaml), "
                       "runs inference on the held-out data (label volumes, slide heatmaps, frame masks, a nodule submission CSV) and prints the metrics and output paths. "
                       + " and ".join(tasks_with("slide_labels")) + " then learns again from slide labels alone (train --supervision slide: attention "
                       "MIL on patch features, <task>_slide), so both ways are shown on one scale.")
    p.add_argument("--task", choices=[*tasks_with("synthetic"), "all"], default="all", help="which demo (default: all)")
    p.add_argument("--output", default="runs/demo", help="run folder; one subfolder per task (default runs/demo)")
    p.add_argument("--max-steps", type=int, help="override the demo's training steps (of slide-label learning too)")
    p.add_argument("--config", help="YAML merged over the demo's config (configs/<task>_demo.yaml), e.g. a smaller synthetic dataset")


def run(args, invocation: Invocation) -> int:
    from importlib import resources

    from hsmla_med.config import load_yaml, merge_config, merge_user_config, task_config, validate_config
    from hsmla_med.pipelines.task import InferenceOptions

    tasks = tasks_with("synthetic") if args.task == "all" else [args.task]
    lines = []
    for name in tasks:
        started = time.perf_counter()
        overlay = resources.files("hsmla_med.configs") / f"{name}_demo.yaml"
        config = merge_config(task_config(name), load_yaml(overlay), f"{name}_demo.yaml")
        if args.config:
            config = merge_user_config(config, args.config, f"the {name} demo")
        output = Path(args.output) / name
        config["output"] = str(output)
        if args.max_steps is not None:
            config["trainer"]["max_steps"] = args.max_steps
        summary = train(validate_config(config, args.config or f"{name}_demo.yaml"), invocation)
        task = get_task(name)
        cases = task.datalist(config)
        module, _ = task.load(output / "best.ckpt")
        predictions = output / "predictions"
        for item in task.held_out(cases):
            task.predict(module, item, predictions, InferenceOptions(overwrite=True))
        # every file written, not only what marks a case done (a slide's heatmap, overlay and regions too)
        written = sorted(str(p.relative_to(predictions)) for p in predictions.rglob("*") if p.is_file() and not p.relative_to(predictions).parts[0].startswith("."))
        metric = module.monitor
        # a score over slides says so: its items (patches) are not what it averages
        held = f"{summary['slides']} held-out synthetic slides" if "slides" in summary else f"{summary['cases']} held-out synthetic items"
        lines.append(
            f"{name}: {metric} {_score(summary[metric])} on {held}, "
            f"{time.perf_counter() - started:.0f} s\n  checkpoints: {output / 'best.ckpt'}, {output / 'last.ckpt'}\n"
            f"  metrics: {output / 'metrics.json'}, curve: {output / 'training_curve.png'}, report: {output / 'report.html'}\n"
            f"  outputs in {predictions}: {', '.join(written)}"
        )
        if name in tasks_with("slide_labels"):
            lines.append(_slide_labels(name, config, Path(args.output) / f"{name}_slide", args.max_steps, invocation))
    print("\n" + "\n".join(lines))
    return 0


def _slide_labels(name: str, config: dict, output: Path, max_steps: int | None, invocation: Invocation) -> str:
    """The task learned again from its slides' labels alone (``train --supervision slide``, on
    the synthetic slides of ``mil.synthetic``, for ``mil.epochs`` epochs or ``max_steps``); its
    line of the demo's output."""
    started = time.perf_counter()
    trainer = {**config["trainer"], "max_epochs": config["mil"]["epochs"], "max_steps": max_steps}
    summary = run_slide_labels({**config, "output": str(output), "trainer": trainer}, invocation)
    return (f"{name} from slide labels alone (attention MIL): slide AUC {_score(summary['auc'])} on {summary['auc_slides']} held-out synthetic "
            f"slides, lesion FROC {_score(summary['froc'])}, top-10 attention in the lesions {_score(summary['attention_top10_in_lesions'])}, "
            f"{time.perf_counter() - started:.0f} s\n  checkpoint: {output / 'last.ckpt'}, summary: {output / 'summary.json'}, report: "
            f"{output / 'report.html'}\n  outputs: {output / 'features'} (patch features), {output / 'attention'} (per patch), "
            f"{output / 'heatmaps'} (attention heatmaps as wsi-heatmap's files)")


def _score(value: float | None) -> str:
    """A score as the demo prints it: ``n/a`` where it is undefined (held-out data of one class)."""
    return "n/a" if value is None else f"{value:.4f}"
