"""``hsmla-med infer``: run a checkpoint (or an exported network, or an ensemble) on new inputs."""

from __future__ import annotations

import time

from hsmla_med.cli.invocation import Invocation, apart, report
from hsmla_med.cli.options import add_declared_options, add_prediction_options, add_task_options, checkpoint_task, declared_values, prediction_options
from hsmla_med.defaults import UNCERTAINTY_KINDS, UNCERTAINTY_THRESHOLD
from hsmla_med.pipelines import CARDS, get_task, tasks_with


def add_parser(sub) -> None:
    from hsmla_med.config import task_config

    p = sub.add_parser("infer", help="run a checkpoint on new inputs", description="Run a checkpoint on new inputs. " + "; ".join(f"{n}: {card.outputs}" for n, card in CARDS.items()) + ".")
    add_task_options(p, data=False, required=False, help="; default: the task the checkpoint was trained for")
    p.add_argument("--checkpoint", required=True, nargs="+", metavar="CKPT", help="a checkpoint written by train (best.ckpt or last.ckpt), or a "
                   "network of hsmla-med export: model.ts or a bundle folder; several (the folds of cross-validate): their ensemble, the "
                   "mean of their class probabilities (float32) before the argmax (checkpoints of one task, label set, spatial dims and "
                   "data preparation)")
    p.add_argument("--input", required=True, help="a file or a folder: " + "; ".join(f"{card.inputs} ({n})" for n, card in CARDS.items()))
    p.add_argument("--output", required=True, help="folder for the predictions")
    p.add_argument("--tta", action="store_true", help="mirroring test-time augmentation")
    overlaps = ", ".join(f"{n} {c['inference']['overlap']}" for n in CARDS if "overlap" in (c := task_config(n))["inference"])
    p.add_argument("--overlap", type=float, help=f"sliding-window overlap in [0, 1) (default: the checkpoint's; as trained by default: {overlaps})")
    p.add_argument("--output-format", action="append", metavar="F", help=f"{', '.join(tasks_with('output_formats'))}: the label map "
                   "formats, by the volume format registry's names: nifti (OUTPUT/<case>.nii.gz), metaimage (.mha), nrrd (.nrrd) and/or "
                   "dicom-seg (OUTPUT/<case>.seg.dcm, a DICOM SEG referencing the input series; DICOM inputs only); repeat it or give a "
                   "comma list; default: the input's own format (NIfTI for a DICOM series)")
    p.add_argument("--uncertainty", choices=UNCERTAINTY_KINDS, help=f"{', '.join(tasks_with('uncertainty'))}: also write "
                   "OUTPUT/uncertainty/<case>_uncertainty.nii.gz, "
                   "the voxel-wise uncertainty on the label map's grid, normalised to [0, 1] (entropy: of the class probabilities; "
                   "mutual-information: the disagreement of the mirrored copies of --tta and/or of several --checkpoint, which it needs), "
                   "and OUTPUT/uncertainty.csv, a review queue: per case the mean uncertainty over the predicted foreground, the volume "
                   "(mL) above --uncertainty-threshold and the foreground's volume, most uncertain first")
    p.add_argument("--uncertainty-threshold", type=float, default=UNCERTAINTY_THRESHOLD, metavar="U", help="with --uncertainty: voxels above U "
                   f"count as uncertain in uncertainty.csv (default {UNCERTAINTY_THRESHOLD}: half the largest possible entropy)")
    add_declared_options(p, "infer")
    add_prediction_options(p)


def output_formats(given: list[str] | None, task) -> tuple[str, ...]:
    """``--output-format`` values (repeated or comma lists) in order, once each, each a format of
    the volume format registry that the task's card declares; none given: ``()``, the input's own."""
    from hsmla_med.errors import InputError
    from hsmla_med.io.volumes import output_format

    formats = tuple(dict.fromkeys(f.strip() for value in given or [] for f in value.split(",") if f.strip()))
    for name in formats:
        written = output_format(name)
        if name not in task.card.output_formats:
            writers = ", ".join(tasks_with("output_formats", name))
            raise InputError(f"--output-format {name}: only --task {writers or 'none'} writes label volumes as {written.title}, not {task.name}")
    return formats


def run(args, invocation: Invocation) -> list:
    from hsmla_med.errors import InputError

    args.task = checkpoint_task(args)
    task = get_task(args.task)
    formats = output_formats(args.output_format, task)
    if args.uncertainty is not None and args.uncertainty not in task.card.uncertainty:
        raise InputError(f"--uncertainty: only --task {', '.join(tasks_with('uncertainty', args.uncertainty))} writes uncertainty maps, not {task.name}")
    declared = task.inference_values(declared_values(args, "infer", task.name), args.checkpoint, report)
    options = prediction_options(args, output_formats=formats, uncertainty=args.uncertainty, uncertainty_threshold=args.uncertainty_threshold, **declared)
    apart(args.input, args.output, "--input")
    output = invocation.writable_folder(args.output, "--output")
    module, _ = task.load(args.checkpoint)
    started = time.perf_counter()
    written = task.predict(module, args.input, output, options)
    report(f"{len(written)} output file(s) in {output} ({time.perf_counter() - started:.1f} s): "
           + ", ".join(p.name for p in written[:3]) + (", ..." if len(written) > 3 else ""))
    return written
