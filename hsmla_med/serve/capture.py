"""Burned-in results: a Secondary Capture series of the source slices with the predicted classes
drawn in (each class in its colour of our pictures and SEG, :func:`~hsmla_med.io.overlays.class_colour`,
over the slice in grey), for the PACS viewers that show no SEG. Burned In Annotation is YES: the
pixels are a picture for reading, not the images to measure on.

The labels are the SEG's, read back onto the series (:func:`~hsmla_med.io.dicom_seg.read_seg`),
so the two results cannot disagree. The UIDs derive from the job's folder and the source
instances, so a job run again writes the same instances: a destination that received them once
stores them once.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hsmla_med.io.atomic import atomic_path

__all__ = ["write_burned_in", "ALPHA", "SERIES_NUMBER"]

ALPHA = 0.4  # the opacity of the class colours: the anatomy stays readable under them
SERIES_NUMBER = 301  # beside the SEG's 300 (hsmla_med.io.dicom_seg)
_DESCRIPTION = "hsmla-med segmentation (burned in)"


def _grey(ds) -> np.ndarray:
    """The slice as 8-bit grey: its modality values through its own window (the first, where
    several are given), else between their 1st and 99th percentiles."""
    from pydicom.multival import MultiValue
    from pydicom.pixels import apply_modality_lut

    values = apply_modality_lut(ds.pixel_array, ds).astype(np.float64)
    if "WindowCenter" in ds and "WindowWidth" in ds:
        centre, width = (float(v[0]) if isinstance(v, MultiValue) else float(v) for v in (ds.WindowCenter, ds.WindowWidth))
        low, high = centre - width / 2, centre + width / 2
    else:
        low, high = np.percentile(values, (1, 99))
    return np.rint(255 * np.clip((values - low) / ((high - low) or 1.0), 0, 1)).astype(np.uint8)


def burn_in(grey: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """``(rows, columns, 3)`` RGB: the grey slice, each labelled pixel blended with its class's colour."""
    from hsmla_med.io.overlays import class_colour

    rgb = np.repeat(grey[..., None].astype(np.float64), 3, axis=2)
    for value in np.unique(labels[labels > 0]):
        where = labels == value
        rgb[where] = (1 - ALPHA) * rgb[where] + ALPHA * np.asarray(class_colour(int(value)), np.float64)
    return np.rint(rgb).astype(np.uint8)


def _orientation(ds) -> tuple[str, str]:
    """Patient Orientation of a slice: the patient direction nearest to its rows' and to its columns' (LPS)."""
    letters = (("R", "L"), ("A", "P"), ("F", "H"))
    directions = np.reshape(np.asarray(ds.ImageOrientationPatient, np.float64), (2, 3))
    return tuple(letters[int(np.argmax(np.abs(d)))][int(d[np.argmax(np.abs(d))] > 0)] for d in directions)


def write_burned_in(seg: Path, files: Sequence[Path], label_names: Sequence[str], output: Path, token: str) -> list[Path]:
    """Write one Secondary Capture image per source file (``files``: the series sorted along the
    slice normal) into ``output``, atomically; returns their paths in slice order. ``token``: the
    job's, the seed of the UIDs."""
    import highdicom as hd
    import pydicom
    from pydicom.uid import ExplicitVRLittleEndian, generate_uid

    from hsmla_med import __version__
    from hsmla_med.io.dicom_seg import ALGORITHM_NAME, read_seg

    labels = read_seg(seg, files, label_names)
    series_uid = generate_uid(entropy_srcs=[token, "burned-in series"])
    written = []
    for z, path in enumerate(files):
        ds = pydicom.dcmread(path)
        image = hd.sc.SCImage.from_ref_dataset(
            ref_dataset=ds, pixel_array=burn_in(_grey(ds), labels[:, :, z].T), photometric_interpretation="RGB", bits_allocated=8,
            coordinate_system="PATIENT", series_instance_uid=series_uid, series_number=SERIES_NUMBER,
            sop_instance_uid=generate_uid(entropy_srcs=[token, str(ds.SOPInstanceUID)]), instance_number=z + 1, manufacturer=ALGORITHM_NAME,
            pixel_spacing=tuple(float(v) for v in ds.PixelSpacing) if "PixelSpacing" in ds else None, patient_orientation=_orientation(ds),
            transfer_syntax_uid=ExplicitVRLittleEndian, series_description=_DESCRIPTION, software_versions=__version__,
        )
        image.BurnedInAnnotation = "YES"
        source = pydicom.Dataset()
        source.ReferencedSOPClassUID, source.ReferencedSOPInstanceUID = ds.SOPClassUID, ds.SOPInstanceUID
        image.SourceImageSequence = [source]
        target = output / f"burned_in_{z + 1:04d}.dcm"
        with atomic_path(target) as tmp:
            image.save_as(tmp, enforce_file_format=True)
        written.append(target)
    return written
