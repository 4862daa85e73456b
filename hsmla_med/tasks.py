"""The task registry: each task's card, what it is and can do (help texts and capabilities),
read by the command line, the configs, the engine and the export without importing the task's
pipeline (the pipelines load torch, MONAI and Lightning: seconds), so that ``hsmla-med --help``
answers at once and nothing outside ``pipelines/`` asks a task's name what it supports.

The pipelines themselves are :mod:`hsmla_med.pipelines` (``get_task``); this module sits below
everything that reads a card, importing only the package's constants and errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hsmla_med.defaults import UNCERTAINTY_KINDS
from hsmla_med.errors import ConfigError

__all__ = ["TASKS", "ALIASES", "CARDS", "TaskCard", "TaskOption", "task_name", "tasks_with"]


@dataclass(frozen=True)
class TaskOption:
    """A command-line option of a task's own, declared on its card: the command line adds it to
    each command named (its help text is the task's), and hands its value to the task: ``infer``
    in :class:`~hsmla_med.pipelines.task.InferenceOptions` (its field of the option's ``dest``,
    else :attr:`~hsmla_med.pipelines.task.InferenceOptions.extra`), ``evaluate`` in the options
    of :meth:`~hsmla_med.pipelines.task.Task.score_predictions` and
    :meth:`~hsmla_med.pipelines.task.Task.evaluation_outputs`. Several tasks may declare one
    flag: their help texts are joined, each after its tasks' names, and its other arguments must
    agree. Given for a task that does not declare it, the option is refused.

    Attributes:
        flag: the option, ``--name``; its ``dest`` is the name with ``_`` for ``-``.
        commands: the commands that take it (``infer``, ``evaluate``).
        help: what it does, without the task's name (the command line puts it first).
        arguments: the other keyword arguments of ``argparse``'s ``add_argument`` (``metavar``,
            ``choices``, ``action``, ``type``, ``default``).
    """

    flag: str
    commands: tuple[str, ...]
    help: str
    arguments: dict[str, Any] = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class TaskCard:
    """A task as the command line describes it and what it supports beyond train, infer and
    evaluate. A card's entry in :data:`CARDS` registers the task: with its pipeline module and
    its config YAML, a task needs nothing else (docs/design.md §5.3).

    Attributes:
        inputs: what ``infer --input`` takes (help text).
        outputs: what ``infer`` writes (help text).
        monitor: the validation score that picks ``best.ckpt``, its LightningModule's ``monitor``
            (tests/test_cli.py checks they agree).
        metrics: what ``evaluate`` reports (help text; the ``monitor`` is among them).
        output_formats: the label map formats ``infer --output-format`` writes, by their names in
            the volume format registry (:data:`hsmla_med.io.volumes.OUTPUT_FORMATS`); without the
            option, the input's own format; empty for a task whose outputs have a format of their
            own (``outputs``).
        uncertainty: the kinds of ``infer --uncertainty`` the task writes maps of; empty: none.
        calibration: what ``calibrate`` samples from the validation to fit a temperature on the
            softmax outputs (``patches``); empty: the task draws no sample and is not calibrated.
        bundle: whether ``export --format bundle`` writes a MONAI Bundle (the task's
            :meth:`~hsmla_med.pipelines.task.Task.bundle` gives its parts).
        synthetic: the synthetic stand-in of the benchmark that ``train`` uses without
            ``--data-dir`` and ``demo`` trains on (``configs/<task>_demo.yaml``); empty: the task
            needs a dataset and ``demo`` leaves it out.
        slide_labels: ``train --supervision slide`` trains it from slide labels alone (attention
            MIL on patch features) and ``evaluate --features`` scores such a checkpoint.
        options: the command-line options of the task's own (:class:`TaskOption`).
    """

    inputs: str
    outputs: str
    monitor: str
    metrics: str
    output_formats: tuple[str, ...] = ()
    uncertainty: tuple[str, ...] = ()
    calibration: str = ""
    bundle: bool = False
    synthetic: str = ""
    slide_labels: bool = False
    options: tuple[TaskOption, ...] = ()


def _series_options(rules_default: str = "") -> tuple[TaskOption, ...]:
    """The DICOM series options of a task that reads volumes from DICOM series."""
    return (
        TaskOption("--series-uid", ("infer",), "the DICOM series (SeriesInstanceUID) to read in an --input folder that holds files of "
                   "several series (refused without it, listing them)", {"metavar": "UID"}),
        TaskOption("--series-rules", ("infer",), "a YAML or JSON file of rules that pick the DICOM series to read by their attributes, in "
                   "MONAI Deploy's format ({selections: [{name, conditions: {Modality: '(?i)CT', SeriesDescription: REGEX, ImageType: "
                   "[ORIGINAL, PRIMARY]}}]})" + rules_default, {"metavar": "F"}),
    )


CARDS = {
    "btcv": TaskCard(
        inputs="NIfTI volumes (.nii, .nii.gz, .hdr/.img pairs), MetaImage (.mha, .mhd) or NRRD (.nrrd, .nhdr) volumes, or DICOM series "
               "(a series folder, or a folder of series folders)",
        outputs="OUTPUT/<case>.nii.gz label maps with each input's shape and affine (MetaImage / NRRD in: <case>.mha / .nrrd; a DICOM "
                "series: also or instead <case>.seg.dcm, --output-format)",
        monitor="dice",
        metrics="Dice, HD95 and NSD per class, each prediction brought back to its original image grid as infer writes it and scored "
                "against the original label file at its spacing, also written as OUTPUT/summary.json, OUTPUT/metrics_per_case.csv "
                "and the label maps OUTPUT/validation/<case>.nii.gz",
        output_formats=("nifti", "metaimage", "nrrd", "dicom-seg"),
        uncertainty=UNCERTAINTY_KINDS,
        calibration="voxels of each preprocessed volume",
        bundle=True,
        synthetic="BTCV NIfTI volumes",
        options=(
            *_series_options("; default: the checkpoint's inference.series_selection"),
            TaskOption("--save-probabilities", ("infer",), "also write OUTPUT/<case>.npz, the class probabilities (float16) in the input's "
                       "grid (an ensemble's: their mean)", {"action": "store_true"}),
            TaskOption("--postprocessing", ("infer",), "the postprocessing.json to apply to the label maps (largest connected components, "
                       "chosen on validation by cross-validate); default: the postprocessing.json in the folder that holds the "
                       "checkpoints, or above a cross-validate fold_K folder, if there is one; none: no post-processing", {"metavar": "F"}),
            TaskOption("--save-probabilities", ("evaluate",), "with --checkpoint: also write OUTPUT/validation/<case>.npz, the class "
                       "probabilities (float16, classes first) in the original geometry beside the label maps", {"action": "store_true"}),
            TaskOption("--dataset-json", ("evaluate",), "with --predictions: dataset.json naming the classes ('labels'; default: the label "
                       "values found) and pairing each label with the image its lists name beside it (a prediction is named after its "
                       "image: imgNNNN.nii.gz scores against labelNNNN.nii.gz)", {"metavar": "F"}),
            TaskOption("--dicom", ("evaluate",), "with --predictions: the folder under which the image series that DICOM SEG files (.dcm, "
                       "among the predictions or labels) reference are found, by Series Instance UID, at any depth (default: the --labels "
                       "folder); a SEG's segments take the label values of their names in --dataset-json", {"metavar": "DIR"}),
            TaskOption("--nsd-tolerance", ("evaluate",), "NSD tolerance in mm (default: the checkpoint's inference.nsd_tolerance; with "
                       "--predictions 2)", {"metavar": "MM", "type": float}),
        ),
    ),
    "camelyon16": TaskCard(
        inputs="whole slides (any format OpenSlide opens) or a folder of them",
        outputs="OUTPUT/<slide>_heatmap.tif (pyramidal), _overlay.png, _gates.png, <slide>.geojson (QuPath), <slide>.xml (ASAP), <slide>.json, "
                "lesions/<slide>.csv and slides.csv",
        monitor="auc",
        metrics="slide AUC, patch AUC and lesion FROC",
        calibration="patches",
        synthetic="CAMELYON16 slides",
        slide_labels=True,
        options=(
            TaskOption("--masks", ("evaluate",), "with --predictions: the ground-truth mask TIFFs <slide>_Mask.tif that Evaluation_FROC.py "
                       "reads (default: Masks or Ground_Truth/Masks beside --labels, if there; else each slide's XML, rasterised as ASAP "
                       "makes those masks)", {"metavar": "DIR"}),
        ),
    ),
    "endovis": TaskCard(
        inputs="PNG frames, video folders or an EndoVis 2017 root",
        outputs="one PNG mask per frame at the frame's size",
        monitor="dice",
        metrics="Dice and IoU per frame",
        bundle=True,
        synthetic="EndoVis 2017 frames",
        options=(
            TaskOption("--crop", ("infer",), "auto crops frames of the challenge's raw size as in training and uses other sizes whole; none "
                       "never crops", {"choices": ["auto", "none"], "default": "auto"}),
            TaskOption("--problem", ("evaluate",), "with --predictions: the task the masks answer (default binary)",
                       {"choices": ["binary", "parts", "type"]}),
        ),
    ),
    "luna16": TaskCard(
        inputs="MetaImage scans (.mhd), a folder searched recursively, or DICOM series (a series folder, a folder of series folders, "
               "a DICOM file for its series; seriesuid: the SeriesInstanceUID)",
        outputs="OUTPUT/submission.csv (seriesuid,coordX,coordY,coordZ,probability)",
        monitor="cpm",
        metrics="FROC sensitivities and CPM",
        synthetic="LUNA16 MetaImage scans",
        options=(
            *_series_options(),
            TaskOption("--excluded", ("evaluate",), "with --predictions: annotations_excluded.csv (findings there count neither way)",
                       {"metavar": "F"}),
            TaskOption("--seriesuids", ("evaluate",), "with --predictions: seriesuids.csv, the scans scored (default: those of --labels)",
                       {"metavar": "F"}),
        ),
    ),
}
TASKS = tuple(CARDS)
#: generic names for one's own data: ``--task segmentation`` is the volume segmentation pipeline
#: that ``btcv`` presets for the BTCV benchmark (its labels, its synthetic stand-in when no
#: ``--data-dir`` is given); with the generic name a dataset folder is required
ALIASES = {"segmentation": "btcv"}


def task_name(name: str) -> str:
    """The pipeline of ``name`` (a task or an alias); :class:`ConfigError` for an unknown one."""
    name = ALIASES.get(name, name)
    if name not in CARDS:
        raise ConfigError(f"unknown task {name!r}; available: {', '.join([*CARDS, *ALIASES])}")
    return name


def tasks_with(capability: str, value: str | None = None) -> list[str]:
    """The tasks whose card declares ``capability``, the :class:`TaskCard` field of that name
    (set: true or not empty; with ``value``: holding it), in :data:`CARDS`' order; what the help
    and the refusals name."""
    return [name for name, card in CARDS.items() if (value in getattr(card, capability) if value is not None else getattr(card, capability))]
