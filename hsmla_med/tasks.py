"""The task registry: each task's card, what it is and can do (help texts and capabilities),
read by the command line, the configs, the engine and the export without importing the task's
pipeline (the pipelines load torch, MONAI and Lightning: seconds), so that ``hsmla-med --help``
answers at once and nothing outside ``pipelines/`` asks a task's name what it supports.

The pipelines themselves are :mod:`hsmla_med.pipelines` (``get_task``); this module sits below
everything that reads a card, importing only the package's constants and errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from hsmla_med.defaults import UNCERTAINTY_KINDS
from hsmla_med.errors import ConfigError

__all__ = ["TASKS", "ALIASES", "CARDS", "TaskCard", "task_name", "tasks_with"]


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
        output_formats: the label map formats ``infer --output-format`` writes, the first the
            default (``nifti``: NIfTI, or MetaImage / NRRD for such inputs; ``dicom-seg``); empty
            for a task whose outputs have a format of their own (``outputs``).
        uncertainty: the kinds of ``infer --uncertainty`` the task writes maps of; empty: none.
        calibration: what ``calibrate`` samples from the validation to fit a temperature on the
            softmax outputs (``patches``); empty: the task draws no sample and is not calibrated.
        bundle: whether ``export --format bundle`` writes a MONAI Bundle (the task's
            :meth:`~hsmla_med.pipelines.task.Task.bundle` gives its parts).
        synthetic: the synthetic stand-in of the benchmark that ``train`` uses without
            ``--data-dir`` and ``demo`` trains on (``configs/<task>_demo.yaml``); empty: the task
            needs a dataset and ``demo`` leaves it out.
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
        output_formats=("nifti", "dicom-seg"),
        uncertainty=UNCERTAINTY_KINDS,
        calibration="voxels of each preprocessed volume",
        bundle=True,
        synthetic="BTCV NIfTI volumes",
    ),
    "camelyon16": TaskCard(
        inputs="whole slides (any format OpenSlide opens) or a folder of them",
        outputs="OUTPUT/<slide>_heatmap.tif (pyramidal), _overlay.png, _gates.png, <slide>.geojson (QuPath), <slide>.xml (ASAP), <slide>.json, "
                "lesions/<slide>.csv and slides.csv",
        monitor="auc",
        metrics="slide AUC, patch AUC and lesion FROC",
        calibration="patches",
        synthetic="CAMELYON16 slides",
    ),
    "endovis": TaskCard(
        inputs="PNG frames, video folders or an EndoVis 2017 root",
        outputs="one PNG mask per frame at the frame's size",
        monitor="dice",
        metrics="Dice and IoU per frame",
        bundle=True,
        synthetic="EndoVis 2017 frames",
    ),
    "luna16": TaskCard(
        inputs="MetaImage scans (.mhd), a folder searched recursively, or DICOM series (a series folder, a folder of series folders, "
               "a DICOM file for its series; seriesuid: the SeriesInstanceUID)",
        outputs="OUTPUT/submission.csv (seriesuid,coordX,coordY,coordZ,probability)",
        monitor="cpm",
        metrics="FROC sensitivities and CPM",
        synthetic="LUNA16 MetaImage scans",
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
