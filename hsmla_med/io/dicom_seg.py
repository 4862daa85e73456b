"""DICOM Segmentation (SEG) objects: label maps written for, and read from, a DICOM image series.

A SEG is what a PACS stores and what 3D Slicer, OHIF and MONAI Label display over the series it
references. Both directions go through ``highdicom`` (the library MONAI Deploy writes SEG with),
which fills in the patient, study, Frame of Reference and per-frame plane positions from the
source images and checks the object against the standard.

Geometry. Our label volumes are indexed as the NIfTI of the series is (MONAI/nibabel order):
``labels[x, y, z]`` with ``x`` the column index of a slice (along the first direction of Image
Orientation (Patient), the row direction), ``y`` its row index, and ``z`` the position of the slice
in ``source_files``, which are sorted along the slice normal (the cross product of the row and
column directions), as SimpleITK's series reader orders them. A DICOM frame is ``rows x columns``,
so the frame of source file ``z`` is ``labels[:, :, z].T``, and reading a SEG back transposes again.

Codes. Each foreground class present becomes one BINARY segment labelled with the class name; its
Segmented Property Category and Type are SNOMED CT codes (scheme ``SCT``; never the retired
``SRT``) taken from pydicom's code dictionary (``codes.SCT``) for the BTCV organs (both the names
of our synthetic ``dataset_0.json`` and MONAI's short ones), with Right/Left as a Type Modifier
for paired organs. A class with no entry gets the generic category and type SCT 85756007
"Tissue", its name still the Segment Label. The class held in a segment is recovered on reading
from its label (:func:`read_seg` with the dataset's label names). Each segment recommends to
viewers the colour our pictures draw its class in (:func:`~hsmla_med.io.overlays.class_colour`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hsmla_med.errors import DataError
from hsmla_med.io.atomic import atomic_path

__all__ = ["ALGORITHM_NAME", "SEG_SUFFIX", "segment_codes", "write_seg", "read_seg", "referenced_series_uid", "is_seg_file"]

ALGORITHM_NAME = "hsmla-med"
SEG_SUFFIX = ".seg.dcm"  # infer's output name: <case>.seg.dcm beside <case>.nii.gz
# Patient and General Study attributes of type 2 (present, may be empty) that highdicom copies
# from the first source; anonymised exports often drop them, so absent ones are set empty there
_TYPE2_COPIED = ("PatientName", "PatientID", "PatientBirthDate", "PatientSex", "AccessionNumber", "StudyID", "StudyDate", "StudyTime",
                 "ReferringPhysicianName")
_UID = re.compile(r"(0|[1-9][0-9]*)(\.(0|[1-9][0-9]*))*")  # DICOM PS3.5 9.1: numbers without leading zeros, joined by dots
_SERIES_NUMBER = 300  # not a source series' number in the usual CT exports (1..20); viewers sort by it

# normalised class name -> (pydicom codes.SCT keyword of the type, laterality keyword or None);
# BTCV's organs under our synthetic dataset's names and MONAI's dataset_0.json short names
_ORGANS = {
    "spleen": ("Spleen", None),
    "right_kidney": ("Kidney", "Right"), "rkid": ("Kidney", "Right"),
    "left_kidney": ("Kidney", "Left"), "lkid": ("Kidney", "Left"),
    "gallbladder": ("Gallbladder", None), "gall": ("Gallbladder", None),
    "esophagus": ("Esophagus", None), "eso": ("Esophagus", None),
    "liver": ("Liver", None),
    "stomach": ("Stomach", None), "sto": ("Stomach", None),
    "aorta": ("Aorta", None),
    "inferior_vena_cava": ("InferiorVenaCava", None), "ivc": ("InferiorVenaCava", None),
    # one BTCV class holds both veins; SNOMED CT has no code for the pair: the portal vein's,
    # the Segment Label names both
    "portal_and_splenic_vein": ("PortalVein", None), "veins": ("PortalVein", None),
    "pancreas": ("Pancreas", None),
    "right_adrenal_gland": ("AdrenalGland", "Right"), "rad": ("AdrenalGland", "Right"),
    "left_adrenal_gland": ("AdrenalGland", "Left"), "lad": ("AdrenalGland", "Left"),
}


def _normalised(name: str) -> str:
    """``"Right Kidney"``, ``"right-kidney"``, ``"right_kidney"`` -> ``"right_kidney"``."""
    return re.sub(r"[\s\-]+", "_", name.strip().lower())


def segment_codes(name: str) -> tuple:
    """``(category, type, modifier or None)``, pydicom ``Code`` objects of scheme SCT, for a class
    name (module docstring)."""
    from pydicom.sr.codedict import codes

    organ = _ORGANS.get(_normalised(name))
    if organ is None:
        return codes.SCT.Tissue, codes.SCT.Tissue, None
    kind, side = organ
    return codes.SCT.AnatomicalStructure, getattr(codes.SCT, kind), getattr(codes.SCT, side) if side else None


def _segment(number: int, value: int, name: str, algorithm):
    """One highdicom SegmentDescription: class ``value`` labelled ``name``, SCT codes, AUTOMATIC
    by ``algorithm``, the class's colour of our pictures as the recommended display colour."""
    import highdicom as hd

    from hsmla_med.io.overlays import class_colour  # matplotlib: imported when a SEG is written, not with infer

    category, kind, modifier = segment_codes(name)
    colour = hd.color.CIELabColor.from_rgb(*class_colour(value))  # viewers show the colours of our pictures
    description = hd.seg.SegmentDescription(number, name, category, kind, hd.seg.SegmentAlgorithmTypeValues.AUTOMATIC, algorithm,
                                            display_color=colour)
    if modifier is not None:  # highdicom has no argument for it; the standard nests it in the type's item
        description.SegmentedPropertyTypeCodeSequence[0].SegmentedPropertyTypeModifierCodeSequence = [hd.sr.CodedConcept.from_code(modifier)]
    return description


def _algorithm(model: dict):
    """Algorithm Identification: hsmla-med, its version, and the weights' sha256 (and checkpoint
    file name) as parameters, so a SEG names the model that made it."""
    import highdicom as hd
    from pydicom.sr.codedict import codes

    from hsmla_med import __version__

    parameters = {"weights_sha256": str(model["sha256"])}
    if model.get("checkpoint"):
        parameters["checkpoint"] = Path(model["checkpoint"]).name  # a name, not a path of this machine
    return hd.AlgorithmIdentificationSequence(ALGORITHM_NAME, codes.DCM.ArtificialIntelligence, __version__, parameters=parameters)


def _header(path: str | Path):
    """The header of a DICOM file (no pixel data); :class:`DataError` for another file."""
    import pydicom

    try:
        return pydicom.dcmread(str(path), stop_before_pixels=True)
    except Exception as err:  # pydicom raises several types for foreign or truncated files
        raise DataError(f"{path}: cannot read as DICOM ({err})") from None


def _read_sources(source_files: Sequence[str | Path]) -> list:
    """The source headers; multi-frame images refused, since a label volume's slice is one
    source file here."""
    datasets = []
    for path in source_files:
        ds = _header(path)
        if int(getattr(ds, "NumberOfFrames", 1) or 1) > 1:
            raise DataError(f"{path}: a multi-frame image; a DICOM SEG is written for series of single-frame slices")
        datasets.append(ds)
    return datasets


def _check_order(datasets: list) -> None:
    """The sources must be sorted along the slice normal (the geometry contract above), else
    the SEG would put each slice's labels on another slice."""
    positions = [np.dot(np.cross(*np.reshape(np.asarray(ds.ImageOrientationPatient, float), (2, 3))), np.asarray(ds.ImagePositionPatient, float))
                 for ds in datasets]
    if len(positions) > 1 and not np.all(np.diff(positions) > 0):
        raise ValueError("source_files must be sorted by position along the slice normal (as the series reader sorts them)")


def write_seg(labels: np.ndarray, source_files: Sequence[str | Path], label_names: Sequence[str], output_path: str | Path,
              algorithm: dict, sop_instance_uid: str | None = None) -> Path:
    """Write ``labels`` as a BINARY DICOM SEG referencing the series of ``source_files``, atomically.

    Args:
        labels: ``(x, y, z)`` integer label map on the series' grid (module docstring).
        source_files: the series' files, sorted along the slice normal; one per ``z``.
        label_names: class names by label value (0 = background).
        output_path: the ``.dcm`` file to write (folders are created).
        algorithm: the model's record (:func:`~hsmla_med.engine.prediction.model_record`:
            ``sha256``, ``checkpoint``), written as the Algorithm Identification.
        sop_instance_uid: the SEG's SOP Instance UID, fixed by the caller before the SEG exists
            (the DICOM node records it when it queues a job, so a job run again writes the same
            object); its Series Instance UID then derives from it, so that both stay the same.
            Default: new UIDs.

    One segment per foreground class present, numbered 1.. in class order (classes absent from
    ``labels`` are left out, as are frames without any segment). Returns ``output_path``.
    """
    import highdicom as hd
    from pydicom.uid import generate_uid

    from hsmla_med import __version__

    datasets = _read_sources(source_files)
    _check_order(datasets)
    for keyword in _TYPE2_COPIED:  # in memory only: the source files stay as they are
        if keyword not in datasets[0]:
            setattr(datasets[0], keyword, "")
    expected = (int(datasets[0].Columns), int(datasets[0].Rows), len(datasets))
    if labels.ndim != 3 or labels.shape != expected:
        raise ValueError(f"labels of shape {labels.shape} do not lie on the series' grid (columns, rows, slices) {expected}")
    present = [int(v) for v in np.unique(labels) if v != 0]
    if not present:  # the Segment Sequence is required (type 1): a SEG holds at least one segment
        raise ValueError("no foreground class in the label map: a DICOM SEG needs at least one segment")
    if present[-1] >= len(label_names):
        raise ValueError(f"label value {present[-1]} has no name among {len(label_names)} label names")
    if sop_instance_uid is not None and not (len(sop_instance_uid) <= 64 and _UID.fullmatch(sop_instance_uid)):
        raise ValueError(f"{sop_instance_uid!r} is no valid DICOM UID (digits and dots, at most 64 characters)")
    sop_uid = sop_instance_uid or generate_uid()
    series_uid = generate_uid(entropy_srcs=[sop_uid, "SEG series"]) if sop_instance_uid else generate_uid()
    model = _algorithm(algorithm)
    segments = [_segment(i + 1, value, label_names[value], model) for i, value in enumerate(present)]
    numbers = np.zeros(present[-1] + 1, np.uint8 if len(present) < 256 else np.uint16)
    numbers[present] = np.arange(1, len(present) + 1)  # class value -> segment number
    frames = np.ascontiguousarray(numbers[labels].transpose(2, 1, 0))  # (z, rows = y, columns = x)
    seg = hd.seg.Segmentation(
        source_images=datasets, pixel_array=frames, segmentation_type=hd.seg.SegmentationTypeValues.BINARY, segment_descriptions=segments,
        series_instance_uid=series_uid, series_number=_SERIES_NUMBER, sop_instance_uid=sop_uid, instance_number=1,
        manufacturer=ALGORITHM_NAME, manufacturer_model_name=ALGORITHM_NAME, software_versions=__version__, device_serial_number="none",
        content_label="HSMLA_MED", content_description=f"{ALGORITHM_NAME} segmentation", series_description=f"{ALGORITHM_NAME} segmentation",
        omit_empty_frames=True,
    )
    with atomic_path(output_path) as tmp:
        seg.save_as(tmp, enforce_file_format=True)
    return Path(output_path)


def _read(path: str | Path):
    import highdicom as hd

    try:
        return hd.seg.segread(str(path))
    except Exception as err:  # pydicom / highdicom raise several types for other objects
        raise DataError(f"{path}: cannot read as a DICOM SEG ({err})") from None


def is_seg_file(path: str | Path) -> bool:
    """Whether ``path`` is a DICOM file holding a Segmentation (Modality SEG)."""
    from hsmla_med.io.dicom import is_dicom_file

    return Path(path).is_file() and is_dicom_file(path) and str(_header(path).get("Modality", "")) == "SEG"


def referenced_series_uid(path: str | Path) -> str:
    """The Series Instance UID of the image series a SEG references (from its header);
    :class:`DataError` for a SEG referencing none or several."""
    series = {str(item.SeriesInstanceUID) for item in _header(path).get("ReferencedSeriesSequence", [])}
    if len(series) != 1:
        raise DataError(f"{path}: a DICOM SEG must reference one image series, it references {len(series)}")
    return series.pop()


def read_seg(path: str | Path, source_files: Sequence[str | Path], label_names: Sequence[str] | None = None) -> np.ndarray:
    """The label map of a BINARY SEG on the grid of its series: ``(x, y, z)`` as
    :func:`write_seg` takes it, ``source_files`` sorted along the slice normal.

    A segment's voxels take the value of its Segment Label among ``label_names`` (compared
    case-, space- and underscore-insensitively; a label not there is a :class:`DataError`);
    without names, its segment number. Overlapping segments are refused: a label map holds one
    class per voxel."""
    seg = _read(path)
    segments = {int(s.SegmentNumber): str(s.SegmentLabel) for s in seg.SegmentSequence}
    if label_names is None:
        values = {number: number for number in segments}
    else:
        index = {_normalised(name): value for value, name in enumerate(label_names)}
        unknown = sorted(label for label in segments.values() if _normalised(label) not in index)
        if unknown:
            raise DataError(f"{path}: segment label(s) {unknown} are not among the label names {list(label_names)[1:]}")
        values = {number: index[_normalised(label)] for number, label in segments.items()}
    uids = [str(ds.SOPInstanceUID) for ds in _read_sources(source_files)]
    try:
        frames = seg.get_pixels_by_source_instance(source_sop_instance_uids=uids, combine_segments=True, relabel=False)
    except Exception as err:  # highdicom: unreferenced instances, overlaps, fractional segments
        raise DataError(f"{path}: cannot be read onto its series ({err})") from None
    lookup = np.zeros(max(values, default=0) + 1, np.uint8 if max(values.values(), default=0) < 256 else np.uint16)
    for number, value in values.items():
        lookup[number] = value
    return lookup[frames].transpose(2, 1, 0)  # (z, rows, columns) -> (x, y, z)
