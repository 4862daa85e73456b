"""A MONAI transform that refuses unusable image/label contents with a message naming the file.

Header-level problems (missing files, shape or affine mismatch) are caught when the datalist is
read (:mod:`hsmla_med.data.datalist`); what needs the voxels — channel count, NaN/Inf, label
values outside the dataset's labels — is checked here, right after loading, so that the error
names the file instead of surfacing later as a NaN loss or an index error in one-hot encoding.
"""

from __future__ import annotations

import copy
import logging
import os
import warnings
from collections.abc import Hashable, Mapping, Sequence

import torch
from monai.data import MetaTensor, NibabelReader
from monai.transforms import LoadImaged, MapTransform
from monai.utils import ensure_tuple

from hsmla_med.data.datalist import check_nifti
from hsmla_med.errors import DataError
from hsmla_med.io.dicom import DicomSeriesReader, series_in
from hsmla_med.io.dicom_seg import is_seg_file, read_seg
from hsmla_med.io.itk import ITKFileReader

__all__ = ["CheckCased", "LoadCased", "NiftiReader", "source_file"]


def source_file(tensor) -> str:
    """The file a loaded MONAI MetaTensor came from (``?`` when unknown)."""
    meta = getattr(tensor, "meta", None) or {}
    return str(meta.get("filename_or_obj", "?"))


class NiftiReader(NibabelReader):
    """MONAI's ``NibabelReader`` whose files are checked to hold the voxels their headers
    describe before any is read (:func:`~hsmla_med.data.datalist.check_nifti`: a cut-off or
    damaged ``.nii.gz``, a ``.nii`` shorter than its header's voxels), and which also reads NIfTI
    pairs (``CASE.hdr`` with ``CASE.img``): nibabel reads them as it reads ``.nii``, but MONAI
    picks its reader by the suffixes ``.nii`` and ``.nii.gz`` only, and without this one a
    pair's header went to the DICOM reader."""

    def verify_suffix(self, filename) -> bool:
        return all(str(f).endswith((".nii", ".nii.gz", ".hdr", ".img")) for f in ensure_tuple(filename))

    def read(self, data, **kwargs):
        img = super().read(data, **kwargs)
        for one, name in zip(ensure_tuple(img), self.filenames):
            check_nifti(one, name, inflate=True)
        return img


class LoadCased(LoadImaged):
    """``LoadImaged`` whose failures (truncated or foreign files) name the file that failed, and
    which reads NIfTI files and pairs, their voxels checked (:class:`NiftiReader`), MetaImage and
    NRRD files through SimpleITK (:class:`~hsmla_med.io.itk.ITKFileReader`), a DICOM series (a series folder,
    or the list of a series' files: :class:`~hsmla_med.io.dicom.DicomSeriesReader`, tried
    before MONAI's readers) and, for a key after the first, a DICOM SEG: the label map of a
    case whose image (the first key) is the series the SEG references, read onto that series'
    grid (:func:`~hsmla_med.io.dicom_seg.read_seg`; ``label_names``, the dataset's, give its
    segments their values). MONAI has no SEG reader (MONAI #8468), and a SEG alone has no voxel grid.
    """

    def __init__(self, keys, *args, label_names: Sequence[str] | None = None, **kwargs) -> None:
        # MONAI instantiates every reader it can import; with pydicom installed that includes
        # NvImgCodecPydicomReader, which logs and warns on every machine without nvImageCodec
        # (a GPU JPEG decoder that none of our files need): silenced while it is built
        plugin_log = logging.getLogger("monai.data.nvimgcodec_pydicom_plugin")
        disabled, plugin_log.disabled = plugin_log.disabled, True
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="NvImgCodecPydicomReader")
                # missing keys: refused below, where a SEG key is told apart
                super().__init__(keys, *args, allow_missing_keys=True, **kwargs)
        finally:
            plugin_log.disabled = disabled
        self.register(NiftiReader())
        self.register(ITKFileReader())
        self.register(DicomSeriesReader())
        self.label_names = list(label_names) if label_names is not None else None

    def __call__(self, data, reader=None):
        files = ", ".join(str(data[k]) for k in self.keys if k in data)
        missing = [str(k) for k in self.keys if k not in data]
        if missing:
            raise DataError(f"{files or '?'}: the case has no {' and '.join(missing)}")
        segs = {k: data[k] for k in self.keys[1:] if isinstance(data[k], (str, os.PathLike)) and is_seg_file(data[k])}
        try:
            loaded = super().__call__({k: v for k, v in data.items() if k not in segs}, reader)
        except DataError:
            raise  # already names the file (the DICOM checks)
        except Exception as err:
            raise DataError(f"{files}: cannot read image data ({type(err).__name__}: {err})") from None
        for key, path in segs.items():
            loaded[key] = self._seg(path, loaded[self.keys[0]])
        return loaded

    def _seg(self, path, image: MetaTensor) -> MetaTensor:
        """The SEG at ``path`` as a channel-first label volume with the meta data of ``image``,
        the series it was read onto."""
        (series,) = series_in(source_file(image))  # the image's own series, in slice order
        labels = read_seg(path, series.files, self.label_names)
        meta = copy.deepcopy(image.meta)
        meta["filename_or_obj"] = str(path)
        return MetaTensor(torch.as_tensor(labels[None]), meta=meta)  # meta: the image's affine among the rest


class CheckCased(MapTransform):
    """Check a channel-first image (and label) after ``LoadImaged(ensure_channel_first=True)``.

    Args:
        in_channels: channels the network expects; the image must have exactly these, and three
            spatial dims (a volume; a 2D image is refused).
        num_classes: label values must be integers in ``0..num_classes - 1``.
        image_key, label_key: dictionary keys; a missing label (inference) is not checked.
        label_values: the values a label may hold instead (a dataset with an ignore label or
            regions: :meth:`~hsmla_med.data.datalist.Datalist.label_values`).
    """

    def __init__(self, in_channels: int, num_classes: int, image_key: Hashable = "image", label_key: Hashable = "label",
                 label_values: Sequence[int] | None = None) -> None:
        super().__init__([image_key], allow_missing_keys=True)
        self.in_channels, self.num_classes = in_channels, num_classes
        self.image_key, self.label_key = image_key, label_key
        self.label_values = sorted(label_values) if label_values is not None else list(range(num_classes))

    def __call__(self, data: Mapping) -> dict:
        image = data[self.image_key]
        if image.dim() != 4:
            raise DataError(f"{source_file(image)}: a volume has three spatial dims, this image has {image.dim() - 1} ({tuple(image.shape[1:])})")
        if image.shape[0] != self.in_channels:
            raise DataError(f"{source_file(image)}: image has {image.shape[0]} channel(s), the model expects {self.in_channels}")
        finite = torch.isfinite(image)
        if not bool(finite.all()):
            raise DataError(f"{source_file(image)}: {int((~finite).sum())} voxel(s) are NaN or Inf")
        label = data.get(self.label_key)
        if label is not None:
            if label.shape[0] != 1:
                raise DataError(f"{source_file(label)}: a label map has one channel, got {label.shape[0]}")
            values = torch.unique(label)
            bad = values[~torch.isin(values, torch.tensor(self.label_values, dtype=values.dtype, device=values.device))]
            if bad.numel():
                shown = ", ".join(f"{v:g}" for v in bad[:8].tolist())
                allowed = f"0..{self.num_classes - 1}" if self.label_values == list(range(self.num_classes)) else str(self.label_values)
                raise DataError(f"{source_file(label)}: label value(s) {shown} outside the dataset's labels {allowed}")
        return dict(data)
