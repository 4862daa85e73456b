"""LUNA16 on disk: MetaImage CT scans, nodule annotations in world millimetres, and the
geometry between the two.

LUNA16 ships ``subset0`` .. ``subset9`` folders of ``<seriesuid>.mhd`` headers with their
``.raw`` voxels, lung masks of the same names in ``seg-lungs-LUNA16/`` (not scans),
``annotations.csv`` (``seriesuid,coordX,coordY,coordZ,diameter_mm``) in ``CSVFILES/`` and, in
``evaluationScript/annotations/``, the same ``annotations.csv``, ``annotations_excluded.csv``
(irrelevant findings, which count neither as hits nor as false positives; ``diameter_mm`` is -1
where their size is unknown) and ``seriesuids.csv`` (the evaluated scans, one per line, no
header). The coordinates are ITK physical points: millimetres in the scanner's LPS frame, mapped from a voxel
index ``(i, j, k)`` (x, y, z order) by ``origin + direction @ (spacing * index)``.

LUNA16's scans are LIDC-IDRI's CT series, distributed as DICOM, and its file names are their
SeriesInstanceUIDs: a DICOM series is read as the same scan (:class:`LoadScand`), its
ImagePositionPatient / ImageOrientationPatient being the same LPS millimetres.

MONAI's ITK reader turns the same geometry into a RAS affine (x and y negated); the nodule masks
and the detections are computed in that frame, and converted back to LPS for the CSVs.
"""

from __future__ import annotations

import copy
import csv
import logging
from collections.abc import Hashable, Mapping
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from monai.data import MetaTensor
from monai.transforms import MapTransform

from hsmla_med.errors import DataError
from hsmla_med.io.dicom import read_series
from hsmla_med.io.itk import check_metaimage, header_reader, read_itk
from hsmla_med.metrics.detection import affine_points

__all__ = [
    "COLUMNS",
    "CSV_FOLDERS",
    "Geometry",
    "find_scans",
    "find_csv",
    "csv_places",
    "read_findings",
    "read_geometry",
    "read_annotations",
    "read_seriesuids",
    "read_submission",
    "voxel_to_world",
    "world_to_voxel",
    "lps_to_ras",
    "voxel_to_lps",
    "LoadScand",
    "NoduleMaskd",
]

log = logging.getLogger("hsmla_med")
COLUMNS = ("seriesuid", "coordX", "coordY", "coordZ", "diameter_mm")
SUBMISSION_COLUMNS = (*COLUMNS[:4], "probability")
LUNG_MASKS = "seg-lungs-LUNA16"  # the distribution's lung segmentations: .mhd files that are not scans
CSV_FOLDERS = (".", "CSVFILES", "evaluationScript/annotations")  # where LUNA16's CSVs may lie, in this order
LPS_TO_RAS = np.array([-1.0, -1.0, 1.0])


class Geometry:
    """Voxel grid of a scan in ITK's terms: ``origin`` (3,), ``spacing`` (3,) and ``direction``
    (3, 3), all in x, y, z order, and ``size`` (3,) in voxels."""

    def __init__(self, origin, spacing, direction, size) -> None:
        self.origin = np.asarray(origin, dtype=np.float64)
        self.spacing = np.asarray(spacing, dtype=np.float64)
        self.direction = np.asarray(direction, dtype=np.float64).reshape(3, 3)
        self.size = np.asarray(size, dtype=np.int64)


def voxel_to_world(index: np.ndarray, geometry: Geometry) -> np.ndarray:
    """LPS millimetres of continuous voxel indices ``(n, 3)`` (x, y, z order)."""
    index = np.atleast_2d(np.asarray(index, dtype=np.float64))
    return geometry.origin + (index * geometry.spacing) @ geometry.direction.T


def world_to_voxel(world: np.ndarray, geometry: Geometry) -> np.ndarray:
    """Continuous voxel indices ``(n, 3)`` (x, y, z order) of LPS millimetres ``(n, 3)``."""
    world = np.atleast_2d(np.asarray(world, dtype=np.float64))
    return np.linalg.solve(geometry.direction, (world - geometry.origin).T).T / geometry.spacing


def lps_to_ras(points: np.ndarray) -> np.ndarray:
    """LPS <-> RAS millimetres ``(n, 3)`` (the same sign flip both ways)."""
    return np.asarray(points, dtype=np.float64) * LPS_TO_RAS


def read_geometry(path: str | Path) -> Geometry:
    """The voxel grid of a MetaImage scan, from its header only."""
    reader = header_reader(path)
    return Geometry(reader.GetOrigin(), reader.GetSpacing(), reader.GetDirection(), reader.GetSize())


def find_scans(root: str | Path) -> dict[str, Path]:
    """``{seriesuid: path}`` of the ``.mhd`` scans under ``root`` (LUNA16's ``subsetK/``
    folders or any other nesting), each checked for its ``.raw``; the lung masks in
    ``seg-lungs-LUNA16/`` (same names, not scans) are left out."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: data directory not found")
    scans = {}
    for path in sorted(root.rglob("*.mhd")):
        if LUNG_MASKS in path.relative_to(root).parts[:-1]:
            continue
        check_metaimage(path)
        if path.stem in scans:
            raise DataError(f"{path}: series {path.stem} appears twice (also {scans[path.stem]})")
        scans[path.stem] = path
    if not scans:
        raise DataError(f"{root}: no MetaImage scans (*.mhd) found")
    return scans


def find_csv(root: Path, name: str) -> Path | None:
    """``name`` at the top of the dataset, in ``CSVFILES/`` or in ``evaluationScript/annotations/``
    (the distribution keeps annotations.csv in the first two, annotations_excluded.csv and
    seriesuids.csv in the last)."""
    for folder in CSV_FOLDERS:
        if (root / folder / name).is_file():
            return root / folder / name
    return None


def csv_places(name: str) -> str:
    """Where :func:`find_csv` looks for ``name``, in its order, for the messages that it is not there."""
    return ", ".join(f"{folder}/{name}".removeprefix("./") for folder in CSV_FOLDERS)


@contextmanager
def _readable(path: Path, what: str):
    """Turn a file that cannot be read or is not CSV text into a :class:`DataError` naming it."""
    try:
        yield
    except OSError as err:
        raise DataError(f"{path}: cannot read {what} ({err.strerror})") from None
    except (UnicodeDecodeError, csv.Error) as err:
        raise DataError(f"{path}: not a CSV text file ({type(err).__name__})") from None


def _read_rows(path: Path, columns: tuple[str, ...], what: str) -> list[dict]:
    """The rows of a CSV file with (at least) ``columns``; :class:`DataError` naming the file
    when it cannot be read, is not text or lacks a column."""
    # utf-8-sig: a CSV saved by a spreadsheet starts with a byte-order mark, which would
    # otherwise stick to the first column's name
    with _readable(path, what), path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        missing = [c for c in columns if c not in (reader.fieldnames or [])]
        if missing:
            raise DataError(f"{path}: missing column(s) {', '.join(missing)}; expected {','.join(columns)}")
        return list(reader)


def _lines(path: Path, columns: tuple[str, ...], what: str, why_not_negative: str | None = None) -> dict[str, list[tuple[int, list[float]]]]:
    """``{seriesuid: [(line number, values of the other columns)]}`` of a CSV whose other columns
    are finite numbers, the last one not negative when ``why_not_negative`` says why
    (:class:`DataError` naming the file and line otherwise)."""
    found: dict[str, list] = {}
    for line, row in enumerate(_read_rows(path, columns, what), 2):
        try:
            values = [float(row[c]) for c in columns[1:]]
        except (TypeError, ValueError):
            raise DataError(f"{path}, line {line}: {', '.join(columns[1:])} must be numbers, got {[row[c] for c in columns[1:]]}") from None
        if not np.all(np.isfinite(values)):
            raise DataError(f"{path}, line {line}: {', '.join(columns[1:])} must be finite")
        if why_not_negative and values[-1] < 0:
            raise DataError(f"{path}, line {line}: {columns[-1]} must not be negative, got {values[-1]:g} ({why_not_negative})")
        found.setdefault(row[columns[0]], []).append((line, values))
    return found


def _arrays(found: Mapping[str, list], width: int) -> dict[str, np.ndarray]:
    """``{seriesuid: (n, width) float array}`` of :func:`_lines`' rows."""
    return {uid: np.asarray([v for _, v in rows], dtype=np.float64).reshape(-1, width) for uid, rows in found.items()}


def _inside(path: Path, uid: str, rows: list, scan: Path, refuse: bool) -> list:
    """The rows (:func:`_lines`) of series ``uid`` whose centre lies in its scan: within the
    scan's extent, half a voxel beyond its outer voxel centres. A nodule outside can be neither
    a training target nor detected, and would count as missed: refused with ``refuse`` (a
    :class:`DataError` naming the file, line and series), else skipped with one warning for the
    scan that counts them."""
    geometry = read_geometry(scan)
    index = world_to_voxel([values[:3] for _, values in rows], geometry)
    outside = np.any((index < -0.5) | (index > geometry.size - 0.5), axis=1)
    if not outside.any():
        return rows
    if refuse:
        (line, (x, y, z, _)), (i, j, k) = next((row, ijk) for row, ijk, out in zip(rows, index, outside) if out)
        raise DataError(f"{path}, line {line}: the nodule of series {uid} at ({x:g}, {y:g}, {z:g}) mm lies outside its scan {scan} "
                        f"(voxel {i:.1f}, {j:.1f}, {k:.1f} of {' x '.join(map(str, geometry.size))})")
    lines = [line for (line, _), out in zip(rows, outside) if out]
    where = f"line{'s' if len(lines) > 1 else ''} {', '.join(map(str, lines))}"
    if len(lines) == len(rows):
        nodules = "its nodule lies" if len(rows) == 1 else f"all its {len(rows)} nodules lie"
        log.warning("%s: series %s: %s outside its scan (%s); skipped: the scan trains without nodules", path, uid, nodules, where)
    else:
        nodules = f"{len(lines)} of its {len(rows)} nodules {'lies' if len(lines) == 1 else 'lie'}"
        log.warning("%s: series %s: %s outside its scan (%s); skipped", path, uid, nodules, where)
    return [row for row, out in zip(rows, outside) if not out]


def read_annotations(
    path: str | Path, series: Mapping[str, object] | None = None, excluded: bool = False, rendered: bool = True,
    scans: Mapping[str, Path] | None = None, refuse_outside: bool = False,
) -> dict[str, np.ndarray]:
    """``{seriesuid: (n, 4) float array of x, y, z (LPS mm), diameter (mm)}`` from a LUNA16 CSV.

    Args:
        path: ``annotations.csv`` or ``annotations_excluded.csv``.
        series: the known scans; rows of other series are dropped with one warning naming the
            file (LUNA16's CSVs list all ten subsets, a user may hold a few).
        excluded: the file lists irrelevant findings (``annotations_excluded.csv``), where a
            negative diameter (LUNA16 writes -1) means "size unknown" and is kept as it is (the
            evaluation takes 10 mm for it).
        rendered: the nodules become training targets, so each needs its size and a negative
            diameter in ``annotations.csv`` is refused; ``False`` when they are only scored,
            where the official script's 10 mm applies to them too.
        scans: ``{seriesuid: scan}``: the rows of these series are checked against their scan's
            geometry (its header): a nodule outside its scan is skipped with one warning per
            scan (training), or refused with ``refuse_outside`` (evaluation labels).
    """
    path = Path(path)
    why = None if excluded or not rendered else "-1 marks an irrelevant finding, which belongs in annotations_excluded.csv"
    found = _lines(path, COLUMNS, "annotations", why)
    if series is not None:
        unknown = sorted(set(found) - set(series))
        if unknown:
            log.warning("%s: %d series without a scan here ignored (%s%s)", path, len(unknown), ", ".join(unknown[:3]), ", ..." if len(unknown) > 3 else "")
        found = {uid: v for uid, v in found.items() if uid in series}
    if scans is not None:
        found = {uid: _inside(path, uid, rows, scans[uid], refuse_outside) if uid in scans else rows for uid, rows in found.items()}
    return _arrays(found, len(COLUMNS) - 1)


def read_findings(root: Path, scans: dict[str, Path | None]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The nodules and the excluded findings of the scans under ``root`` (``{seriesuid: scan
    file}``; ``None``: a series scored without its scan); a nodule outside its scan is skipped,
    with a warning for the scan (:func:`read_annotations`). Without
    ``annotations_excluded.csv`` every finding outside ``annotations.csv`` counts as a false
    positive, so its absence is a warning naming where it was looked for."""
    notes = find_csv(root, "annotations.csv")
    if notes is None:
        raise DataError(f"{root}: annotations.csv not found ({csv_places('annotations.csv')})")
    excluded_csv = find_csv(root, "annotations_excluded.csv")
    if excluded_csv is None:
        log.warning(
            "%s: no annotations_excluded.csv (looked for %s): candidates on irrelevant findings will count as "
            "false positives and CPM will be lower than the official evaluation's", root, csv_places("annotations_excluded.csv"),
        )
    excluded = read_annotations(excluded_csv, scans, excluded=True) if excluded_csv else {}
    return read_annotations(notes, scans, scans={uid: path for uid, path in scans.items() if path is not None}), excluded


def read_submission(path: str | Path) -> dict[str, np.ndarray]:
    """``{seriesuid: (n, 4) x, y, z (LPS mm), probability}`` of a LUNA16 submission CSV
    (``seriesuid,coordX,coordY,coordZ,probability``)."""
    return _arrays(_lines(Path(path), SUBMISSION_COLUMNS, "submission"), len(SUBMISSION_COLUMNS) - 1)


def read_seriesuids(path: str | Path) -> list[str]:
    """The scans of LUNA16's ``seriesuids.csv``: one series UID per line, no header (the
    official script takes every line's first field)."""
    path = Path(path)
    with _readable(path, "the series list"), path.open(newline="", encoding="utf-8") as f:
        uids = [row[0].strip() for row in csv.reader(f) if row and row[0].strip()]
    if not uids:
        raise DataError(f"{path}: no series UID in it")
    return uids


def voxel_to_lps(index: np.ndarray, affine) -> np.ndarray:
    """LPS millimetres of continuous voxel indices ``(n, 3)`` of a MONAI (RAS) affine ``(4, 4)``."""
    return lps_to_ras(affine_points(index, affine))  # the sign flip is its own inverse


def _read_mhd(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """The voxels ``(x, y, z)`` (float32) and RAS affine of a MetaImage scan (SimpleITK)."""
    voxels, affine = read_itk(path)
    return voxels.astype(np.float32), affine


def _read_scan(source: str | Path | list) -> tuple[np.ndarray, np.ndarray, str]:
    """The voxels ``(x, y, z)`` (float32), RAS affine and name of a scan: a MetaImage file, or
    the files of a DICOM series in slice order (a list, as ``infer`` gives a series:
    :func:`~hsmla_med.io.dicom.read_series`, on SimpleITK's grid as for a MetaImage, the same
    LPS geometry turned into RAS; named by its folder)."""
    if isinstance(source, (list, tuple)):
        voxels, affine = read_series([Path(f) for f in source])
        return np.asarray(voxels, dtype=np.float32), affine, str(Path(source[0]).parent)
    return (*_read_mhd(Path(source)), str(source))


class LoadScand(MapTransform):
    """Read a scan (a MetaImage file, or a DICOM series as the list of its files in slice
    order) into a channel-first float32 MONAI MetaTensor ``(1, X, Y, Z)`` whose affine maps
    voxels to RAS millimetres, as MONAI's readers do. A missing ``.raw``, an unreadable file or
    NaN/Inf voxels raise a :class:`DataError` naming the file."""

    def __init__(self, keys: Hashable = "image") -> None:
        super().__init__([keys])

    def __call__(self, data: Mapping) -> dict:
        data = dict(data)
        for key in self.keys:
            voxels, affine, name = _read_scan(data[key])
            finite = np.isfinite(voxels)
            if not finite.all():
                raise DataError(f"{name}: {int((~finite).sum())} voxel(s) are NaN or Inf")
            meta = {"filename_or_obj": name, "affine": torch.as_tensor(affine), "original_affine": affine.copy(),
                    "spatial_shape": np.asarray(voxels.shape)}
            data[key] = MetaTensor(torch.from_numpy(np.ascontiguousarray(voxels))[None], meta=meta)
        return data


class NoduleMaskd(MapTransform):
    """Render the nodules of a loaded scan as a ``label`` map of spheres (1 inside, 0 outside).

    The scan is a channel-first MONAI MetaTensor ``(1, H, W, D)`` with its RAS affine (MONAI's
    ITK reader); ``nodules`` holds the case's ``(n, 4)`` LPS centres and diameters in mm. A voxel
    belongs to a nodule when its centre lies within the radius; a nodule smaller than a voxel
    still marks the voxel nearest its centre.
    """

    def __init__(self, image_key: Hashable = "image", nodules_key: Hashable = "nodules", label_key: Hashable = "label") -> None:
        super().__init__([image_key])
        self.image_key, self.nodules_key, self.label_key = image_key, nodules_key, label_key

    def __call__(self, data: Mapping) -> dict:
        data = dict(data)
        image = data[self.image_key]
        affine = np.asarray(image.affine, dtype=np.float64)
        shape = image.shape[1:]
        label = np.zeros(shape, dtype=np.uint8)
        inverse = np.linalg.inv(affine)
        spacing = np.linalg.norm(affine[:3, :3], axis=0)
        for x, y, z, diameter in np.asarray(data[self.nodules_key], dtype=np.float64).reshape(-1, 4):
            centre = lps_to_ras([[x, y, z]])[0]
            voxel = inverse[:3, :3] @ centre + inverse[:3, 3]
            radius = diameter / 2
            reach = np.ceil(radius / spacing).astype(int) + 1
            lo = np.maximum(np.floor(voxel).astype(int) - reach, 0)
            hi = np.minimum(np.ceil(voxel).astype(int) + reach + 1, shape)
            if np.any(lo >= hi):
                continue  # entirely outside the scan
            grid = np.stack(np.meshgrid(*(np.arange(a, b) for a, b in zip(lo, hi)), indexing="ij"), axis=-1)
            mm = grid @ affine[:3, :3].T + affine[:3, 3]
            inside = np.linalg.norm(mm - centre, axis=-1) <= radius
            label[tuple(slice(a, b) for a, b in zip(lo, hi))][inside] = 1
            nearest = np.round(voxel).astype(int)
            if np.all((nearest >= 0) & (nearest < shape)):
                label[tuple(nearest)] = 1
        data[self.label_key] = MetaTensor(torch.from_numpy(label[None]), meta=copy.deepcopy(image.meta))
        return data
