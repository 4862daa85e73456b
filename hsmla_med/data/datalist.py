"""Dataset JSON handling: MSD / nnU-Net folders and MONAI's ``training``/``validation`` lists.

Three layouts describe the same thing, a list of image/label pairs and the label names:

- MSD (``dataset.json`` with ``labels`` ``{"0": "background", ...}`` and ``training``
  ``[{"image": ..., "label": ...}]``), which MONAI's tutorials extend with a ``validation`` list
  (BTCV's ``dataset_0.json``);
- nnU-Net v2 (``labels`` ``{"background": 0, ...}``, no lists: ``imagesTr/CASE_0000.nii.gz``
  pairs with ``labelsTr/CASE.nii.gz``).

:func:`load_datalist` reads either into one :class:`Datalist` (the lists through MONAI's
``load_decathlon_datalist``), checks that every file exists, that each affine places voxels
(finite, no zero spacing) and that each image and label agree in shape and affine (headers only,
so it is cheap), and raises a :class:`~hsmla_med.errors.DataError` naming the file otherwise.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import nibabel as nib
import numpy as np
from monai.data import load_decathlon_datalist

from hsmla_med.errors import DataError

__all__ = ["Datalist", "load_datalist", "find_dataset_json", "read_json", "read_header", "image_series", "check_affine", "case_name", "check_pair"]

_JSON_NAMES = ("dataset.json", "dataset_0.json")
_NIFTI = re.compile(r"\.nii(\.gz)?$")
_CHANNEL_SUFFIX = re.compile(r"_\d{4}$")  # nnU-Net's modality index, CASE_0000


@dataclass
class Datalist:
    """Cases of a dataset: dicts ``{"image": path, "label": path}`` (``test``: no label)."""

    label_names: list[str]
    training: list[dict] = field(default_factory=list)
    validation: list[dict] = field(default_factory=list)
    test: list[dict] = field(default_factory=list)
    source: Path | None = None
    synthetic: bool = False
    split: dict | None = None  # the fold these lists are (hsmla_med.data.splits.fold_cases' record)

    @property
    def num_classes(self) -> int:
        return len(self.label_names)


def case_name(path: str | Path) -> str:
    """``img0001`` for ``img0001.nii.gz``; nnU-Net's channel suffix is dropped (``case_0000``)."""
    return _CHANNEL_SUFFIX.sub("", _NIFTI.sub("", Path(path).name))


def find_dataset_json(data_dir: str | Path, name: str | None = None) -> Path:
    """The dataset JSON of ``data_dir``: ``name`` if given, else ``dataset.json`` or ``dataset_0.json``."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"{data_dir}: data directory not found")
    candidates = [name] if name else _JSON_NAMES
    for candidate in candidates:
        path = data_dir / candidate
        if path.is_file():
            return path
    raise DataError(f"{data_dir}: no dataset JSON ({' or '.join(candidates)}) in the data directory")


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: malformed JSON: {err}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: cannot read dataset JSON ({err})") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object at the top level")
    return data


def _label_names(labels, path: Path) -> list[str]:
    """Names indexed by label value from MSD ``{"1": "spleen"}`` or nnU-Net ``{"spleen": 1}``."""
    if not isinstance(labels, dict) or not labels:
        raise DataError(f"{path}: 'labels' must be a non-empty mapping of label values and names")
    try:
        if all(str(k).strip().isdigit() for k in labels):
            by_value = {int(k): str(v) for k, v in labels.items()}
        else:  # nnU-Net v2; region-based entries (lists of values) are not plain labels
            by_value = {int(v): str(k) for k, v in labels.items()}
    except (TypeError, ValueError):
        raise DataError(f"{path}: 'labels' values must be integers (label values) or names") from None
    if sorted(by_value) != list(range(len(by_value))):
        raise DataError(f"{path}: label values must be 0..{len(by_value) - 1} without gaps, got {sorted(by_value)}")
    return [by_value[i] for i in range(len(by_value))]


def _entry_error(path: Path, key: str, fields: tuple[str, ...], entry) -> DataError:
    return DataError(f"{path}: each '{key}' entry needs {' and '.join(fields)}, got {entry!r}")


def _listed(data_dir: Path, path: Path, meta: dict, key: str, fields: tuple[str, ...]) -> list[dict]:
    """The cases of the JSON's ``key`` list (``training``, ``validation``, ``test``), paths
    resolved against ``data_dir`` by MONAI's ``load_decathlon_datalist`` (what MONAI's BTCV
    tutorial reads ``dataset_0.json`` with), then checked here: MONAI passes entries of the
    wrong shape through unchanged and never looks at the files."""
    entries = meta.get(key) or []
    if not isinstance(entries, list):
        raise DataError(f"{path}: '{key}' must be a list")
    if not entries:
        return []
    try:
        resolved = load_decathlon_datalist(path, is_segmentation=True, data_list_key=key, base_dir=data_dir)
    except TypeError:  # an entry that is not a mapping (MONAI's test lists may be plain paths)
        raise _entry_error(path, key, fields, next(e for e in entries if not isinstance(e, dict))) from None
    return [_checked(entry, original, path, key, fields) for entry, original in zip(resolved, entries)]


def _checked(entry: dict, original, path: Path, key: str, fields: tuple[str, ...]) -> dict:
    """One resolved entry as ``{field: existing file}``; ``original`` is the entry as written."""
    written = original if isinstance(original, dict) else {"image": original}  # a test list's plain path
    if any(k not in written for k in fields):
        raise _entry_error(path, key, fields, original)
    case = {}
    for field_name in fields:
        value, resolved = written[field_name], entry[field_name]
        if isinstance(value, list):  # MSD allows one file per modality; this project reads one
            if len(value) != 1:
                raise DataError(f"{path}: multi-file {field_name} entries are not supported: {value!r}")
            value, resolved = value[0], resolved[0]
        if not isinstance(value, str) or not value:
            raise DataError(f"{path}: {field_name} entries must be file paths (strings), got {value!r}")
        if not Path(resolved).is_file() and not (field_name == "image" and Path(resolved).is_dir()):  # a folder: a DICOM series
            raise DataError(f"{resolved}: {field_name} file listed in {path.name} not found")
        case[field_name] = resolved
    return case


def _pair_folders(data_dir: Path, path: Path) -> list[dict]:
    """nnU-Net v2: ``imagesTr/CASE_0000.nii.gz`` with ``labelsTr/CASE.nii.gz``."""
    images = sorted(p for p in (data_dir / "imagesTr").glob("*") if _NIFTI.search(p.name))
    cases = []
    for image in images:
        label = data_dir / "labelsTr" / (case_name(image) + _NIFTI.search(image.name).group(0))
        if not label.is_file():
            raise DataError(f"{image}: no label file {label} for this image")
        cases.append({"image": str(image), "label": str(label)})
    if not cases:
        raise DataError(f"{path}: no 'training' list and no NIfTI images in {data_dir / 'imagesTr'}")
    return cases


def read_header(path: str | Path) -> tuple[tuple[int, ...], np.ndarray]:
    """Shape and affine of a NIfTI file from its header, or of a folder holding one DICOM series
    from the series' headers (:func:`~hsmla_med.io.dicom.series_geometry`); :class:`DataError`
    if unreadable or if the affine cannot place voxels (:func:`check_affine`)."""
    if Path(path).is_dir():
        from hsmla_med.io.dicom import series_geometry

        shape, affine = series_geometry(image_series(path))
        check_affine(affine, path)
        return shape, affine
    try:
        img = nib.load(str(path))
        shape, affine = tuple(int(s) for s in img.shape), np.asarray(img.affine, dtype=np.float64)
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except Exception as err:  # nibabel raises several types for truncated or foreign files
        raise DataError(f"{path}: cannot read as NIfTI ({err})") from None
    check_affine(affine, path)
    return shape, affine


def image_series(folder: str | Path):
    """The one DICOM image series of a case's image folder (:class:`~hsmla_med.io.dicom.DicomSeries`)."""
    from hsmla_med.io.dicom import series_in

    series = series_in(folder)
    if len(series) != 1:
        raise DataError(f"{folder}: a case's image folder holds one DICOM series, this one {len(series)}: " + "; ".join(s.line() for s in series))
    return series[0]


def check_affine(affine: np.ndarray, path: str | Path) -> None:
    """Refuse an affine that maps no volume: NaN or infinite entries (resampling and the header
    of the output fail on them: ``SVD did not converge``), a zero voxel spacing (a column of
    zeros: resampling divides by it) or axes that are not independent."""
    linear = np.asarray(affine, dtype=np.float64)[:3, :3]
    if not np.isfinite(affine).all():
        raise DataError(f"{path}: the header's affine (qform/sform) has NaN or infinite entries")
    spacing = np.linalg.norm(linear, axis=0)
    if (spacing == 0).any():
        raise DataError(f"{path}: zero voxel spacing along axis {int(np.argmin(spacing))} in the header's affine (qform/sform), spacing {spacing.tolist()}")
    if abs(np.linalg.det(linear / spacing)) < 1e-6:  # unit columns: a volume of 0 means parallel axes
        raise DataError(f"{path}: the header's affine (qform/sform) is singular: its voxel axes are not independent")


def check_pair(case: dict, atol: float = 1e-3) -> None:
    """Image and label must cover the same voxels: same spatial shape and affine; a DICOM SEG
    label must reference the case's image series (it is read onto that series' grid)."""
    from hsmla_med.io.dicom_seg import is_seg_file, referenced_series_uid

    if is_seg_file(case["label"]):
        uid = referenced_series_uid(case["label"])
        if not Path(case["image"]).is_dir() or (image_uid := image_series(case["image"]).uid) != uid:
            image = f"series {image_uid}" if Path(case["image"]).is_dir() else "no DICOM series"
            raise DataError(f"{case['label']}: a DICOM SEG label of series {uid}, but its image {case['image']} is {image}")
        return
    image_shape, image_affine = read_header(case["image"])
    label_shape, label_affine = read_header(case["label"])
    if image_shape[:3] != label_shape[:3]:
        raise DataError(f"{case['label']}: label shape {label_shape} does not match image shape {image_shape} ({case['image']})")
    if not np.allclose(image_affine, label_affine, atol=atol):
        raise DataError(
            f"{case['label']}: label affine does not match the image's ({case['image']}):\n"
            f"{np.array2string(label_affine, precision=3)}\nvs\n{np.array2string(image_affine, precision=3)}"
        )


def load_datalist(data_dir: str | Path, dataset_json: str | None = None) -> Datalist:
    """Read a dataset folder into a :class:`Datalist` and check its files.

    The lists are the JSON's (``validation`` empty when it has none); the folds of training
    are drawn from them by :func:`hsmla_med.data.splits.fold_cases`.

    Args:
        data_dir: folder holding the dataset JSON; relative paths in it are relative to this folder.
        dataset_json: the JSON's file name; default ``dataset.json`` then ``dataset_0.json``.
    """
    data_dir = Path(data_dir)
    path = find_dataset_json(data_dir, dataset_json)
    meta = read_json(path)
    if "labels" not in meta:
        raise DataError(f"{path}: missing 'labels' (label value → name)")
    names = _label_names(meta["labels"], path)
    pair = ("image", "label")
    training = _listed(data_dir, path, meta, "training", pair) if "training" in meta else _pair_folders(data_dir, path)
    validation = _listed(data_dir, path, meta, "validation", pair)
    test = _listed(data_dir, path, meta, "test", ("image",))
    if not training:
        raise DataError(f"{path}: the dataset lists no training cases")
    if len(training) + len(validation) < 2:
        raise DataError(f"{path}: need at least two cases to hold one out for validation")
    for case in training + validation:
        check_pair(case)
    return Datalist(names, training, validation, test, path, bool(meta.get("synthetic", False)))
