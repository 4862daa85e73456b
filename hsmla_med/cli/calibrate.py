"""``hsmla-med calibrate``: temperature scaling of a checkpoint on its validation cases."""

from __future__ import annotations

from pathlib import Path

from hsmla_med.cli.evaluate import scored_cases
from hsmla_med.cli.invocation import Invocation
from hsmla_med.cli.options import add_trainer_options
from hsmla_med.defaults import CALIBRATION_SAMPLES
from hsmla_med.pipelines import get_task, tasks_with


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="fit a temperature to a checkpoint's probabilities on its validation cases",
                       description=f"Temperature scaling: runs the checkpoint ({', '.join(tasks_with('calibration'))}) on the validation cases of the split it "
                       "recorded, as evaluate does, fits one temperature T (or one per class) by L-BFGS minimising the NLL of softmax(logits / T) "
                       "on a uniform sample of the validation voxels or patches, and writes OUTPUT/<checkpoint name> (the calibrated checkpoint: "
                       "the network divides its logits by T, so infer, --save-probabilities, wsi-heatmap, evaluate and export apply it), "
                       "OUTPUT/calibration.json (T; ECE over 15 equal-mass bins, over all samples and over the foreground, Brier score and "
                       "NLL, each before and after) and OUTPUT/reliability.png.")
    p.add_argument("--checkpoint", required=True, metavar="CKPT", help="a checkpoint written by train")
    p.add_argument("--data-dir", help="the dataset the checkpoint trained on (default: the synthetic dataset)")
    p.add_argument("--config", help="YAML merged over the task's default config (configs/<task>.yaml)")
    p.add_argument("--output", required=True, help="folder for the calibrated checkpoint, calibration.json and reliability.png")
    p.add_argument("--per-class", action="store_true", help="one temperature per class (can change the argmax, hence the label maps); "
                   "default: one temperature, which keeps every argmax")
    p.add_argument("--samples", type=int, default=CALIBRATION_SAMPLES, metavar="N", help="fit and score on a uniform sample of at most N "
                   f"validation voxels or patches (default {CALIBRATION_SAMPLES})")
    p.add_argument("--allow-training-cases", action="store_true", help="calibrate on validation cases the checkpoint trained on (refused by default)")
    add_trainer_options(p)


def run(args, invocation: Invocation) -> dict | None:
    from hsmla_med.engine.calibration import calibrate, check_calibratable
    from hsmla_med.engine.checkpoint import read_hparams
    from hsmla_med.errors import InputError

    hparams = read_hparams(args.checkpoint)  # a missing or foreign file: one line, before any work
    check_calibratable(hparams, args.checkpoint)
    args.task = hparams["task"]
    task = get_task(args.task)
    output = invocation.writable_folder(args.output, "--output")
    module, _ = task.load(args.checkpoint)
    config, cases = scored_cases(task, module, args, [args.checkpoint])
    if not cases.validation:
        raise InputError(f"--checkpoint {args.checkpoint}: the split it recorded leaves no validation cases in {config['data']['data_dir'] or 'the synthetic dataset'}")
    record = calibrate(task, module, task.datamodule(config, cases), config["trainer"], args.checkpoint, output, args.per_class, args.samples,
                       cases.split)
    if record is not None:
        before, after = record["before"], record["after"]
        fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
        print(f"temperature {', '.join(f'{t:.4g}' for t in record['temperature'])} from {record['samples']} validation samples; "
              + "; ".join(f"{k} {fmt(before[k])} -> {fmt(after[k])}" for k in ("ece", "ece_foreground", "brier", "nll")))
        print(f"calibrated checkpoint: {output / Path(args.checkpoint).name}; {output / 'calibration.json'}, {output / 'reliability.png'}")
        invocation.write_html_report(output)
    return record
