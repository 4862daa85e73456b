"""LUNA16: lung nodule detection in chest CT (MetaImage scans or their LIDC-IDRI DICOM series,
nodules in world millimetres).

What is specific to the benchmark lives here: the dataset (LUNA16 as distributed, ``subsetK/*.mhd``
folders with ``annotations.csv`` and ``annotations_excluded.csv`` in ``CSVFILES/`` or
``evaluationScript/annotations/``, or the synthetic default in the same layout), nodule spheres
rendered as segmentation targets, the submission CSV of ``infer`` and the files of its scoring by
the official rules (:mod:`hsmla_med.evaluation.detection`).

The model is an HSMLA segmentation network, slice-wise by default (``mode: 2d``): axial slices
after resampling to ``data.spacing``, predicted slice by slice into a probability volume. It is
the BTCV pipeline's choice and for the same reason, the CPU budget; 2.5D slabs would add little
for spheres that the resampled slices already cover several times, and ``mode: 3d`` trains 3D
patches with the same code. Candidates are the connected components of the probability volume
(:mod:`hsmla_med.metrics.detection`), placed in world millimetres through the preprocessed
volume's affine, so no inverse resampling is needed.
"""

from __future__ import annotations

import csv
import logging
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from monai.transforms import Compose, DeleteItemsd, EnsureTyped, Orientationd, ScaleIntensityRanged, Spacingd

from hsmla_med.data.datalist import Datalist
from hsmla_med.data.luna16 import SUBMISSION_COLUMNS, LoadScand, NoduleMaskd, find_scans, read_findings, voxel_to_lps
from hsmla_med.data.splits import fold_cases, other_dataset
from hsmla_med.data.synthetic.luna16 import generate_luna16
from hsmla_med.data.volume_crops import crop_and_augment, roi_size, spatial_dims
from hsmla_med.engine.base import hparams
from hsmla_med.engine.datamodule import CaseDataModule
from hsmla_med.engine.detection import DetectionModule, scan_candidates
from hsmla_med.errors import ConfigError, DataError, InputError
from hsmla_med.evaluation.detection import score_submission_files
from hsmla_med.io import atomic_path
from hsmla_med.io.dicom import DicomSeries, SeriesRules, find_series, is_dicom_file, select_series, series_of
from hsmla_med.pipelines.task import InferenceOptions, Task, input_files, predict_cases, synthetic_root

__all__ = [
    "TASK", "LABELS", "datalist", "preprocessing", "transforms", "datamodule", "module_config", "held_out", "infer",
    "hu_window", "score_predictions", "crossval_score",
]

log = logging.getLogger("hsmla_med")

LABELS = ["background", "nodule"]
SUBSET = re.compile(r"subset\d+")  # LUNA16's official folds: subset0 .. subset9
SUBMISSION = "submission.csv"
CANDIDATES = "candidates"  # one CSV per scan, merged into SUBMISSION


def hu_window(data: dict) -> tuple[float, float]:
    """``data.hu_window`` as (low, high); a reversed or empty window is a :class:`ConfigError`
    (MONAI's ScaleIntensityRange would invert the image without a word)."""
    window = data["hu_window"]
    if not (isinstance(window, (list, tuple)) and len(window) == 2 and all(isinstance(v, (int, float)) and np.isfinite(v) for v in window)):
        raise ConfigError(f"data.hu_window must be two numbers [low, high] in HU, got {window!r}")
    if not window[0] < window[1]:
        raise ConfigError(f"data.hu_window must be [low, high] with low < high, got {list(window)}")
    return float(window[0]), float(window[1])


def datalist(config: dict) -> Datalist:
    """Scans with their nodules and excluded findings: the user's folder or the synthetic
    default (generated once into ``cache_dir``, logged as synthetic). Fold K holds out the K-th
    ``subsetK`` folder present (``subsetK`` itself with all ten: the official folds); scans
    outside subset folders are dealt over the folds, seeded (``splits_final.json``,
    :func:`~hsmla_med.data.splits.fold_cases`). A folder of one subset, and no scan outside it
    (many users start with ``subset0``), is split by scan, as scans outside subsets are."""
    data = config["data"]
    hu_window(data)  # before any scan is read or generated
    root, synthetic = data["data_dir"], False
    if not root:
        synth = data["synthetic"]
        root = synthetic_root(data, "luna16", "LUNA16-format scans", "phantoms, not patients",
                              lambda root: generate_luna16(root, synth["num_scans"], tuple(synth["shape"]), synth["seed"]))
        synthetic = True
    root = Path(root)
    scans = find_scans(root)
    nodules, excluded = read_findings(root, scans)
    none = np.zeros((0, 4))
    cases = [
        {"image": str(path), "seriesuid": uid, "nodules": nodules.get(uid, none), "excluded": excluded.get(uid, none)}
        for uid, path in scans.items()
    ]
    if len(cases) < 2 and not other_dataset(config, list(scans)):
        raise DataError(f"{root}: need at least two scans to hold one out for validation, found {len(cases)}")
    groups = [_subset(path, root) for path in scans.values()]
    subsets = sorted({g for g in groups if g is not None}, key=lambda g: int(g[len("subset"):]))
    if set(groups) == set(subsets[:1]):  # one subset holds every scan: as one unit, it could not be held out
        log.info("one subset: folds by scan within %s", subsets[0])
        subsets = []
    fixed = {g: k for k, g in enumerate(subsets)}
    groups = [g if g in fixed else uid for g, uid in zip(groups, scans)]
    training, validation, record = fold_cases(config, root, cases, list(scans), synthetic, groups=groups, fixed=fixed)
    return Datalist(LABELS, training, validation, [], root, synthetic, record)


def _subset(path: Path, root: Path) -> str | None:
    """The official fold of a scan: its ``subsetK`` folder (the nearest one above it)."""
    for parent in Path(path).relative_to(root).parents:
        if SUBSET.fullmatch(parent.name):
            return parent.name
    return None


def preprocessing(data: dict, label: bool = True) -> list:
    """Read the scan (and render its nodules), RAS orientation, resampling to ``data.spacing``,
    HU window ``data.hu_window`` to 0..1, as the ``data`` section (of a task config or a
    checkpoint) says."""
    keys = ["image", "label"] if label else ["image"]
    a_min, a_max = hu_window(data)
    return [
        LoadScand("image"),
        *([NoduleMaskd()] if label else []),
        Orientationd(keys, axcodes="RAS", labels=(("L", "R"), ("P", "A"), ("I", "S"))),
        Spacingd(keys, pixdim=data["spacing"], mode=["bilinear", "nearest"][: len(keys)]),
        ScaleIntensityRanged("image", a_min=a_min, a_max=a_max, b_min=0.0, b_max=1.0, clip=True),
        EnsureTyped(keys, dtype=[torch.float32, torch.int64][: len(keys)], track_meta=True),
    ]


def transforms(config: dict) -> tuple[Compose, Compose]:
    """Training: preprocessing, then nodule-biased random crops and augmentation (the BTCV
    pipeline's, :func:`~hsmla_med.data.volume_crops.crop_and_augment`, nnU-Net's intensity and
    resolution augmentations included, set in ``data.augment``); validation: preprocessing."""
    pre = preprocessing(config["data"])
    # the per-scan annotation arrays differ in length: the training batches need only the crops
    drop = DeleteItemsd(["nodules", "excluded", "seriesuid"])
    return Compose(pre + [drop] + crop_and_augment(config)), Compose(pre)


def datamodule(config: dict, cases: Datalist) -> CaseDataModule:
    train, val = transforms(config)
    data = config["data"]
    return CaseDataModule(cases.training, cases.validation, train, val, data["batch_size"], data["num_workers"], data["cache_rate"])


def module_config(config: dict, model: dict, label_names: list[str], in_channels: int = 1) -> dict:
    """The hyper-parameters of :class:`DetectionModule` for this task config."""
    inference = {**config["inference"], "roi_size": roi_size(config)}
    data = {"spacing": list(config["data"]["spacing"]), "hu_window": list(hu_window(config["data"]))}
    return hparams(config, model, label_names, spatial_dims(config), in_channels, inference, data)


def held_out(cases: Datalist) -> list[list[str]]:
    """The scans ``demo`` detects nodules in after training: the validation scans, as one input
    list, so that they share one submission CSV."""
    return [[c["image"] for c in cases.validation]]


def _scan_inputs(folder: Path, series_uid: str | None = None, rules: SeriesRules | None = None) -> list[Path | DicomSeries]:
    """The MetaImage scans under an input folder (any depth), else its DICOM image series (one
    scan per series: :func:`~hsmla_med.io.dicom.select_series`, several series in one folder
    need ``series_uid`` or selection ``rules``)."""
    if any(folder.rglob("*.mhd")):
        return list(find_scans(folder).values())
    series = find_series(folder)
    if not series:
        raise DataError(f"{folder}: no MetaImage scans (*.mhd) and no DICOM image series in the input folder")
    return select_series(series, folder, series_uid, rules)


def _case(source: Path | DicomSeries, folder: Path) -> dict:
    """The ``infer`` item of a MetaImage scan (named by its file, LUNA16's seriesuid) or a DICOM
    series (a DICOM file given alone: its series), named by its SeriesInstanceUID, the seriesuid
    of LUNA16's CSVs, and loaded from its files in slice order."""
    if isinstance(source, Path) and is_dicom_file(source):
        source = series_of(source)
    name, image = (source.uid, [str(f) for f in source.files]) if isinstance(source, DicomSeries) else (source.stem, str(source))
    return {"name": name, "image": image, "output": folder / f"{name}.csv"}


def infer(
    module: DetectionModule, inputs: str | Path | Iterable[str | Path], output: str | Path, options: InferenceOptions = InferenceOptions()
) -> list[Path]:
    """Detect nodules in scans and write ``output/submission.csv`` in LUNA16's format
    (``seriesuid,coordX,coordY,coordZ,probability``, LPS world millimetres), at most
    ``inference.max_candidates`` rows per scan, most probable first.

    The inputs (a path or a list): MetaImage scans (a ``.mhd``, a folder searched recursively),
    or DICOM series, as LIDC-IDRI distributes LUNA16's scans (a series folder, a folder of series
    folders, a single DICOM file for its series; a folder holding files of several series needs
    ``options.series_uid`` or ``options.series_rules``, :func:`_scan_inputs`). A series' seriesuid is its
    SeriesInstanceUID, so that the submission is scored against LUNA16's annotations.

    Runs in Lightning's predict loop (:func:`predict_cases`: scans split over processes and
    shards). Each scan's candidates go to ``output/candidates/<seriesuid>.csv`` as soon as it is
    done, and a scan whose file exists is skipped; at the end the first process merges the
    files of this run's scans (all its inputs, whatever the shard) into the submission, so a
    resumed or sharded run's submission holds all of them, and a file that another run left
    there for other scans is not taken in.
    """
    cfg = module.config
    inference = options.apply(cfg["inference"])
    folder = Path(output) / CANDIDATES
    rules = SeriesRules(options.series_rules, "--series-rules", InputError) if options.series_rules is not None else None
    items = [_case(source, folder) for source in input_files(inputs, lambda root: _scan_inputs(root, options.series_uid, rules))]

    def write(case: dict) -> list[Path]:
        found = scan_candidates(case["probs"][1].numpy(), case["image"].affine, inference, voxel_to_lps)
        rows = [[case["name"], *np.round(c[:3], 3).tolist(), round(float(c[3]), 5)] for c in found]
        folder.mkdir(parents=True, exist_ok=True)
        _write_csv(case["output"], rows)
        options.progress(f"{case['name']}: {len(found)} candidate(s) -> {case['output']}")
        return [case["output"]]

    def merge() -> list[Path]:
        rows, done = [], [item["output"] for item in items if item["output"].is_file()]
        for part in done:
            with part.open(newline="") as f:
                rows += list(csv.reader(f))[1:]
        if len(done) < len(items):
            options.progress(f"{SUBMISSION}: {len(done)} of {len(items)} scan(s) so far (the others are other shards')")
        path = Path(output) / SUBMISSION
        _write_csv(path, rows)
        return [path]

    return predict_cases(module, items, Compose(preprocessing(cfg["data"], label=False)), write, options, finish=merge, folder=output,
                         settings=inference)


def _write_csv(path: Path, rows: list[list]) -> None:
    with atomic_path(path) as tmp, tmp.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(SUBMISSION_COLUMNS)
        writer.writerows(rows)


def crossval_score(folds: list[tuple[Datalist, Path]], output: Path, config: dict) -> dict:
    """Every fold's validation submission merged into ``output/submission.csv`` and scored as
    one by the official rules against the dataset's CSVs, the false positives counted over
    every validation scan (``output/seriesuids.csv``)."""
    rows, uids = [], []
    for cases, folder in folds:
        lines = (folder / SUBMISSION).read_text().splitlines()
        rows += [line for line in lines[1:] if line.strip()]
        uids += [case["seriesuid"] for case in cases.validation]
    output.mkdir(parents=True, exist_ok=True)
    with atomic_path(output / SUBMISSION) as tmp:
        Path(tmp).write_text("\n".join([",".join(SUBMISSION_COLUMNS), *rows]) + "\n")
    with atomic_path(output / "seriesuids.csv") as tmp:
        Path(tmp).write_text("".join(f"{uid}\n" for uid in uids))
    # the nodules outside their scan were skipped in every fold's training and validation: here too
    return score_predictions(output / SUBMISSION, folds[0][0].source, output, {"seriesuids": output / "seriesuids.csv", "skip_outside": True})


def score_predictions(predictions: Path, labels: Path, output: Path, options: dict) -> dict:
    """``evaluate --task luna16 --predictions submission.csv --labels annotations.csv
    [--excluded annotations_excluded.csv] [--seriesuids seriesuids.csv]``: any LUNA16 submission
    (``seriesuid,coordX,coordY,coordZ,probability``, LPS mm) scored as the official script
    scores it (:func:`~hsmla_med.evaluation.detection.score_submission_files`, which writes
    ``output/summary.json`` and ``froc.png``). ``predictions`` may be ``infer``'s output folder
    (its submission.csv), ``labels`` a LUNA16 folder.
    """
    submission = Path(predictions) / SUBMISSION if Path(predictions).is_dir() else Path(predictions)
    return score_submission_files(submission, Path(labels), Path(output), options, task=TASK.name)


class NoduleModule(DetectionModule):
    """:class:`~hsmla_med.engine.detection.DetectionModule` with LUNA16's convention: candidates
    and annotations in LPS millimetres (the scans' affines are RAS, as MONAI's)."""

    world_points = staticmethod(voxel_to_lps)


class LUNA16(Task):
    """LUNA16 nodule detection: MetaImage scans or DICOM series, the submission CSV."""

    name = "luna16"
    module_class = NoduleModule
    in_channels = 1

    def score_lines(self, summary: dict, output: Path) -> list[str]:
        """CPM, the seven sensitivities with their bootstrap band, the counts."""
        fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
        band = summary["bootstrap"]
        span = lambda b: f"[{fmt(b['low'])}, {fmt(b['high'])}]"  # noqa: E731
        lines = [
            f"CPM {fmt(summary['cpm'])} {span(band['cpm'])}   {summary['scans']} scans ({summary['scans_from']}), "
            f"{summary['nodules']} nodules, {summary['detected']} detected, {summary['false_positives']} false positives, "
            f"{summary['ignored']} on excluded findings",
            f"sensitivity at FPs/scan, {band['confidence']:.0%} bootstrap band ({band['draws_used']} of {band['draws']} draws, seed {band['seed']}):",
        ]
        lines += [f"  {rate:>5}: {fmt(summary['froc'][rate])} {span(band['froc'][rate])}" for rate in summary["froc"]]
        return lines + [f"summary: {output / 'summary.json'}"]


TASK = LUNA16()
