"""Dataset JSON handling: MSD / nnU-Net folders and MONAI's ``training``/``validation`` lists.

Three layouts describe the same thing, a list of image/label pairs and the label names:

- MSD (``dataset.json`` with ``labels`` ``{"0": "background", ...}`` and ``training``
  ``[{"image": ..., "label": ...}]``), which MONAI's tutorials extend with a ``validation`` list
  (BTCV's ``dataset_0.json``);
- nnU-Net v2 (``labels`` ``{"background": 0, ...}``, no lists: ``imagesTr/CASE_0000.nii.gz``
  pairs with ``labelsTr/CASE.nii.gz``; with ``file_ending`` ``.mha``, ``.nrrd``, ... the files of
  that format: :mod:`hsmla_med.io.volumes`).

Several input channels: ``channel_names`` (nnU-Net v2, ``{"0": "T1", "1": "T2"}``) or
``modality`` (MSD) give their number; a case's image is then the list of its channel files
(``CASE_0000.nii.gz``, ``CASE_0001.nii.gz``, ... in the folders; a list per entry in the JSON's
lists; or one 4D file), which MONAI's ``LoadImaged`` stacks channel first. nnU-Net v2's label
kinds are read too (:func:`label_spec`): an ``ignore`` label (the highest value: voxels that
count in neither loss nor metrics) and region labels (``"tumour_core": [2, 3]`` with
``regions_class_order``).

:func:`load_datalist` reads either into one :class:`Datalist` (the lists through MONAI's
``load_decathlon_datalist``), checks that every file exists, that each affine places voxels
(finite, no zero spacing) and that each image and label agree in shape and affine (headers only,
so it is cheap), and raises a :class:`~hsmla_med.errors.DataError` naming the file otherwise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from monai.data import load_decathlon_datalist

from hsmla_med.errors import DataError
# the volume formats' registry; case_name, check_nifti, VOLUME_FILE and VOLUME_FORMATS are also
# imported from here by the modules that read datasets (hsmla_med.data.checks, .splits, the pipelines)
from hsmla_med.io.volumes import VOLUME_FILE, VOLUME_FORMATS, case_name, check_nifti, file_ending, file_format, file_stem, image_series, volume_format

__all__ = ["Datalist", "load_datalist", "label_spec", "channel_groups", "find_dataset_json", "read_json", "read_header", "channels_grid", "check_affine",
           "case_name", "check_pair", "check_nifti", "VOLUME_FILE", "VOLUME_FORMATS"]

_JSON_NAMES = ("dataset.json", "dataset_0.json")


@dataclass
class Datalist:
    """Cases of a dataset: dicts ``{"image": path, "label": path}`` (``test``: no label); with
    several ``channels`` the image is the list of a case's channel files (or one 4D file).

    ``label_names``: the classes the network predicts, background first (with ``regions``: the
    background and the regions); ``ignore_label``: the label value whose voxels count in
    neither loss nor metrics, or ``None``; ``regions``: each region's label values, in the order
    of ``label_names[1:]``, and ``regions_class_order`` the value each one writes (nnU-Net v2)."""

    label_names: list[str]
    training: list[dict] = field(default_factory=list)
    validation: list[dict] = field(default_factory=list)
    test: list[dict] = field(default_factory=list)
    source: Path | None = None
    synthetic: bool = False
    split: dict | None = None  # the fold these lists are (hsmla_med.data.splits.fold_cases' record)
    plan: dict | None = None  # the plan its config's auto values took (hsmla_med.data.plans.plan_dataset)
    channels: int = 1
    ignore_label: int | None = None
    regions: list[list[int]] | None = None
    regions_class_order: list[int] | None = None

    @property
    def num_classes(self) -> int:
        return len(self.label_names)

    def label_values(self) -> list[int]:
        """Every value a label map of the dataset may hold (the ignore label's included)."""
        values = sorted({0, *(v for r in self.regions for v in r)}) if self.regions else list(range(self.num_classes))
        return values + ([self.ignore_label] if self.ignore_label is not None else [])

    def label_config(self) -> dict:
        """What a module's config keeps of the labels beyond their names (its loss, its label
        maps and its scores depend on them)."""
        return {"ignore_label": self.ignore_label, "regions": self.regions, "regions_class_order": self.regions_class_order}


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


IGNORE = "ignore"  # nnU-Net v2's name of the ignore label


def _label_value(value, path: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int) and not (isinstance(value, str) and value.strip().isdigit()):
        raise DataError(f"{path}: 'labels' values must be integers (label values) or names, got {value!r}")
    return int(value)


def label_spec(meta: dict, path: Path) -> tuple[list[str], int | None, list[list[int]] | None, list[int] | None]:
    """The classes of a dataset JSON: ``(names, ignore_label, regions, regions_class_order)``.

    ``labels`` is MSD's ``{"1": "spleen"}`` or nnU-Net v2's ``{"spleen": 1}``, values
    ``0..N-1`` without gaps (``names`` by value). nnU-Net v2 also has an ``"ignore"`` label,
    the highest value (left out of ``names``), and regions: labels whose value is a list
    (``"tumour_core": [2, 3]``), with ``regions_class_order`` (one label value per foreground
    region, the value its voxels get in a label map); then ``names`` is the background and the
    regions in the JSON's order, and ``regions`` their label values."""
    labels = meta.get("labels")
    if not isinstance(labels, dict) or not labels:
        raise DataError(f"{path}: 'labels' must be a non-empty mapping of label values and names")
    if all(str(k).strip().isdigit() for k in labels):  # MSD: value -> name
        by_name = {str(v): _label_value(k, path) for k, v in labels.items()}
    else:  # nnU-Net v2: name -> value, or -> list of values (a region)
        by_name = {str(k): [_label_value(x, path) for x in v] if isinstance(v, list) else _label_value(v, path) for k, v in labels.items()}
    ignore = by_name.pop(IGNORE, None)
    if isinstance(ignore, list):
        raise DataError(f"{path}: the '{IGNORE}' label is one label value, got {ignore!r}")
    highest = max((x for v in by_name.values() for x in (v if isinstance(v, list) else [v])), default=0)
    if ignore is not None and ignore <= highest:
        raise DataError(f"{path}: the '{IGNORE}' label must have the highest label value (above {highest}), got {ignore}")
    if any(isinstance(v, list) for v in by_name.values()):
        names, regions, order = _regions(by_name, meta.get("regions_class_order"), path)
    else:
        by_value = {v: k for k, v in by_name.items()}
        if len(by_value) != len(by_name) or sorted(by_value) != list(range(len(by_value))):
            raise DataError(f"{path}: label values must be 0..{len(by_name) - 1} without gaps or repeats, got {sorted(by_name.values())}")
        names, regions, order = [by_value[i] for i in range(len(by_value))], None, None
    return names, ignore, regions, order


def _regions(by_name: dict, order, path: Path) -> tuple[list[str], list[list[int]], list[int]]:
    """Names, label values and ``regions_class_order`` of a region-based ``labels``."""
    if by_name.get("background") != 0:
        raise DataError(f"{path}: region-based labels need \"background\": 0")
    regions = {k: v if isinstance(v, list) else [v] for k, v in by_name.items() if k != "background"}
    if not isinstance(order, list) or len(order) != len(regions) or not all(isinstance(v, int) and not isinstance(v, bool) for v in order):
        raise DataError(f"{path}: region-based labels need 'regions_class_order', one label value per region ({len(regions)}), got {order!r}")
    for name, values in regions.items():
        if not values or min(values) < 1:
            raise DataError(f"{path}: region {name!r} must list label values above 0, got {values}")
    return ["background", *regions], list(regions.values()), list(order)


def _channels(meta: dict, path: Path) -> int:
    """Input channels: the entries of nnU-Net v2's ``channel_names`` or MSD's ``modality``
    (``{"0": "T1", "1": "T2"}``); 1 without either."""
    names = meta.get("channel_names", meta.get("modality"))
    if names is None:
        return 1
    if not isinstance(names, dict) or sorted(str(k) for k in names) != sorted(str(i) for i in range(len(names))) or not names:
        raise DataError(f"{path}: 'channel_names' / 'modality' must map channel indices 0..C-1 to names, got {names!r}")
    return len(names)


def _entry_error(path: Path, key: str, fields: tuple[str, ...], entry) -> DataError:
    return DataError(f"{path}: each '{key}' entry needs {' and '.join(fields)}, got {entry!r}")


def _listed(data_dir: Path, path: Path, meta: dict, key: str, fields: tuple[str, ...], channels: int = 1) -> list[dict]:
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
    return [_checked(entry, original, path, key, fields, channels) for entry, original in zip(resolved, entries)]


def _checked(entry: dict, original, path: Path, key: str, fields: tuple[str, ...], channels: int = 1) -> dict:
    """One resolved entry as ``{field: existing file}`` (an image of several channels: the list
    of its files, one per channel, or one file that holds them all); ``original`` is the entry
    as written."""
    written = original if isinstance(original, dict) else {"image": original}  # a test list's plain path
    if any(k not in written for k in fields):
        raise _entry_error(path, key, fields, original)
    case = {}
    for field_name in fields:
        value, resolved = written[field_name], entry[field_name]
        if isinstance(value, list):  # MSD: one file per modality
            allowed = {1, channels} if field_name == "image" else {1}
            if len(value) not in allowed:
                raise DataError(f"{path}: a {field_name} entry lists {len(value)} files, the dataset has {channels} channel(s) "
                                f"('channel_names' / 'modality'): {value!r}")
            if len(value) == 1:
                value, resolved = value[0], resolved[0]
        for one, file in zip(*((value, resolved) if isinstance(value, list) else ([value], [resolved]))):
            if not isinstance(one, str) or not one:
                raise DataError(f"{path}: {field_name} entries must be file paths (strings), got {one!r}")
            if not Path(file).is_file() and not (field_name == "image" and Path(file).is_dir()):  # a folder: a DICOM series
                raise DataError(f"{file}: {field_name} file listed in {path.name} not found")
        case[field_name] = resolved
    return case


def channel_groups(files, channels: int) -> list[list[Path]]:
    """Volume files grouped into cases by :func:`case_name`, each case's files in channel order
    (nnU-Net's ``CASE_0000``, ``CASE_0001``, ...); :class:`DataError` naming a case that does not
    have exactly ``channels`` files with the suffixes ``_0000`` to ``_{channels - 1:04d}``. A
    file without a channel suffix is a case alone (MSD's 4D file of every channel)."""
    groups: dict[str, list[Path]] = {}
    for file in sorted(Path(f) for f in files):
        groups.setdefault(case_name(file), []).append(file)
    for name, group in groups.items():
        suffixes = [file_stem(f)[len(name):] for f in group]
        expected = [f"_{i:04d}" for i in range(channels)]
        if channels > 1 and suffixes not in (expected, [""]):
            raise DataError(f"{group[0].parent / name}: the case has channel files {', '.join(f.name for f in group)}; the dataset has "
                            f"{channels} channels, one file each: {name}{expected[0]} to {name}{expected[-1]} ({file_ending(group[0])})")
    return list(groups.values())


def _file_ending(meta: dict, path: Path) -> str | None:
    """nnU-Net v2's ``file_ending``, the images' format (``None``: not given); one this reader
    does not take (nnU-Net also reads ``.png`` and ``.tif`` through its own readers) is one
    :class:`DataError` naming it, before any folder is searched."""
    ending = meta.get("file_ending")
    if ending is None:
        return None
    if not isinstance(ending, str) or file_format(ending) is None:
        raise DataError(f"{path}: file_ending {ending!r}: hsmla-med reads volumes in {VOLUME_FORMATS} and DICOM series; convert the "
                        "dataset to NIfTI (SimpleITK's ReadImage / WriteImage keep the geometry) and set file_ending to \".nii.gz\"")
    return ending


def _pair_folders(data_dir: Path, path: Path, channels: int = 1, ending: str | None = None) -> list[dict]:
    """nnU-Net v2: ``imagesTr/CASE_0000.nii.gz`` (and ``CASE_0001.nii.gz``, ... with several
    channels) with ``labelsTr/CASE.nii.gz``; with a ``file_ending`` the files of that format
    only, as nnU-Net lists them (NIfTI: ``.nii.gz``, ``.nii`` and pairs alike: one prediction ending)."""
    wanted = None if ending is None else file_format(ending).prediction_ending
    images = [p for p in (data_dir / "imagesTr").glob("*") if (f := file_format(p)) is not None and wanted in (None, f.prediction_ending)]
    cases = []
    for group in channel_groups(images, channels) if channels > 1 else [[p] for p in sorted(images)]:
        label = data_dir / "labelsTr" / (case_name(group[0]) + file_ending(group[0]))
        if not label.is_file():
            raise DataError(f"{group[0]}: no label file {label} for this image")
        cases.append({"image": [str(p) for p in group] if len(group) > 1 else str(group[0]), "label": str(label)})
    if not cases:
        raise DataError(f"{path}: no 'training' list and no {ending or 'volume'} images in {data_dir / 'imagesTr'} ({VOLUME_FORMATS})")
    return cases


def read_header(path: str | Path) -> tuple[tuple[int, ...], np.ndarray]:
    """Shape and affine of a volume file from its header, or of a folder holding one DICOM series
    from the series' headers, as its format reads them (:func:`~hsmla_med.io.volumes.volume_format`);
    :class:`DataError` if unreadable or if the affine cannot place voxels (:func:`check_affine`)."""
    shape, affine = volume_format(path).header(path)
    check_affine(affine, path)
    return shape, affine


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


def _one_line(affine: np.ndarray) -> str:
    return np.array2string(np.asarray(affine), precision=3, separator=",").replace("\n", "")


def channels_grid(image: str | Path | list, atol: float = 1e-3) -> tuple[tuple[int, ...], np.ndarray]:
    """Shape and affine of a case's image (:func:`read_header`); a list of channel files must
    share them, else a :class:`DataError` naming the first file that differs from the first."""
    first, *others = image if isinstance(image, list) else [image]
    shape, affine = read_header(first)
    for other in others:
        other_shape, other_affine = read_header(other)
        if other_shape != shape:
            raise DataError(f"{other}: channel file of shape {other_shape}, the case's first channel {Path(first).name} has {shape}")
        if not np.allclose(other_affine, affine, atol=atol):
            raise DataError(f"{other}: channel file affine {_one_line(other_affine)} differs from the case's first channel "
                            f"{Path(first).name}'s {_one_line(affine)}")
    return shape, affine


def check_pair(case: dict, atol: float = 1e-3) -> None:
    """Image and label must cover the same voxels: same spatial shape and affine; a DICOM SEG
    label must reference the case's image series (it is read onto that series' grid)."""
    from hsmla_med.io.dicom_seg import is_seg_file, referenced_series_uid

    if is_seg_file(case["label"]):
        uid = referenced_series_uid(case["label"])
        series = not isinstance(case["image"], list) and Path(case["image"]).is_dir()  # (a list: channel files)
        if not series or (image_uid := image_series(case["image"]).uid) != uid:
            image = f"series {image_uid}" if series else "no DICOM series"
            raise DataError(f"{case['label']}: a DICOM SEG label of series {uid}, but its image {case['image']} is {image}")
        return
    image = case["image"][0] if isinstance(case["image"], list) else case["image"]
    image_shape, image_affine = channels_grid(case["image"], atol)
    label_shape, label_affine = read_header(case["label"])
    if image_shape[:3] != label_shape[:3]:
        raise DataError(f"{case['label']}: label shape {label_shape} does not match image shape {image_shape} ({image})")
    if not np.allclose(image_affine, label_affine, atol=atol):
        raise DataError(
            f"{case['label']}: label affine does not match the image's ({image}):\n"
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
    names, ignore, regions, order = label_spec(meta, path)
    channels = _channels(meta, path)
    pair = ("image", "label")
    ending = _file_ending(meta, path)
    training = _listed(data_dir, path, meta, "training", pair, channels) if "training" in meta else _pair_folders(data_dir, path, channels, ending)
    validation = _listed(data_dir, path, meta, "validation", pair, channels)
    test = _listed(data_dir, path, meta, "test", ("image",), channels)
    if not training:
        raise DataError(f"{path}: the dataset lists no training cases")
    if len(training) + len(validation) < 2:
        raise DataError(f"{path}: need at least two cases to hold one out for validation")
    for case in training + validation:
        check_pair(case)
    return Datalist(names, training, validation, test, path, bool(meta.get("synthetic", False)),
                    channels=channels, ignore_label=ignore, regions=regions, regions_class_order=order)
