"""A synthetic volume written as a CT DICOM series, as a PACS exports one: one file per slice
under random names (no ``.dcm``), signed 16-bit Hounsfield units, the geometry of a RAS affine
(NIfTI's) converted to DICOM's LPS patient coordinates. The synthetic BTCV dataset ships one
test case this way so that ``infer`` on the default data shows the DICOM input path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, generate_uid

from hsmla_med.io import atomic_path

__all__ = ["write_ct_series"]


def write_ct_series(folder: str | Path, image: np.ndarray, affine: np.ndarray, rng: np.random.Generator, patient_id: str,
                    description: str = "synthetic CT", series_number: int = 1) -> list[Path]:
    """Write ``image`` ``(x, y, z)`` (int16 HU) with its RAS ``affine`` (orthogonal voxel axes)
    as one CT file per slice in ``folder``; the UIDs (``generate_uid`` from the series' own
    entropy) and file names come from ``rng``, so a seed gives the same series. Returns the
    files in slice order."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lps = np.diag([-1.0, -1.0, 1.0]) @ np.asarray(affine, dtype=np.float64)[:3]  # RAS -> LPS: x and y negated
    spacing = np.linalg.norm(lps[:, :3], axis=0)
    row, col = lps[:, 0] / spacing[0], lps[:, 1] / spacing[1]  # along a row (x index), along a column (y index)
    entropy = [str(v) for v in rng.integers(2**31, size=4)]
    study, series, frame = (generate_uid(entropy_srcs=[*entropy, kind]) for kind in ("study", "series", "frame"))
    files = []
    for k in range(image.shape[2]):
        sop = generate_uid(entropy_srcs=[*entropy, "slice", str(k)])
        meta = FileMetaDataset()
        meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID, meta.TransferSyntaxUID = CTImageStorage, sop, ExplicitVRLittleEndian
        ds = Dataset()
        ds.file_meta = meta
        ds.SOPClassUID, ds.SOPInstanceUID = CTImageStorage, sop
        ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.FrameOfReferenceUID = study, series, frame
        ds.PatientID, ds.PatientName, ds.StudyDate, ds.Modality = patient_id, f"Synthetic^{patient_id}", "20240101", "CT"
        ds.SeriesNumber, ds.SeriesDescription, ds.InstanceNumber = series_number, description, k + 1
        ds.ImagePositionPatient = [round(float(v), 6) for v in lps[:, 3] + k * lps[:, 2]]
        ds.ImageOrientationPatient = [round(float(v), 8) for v in (*row, *col)]
        ds.PixelSpacing = [round(float(spacing[1]), 6), round(float(spacing[0]), 6)]  # between rows (y), between columns (x)
        ds.SliceThickness = round(float(spacing[2]), 6)
        ds.Rows, ds.Columns = image.shape[1], image.shape[0]
        ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
        ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 1
        ds.RescaleIntercept, ds.RescaleSlope, ds.RescaleType = 0, 1, "HU"
        ds.PixelData = np.ascontiguousarray(image[:, :, k].T, dtype="<i2").tobytes()  # rows run along y
        path = folder / f"{int(rng.integers(2**63)):016x}"  # random names: the order is in the headers only
        with atomic_path(path) as tmp:
            ds.save_as(tmp, enforce_file_format=True)
        files.append(path)
    return files
