"""DICOM series in: the one place that finds, checks and reads DICOM image series.

A folder exported from a PACS holds one file per slice under random names, often several
series, and sometimes non-image objects (structured reports, presentation states, RT structure
sets, segmentations). :func:`find_series` groups the image files by SeriesInstanceUID from their
headers alone and sorts each series by position along the slice normal (never by file name);
:func:`read_series` reads the voxels through SimpleITK's series reader (GDCM: rescale slope and
intercept applied), on the same physical grid as SimpleITK's reading, with the affine in RAS as
nibabel and MONAI give it for NIfTI. What SimpleITK does not check is checked here, from the
headers, before any voxel is read: missing slices, orientation or pixel spacing that changes
within a series, gantry tilt (refused: a tilted series is no regular grid, and resampling it
would silently change the image the model sees). :class:`DicomSeriesReader` makes MONAI's
``LoadImage`` read a series folder or a series' file list like any NIfTI file.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pydicom
from monai.data import ImageReader
from pydicom.errors import InvalidDicomError

from hsmla_med.errors import DataError
from hsmla_med.io.itk import image_affine, ras_affine

__all__ = ["DicomSeries", "DicomSeriesReader", "SeriesRules", "find_series", "series_of", "select_series", "series_in", "read_series", "series_geometry",
           "is_dicom_file"]

log = logging.getLogger(__name__)

# Objects that are no image volume: structured reports, key objects, presentation states, RT
# structure sets / plans / doses, segmentations, raw data, encapsulated documents.
NON_IMAGE_MODALITIES = {"SR", "KO", "PR", "RTSTRUCT", "RTPLAN", "RTRECORD", "RTDOSE", "SEG", "REG", "RAW", "DOC", "PLAN", "FID"}
ORIENTATION_TOLERANCE = 1e-4  # direction cosines that differ by less are the same orientation
ORTHONORMAL_TOLERANCE = 1e-3  # ImageOrientationPatient: unit lengths and a right angle, as written to 4-6 digits
SPACING_TOLERANCE = 1e-3  # mm: pixel spacings, and a tilt's in-plane shift over the series
SLICE_STEP_TOLERANCE = 0.01  # relative: slice steps within 1% of the median step are regular
# pydicom's decoders (the dicom-codecs extra) for compressed transfer syntaxes, by a word of the
# syntax's name, most specific first; RLE and deflate pydicom decodes itself
_DECODERS = (("JPEG-LS", "pylibjpeg-libjpeg"), ("JPEG 2000", "pylibjpeg-openjpeg"), ("JPEG", "pylibjpeg-libjpeg"))


@dataclass
class DicomSeries:
    """One image series: its UID, SeriesNumber, SeriesDescription, Modality, its files sorted
    by position along the slice normal, and ``name``: the case name (sanitised
    ``PatientID_StudyDate_SeriesNumber_Description``, unique among the series found together)."""

    uid: str
    number: str
    description: str
    modality: str
    files: list[Path]
    name: str = ""
    folder: Path = field(default=Path("."), repr=False)

    def line(self) -> str:
        """The series as the refusal of a folder of several series lists it."""
        return f"{self.uid} (number {self.number or '?'}, {self.description or 'no description'!r}, {len(self.files)} slice(s))"


def is_dicom_file(path: str | Path) -> bool:
    """A DICOM Part 10 file: ``DICM`` after the 128-byte preamble (read without parsing)."""
    try:
        with open(path, "rb") as f:
            return f.read(132)[128:] == b"DICM"
    except OSError:
        return False


def _header(path: Path):
    """The header of ``path`` (no pixel data), or ``None`` if it is no DICOM file."""
    try:
        return pydicom.dcmread(path, stop_before_pixels=True)
    except (InvalidDicomError, OSError, ValueError, EOFError, AttributeError):
        return None


def _is_volume_slice(ds) -> bool:
    """An image slice that a volume can be built from: an image modality, a position and an
    orientation in the patient (a SEG, SR or RTSTRUCT has none at the top level)."""
    return (ds.get("Modality", "") not in NON_IMAGE_MODALITIES and "ImagePositionPatient" in ds and "ImageOrientationPatient" in ds
            and "PixelSpacing" in ds)


def _values(values) -> str:
    """A multi-valued DICOM attribute as ``[1.0, 0.0]`` (its ``list`` shows strings' quotes)."""
    return "[" + ", ".join(str(v) for v in values) + "]"


def _sanitise(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.-]+", "-", str(text)).strip("-.")


def find_series(folder: str | Path) -> list[DicomSeries]:
    """Every image series in the files under ``folder`` (any depth, any file names), grouped by
    SeriesInstanceUID from the headers alone, each sorted and checked (:func:`check_series`).
    Non-image objects are skipped with one logged note; other files are ignored."""
    folder = Path(folder)
    groups: dict[str, list[tuple[Path, object]]] = {}
    skipped: list[str] = []
    for root, _, names in os.walk(folder):
        for name in sorted(names):
            path = Path(root) / name
            ds = _header(path)
            if ds is None or "SeriesInstanceUID" not in ds:
                continue  # not DICOM, or a DICOMDIR
            if not _is_volume_slice(ds):
                skipped.append(f"{path.name} ({ds.get('Modality', '?')})")
                continue
            groups.setdefault(str(ds.SeriesInstanceUID), []).append((path, ds))
    if skipped:
        log.warning("%s: skipped %d non-image DICOM object(s): %s", folder, len(skipped), ", ".join(skipped[:5]) + (" ..." if len(skipped) > 5 else ""))
    series = [_series(uid, members) for uid, members in groups.items()]
    series.sort(key=lambda s: (str(s.folder), _number(s.number), s.uid))
    _name_uniquely(series)
    return series


def series_of(file: str | Path) -> DicomSeries:
    """The series of a DICOM file given alone (found among the series of its folder); a
    :class:`DataError` for a file that is no slice of an image series (a SEG, a report)."""
    file = Path(file)
    found = next((s for s in find_series(file.parent) if file.resolve() in {f.resolve() for f in s.files}), None)
    if found is None:
        raise DataError(f"{file}: not a slice of a DICOM image series (an image with a position and orientation in the patient)")
    return found


def _number(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        return float("inf")


def _series(uid: str, members: list[tuple[Path, object]]) -> DicomSeries:
    """A checked :class:`DicomSeries` of the files (and headers) of one SeriesInstanceUID; its
    ``folder`` (the one its errors name) is the deepest that holds all its files."""
    folder = Path(os.path.commonpath([str(path.parent) for path, _ in members]))
    files, headers = _sorted_slices(members, folder)
    first = headers[0]
    parts = [first.get("PatientID", ""), first.get("StudyDate", ""), first.get("SeriesNumber", ""), first.get("SeriesDescription", "")]
    name = "_".join(p for p in (_sanitise(x) for x in parts) if p) or _sanitise(uid)
    return DicomSeries(uid, str(first.get("SeriesNumber", "")), str(first.get("SeriesDescription", "")), str(first.get("Modality", "")),
                       files, name, folder)


def _name_uniquely(series: list[DicomSeries]) -> None:
    """Suffix ``-2``, ``-3`` ... to names already taken."""
    seen: set[str] = set()
    for s in series:
        base, k = s.name, 2
        while s.name in seen:
            s.name, k = f"{base}-{k}", k + 1
        seen.add(s.name)


def _orthonormal(row_col: np.ndarray) -> bool:
    """Whether ImageOrientationPatient holds two orthogonal unit vectors (else the grid has no
    slice normal, and the tilt and gap checks would report nonsense)."""
    row, col = row_col[:3], row_col[3:]
    return row_col.shape == (6,) and max(abs(row @ row - 1), abs(col @ col - 1), abs(row @ col)) < ORTHONORMAL_TOLERANCE


def _sorted_slices(members: list[tuple[Path, object]], folder: Path) -> tuple[list[Path], list]:
    """The files of one series sorted by position along the slice normal, after the checks of
    a regular grid (each a :class:`DataError` naming ``folder``): multi-frame objects, an
    orientation that is a rotation, one orientation, one pixel spacing and size, no gantry tilt, no repeated or missing slice."""
    for path, ds in members:
        if int(ds.get("NumberOfFrames", 1) or 1) > 1:
            raise DataError(f"{path}: a multi-frame DICOM object ({ds.NumberOfFrames} frames) is not read; export the series as one file per slice")
    ref = members[0][1]
    row_col = np.array(ref.ImageOrientationPatient, dtype=np.float64)
    if not _orthonormal(row_col):
        raise DataError(f"{members[0][0]}: ImageOrientationPatient {_values(ref.ImageOrientationPatient)} is not two orthogonal unit vectors")
    size, spacing = (ref.Rows, ref.Columns), np.array(ref.PixelSpacing, dtype=np.float64)
    for path, ds in members[1:]:
        if np.abs(np.array(ds.ImageOrientationPatient, dtype=np.float64) - row_col).max() > ORIENTATION_TOLERANCE:
            raise DataError(f"{folder}: series {ref.SeriesInstanceUID}: inconsistent orientation within the series: {path.name} has "
                            f"{_values(ds.ImageOrientationPatient)}, {members[0][0].name} {_values(ref.ImageOrientationPatient)}")
        if (ds.Rows, ds.Columns) != size or np.abs(np.array(ds.PixelSpacing, dtype=np.float64) - spacing).max() > SPACING_TOLERANCE:
            raise DataError(f"{folder}: series {ref.SeriesInstanceUID}: inconsistent pixel spacing or size within the series: {path.name} has "
                            f"{_values(ds.PixelSpacing)} mm, {ds.Rows} x {ds.Columns}; {members[0][0].name} {_values(ref.PixelSpacing)} mm, {size[0]} x {size[1]}")
    normal = np.cross(row_col[:3], row_col[3:])
    positions = np.array([ds.ImagePositionPatient for _, ds in members], dtype=np.float64)
    order = np.argsort(positions @ normal, kind="stable")
    members, positions = [members[i] for i in order], positions[order]
    _check_positions(positions, normal, [p for p, _ in members], folder, str(ref.SeriesInstanceUID))
    return [p for p, _ in members], [ds for _, ds in members]


def _check_positions(positions: np.ndarray, normal: np.ndarray, files: list[Path], folder: Path, uid: str) -> None:
    """Refuse slices that are not one regular stack along ``normal``: a tilt (slices shifted
    in-plane, along the gantry's tilt), two slices at one position, missing slices (a step a
    whole multiple of the usual one) and irregular steps."""
    if len(positions) < 2:
        return
    offsets = positions - positions[0]
    along = offsets @ normal
    across = np.linalg.norm(offsets - np.outer(along, normal), axis=1)
    if across.max() > SPACING_TOLERANCE * max(1.0, len(positions)):
        degrees = float(np.degrees(np.arctan2(across[-1], abs(along[-1]) or 1e-12)))
        raise DataError(f"{folder}: series {uid}: gantry tilt of {degrees:.2f} degrees (the slices are shifted in-plane along the stack); "
                        "refused, not resampled: reslice it to an untilted grid first (e.g. 3D Slicer's DICOM import)")
    steps = np.diff(along)
    step = float(np.median(steps))
    if steps.min() <= SPACING_TOLERANCE:
        i = int(np.argmin(steps))
        raise DataError(f"{folder}: series {uid}: {files[i].name} and {files[i + 1].name} lie at the same slice position "
                        f"({along[i]:.3f} mm along the normal); several acquisitions in one series?")
    irregular = np.abs(steps - step) > SLICE_STEP_TOLERANCE * step
    if irregular.any():
        i = int(np.argmax(irregular))
        missing = steps[i] / step
        if abs(missing - round(missing)) < SLICE_STEP_TOLERANCE * missing and round(missing) >= 2:
            raise DataError(f"{folder}: series {uid}: {round(missing) - 1} missing slice(s) between {files[i].name} and {files[i + 1].name} "
                            f"(a gap of {steps[i]:.3f} mm where slices are {step:.3f} mm apart)")
        raise DataError(f"{folder}: series {uid}: irregular slice spacing: {steps[i]:.3f} mm between {files[i].name} and {files[i + 1].name}, "
                        f"{step:.3f} mm elsewhere")


class SeriesRules:
    """Rules that pick the series to read by their attributes, as MONAI Deploy's
    ``DICOMSeriesSelectorOperator`` does (its rules file is accepted as it is):
    ``{"selections": [{"name": ..., "conditions": {keyword: value, ...}}, ...]}``, or the list
    of selections alone. A series matches a selection when every condition holds on its first
    file's header: a string is a regular expression searched in the attribute's value
    (``"(?i)ct"``; a multi-valued attribute as DICOM writes it, ``ORIGINAL\\PRIMARY\\AXIAL``),
    a list names values the attribute must all hold (``ImageType: [ORIGINAL, PRIMARY]``,
    case-insensitively), a number equals the attribute's value. Earlier selections are
    preferred: in each folder, the series of the first selection that matches any there.

    Args:
        rules: the parsed YAML / JSON.
        where: the option or config key the rules came from, for errors.
        error: the exception type of malformed rules (:class:`DataError`; a config's
            :class:`~hsmla_med.errors.ConfigError`).
    """

    def __init__(self, rules, where: str, error: type[Exception] = DataError) -> None:
        self.where, self.error, self.selections = where, error, []
        selections = rules.get("selections") if isinstance(rules, dict) else rules
        if not isinstance(selections, list) or not selections:
            raise error(f"{where}: series selection rules are a non-empty list of selections (or {{selections: [...]}}), got {rules!r}")
        for i, selection in enumerate(selections):
            conditions = selection.get("conditions") if isinstance(selection, dict) else None
            if not isinstance(conditions, dict) or not conditions:
                raise error(f"{where}: selection {i + 1} needs 'conditions', a mapping of DICOM keywords to values, got {selection!r}")
            for keyword, value in conditions.items():
                self._check(keyword, value, i)
            self.selections.append((str(selection.get("name", f"selection {i + 1}")), conditions))

    def _check(self, keyword, value, i: int) -> None:
        from pydicom.datadict import tag_for_keyword

        if not isinstance(keyword, str) or tag_for_keyword(keyword) is None:
            raise self.error(f"{self.where}: selection {i + 1}: {keyword!r} is not a DICOM attribute keyword (e.g. Modality, SeriesDescription)")
        if isinstance(value, str):
            try:
                re.compile(value)
            except re.error as err:
                raise self.error(f"{self.where}: selection {i + 1}: {keyword}: {value!r} is not a regular expression ({err})") from None
        elif not isinstance(value, (list, int, float)) or isinstance(value, bool):
            raise self.error(f"{self.where}: selection {i + 1}: {keyword}: a condition is a regular expression, a list of values or a number, got {value!r}")

    @staticmethod
    def _holds(ds, keyword: str, value) -> bool:
        if keyword not in ds or ds[keyword].value is None:
            return False
        attribute = ds[keyword].value
        values = [str(v) for v in attribute] if isinstance(attribute, (list, pydicom.multival.MultiValue)) else [str(attribute)]
        if isinstance(value, str):
            return re.search(value, "\\".join(values)) is not None
        if isinstance(value, list):
            held = {v.strip().upper() for v in values}
            return all(str(v).strip().upper() in held for v in value)
        try:
            return len(values) == 1 and abs(float(values[0]) - float(value)) <= 1e-6 * max(1.0, abs(float(value)))
        except ValueError:
            return False

    def rank(self, series: DicomSeries) -> int | None:
        """The index of the first selection ``series`` matches, ``None`` for none."""
        ds = _header(series.files[0])
        return next((i for i, (_, conditions) in enumerate(self.selections)
                     if all(self._holds(ds, k, v) for k, v in conditions.items())), None)

    def apply(self, series: list[DicomSeries], folder: str | Path) -> list[DicomSeries]:
        """The series each folder's best selection matches; the others are skipped with a
        logged note, and none matching at all is a :class:`DataError` listing the series."""
        ranks = {s.uid: self.rank(s) for s in series}
        best: dict[Path, int] = {}
        for s in series:
            if ranks[s.uid] is not None:
                best[s.folder] = min(best.get(s.folder, ranks[s.uid]), ranks[s.uid])
        picked = [s for s in series if ranks[s.uid] is not None and ranks[s.uid] == best[s.folder]]
        if not picked:
            raise DataError(f"{folder}: no DICOM series matches the series selection rules of {self.where}; the series are: "
                            + "; ".join(s.line() for s in series))
        if len(picked) < len(series):
            log.info("%s: %s picked %d of %d series: %s", folder, self.where, len(picked), len(series),
                     "; ".join(f"{s.uid} ({self.selections[ranks[s.uid]][0]})" for s in picked))
        return picked


def select_series(series: list[DicomSeries], folder: str | Path, series_uid: str | None = None,
                  rules: SeriesRules | None = None) -> list[DicomSeries]:
    """The cases of a DICOM input: the series with ``series_uid`` if given, else those
    ``rules`` pick (:class:`SeriesRules`; default every series), each in its own folder; files
    of several series in one folder are refused with one line listing them (pick one with
    ``--series-uid`` or selection rules)."""
    if series_uid is not None:
        picked = [s for s in series if s.uid == series_uid]
        if not picked:
            raise DataError(f"{folder}: no series with --series-uid {series_uid}; the series are: " + "; ".join(s.line() for s in series))
        return picked
    if rules is not None:
        series = rules.apply(series, folder)
    by_folder: dict[Path, list[DicomSeries]] = {}
    for s in series:
        by_folder.setdefault(s.folder, []).append(s)
    for where, together in by_folder.items():
        if len(together) > 1:
            how = f"the rules of {rules.where} match {len(together)}" if rules is not None else f"{len(together)} DICOM series in one folder"
            raise DataError(f"{where}: {how}; pick one with --series-uid or series selection rules: " + "; ".join(s.line() for s in together))
    return series


def series_in(folder: str | Path, series_uid: str | None = None, rules: SeriesRules | None = None) -> list[DicomSeries]:
    """:func:`select_series` of :func:`find_series`; a folder without any image series is a
    :class:`DataError`."""
    series = find_series(folder)
    if not series:
        raise DataError(f"{folder}: no DICOM image series in the folder")
    return select_series(series, folder, series_uid, rules)


def _sitk_volume(files: Sequence[Path]) -> tuple[np.ndarray, np.ndarray]:
    """The voxels ``(x, y, z)`` and RAS affine of SimpleITK's reading of ``files`` in this order."""
    import SimpleITK as sitk

    # ITK warns on stderr of steps that differ by more than its own small tolerance; the steps
    # were checked already (_check_positions), and a warning per case is noise in a run's log
    sitk.ProcessObject.SetGlobalWarningDisplay(False)
    reader = sitk.ImageSeriesReader()
    reader.SetFileNames([str(f) for f in files])
    # float32 (what the pipeline computes in): else the first slice's pixel type holds every
    # slice, and a later slice's fractional rescale slope would be truncated to integers
    reader.SetOutputPixelType(sitk.sitkFloat32)
    image = reader.Execute()
    return sitk.GetArrayFromImage(image).transpose(2, 1, 0), image_affine(image)


def _grid(first, last, count: int) -> np.ndarray:
    """The RAS affine of a series of ``count`` slices from the headers of its first and last,
    as ITK builds SimpleITK's grid: origin at the first slice, the mean step from the first to
    the last (SpacingBetweenSlices, else 1 mm, for a single slice)."""
    row_col = np.array(first.ImageOrientationPatient, dtype=np.float64)
    normal = np.cross(row_col[:3], row_col[3:])
    origin = np.array(first.ImagePositionPatient, dtype=np.float64)
    if count > 1:
        step = float((np.array(last.ImagePositionPatient, dtype=np.float64) - origin) @ normal) / (count - 1)
    else:
        step = float(first.get("SpacingBetweenSlices", 1.0) or 1.0)
    row_spacing, col_spacing = (float(v) for v in first.PixelSpacing)  # DICOM: between rows, then between columns
    linear = np.stack([row_col[:3] * col_spacing, row_col[3:] * row_spacing, normal * step], axis=1)
    return ras_affine(linear, origin)


def series_geometry(series: DicomSeries | Sequence[str | Path]) -> tuple[tuple[int, int, int], np.ndarray]:
    """The shape ``(x, y, z)`` and RAS affine :func:`read_series` gives a series (or its files
    in slice order), from the headers of its first and last files: no voxel is read."""
    files = list(series.files if isinstance(series, DicomSeries) else [Path(f) for f in series])
    first, last = (pydicom.dcmread(f, stop_before_pixels=True) for f in (files[0], files[-1]))
    return (int(first.Columns), int(first.Rows), len(files)), _grid(first, last, len(files))


def _pydicom_volume(files: Sequence[Path]) -> tuple[np.ndarray, np.ndarray]:
    """The same volume as :func:`_sitk_volume` decoded by pydicom's pixel handlers (pylibjpeg
    plugins: compressed syntaxes GDCM lacks), on the grid of :func:`_grid`."""
    from pydicom.pixels import apply_rescale

    slices = [pydicom.dcmread(f) for f in files]
    volume = np.stack([apply_rescale(ds.pixel_array, ds) for ds in slices], axis=-1)  # unchanged without a rescale
    return volume.transpose(1, 0, 2), _grid(slices[0], slices[-1], len(slices))


def _decoder_hint(transfer_syntax) -> str:
    """Which package decodes ``transfer_syntax`` for pydicom, and how to install it."""
    name = getattr(transfer_syntax, "name", str(transfer_syntax))
    for key, package in _DECODERS:
        if key in name:
            return f"pydicom decodes it with {package} (pip install 'hsmla-med[dicom-codecs]': pylibjpeg, pylibjpeg-libjpeg, pylibjpeg-openjpeg)"
    return "no other decoder for it is known to hsmla-med"


def read_series(series: DicomSeries | Sequence[str | Path]) -> tuple[np.ndarray, np.ndarray]:
    """The voxels ``(x, y, z)`` (rescaled values) and RAS affine of a series (or of its files in
    slice order), as SimpleITK reads them; pixel data SimpleITK cannot decode is decoded by
    pydicom (and its pylibjpeg plugins), on the same grid; a :class:`DataError` naming the
    transfer syntax and the package that decodes it if neither can."""
    files = list(series.files if isinstance(series, DicomSeries) else [Path(f) for f in series])
    try:
        return _sitk_volume(files)
    except RuntimeError as sitk_err:
        try:
            return _pydicom_volume(files)
        except Exception as err:
            syntax = pydicom.dcmread(files[0], stop_before_pixels=True).file_meta.get("TransferSyntaxUID", "?")
            name = getattr(syntax, "name", syntax)
            raise DataError(f"{files[0].parent}: cannot decode the pixel data of {files[0].name} (transfer syntax {name}, {syntax}): "
                            f"{_decoder_hint(syntax)}; SimpleITK: {str(sitk_err).strip().splitlines()[-1]}; pydicom: {err}") from None


class DicomSeriesReader(ImageReader):
    """A MONAI ``ImageReader`` for a DICOM series: a folder holding one series, or the files of
    one series (a list, as ``infer`` keeps them). Registered first in
    :class:`~hsmla_med.data.checks.LoadCased`, so ``LoadImaged`` reads a series where it reads a
    NIfTI file; the image is ``(x, y, z)`` without a channel, with ``affine`` and
    ``original_affine`` in RAS, as MONAI's NIfTI reader gives them."""

    def verify_suffix(self, filename: Sequence[str | os.PathLike] | str | os.PathLike) -> bool:
        names = [filename] if isinstance(filename, (str, os.PathLike)) else list(filename)
        return bool(names) and ((len(names) == 1 and Path(names[0]).is_dir()) or is_dicom_file(names[0]))

    def read(self, data: Sequence[str | os.PathLike] | str | os.PathLike, **kwargs) -> tuple[list[Path], str]:
        """The series' files in slice order (checked again: a list may come from anywhere) and the folder that names it."""
        names = [data] if isinstance(data, (str, os.PathLike)) else list(data)
        if len(names) == 1 and Path(names[0]).is_dir():
            (series,) = series_in(names[0])
            return series.files, str(names[0])
        members = [(Path(n), _header(Path(n))) for n in names]
        return _sorted_slices(members, Path(names[0]).parent)[0], str(Path(names[0]).parent)

    def get_data(self, img: tuple[list[Path], str]) -> tuple[np.ndarray, dict]:
        files, where = img
        volume, affine = read_series(files)
        meta = {"affine": affine, "original_affine": affine.copy(), "spatial_shape": np.array(volume.shape), "original_channel_dim": float("nan"),
                "space": "RAS", "filename_or_obj": where}
        return volume, meta
