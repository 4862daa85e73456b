"""Volume files in and out, one class per format, chosen by file ending; and the one rule that
names a case's predicted label map.

Each format is a small class (:class:`VolumeFormat`), as nnU-Net v2's ``BaseReaderWriter``
(``nnunetv2/imageio``: one class per format with ``read_images`` / ``read_seg`` / ``write_seg``,
chosen from a registry by the dataset's ``file_ending``) and MONAI's ``image_writer``
(``register_writer`` / ``resolve_writer``: writers by file extension) have them. A format knows
its file endings, reads a volume and, where that is all the code needs, its header, and writes a
label map in the geometry of a reference input. The formats wrap the readers and writers of
their own modules (:mod:`hsmla_med.io.itk`, :mod:`hsmla_med.io.dicom`,
:mod:`hsmla_med.io.dicom_seg`, nibabel); what is written here is which one applies.

Geometry, as everywhere in hsmla-med: voxels ``(x, y, z)`` and a ``(4, 4)`` affine from voxel
indices to NIfTI's RAS world in mm (MONAI's and nibabel's convention; ITK's and DICOM's LPS
turned into it: :func:`~hsmla_med.io.itk.ras_affine`).

The registry (:data:`FORMATS`) chooses by the file name's ending, the longest registered ending
first (``.seg.dcm`` before ``.dcm``, ``.nii.gz`` before ``.nii``; a DICOM SEG's endings in any
letter case, as PACS exports name files); a folder is a DICOM series (:data:`DICOM_SERIES`).

The naming rule (:func:`prediction_path`): a case's label map is ``<case><ending>``, the case
named after its input (:func:`case_name`; a DICOM series by
:attr:`~hsmla_med.io.dicom.DicomSeries.name`), the ending its input format's prediction ending
(nnU-Net writes predictions in the dataset's ``file_ending``): ``.mha`` for MetaImage, ``.nrrd``
for NRRD, ``.nii.gz`` for NIfTI (also a NIfTI pair) and a DICOM series, ``.seg.dcm`` for a DICOM
SEG of a series.

The registry's names (:attr:`VolumeFormat.name`) are the one vocabulary of output formats:
``infer --output-format NAME``, the task cards' ``output_formats`` and the pipelines use them
(:data:`OUTPUT_FORMATS`: the formats that write predictions, :func:`output_format`). A new format
is its class and its instance in :data:`FORMATS` (docs/design.md, "A new output format").
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import nibabel as nib
import numpy as np

from hsmla_med.errors import DataError, InputError
from hsmla_med.io.atomic import atomic_path
from hsmla_med.io.compressed import check_inflated
from hsmla_med.io.dicom_seg import SEG_SUFFIX, read_seg, write_seg
from hsmla_med.io.itk import METAIMAGE_ENDINGS, NRRD_ENDINGS, itk_header, read_itk, write_itk

__all__ = ["PredictedVolume", "VolumeFormat", "Nifti", "NiftiPair", "ItkVolume", "MetaImage", "Nrrd", "DicomSeriesFolder", "DicomSeg", "NIFTI", "NIFTI_PAIR",
           "METAIMAGE", "NRRD", "DICOM_SERIES", "DICOM_SEG", "FORMATS", "OUTPUT_FORMATS", "output_format", "VOLUME_FILE", "VOLUME_FORMATS", "file_format", "file_ending",
           "file_stem", "volume_format", "write_labels", "case_name", "label_suffix", "prediction_path", "check_nifti", "image_series"]

_CHANNEL_SUFFIX = re.compile(r"_\d{4}$")  # nnU-Net's modality index, CASE_0000


@dataclass(frozen=True)
class PredictedVolume:
    """A case's predicted label map as a format writes it (:meth:`VolumeFormat.write_prediction`).

    Attributes:
        source: the case's input, a volume file or a DICOM series' folder.
        name: the case's name (:func:`case_name`, a series' own name).
        reference: the input's grid: the file, or for a series its RAS affine ``(4, 4)``.
        series: a series input's files, in slice order (``None`` for a volume file).
        label_names: class names by label value.
        algorithm: the model's record (``sha256``, ``checkpoint``), for formats that name the
            algorithm that made them (a DICOM SEG's Algorithm Identification).
        seg_uid: the SOP Instance UID its DICOM SEG gets (``None``: a new one).
    """

    source: Path
    name: str
    reference: str | Path | np.ndarray
    series: Sequence[Path] | None = None
    label_names: Sequence[str] = ()
    algorithm: dict | None = None
    seg_uid: str | None = None


class VolumeFormat:
    """A volume file format: its name, the endings it is known by and how its files are read and
    written.

    Subclasses define ``header(path)``, the shape and RAS affine ``(4, 4)`` from the header alone,
    and ``read(path)``, the voxels ``(x, y, z)`` and RAS affine, where the code reads the format;
    ``write_labels(path, labels, reference)`` where a label map is written in it, and set
    ``writes_predictions`` where ``infer --output-format NAME`` writes it.
    """

    #: the registry's name of the format: ``infer --output-format`` and the task cards use it
    name = ""
    #: what the format is called in messages
    title = ""
    #: ``infer --output-format`` writes predicted label maps in it (:meth:`write_prediction`)
    writes_predictions = False
    #: a prediction in it references the input's DICOM instances: DICOM series inputs only
    needs_series = False
    #: the file name endings the registry knows it by
    endings: tuple[str, ...] = ()
    #: endings compared in any letter case (else as the format's own tools write them)
    ignore_case = False
    #: a file of the format holds a volume on its own grid: a volume file of a dataset or an
    #: input folder (a DICOM SEG holds none: it is read onto the series it references)
    volume_file = True
    #: the ending of the label map predicted for an input of this format
    prediction_ending = ".nii.gz"

    def predicted_as(self) -> VolumeFormat:
        """The format an input of this one is predicted in where ``--output-format`` is not given
        (nnU-Net writes predictions in the dataset's ``file_ending``): its own, or NIfTI."""
        return self if self.writes_predictions else NIFTI

    def write_prediction(self, folder: Path, labels: np.ndarray, case: PredictedVolume) -> Path | None:
        """Write a case's label map ``(x, y, z)`` as ``folder/<case><ending>``
        (:func:`prediction_path`) on its input's grid, atomically; the path written (``None``:
        nothing to write in this format)."""
        return self.write_labels(prediction_path(folder, case.source, case.name, self), labels, case.reference)


class Nifti(VolumeFormat):
    """NIfTI-1 and NIfTI-2 files (``.nii.gz``, ``.nii``) through nibabel, their voxels checked
    against the header (:func:`check_nifti`); also the format of any file name the registry does
    not know (:func:`volume_format`), whose refusal is then nibabel's, naming the file. Writes
    label maps, and float maps (:meth:`write_map`), in the geometry of any reference input."""

    name, title, writes_predictions = "nifti", "NIfTI", True
    endings = (".nii.gz", ".nii")
    # The header fields that place the voxels in the world: qform (quaternion, offsets, voxel
    # sizes, qfac in pixdim[0]) and sform (three rows), each with its code, and the units.
    _GEOMETRY_FIELDS = ("quatern_b", "quatern_c", "quatern_d", "qoffset_x", "qoffset_y", "qoffset_z",
                        "srow_x", "srow_y", "srow_z", "qform_code", "sform_code", "xyzt_units")

    def header(self, path: str | Path) -> tuple[tuple[int, ...], np.ndarray]:
        """Shape (all the header's dimensions) and affine ``(4, 4)`` float64 of ``path`` from
        its header, the voxel file's size checked (not a compressed one's contents)."""
        try:
            img = nib.load(str(path))
            shape, affine = tuple(int(s) for s in img.shape), np.asarray(img.affine, dtype=np.float64)
        except FileNotFoundError:
            raise DataError(f"{path}: file not found") from None
        except Exception as err:  # nibabel raises several types for truncated or foreign files
            raise DataError(f"{path}: cannot read as NIfTI ({err})") from None
        check_nifti(img, path)
        return shape, affine

    def read(self, path: str | Path) -> tuple[np.ndarray, np.ndarray]:
        """The voxels (the file's own type and shape) and affine ``(4, 4)`` of ``path``; a
        compressed file's stream is checked to its end before the voxels are allocated."""
        try:
            img = nib.load(str(path))
            check_nifti(img, path, inflate=True)  # a cut-off, damaged or short file, before its voxels are allocated
            return np.asanyarray(img.dataobj), np.asarray(img.affine, dtype=np.float64)
        except DataError:
            raise
        except Exception as err:  # nibabel raises several types for truncated or foreign files
            raise DataError(f"{path}: cannot read as NIfTI ({err})") from None

    def write_labels(self, path: Path, labels: np.ndarray, reference: str | Path | np.ndarray) -> Path:
        """Write a label map in the reference's geometry, atomically.

        Args:
            path: the file to write (``.nii.gz``, ``.nii``).
            labels: ``(x, y, z)`` integer labels (uint8 as predicted), on the reference's grid.
            reference: the input the labels were predicted from. A NIfTI file: its qform and
                sform matrices and codes are copied field by field, so a form whose code is 0
                (unknown) stays undeclared and a code 2 (aligned) stays 2, and every reader picks
                the same affine for both files (nibabel: sform if its code is set, else qform,
                else the voxel sizes alone). Another volume (a MetaImage or NRRD file, a DICOM
                series' folder) or a RAS affine ``(4, 4)``, which have no NIfTI header to copy:
                the affine becomes qform and sform, code 1 (scanner).
        """
        with atomic_path(path) as tmp:
            nib.save(self._in_geometry(labels, reference), str(tmp))
        return Path(path)

    def write_map(self, path: Path, data: np.ndarray, reference: str | Path | np.ndarray) -> Path:
        """Write a float map ``(x, y, z)`` (an uncertainty map: :mod:`hsmla_med.inference.uncertainty`)
        in the reference's geometry as :meth:`write_labels` writes a label map, atomically:
        stored as 16-bit integers with the NIfTI scale factor (``scl_slope``, ``scl_inter``;
        nibabel picks them from the map's range), which every NIfTI reader applies. NIfTI-1 has
        no float16 type, and 16 bits over the map's range are finer than float16 in [0, 1]
        (steps of ~1.5e-5, float16's ~5e-4 near 1) at half the size of float32."""
        img = self._in_geometry(np.asarray(data, dtype=np.float32), reference)
        img.set_data_dtype(np.uint16)
        with atomic_path(path) as tmp:
            nib.save(img, str(tmp))
        return Path(path)

    def _in_geometry(self, data: np.ndarray, reference: str | Path | np.ndarray) -> nib.Nifti1Image:
        """``data`` as a NIfTI image with the reference's geometry (see :meth:`write_labels`)."""
        if not isinstance(reference, np.ndarray):
            source = volume_format(reference)
            if not isinstance(source, Nifti):  # no NIfTI header to copy: the volume's RAS affine
                reference = source.header(reference)[1]
        if isinstance(reference, np.ndarray):
            img = nib.Nifti1Image(data, reference)
            img.set_qform(reference, code=1)
            img.set_sform(reference, code=1)
            return img
        ref = nib.load(str(reference)).header
        img = nib.Nifti1Image(data, None)  # no affine: the header's fields below are kept on save
        header = img.header
        for name in self._GEOMETRY_FIELDS:
            header[name] = ref[name]
        pixdim = header["pixdim"].copy()
        pixdim[:4] = ref["pixdim"][:4]  # qfac and voxel sizes; the time step of a 4D input is not ours
        header["pixdim"] = pixdim
        return img


class NiftiPair(Nifti):
    """A NIfTI pair (SPM's and FSL's older output): the header in ``CASE.hdr``, which names the
    case, the voxels in ``CASE.img`` beside it; nibabel reads it as it reads ``.nii``. Its
    predictions are one ``.nii.gz`` file."""

    name, title, writes_predictions = "nifti-pair", "a NIfTI pair", False
    endings = (".hdr",)


class ItkVolume(VolumeFormat):
    """A format read and written through SimpleITK (:mod:`hsmla_med.io.itk`), one file or a
    detached header with its voxel file."""

    def header(self, path: str | Path) -> tuple[tuple[int, int, int], np.ndarray]:
        """Shape ``(x, y, z)`` and RAS affine of ``path`` (:func:`~hsmla_med.io.itk.itk_header`)."""
        return itk_header(path)

    def read(self, path: str | Path) -> tuple[np.ndarray, np.ndarray]:
        """Voxels ``(x, y, z)`` and RAS affine of ``path`` (:func:`~hsmla_med.io.itk.read_itk`)."""
        return read_itk(path)

    writes_predictions = True

    def write_labels(self, path: Path, labels: np.ndarray, reference: str | Path | np.ndarray) -> Path:
        """Write ``labels`` ``(x, y, z)`` as uint8, compressed, on the grid of ``reference``: a
        MetaImage or NRRD file, whose origin, spacing and direction are copied as they are, or
        another input's grid, its RAS affine (of a NIfTI file's or a series' header)
        (:func:`~hsmla_med.io.itk.write_itk`), atomically."""
        if not isinstance(reference, np.ndarray) and not isinstance(volume_format(reference), ItkVolume):
            reference = volume_format(reference).header(reference)[1]
        return write_itk(path, labels.astype(np.uint8, copy=False), reference)


class MetaImage(ItkVolume):
    """MetaImage (grand-challenge.org's exchange format, LUNA16's scans): ``.mha``, or an
    ``.mhd`` header with its voxel file; predictions are one ``.mha`` file."""

    name, title = "metaimage", "MetaImage"
    endings = METAIMAGE_ENDINGS
    prediction_ending = ".mha"


class Nrrd(ItkVolume):
    """NRRD (3D Slicer's format): ``.nrrd``, or an ``.nhdr`` header with its voxel file;
    predictions are one ``.nrrd`` file."""

    name, title = "nrrd", "NRRD"
    endings = NRRD_ENDINGS
    prediction_ending = ".nrrd"


class DicomSeriesFolder(VolumeFormat):
    """A folder holding one DICOM image series (:func:`image_series`), read as SimpleITK reads
    it (:mod:`hsmla_med.io.dicom`); predictions are NIfTI on that grid (or a DICOM SEG:
    :class:`DicomSeg`). Chosen by :func:`volume_format` for a folder, by no ending."""

    name, title = "dicom", "a DICOM series"

    def header(self, folder: str | Path) -> tuple[tuple[int, int, int], np.ndarray]:
        """Shape ``(x, y, z)`` and RAS affine of the series from the headers of its first and last
        files (:func:`~hsmla_med.io.dicom.series_geometry`)."""
        from hsmla_med.io.dicom import series_geometry  # pydicom loads slowly: only series need it

        return series_geometry(image_series(folder))

    def read(self, folder: str | Path) -> tuple[np.ndarray, np.ndarray]:
        """Voxels ``(x, y, z)`` (rescaled values) and RAS affine of the series
        (:func:`~hsmla_med.io.dicom.read_series`)."""
        from hsmla_med.io.dicom import read_series

        return read_series(image_series(folder))


class DicomSeg(VolumeFormat):
    """A DICOM Segmentation object (:mod:`hsmla_med.io.dicom_seg`): ``.seg.dcm`` as ``infer``
    writes it, or any ``.dcm`` among label maps. It holds no grid of its own: it is read onto,
    and written for, the image series it references, whose files (in slice order) are given."""

    name, title, writes_predictions, needs_series = "dicom-seg", "DICOM SEG", True, True
    endings = (SEG_SUFFIX, ".dcm")
    ignore_case = True
    volume_file = False
    prediction_ending = SEG_SUFFIX

    def grid(self, series: Sequence[str | Path]) -> tuple[tuple[int, int, int], np.ndarray]:
        """Shape ``(x, y, z)`` and RAS affine that a SEG of ``series`` (its files in slice order)
        is read onto: the series' own, from the headers of its first and last files
        (:func:`~hsmla_med.io.dicom.series_geometry`)."""
        from hsmla_med.io.dicom import series_geometry  # pydicom loads slowly: only SEG files need it

        return series_geometry(series)

    def read(self, path: str | Path, series: Sequence[str | Path], label_names: Sequence[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The label map ``(x, y, z)`` and RAS affine of the SEG at ``path`` on the grid of its
        series.

        Args:
            path: the SEG file.
            series: the files of the series it references, sorted along the slice normal.
            label_names: class names by label value: a segment takes the value of its label's
                name (:func:`~hsmla_med.io.dicom_seg.read_seg`); without them, its number.
        """
        return read_seg(path, series, label_names), self.grid(series)[1]

    def write_labels(self, path: Path, labels: np.ndarray, reference: Sequence[str | Path], label_names: Sequence[str],
                     algorithm: dict, sop_instance_uid: str | None = None) -> Path:
        """Write ``labels`` as a SEG referencing a series, atomically
        (:func:`~hsmla_med.io.dicom_seg.write_seg`).

        Args:
            path: the file to write (``<case>.seg.dcm``).
            labels: ``(x, y, z)`` integer labels on the series' grid.
            reference: the series' files, sorted along the slice normal.
            label_names: class names by label value, the segments' labels.
            algorithm: the model's record (``sha256``, ``checkpoint``), the SEG's Algorithm Identification.
            sop_instance_uid: the SEG's SOP Instance UID (``None``: a new one).
        """
        return write_seg(labels, reference, label_names, path, algorithm, sop_instance_uid)

    def write_prediction(self, folder: Path, labels: np.ndarray, case: PredictedVolume) -> Path | None:
        """The case's SEG referencing its series; none for a label map without foreground (a SEG
        holds at least one segment)."""
        if not labels.any():
            return None
        return self.write_labels(prediction_path(folder, case.source, case.name, self), labels, case.series, case.label_names, case.algorithm,
                                 case.seg_uid)


NIFTI, NIFTI_PAIR, METAIMAGE, NRRD, DICOM_SEG = Nifti(), NiftiPair(), MetaImage(), Nrrd(), DicomSeg()
DICOM_SERIES = DicomSeriesFolder()
#: the formats the registry chooses by file ending and names (a new format: its class, and its instance here)
FORMATS: tuple[VolumeFormat, ...] = (NIFTI, NIFTI_PAIR, METAIMAGE, NRRD, DICOM_SEG)
#: the names of the formats ``infer --output-format`` writes
OUTPUT_FORMATS = tuple(f.name for f in FORMATS if f.writes_predictions)
# every registered ending with its format, the longest first: a name ending in ".seg.dcm" also
# ends in ".dcm", and is a SEG's "<case>.seg.dcm", not "<case>.seg"'s
_BY_ENDING = sorted(((ending, f) for f in FORMATS for ending in f.endings), key=lambda item: -len(item[0]))
#: a volume file's name (a NIfTI pair by its header), for the code that matches names with a pattern
VOLUME_FILE = re.compile("(" + "|".join(re.escape(ending) for ending, f in _BY_ENDING if f.volume_file) + ")$")
#: what the readers take, for messages (the volume files of FORMATS)
VOLUME_FORMATS = "NIfTI (.nii.gz, .nii, .hdr/.img pairs), MetaImage (.mha, .mhd) or NRRD (.nrrd, .nhdr)"


def _match(path: str | os.PathLike, seg: bool) -> tuple[str, VolumeFormat] | None:
    """The registered ending of ``path``'s name as written there, with its format, the longest
    first; DICOM SEG endings only with ``seg``."""
    name = Path(path).name
    for ending, f in _BY_ENDING:
        if (f.volume_file or seg) and (name.lower() if f.ignore_case else name).endswith(ending):
            return name[len(name) - len(ending):], f
    return None


def output_format(name: str) -> VolumeFormat:
    """The registered format of ``name`` that writes predictions (``--output-format NAME``);
    :class:`~hsmla_med.errors.InputError` for another name."""
    for f in FORMATS:
        if f.name == name and f.writes_predictions:
            return f
    raise InputError(f"--output-format {name}: not an output format; use one or more of {', '.join(OUTPUT_FORMATS)}")


def file_format(path: str | os.PathLike, seg: bool = False) -> VolumeFormat | None:
    """The format of a file by its name's ending (:data:`FORMATS`), ``None`` for a name none
    ends with.

    Args:
        path: the file (only its name is looked at).
        seg: a DICOM file counts, as a DICOM SEG (a folder of label maps); else only volume files.
    """
    match = _match(path, seg)
    return None if match is None else match[1]


def file_ending(path: str | os.PathLike, seg: bool = False) -> str:
    """The registered ending of ``path``'s name as written there (``.nii.gz``, ``.SEG.DCM``),
    ``""`` for none; ``seg`` as for :func:`file_format`."""
    match = _match(path, seg)
    return "" if match is None else match[0]


def file_stem(path: str | os.PathLike, seg: bool = False) -> str:
    """``path``'s name without its registered ending (:func:`file_ending`)."""
    name = Path(path).name
    return name[: len(name) - len(file_ending(name, seg))]


def volume_format(path: str | os.PathLike) -> VolumeFormat:
    """The format that reads the volume at ``path`` and its header: :data:`DICOM_SERIES` for a
    folder; the volume format of its ending; NIfTI for any other name (a DICOM SEG's too: it has
    no grid of its own, :data:`DICOM_SEG` reads it onto its series), whose reader refuses a file it
    cannot read with nibabel's reason, naming the file."""
    if Path(path).is_dir():
        return DICOM_SERIES
    return file_format(path) or NIFTI


def write_labels(path: str | Path, labels: np.ndarray, reference: str | Path | np.ndarray) -> Path:
    """Write a label map ``(x, y, z)`` in the format of ``path``'s ending (:func:`volume_format`)
    in the geometry of ``reference``, the input it was predicted from (a file or a DICOM series'
    folder; for NIfTI also its RAS affine ``(4, 4)``), atomically; returns ``path``."""
    return volume_format(path).write_labels(Path(path), labels, reference)


def case_name(path: str | Path | list) -> str:
    """``img0001`` for ``img0001.nii.gz``; nnU-Net's channel suffix is dropped (``case_0000``);
    a list of channel files is named by its first."""
    path = path[0] if isinstance(path, (list, tuple)) else path
    return _CHANNEL_SUFFIX.sub("", file_stem(path))


def label_suffix(source: str | os.PathLike) -> str:
    """The ending of the label map predicted for the input ``source`` (a file or a DICOM series'
    folder): its format's :attr:`~VolumeFormat.prediction_ending`, as nnU-Net writes predictions in
    the dataset's ``file_ending`` (a MetaImage ``.mhd`` header's: one ``.mha`` file)."""
    return volume_format(source).prediction_ending


def prediction_path(folder: str | Path, source: str | Path | Sequence[str | Path], name: str | None = None,
                    output_format: VolumeFormat | None = None) -> Path:
    """The one naming rule of predicted label maps: ``folder/<name><ending>``.

    Args:
        folder: the output folder.
        source: the case's input: a volume file, its channel files (named by the first), or a
            DICOM series' folder.
        name: the case's name where the input does not give it (a DICOM series': its
            :attr:`~hsmla_med.io.dicom.DicomSeries.name`); default :func:`case_name` of ``source``.
        output_format: the format written where it is not the input's own (:data:`DICOM_SEG`:
            ``<name>.seg.dcm``); default the input's (:func:`label_suffix`).
    """
    first = source[0] if isinstance(source, (list, tuple)) else source
    ending = label_suffix(first) if output_format is None else output_format.prediction_ending
    return Path(folder) / f"{case_name(source) if name is None else name}{ending}"


def check_nifti(img, path: str | Path, inflate: bool = False) -> None:
    """:class:`DataError` unless nibabel read ``path`` as NIfTI (one file or a pair) whose voxel
    file holds the voxels its header describes. An Analyze 7.5 header (a ``.hdr`` without
    NIfTI's magic) stores no orientation: nibabel's affine for it assumes a radiological
    left-right flip, which a label map written back in it would repeat unchecked, so it is
    refused rather than guessed.

    The voxels (shape x data type, from byte ``vox_offset``): an uncompressed file is checked by
    its size, before anything is allocated (nibabel allocates the header's size, then reports a
    short file in two lines, or a MemoryError for a header of far more voxels than the file; bytes
    after the voxels are left, as nibabel leaves them); a gzip-compressed one, with ``inflate``,
    by inflating and counting its stream to its end, which must be the voxels' end
    (:func:`~hsmla_med.io.compressed.check_inflated`: nibabel reports a cut-off stream as zlib's
    EOFError and reads a damaged one unseen). That costs a decompression: it is done where the
    voxels are read (:class:`~hsmla_med.data.checks.NiftiReader`, :meth:`Nifti.read`), not for
    every header read."""
    if not isinstance(img, nib.Nifti1Pair):  # Nifti1Image, Nifti2Image and the pairs derive from it
        raise DataError(f"{path}: an Analyze 7.5 image, not NIfTI: its header has no orientation; convert it to NIfTI "
                        "with the orientation checked (e.g. FSL's fslchfiletype NIFTI_GZ, then fslreorient2std)")
    voxels = Path(img.file_map["image"].filename)
    if not voxels.is_file():  # nibabel reads a pair's header alone and fails only when the voxels are read
        raise DataError(f"{path}: the NIfTI pair's image file {voxels.name} is missing")
    proxy = img.dataobj  # what nibabel will read: its offset, data type and shape (the image's header copy has offset 0)
    offset, size = int(proxy.offset), int(np.prod(proxy.shape)) * proxy.dtype.itemsize
    shape = f"{' x '.join(map(str, proxy.shape))} {proxy.dtype.name}"
    if voxels.suffix == ".gz":
        if inflate:
            check_inflated(voxels, 0, offset + size, f"its header describes ({offset} before the voxels, then {shape})")
    elif voxels.suffix not in (".bz2", ".zst") and voxels.stat().st_size < offset + size:  # (nibabel's other compressions: not checked)
        raise DataError(f"{voxels}: the file is {voxels.stat().st_size} bytes, its header describes {size} bytes of voxels from byte {offset} ({shape})")


def image_series(folder: str | Path):
    """The one DICOM image series of a case's image folder (:class:`~hsmla_med.io.dicom.DicomSeries`)."""
    from hsmla_med.io.dicom import series_in

    series = series_in(folder)
    if len(series) != 1:
        raise DataError(f"{folder}: a case's image folder holds one DICOM series, this one {len(series)}: " + "; ".join(s.line() for s in series))
    return series[0]
