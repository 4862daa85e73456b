"""``hsmla-med infer``: run a checkpoint (or an exported network, or an ensemble) on new inputs."""

from __future__ import annotations

import time

from hsmla_med.cli.invocation import Invocation, apart, report
from hsmla_med.cli.options import add_declared_options, add_prediction_options, add_task_options, checkpoint_task, declared_values, prediction_options
from hsmla_med.defaults import UNCERTAINTY_KINDS, UNCERTAINTY_THRESHOLD
from hsmla_med.pipelines import CARDS, get_task, tasks_with

SEND_AE_TITLE = "HSMLA_MED"  # the calling AE title of --send dimse:..., unless --send-ae-title


def add_parser(sub) -> None:
    from hsmla_med.config import task_config

    p = sub.add_parser("infer", help="run a checkpoint on new inputs", description="Run a checkpoint on new inputs. " + "; ".join(f"{n}: {card.outputs}" for n, card in CARDS.items()) + ".")
    add_task_options(p, data=False, required=False, help="; default: the task the checkpoint was trained for")
    p.add_argument("--checkpoint", required=True, nargs="+", metavar="CKPT", help="a checkpoint written by train (best.ckpt or last.ckpt), or a "
                   "network of hsmla-med export: model.ts or a bundle folder; several (the folds of cross-validate): their ensemble, the "
                   "mean of their class probabilities (float32) before the argmax (checkpoints of one task, label set, spatial dims and "
                   "data preparation)")
    p.add_argument("--input", required=True, help="a file or a folder: " + "; ".join(f"{card.inputs} ({n})" for n, card in CARDS.items())
                   + "; or dicomweb:URL with --study: that study of a DICOMweb server (URL: the base of its /studies)")
    p.add_argument("--output", required=True, help="folder for the predictions")
    p.add_argument("--study", metavar="UID", help="with --input dicomweb:URL: the study (StudyInstanceUID) to predict on; its series are "
                   "found by QIDO-RS and retrieved by WADO-RS into OUTPUT/<Study>/<Series>/ first, then chosen as in a folder "
                   "(--series-uid, --series-rules or the checkpoint's series selection)")
    p.add_argument("--send", action="append", metavar="DEST", help="with --output-format dicom-seg: store the DICOM SEG results at "
                   "dicomweb:URL (STOW-RS) or dimse:AETITLE@HOST:PORT (C-STORE), each tried 3 times; repeat it for several")
    p.add_argument("--send-ae-title", default=SEND_AE_TITLE, metavar="AET", help=f"with --send dimse:...: the calling AE title "
                   f"(default {SEND_AE_TITLE}), the one the destination must accept")
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


def destinations(args, task, formats: tuple[str, ...]) -> list:
    """The ``--send`` destinations (:class:`~hsmla_med.serve.config.Destination`), refused for
    a run that writes no DICOM SEG."""
    from hsmla_med.errors import InputError
    from hsmla_med.serve.config import SEG_FORMAT
    from hsmla_med.serve.dicomweb import destination

    if not args.send:
        return []
    if SEG_FORMAT not in task.card.output_formats:
        raise InputError(f"--send: task {task.name} writes no DICOM results to send (DICOM SEG: --task {', '.join(tasks_with('output_formats', SEG_FORMAT))})")
    if SEG_FORMAT not in formats:
        raise InputError(f"--send: sends the DICOM SEG results; add --output-format {SEG_FORMAT}")
    return [destination(value) for value in args.send]


def send(written: list, targets: list, calling_ae: str) -> None:
    """The SEGs among ``written`` to each destination; a destination that did not store them
    after its attempts is one :class:`InputError` line naming it."""
    import threading

    from hsmla_med.errors import InputError
    from hsmla_med.io.dicom_seg import SEG_SUFFIX
    from hsmla_med.serve.config import Retry
    from hsmla_med.serve.send import SendError, send_files

    segs = [p for p in written if p.name.endswith(SEG_SUFFIX)]
    if not segs:
        report("--send: no DICOM SEG written (no foreground class predicted): nothing sent")
        return
    for target in targets:
        try:
            send_files(segs, target, calling_ae, Retry(), threading.Event())
        except SendError as err:
            raise InputError(f"--send {err}") from None
        report(f"{len(segs)} DICOM SEG(s) sent to {target.name}")


def study_url(args) -> str | None:
    """The DICOMweb server's base URL of ``--input dicomweb:URL`` (with ``--study``), ``None``
    for a file or folder input."""
    from hsmla_med.errors import InputError
    from hsmla_med.serve.dicomweb import DICOMWEB, dicomweb_url

    web = args.input.startswith(DICOMWEB)
    if web != (args.study is not None):
        raise InputError("--input dicomweb:URL needs --study UID, the study to retrieve" if web else
                         "--study: only with --input dicomweb:URL (a DICOMweb server's study); a folder is read as it is")
    return dicomweb_url(args.input, "--input") if web else None


def run(args, invocation: Invocation) -> list:
    from hsmla_med.errors import InputError

    args.task = checkpoint_task(args)
    task = get_task(args.task)
    formats = output_formats(args.output_format, task)
    if args.uncertainty is not None and args.uncertainty not in task.card.uncertainty:
        raise InputError(f"--uncertainty: only --task {', '.join(tasks_with('uncertainty', args.uncertainty))} writes uncertainty maps, not {task.name}")
    targets = destinations(args, task, formats)
    url = study_url(args)
    declared = task.inference_values(declared_values(args, "infer", task.name), args.checkpoint, report)
    options = prediction_options(args, output_formats=formats, uncertainty=args.uncertainty, uncertainty_threshold=args.uncertainty_threshold, **declared)
    if url is None:
        apart(args.input, args.output, "--input")
    output = invocation.writable_folder(args.output, "--output")
    inputs = args.input
    if url is not None:
        from hsmla_med.serve.dicomweb import pull_study

        inputs = pull_study(url, args.study, output, report)
    module, _ = task.load(args.checkpoint)
    started = time.perf_counter()
    written = task.predict(module, inputs, output, options)
    report(f"{len(written)} output file(s) in {output} ({time.perf_counter() - started:.1f} s): "
           + ", ".join(p.name for p in written[:3]) + (", ..." if len(written) > 3 else ""))
    if targets:
        send(written, targets, args.send_ae_title)
    return written
