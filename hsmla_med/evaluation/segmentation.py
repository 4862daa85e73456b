"""Score a folder of predicted label maps from any tool against a folder of reference label maps
(``hsmla-med evaluate --predictions DIR --labels DIR``), as nnU-Net's
``compute_metrics_on_folder`` does, with HD95, NSD and confidence intervals
(:mod:`hsmla_med.metrics.summary`).

Files pair by name (nnU-Net's convention: ``labels/X.nii.gz`` with ``predictions/X.nii.gz``;
``.nii`` and ``.nii.gz`` count as the same name). With a dataset JSON whose ``training`` /
``validation`` lists pair images with labels, a prediction named after its image (what
``hsmla-med infer`` writes: ``img0001.nii.gz`` for BTCV's ``label0001.nii.gz``) pairs too. Every
reference needs a prediction and every prediction a reference; the geometry of every pair
(shape and affine) is checked from the headers before any volume is scored.

A reference or a prediction may also be a DICOM SEG (``X.seg.dcm`` or ``X.dcm``, as ``infer
--output-format dicom-seg`` writes it): it is read onto the grid of the image series it
references (:func:`~hsmla_med.io.dicom_seg.read_seg`), which is looked for by its Series
Instance UID under one folder, ``--dicom`` (default: the labels folder, any depth), and its
segments take the label values of their names in the dataset JSON's ``labels`` (required then).

nnU-Net v2's label kinds in the dataset JSON are scored as nnU-Net scores them: voxels under the
reference's ``ignore`` label are not counted, and region labels (``"tumour_core": [2, 3]``) are
scored as regions, each the voxels holding any of its values.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import nibabel as nib
import numpy as np

# (private helpers of the dataset JSON reader, reused so both read `labels` alike)
from hsmla_med.data.datalist import label_spec, read_header, read_json
from hsmla_med.errors import DataError, InputError
from hsmla_med.io import is_temporary
from hsmla_med.io.volumes import DICOM_SEG, VOLUME_FORMATS, case_name, file_format, file_stem, image_series, volume_format
from hsmla_med.metrics.summary import absent_class, case_metrics, summarize_cases, write_reports

__all__ = ["DEFAULT_NSD_TOLERANCE", "check_nsd_tolerance", "evaluate_folder", "pair_files", "check_geometry", "read_labels", "score_prediction"]

log = logging.getLogger("hsmla_med")

_AFFINE_ATOL = 1e-3  # mm, as hsmla_med.data.datalist.check_pair compares an image with its label
DEFAULT_NSD_TOLERANCE = 2.0  # mm: --nsd-tolerance and inference.nsd_tolerance when not given


def _label_files(folder: Path, option: str, seg: bool = False) -> dict[str, Path]:
    """Volume files (NIfTI, MetaImage, NRRD; with ``seg`` also DICOM SEG files) of ``folder`` by
    name without the extension, so ``X.mha`` pairs with ``X.nii.gz``.
    A SEG beside a NIfTI file of its name is left out: ``infer --output-format nifti,dicom-seg``
    writes both, with the same labels."""
    if not folder.is_dir():
        raise InputError(f"{option} {folder}: folder not found")
    files: dict[str, Path] = {}
    segs: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        kind = file_format(path, seg)
        if kind is not None and path.is_file() and not is_temporary(path):
            found = files if kind.volume_file else segs
            stem = file_stem(path, seg)
            if stem in found:
                raise DataError(f"{path}: {found[stem].name} has the same name in {option} {folder}")
            found[stem] = path
    files = {**{stem: path for stem, path in segs.items() if stem not in files}, **files}
    if not files:
        raise DataError(f"{option} {folder}: no label maps in {VOLUME_FORMATS}{' or DICOM SEG (.dcm)' if seg else ''} in the folder")
    return files


def _image_names(meta: dict) -> dict[str, str]:
    """Label stem -> the case name of its image, from the dataset JSON's image/label lists."""
    aliases = {}
    lists = [meta.get(key) for key in ("training", "validation")]
    for entry in [e for entries in lists if isinstance(entries, list) for e in entries]:
        image = entry.get("image") if isinstance(entry, dict) else None  # (a list: a case's channel files, named by the first)
        if (isinstance(image, str) or isinstance(image, list) and image and isinstance(image[0], str)) and isinstance(entry.get("label"), str):
            aliases[file_stem(entry["label"])] = case_name(image)
    return aliases


def pair_files(predictions: Path, labels: Path, aliases: dict[str, str] | None = None, seg: bool = False,
               partial: bool = False) -> list[tuple[Path, Path]]:
    """``(reference, prediction)`` pairs by file name (or by the reference's image name in
    ``aliases``), in the references' order, DICOM SEG files (``.dcm``) among them with ``seg``.

    ``partial``: the pairs there are, as nnU-Net's ``compute_metrics_on_folder`` scores the
    predictions it finds (a model's predictions of its validation fold against a folder of every
    label; test volumes predicted without labels): the label maps without a prediction and the
    predictions without a label map are left out, each kind listed in one warning. Otherwise, and
    when nothing pairs, a :class:`DataError` lists them, saying how files pair."""
    references = _label_files(labels, "--labels", seg)
    found = _label_files(predictions, "--predictions", seg)
    pairs, missing = [], []
    for stem, reference in references.items():
        names = [stem] + ([aliases[stem]] if aliases and stem in aliases else [])
        match = next((found[n] for n in names if n in found), None)
        if match is None:
            missing.append(reference.name)
        else:
            pairs.append((reference, match))
    how = "predictions pair with labels by file name" + ("" if aliases else ", or with --dataset-json by the image its lists name beside each label "
                                                          "(imgNNNN with labelNNNN)")
    if not pairs:
        raise DataError(f"--predictions {predictions}: none of its {len(found)} prediction(s) pairs with a label map in {labels} ({how})")
    unmatched = sorted(set(found.values()) - {p for _, p in pairs})
    if partial:
        if missing:
            log.warning("scoring %d of the %d label maps in %s: %d have no prediction in %s: %s", len(pairs), len(references), labels,
                        len(missing), predictions, _listing(missing))
        if unmatched:
            log.warning("%d prediction(s) in %s have no label map in %s, not scored: %s", len(unmatched), predictions, labels,
                        _listing([p.name for p in unmatched]))
        return pairs
    if missing:
        raise DataError(f"--predictions {predictions}: no prediction for {len(missing)} of {len(references)} label maps in "
                        f"{labels}: {_listing(missing)} ({how})")
    if unmatched:
        raise DataError(f"--labels {labels}: no label map for {len(unmatched)} prediction(s) in {predictions}: "
                        f"{_listing([p.name for p in unmatched])}")
    return pairs


def _listing(names: list[str], most: int = 10) -> str:
    return ", ".join(names[:most]) + (f", ... ({len(names) - most} more)" if len(names) > most else "")


def _spatial(shape: tuple[int, ...], path: Path) -> tuple[int, ...]:
    """The 3D shape of a label map, trailing length-1 axes (X, Y, Z, 1) dropped."""
    if len(shape) < 3 or any(s != 1 for s in shape[3:]):
        raise DataError(f"{path}: a label map must be 3D, got shape {shape}")
    return shape[:3]


def check_geometry(pairs: list[tuple[Path, Path]], grids: dict[Path, tuple] | None = None) -> list[np.ndarray]:
    """Each prediction must lie on its reference's voxel grid: the same shape and affine (within
    1e-3), read from the NIfTI headers, or for a file in ``grids`` (a DICOM SEG) its series'
    ``(shape, affine)`` there. Returns each reference's voxel spacing in mm; :class:`DataError`
    naming the first prediction that differs, in one line."""
    grids = grids or {}
    spacings = []
    for reference, prediction in pairs:
        ref_shape, ref_affine = grids[reference] if reference in grids else read_header(reference)
        pred_shape, pred_affine = grids[prediction] if prediction in grids else read_header(prediction)
        if _spatial(pred_shape, prediction) != _spatial(ref_shape, reference):
            raise DataError(f"{prediction}: shape {pred_shape} does not match the label map's {ref_shape} ({reference})")
        if not np.allclose(pred_affine, ref_affine, atol=_AFFINE_ATOL):
            worst = float(np.abs(pred_affine - ref_affine).max())
            raise DataError(f"{prediction}: affine does not match the label map's ({reference}): largest difference {worst:.4g}")
        spacings.append(nib.affines.voxel_sizes(ref_affine))
    return spacings


def read_labels(path: Path) -> np.ndarray:
    """A label map as non-negative integers (3D), read by its format
    (:func:`~hsmla_med.io.volumes.volume_format`); :class:`DataError` for other values."""
    data = volume_format(path).read(path)[0]
    data = data.reshape(data.shape[:3])
    if not np.issubdtype(data.dtype, np.integer):
        if not np.all(np.isfinite(data)) or np.any(data != np.round(data)):
            raise DataError(f"{path}: label values must be whole numbers")
        data = data.astype(np.int64)
    if data.size and data.min() < 0:
        raise DataError(f"{path}: label values must not be negative, found {data.min()}")
    return data


def check_nsd_tolerance(value, name: str, error: type[Exception] = InputError) -> float:
    """``value`` as an NSD tolerance in mm (a finite number, 0 or more); else ``error`` naming
    ``name`` (the option or config key) in one line."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
        raise error(f"{name} {value!r}: must be a finite number of mm, 0 or more")
    return float(value)


def score_prediction(reference: Path, prediction: np.ndarray, classes: Sequence[int] | Mapping[int, Sequence[int]], nsd_tolerance: float,
                     prediction_file: str, image: Path | None = None, label_names: Sequence[str] | None = None,
                     ignore_label: int | None = None) -> dict:
    """One case of ``summary.json``: ``prediction``, a label map on the voxel grid of the label
    file ``reference`` (validation brings it there: :func:`~hsmla_med.inference.geometry.labels_in_input_geometry`),
    scored against that file at the voxel spacing of its own affine, for each of ``classes``. A
    DICOM SEG ``reference`` is read onto the grid of ``image``, the series folder it references,
    its segments valued by ``label_names`` (the dataset's). ``classes`` and ``ignore_label`` as
    :func:`~hsmla_med.metrics.summary.case_metrics` takes them (regions, the voxels not counted)."""
    from hsmla_med.io.dicom_seg import is_seg_file

    if is_seg_file(reference):
        truth, affine = DICOM_SEG.read(reference, image_series(image).files, label_names)
        truth = truth.astype(np.int64)
    else:
        _, affine = read_header(reference)
        truth = read_labels(reference)
    if truth.shape != prediction.shape:
        raise DataError(f"{reference}: shape {truth.shape} differs from the prediction's {prediction.shape} in its grid")
    spacing = nib.affines.voxel_sizes(affine).tolist()
    return {"reference_file": str(reference), "prediction_file": prediction_file,
            "metrics": case_metrics(truth, prediction, classes, spacing, nsd_tolerance, ignore_label)}


def _foreground(path: Path, data: np.ndarray, allowed: set[int] | None, dataset_json) -> set[int]:
    """The non-zero label values of a label map; :class:`DataError` for a value not ``allowed``."""
    values = set(np.unique(data).tolist()) - {0}
    if allowed is not None and (unknown := sorted(values - allowed)):
        raise DataError(f"{path}: label values {unknown} are not in the labels of {dataset_json}")
    return values


@dataclass(frozen=True)
class _DatasetLabels:
    """What a dataset JSON says of the scores: ``names`` (key -> name) of the scored classes,
    ``scored`` (their label values: :func:`~hsmla_med.metrics.summary.case_metrics`' ``labels``,
    a mapping for regions), the non-zero values a label map may hold, the ignore label."""

    names: dict[int, str]
    scored: list[int] | dict[int, list[int]]
    allowed: set[int]
    ignore: int | None


def _dataset_labels(dataset_json: Path) -> tuple[_DatasetLabels, dict[str, str]]:
    """The scored classes (nnU-Net v2's ignore label and regions too: :func:`~hsmla_med.data.datalist.label_spec`),
    and the image-name aliases, from a dataset JSON."""
    if not dataset_json.is_file():
        raise InputError(f"--dataset-json {dataset_json}: file not found")
    meta = read_json(dataset_json)
    if "labels" not in meta:
        raise DataError(f"{dataset_json}: missing 'labels' (label value -> name)")
    names, ignore, regions, _ = label_spec(meta, dataset_json)
    keyed = {i: name for i, name in enumerate(names) if i > 0}
    scored = dict(zip(keyed, regions, strict=True)) if regions else list(keyed)
    allowed = {v for r in regions for v in r} if regions else set(keyed)
    return _DatasetLabels(keyed, scored, allowed | ({ignore} if ignore is not None else set()), ignore), _image_names(meta)


def _seg_series(pairs: list[tuple[Path, Path]], folder: Path) -> dict[Path, list[Path]]:
    """Each DICOM SEG among ``pairs`` -> the sorted files of the image series it references,
    found under ``folder``; :class:`DataError` naming a SEG whose series is not there."""
    segs = [path for pair in pairs for path in pair if file_format(path, seg=True) is DICOM_SEG]
    if not segs:
        return {}
    from hsmla_med.io.dicom import find_series
    from hsmla_med.io.dicom_seg import referenced_series_uid

    series = {s.uid: s.files for s in find_series(folder)}
    sources = {}
    for seg in segs:
        uid = referenced_series_uid(seg)
        if uid not in series:
            raise DataError(f"{seg}: the image series it references ({uid}) is not under --dicom {folder}; give the folder that holds it")
        sources[seg] = series[uid]
    return sources


def _seg_grids(sources: dict[Path, list[Path]]) -> dict[Path, tuple]:
    """``(shape, affine)`` of each SEG's series, as the series' NIfTI has them (SimpleITK's grid),
    from the series' headers (:meth:`~hsmla_med.io.volumes.DicomSeg.grid`)."""
    return {seg: DICOM_SEG.grid(files) for seg, files in sources.items()}


def _read_label_map(path: Path, sources: dict[Path, list[Path]], names: dict[int, str] | None) -> np.ndarray:
    """A label map file (:func:`read_labels`), or a DICOM SEG on its series' grid, its segments
    valued by ``names``."""
    if path not in sources:
        return read_labels(path)
    return DICOM_SEG.read(path, sources[path], ["background"] + [names[k] for k in sorted(names)])[0].astype(np.int64)


def evaluate_folder(predictions: str | Path, labels: str | Path, dataset_json: str | Path | None = None,
                    output: str | Path | None = None, nsd_tolerance: float = DEFAULT_NSD_TOLERANCE, draws: int = 1000, seed: int = 0,
                    dicom: str | Path | None = None) -> dict:
    """Score every prediction against its reference; write ``summary.json`` and
    ``metrics_per_case.csv`` into ``output`` (default: the predictions folder).

    Args:
        predictions, labels: folders of NIfTI label maps or DICOM SEG files, paired by file name.
        dataset_json: its ``labels`` (MSD ``{"0": "background"}`` or nnU-Net v2
            ``{"background": 0}``) name the classes scored, and a label value outside them is an
            error; without it the classes are the non-zero values found in either folder.
        output: folder for the two reports.
        nsd_tolerance: NSD tolerance in mm.
        draws, seed: of the bootstrap confidence intervals.
        dicom: the folder under which the image series of DICOM SEG files are found (default:
            ``labels``).

    Returns:
        The ``summary.json`` document (:func:`~hsmla_med.metrics.summary.summarize_cases`).
    """
    predictions, labels = Path(predictions), Path(labels)
    check_nsd_tolerance(nsd_tolerance, "--nsd-tolerance")
    spec, aliases = _dataset_labels(Path(dataset_json)) if dataset_json is not None else (None, {})
    names = spec.names if spec is not None else None
    pairs = pair_files(predictions, labels, aliases, seg=True, partial=True)
    seg = next((path for pair in pairs for path in pair if file_format(path, seg=True) is DICOM_SEG), None)
    if seg is not None and names is None:
        raise InputError(f"{seg}: --dataset-json is needed with DICOM SEG files: its labels give the segments their label values")
    sources = _seg_series(pairs, Path(dicom) if dicom is not None else labels)
    spacings = check_geometry(pairs, _seg_grids(sources))
    cases, sizes = [], []
    for (reference, prediction), spacing in zip(pairs, spacings, strict=True):
        ref, pred = _read_label_map(reference, sources, names), _read_label_map(prediction, sources, names)
        allowed = spec.allowed if spec is not None else None
        found = _foreground(reference, ref, allowed, dataset_json) | _foreground(prediction, pred, allowed, dataset_json)
        log.info("scoring %s against %s", prediction.name, reference.name)
        cases.append({"reference_file": str(reference), "prediction_file": str(prediction),
                      "metrics": case_metrics(ref, pred, spec.scored if spec is not None else sorted(found), spacing.tolist(), nsd_tolerance,
                                              spec.ignore if spec is not None else None)})
        sizes.append(ref.size)
    classes = list(names) if names is not None else sorted({k for c in cases for k in c["metrics"]})
    if not classes:
        raise DataError(f"--labels {labels}: no foreground label in any label map or prediction")
    for case, size in zip(cases, sizes, strict=True):  # classes seen only in other cases: empty here
        case["metrics"] = {k: case["metrics"].get(k) or absent_class(size) for k in classes}
    summary = summarize_cases(cases, classes, names, draws=draws, seed=seed,
                              nsd_tolerance_mm=nsd_tolerance, spacing="the label map's, from its affine")
    write_reports(summary, output if output is not None else predictions)
    return summary
