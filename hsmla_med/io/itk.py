"""ITK's single-volume file formats in and out: MetaImage (``.mha``, or an ``.mhd`` header with its voxel
file) and NRRD (``.nrrd``, or an ``.nhdr`` header with its voxel file), read through SimpleITK.

nnU-Net v2 datasets name them in ``dataset.json``'s ``file_ending`` (grand-challenge.org's
algorithms exchange ``.mha``; Slicer saves ``.nrrd``), LUNA16 ships ``.mhd``. MONAI reads them
only through the ``itk`` package (``ITKReader``), which is a second ITK build of several hundred
MB beside the SimpleITK that hsmla-med already needs for DICOM; :class:`ITKFileReader` is the
same reading through SimpleITK, written here for that reason. The geometry is given as MONAI's
ITK reader gives it (``affine_lps_to_ras``): ITK's LPS world turned into NIfTI's RAS, the voxels in
``(x, y, z)`` order.

What SimpleITK does not check, or reports without naming the problem, is checked here first:
a MetaImage header's sizes and its voxel file (ITK aborts the process on some broken headers,
and a truncated file gives "No such file or directory"), compressed voxels that do not inflate
to the header's size (ITK reads them as zeros: :mod:`hsmla_med.io.compressed`), a volume that
is not 3D, several components per voxel.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from monai.data import ImageReader

from hsmla_med.errors import DataError
from hsmla_med.io.atomic import atomic_path
from hsmla_med.io.compressed import check_inflated

__all__ = ["ITK_FILE", "ITKFileReader", "METAIMAGE_ENDINGS", "NRRD_ENDINGS", "check_metaimage", "data_file", "header_reader", "image_affine",
           "is_itk_file", "itk_header", "ras_affine", "read_itk", "write_itk"]

#: the endings of MetaImage and NRRD files: one file, or a header whose voxels are in a file
#: it names; defined here for this module's reader, and the formats' of :mod:`hsmla_med.io.volumes`
METAIMAGE_ENDINGS = (".mha", ".mhd")
NRRD_ENDINGS = (".nrrd", ".nhdr")
#: the file names SimpleITK reads here
ITK_FILE = re.compile("(" + "|".join(re.escape(e) for e in METAIMAGE_ENDINGS + NRRD_ENDINGS) + ")$")
_HEADER_BYTES = 1 << 16  # a MetaImage header is text lines before the voxels; real ones are under 2 kB
_ELEMENT_BYTES = {"MET_UCHAR": 1, "MET_CHAR": 1, "MET_USHORT": 2, "MET_SHORT": 2, "MET_UINT": 4, "MET_INT": 4,
                  "MET_FLOAT": 4, "MET_ULONG": 8, "MET_LONG": 8, "MET_ULONG_LONG": 8, "MET_LONG_LONG": 8, "MET_DOUBLE": 8}


def is_itk_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is named as a MetaImage or NRRD file."""
    return bool(ITK_FILE.search(Path(path).name))


def _metaimage_header(path: Path) -> tuple[dict[str, str], int]:
    """The ``key = value`` lines of a MetaImage header up to ``ElementDataFile`` (the last
    field, after which an ``.mha`` holds its voxels) and the byte offset where they end."""
    try:
        with open(path, "rb") as f:
            head = f.read(_HEADER_BYTES)
    except OSError as err:
        raise DataError(f"{path}: cannot read MetaImage header ({err.strerror})") from None
    header, offset = {}, 0
    for line in head.splitlines(keepends=True):
        offset += len(line)
        key, sep, value = line.decode("latin-1").partition("=")
        if not sep:
            continue
        header[key.strip()] = value.strip()
        if key.strip() == "ElementDataFile":
            return header, offset
    raise DataError(f"{path}: not a MetaImage header (no ElementDataFile)")


def check_metaimage(path: str | Path, inflate: bool = False) -> None:
    """Refuse, naming the file, a MetaImage header that is not a 3D volume with a positive voxel
    spacing, or whose voxels (in its own voxel file, or after the header of an ``.mha``) are
    missing or not exactly the size the header describes: uncompressed, by the file's size;
    compressed (``CompressedData = True``), with ``inflate``, by inflating and counting the
    stream (:func:`~hsmla_med.io.compressed.check_inflated`), which costs a decompression and is
    done where the voxels are read (:func:`read_itk`), not for every header read. Checked before
    SimpleITK reads it: ITK aborts the process on some of these, and reads a short or damaged
    stream as zeros."""
    path = Path(path)
    header, offset = _metaimage_header(path)
    try:
        size = [int(v) for v in header.get("DimSize", "").split()]
        spacing = [float(v) for v in (header.get("ElementSpacing") or header.get("ElementSize") or "1 1 1").split()]
    except ValueError:
        raise DataError(f"{path}: DimSize and ElementSpacing must be numbers, got {header.get('DimSize')!r}, {header.get('ElementSpacing')!r}") from None
    if len(size) != 3 or min(size) < 1:
        raise DataError(f"{path}: a scan has three dimensions of at least one voxel, the header says DimSize = {header.get('DimSize')!r}")
    if len(spacing) != 3 or not all(np.isfinite(spacing)) or min(spacing) <= 0:
        raise DataError(f"{path}: voxel spacing must be three positive numbers, got {header.get('ElementSpacing')!r}")
    itemsize = _ELEMENT_BYTES.get(header.get("ElementType", ""))
    if itemsize is None:  # ITK reads an unknown type as "unknown(0)" and names neither file nor type
        raise DataError(f"{path}: ElementType {header.get('ElementType')!r} is not a MetaImage voxel type ({', '.join(_ELEMENT_BYTES)})")
    data_file = header["ElementDataFile"]
    if data_file == "LIST" or " " in data_file:
        return  # one file per slice (a list, or a name pattern with its range): SimpleITK checks them
    local = data_file == "LOCAL"
    raw = path if local else path.parent / data_file
    if not raw.is_file():
        raise DataError(f"{path}: its voxel file {raw} is missing")
    skip = int(header.get("HeaderSize", "0") or 0)  # bytes before the voxels in the voxel file; -1: the voxels end it
    expected = int(np.prod(size)) * itemsize * int(header.get("ElementNumberOfChannels", "1") or 1)
    voxels = f"({' x '.join(map(str, size))} {header['ElementType']})"
    if skip < 0:
        return  # the voxels end the file, whatever precedes them: no size to compare
    start = (offset if local else 0) + skip
    if header.get("CompressedData", "False").lower() == "true":
        if inflate:
            check_inflated(raw, start, expected, f"the header {path.name} describes {voxels}")
        return
    actual = raw.stat().st_size - start
    if actual != expected:
        where = f"{path}: {actual} bytes of voxels after the header" if local else f"{raw}: {actual} bytes"
        raise DataError(f"{where}, the header {path.name} describes {expected} {voxels}")


def data_file(path: str | Path) -> Path | None:
    """The separate voxel file of a detached header (``.mhd``'s ``ElementDataFile``, ``.nhdr``'s
    ``data file``), ``None`` for a file that holds its voxels (or lists several data files)."""
    path = Path(path)
    if path.suffix == ".mhd":
        name = _metaimage_header(path)[0]["ElementDataFile"]
    elif path.suffix == ".nhdr":
        lines = path.read_bytes()[:_HEADER_BYTES].decode("latin-1").splitlines()
        name = next((line.split(":", 1)[1].strip() for line in lines if line.lower().startswith(("data file:", "datafile:"))), "LOCAL")
    else:
        return None
    return None if name in ("LOCAL", "LIST") or " " in name else path.parent / name


def _last_line(err: Exception) -> str:
    return str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__


def header_reader(path: str | Path, inflate: bool = False):
    """SimpleITK's reader of ``path`` with the header read and checked: one 3D volume of one
    component (nnU-Net's convention: one file per channel); ``inflate``: a MetaImage's compressed
    voxels too (:func:`check_metaimage`), before they are read."""
    import SimpleITK as sitk  # here: SimpleITK loads slowly, and only these files need it

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    if path.suffix in METAIMAGE_ENDINGS:
        check_metaimage(path, inflate)
    reader = sitk.ImageFileReader()
    reader.SetFileName(str(path))
    try:
        reader.ReadImageInformation()
    except RuntimeError as err:
        raise DataError(f"{path}: cannot read as {'MetaImage' if path.suffix in METAIMAGE_ENDINGS else 'NRRD'} ({_last_line(err)})") from None
    if reader.GetDimension() != 3:
        raise DataError(f"{path}: a volume has three dimensions, this image has {reader.GetDimension()} ({' x '.join(map(str, reader.GetSize()))})")
    if reader.GetNumberOfComponents() != 1:
        raise DataError(f"{path}: {reader.GetNumberOfComponents()} components per voxel; hsmla-med reads one channel per file "
                        "(nnU-Net's CASE_0000, CASE_0001, ...)")
    return reader


def ras_affine(linear_lps: np.ndarray, origin_lps: np.ndarray) -> np.ndarray:
    """DICOM's (and ITK's) LPS world to NIfTI's RAS: x and y negated, as MONAI's ITKReader
    (``affine_lps_to_ras``) and SimpleITK's NIfTI writer do; rounded to float32 as a NIfTI
    header (sform) stores it, so that a volume and its NIfTI conversion enter the preprocessing
    with the same affine: MONAI's ``Spacing`` places an oblique output grid by a corner test
    (``compute_shape_offset``) that float rounding flips, shifting the grid by a fraction of a
    voxel."""
    affine = np.eye(4)
    affine[:3, :3], affine[:3, 3] = linear_lps, origin_lps
    return (np.diag([-1.0, -1.0, 1.0, 1.0]) @ affine).astype(np.float32).astype(np.float64)


def image_affine(image) -> np.ndarray:
    """The RAS affine of a SimpleITK image or reader (origin, spacing and direction)."""
    direction = np.array(image.GetDirection(), dtype=np.float64).reshape(3, 3)
    return ras_affine(direction * np.array(image.GetSpacing()), np.array(image.GetOrigin()))


def itk_header(path: str | Path) -> tuple[tuple[int, int, int], np.ndarray]:
    """Shape ``(x, y, z)`` and RAS affine of a MetaImage or NRRD volume, from its header only."""
    reader = header_reader(Path(path))
    return tuple(int(n) for n in reader.GetSize()), image_affine(reader)


def read_itk(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """The voxels ``(x, y, z)`` (the file's own type) and RAS affine of a MetaImage or NRRD volume."""
    import SimpleITK as sitk

    path = Path(path)
    reader = header_reader(path, inflate=True)
    try:
        image = reader.Execute()
    except RuntimeError as err:
        raise DataError(f"{path}: cannot read the voxels ({_last_line(err)})") from None
    return sitk.GetArrayFromImage(image).transpose(2, 1, 0), image_affine(image)


class ITKFileReader(ImageReader):
    """A MONAI ``ImageReader`` for MetaImage and NRRD files through SimpleITK (MONAI's own
    ``ITKReader`` needs the ``itk`` package). Registered in :class:`~hsmla_med.data.checks.LoadCased`;
    the image is ``(x, y, z)`` without a channel, with ``affine`` and ``original_affine`` in RAS,
    as MONAI's NIfTI reader gives them. A list of files (a case's channels) is stacked channel
    first."""

    def verify_suffix(self, filename: Sequence[str | os.PathLike] | str | os.PathLike) -> bool:
        names = [filename] if isinstance(filename, (str, os.PathLike)) else list(filename)
        return bool(names) and all(is_itk_file(n) for n in names)

    def read(self, data: Sequence[str | os.PathLike] | str | os.PathLike, **kwargs) -> list[Path]:
        return [Path(data)] if isinstance(data, (str, os.PathLike)) else [Path(d) for d in data]

    def get_data(self, img: list[Path]) -> tuple[np.ndarray, dict]:
        """The volume (channels stacked first for several files, whose one grid
        :func:`~hsmla_med.data.datalist.channels_grid` checks from the headers) and its meta data."""
        volumes, affines = zip(*(read_itk(p) for p in img))
        volume = volumes[0] if len(img) == 1 else np.stack(volumes)
        meta = {"affine": affines[0], "original_affine": affines[0].copy(), "spatial_shape": np.array(volumes[0].shape),
                "original_channel_dim": float("nan") if len(img) == 1 else 0, "space": "RAS", "filename_or_obj": str(img[0])}
        return volume, meta


def write_itk(path: str | Path, data: np.ndarray, reference: str | Path | np.ndarray) -> Path:
    """Write ``data`` ``(x, y, z)`` as ``path``'s format (MetaImage or NRRD, compressed) on the
    grid of ``reference``, atomically: a MetaImage or NRRD volume, whose origin, spacing and
    direction are copied from its header as they are (no round trip through an affine), or a RAS
    affine ``(4, 4)`` (another format's input), turned back into ITK's LPS origin, spacing and
    direction (the inverse of :func:`image_affine`)."""
    import SimpleITK as sitk

    if isinstance(reference, np.ndarray):
        lps = np.diag([-1.0, -1.0, 1.0, 1.0]) @ np.asarray(reference, dtype=np.float64)
        spacing = np.linalg.norm(lps[:3, :3], axis=0)
        origin, direction = tuple(lps[:3, 3]), tuple((lps[:3, :3] / spacing).ravel())
        spacing = tuple(spacing)
    else:
        reader = header_reader(reference)
        origin, spacing, direction, size = reader.GetOrigin(), reader.GetSpacing(), reader.GetDirection(), tuple(reader.GetSize())
        if tuple(data.shape) != size:
            raise ValueError(f"{path}: data of shape {tuple(data.shape)} on the grid of {reference}, {size}")
    image = sitk.GetImageFromArray(np.ascontiguousarray(np.asarray(data).transpose(2, 1, 0)))
    image.SetOrigin(origin)
    image.SetSpacing(spacing)
    image.SetDirection(direction)
    with atomic_path(path) as tmp:
        sitk.WriteImage(image, str(tmp), useCompression=True)
    return Path(path)
