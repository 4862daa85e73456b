"""``hsmla-med train``: train a network on a task (Lightning), and the training run that
``cross-validate`` and ``demo`` repeat."""

from __future__ import annotations

import logging
from pathlib import Path

from hsmla_med.cli.invocation import Invocation, first_process
from hsmla_med.cli.options import add_training_options, run_config
from hsmla_med.pipelines import CARDS, get_task

log = logging.getLogger("hsmla_med")


def add_parser(sub) -> None:
    monitors = ", ".join(f"{n} {card.monitor}" for n, card in CARDS.items())
    p = sub.add_parser("train", help="train a network on a task", description="Train with Lightning; writes last.ckpt, best.ckpt (highest "
                       f"validation score: {monitors}), metrics.json, metrics.csv, logs/ and training_curve.png into --output.")
    add_training_options(p, "run folder (config: output, default runs/<task>)")
    p.add_argument("--resume", action="store_true", help="continue from OUTPUT/last.ckpt (weights, optimizer, schedule, step)")
    p.add_argument("--fold", type=int, help="cross-validation fold of splits_final.json to train (config: fold, default 0)")


def run(args, invocation: Invocation) -> dict:
    return train(run_config(args), invocation, args.resume)


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
