"""Task pipelines, one module per benchmark; installed as ``hsmla_med.pipelines``.

Each module defines ``TASK``, an instance of its :class:`~hsmla_med.pipelines.task.Task`
subclass (data list, DataModule, module config, held-out inputs, prediction); the command line
drives them all through that interface alone. What the command line's help says of a task is
here, in :data:`CARDS`, so that ``hsmla-med --help`` answers without importing the pipelines
(they load torch, MONAI and Lightning: seconds).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from hsmla_med.errors import ConfigError

__all__ = ["TASKS", "ALIASES", "CARDS", "TaskCard", "task_name", "get_task"]


@dataclass(frozen=True)
class TaskCard:
    """A task as the help describes it: what ``infer --input`` takes, what ``infer`` writes, and
    the validation score that picks ``best.ckpt`` (its LightningModule's ``monitor``;
    tests/test_cli.py checks they agree)."""

    inputs: str
    outputs: str
    monitor: str


CARDS = {
    "btcv": TaskCard(
        inputs="NIfTI volumes (.nii, .nii.gz, .hdr/.img pairs), MetaImage (.mha, .mhd) or NRRD (.nrrd, .nhdr) volumes, or DICOM series "
               "(a series folder, or a folder of series folders)",
        outputs="OUTPUT/<case>.nii.gz label maps with each input's shape and affine (MetaImage / NRRD in: <case>.mha / .nrrd; a DICOM "
                "series: also or instead <case>.seg.dcm, --output-format)",
        monitor="dice",
    ),
    "camelyon16": TaskCard(
        inputs="whole slides (any format OpenSlide opens) or a folder of them",
        outputs="OUTPUT/<slide>_heatmap.tif (pyramidal), _overlay.png, _gates.png, <slide>.geojson (QuPath), <slide>.xml (ASAP), <slide>.json, "
                "lesions/<slide>.csv and slides.csv",
        monitor="auc",
    ),
    "endovis": TaskCard(inputs="PNG frames, video folders or an EndoVis 2017 root", outputs="one PNG mask per frame at the frame's size", monitor="dice"),
    "luna16": TaskCard(
        inputs="MetaImage scans (.mhd), a folder searched recursively, or DICOM series (a series folder, a folder of series folders, "
               "a DICOM file for its series; seriesuid: the SeriesInstanceUID)",
        outputs="OUTPUT/submission.csv (seriesuid,coordX,coordY,coordZ,probability)",
        monitor="cpm",
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
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; available: {', '.join([*TASKS, *ALIASES])}")
    return name


def get_task(name: str):
    """The :class:`~hsmla_med.pipelines.task.Task` of ``name`` (a task or an alias);
    :class:`ConfigError` for an unknown task."""
    return importlib.import_module(f"hsmla_med.pipelines.{task_name(name)}").TASK
