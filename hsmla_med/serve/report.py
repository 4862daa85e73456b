"""A route's structured report (``structured_report: true``): a DICOM Comprehensive 3D SR of
TID 1500 (Measurement Report, highdicom) with the volume of each segment of the job's SEG in
millilitres, one Volumetric ROI Measurements group per segment (TID 1411) that references the
segment, so that a PACS or a reporting system reads the volumes without the voxels.

A volume is the segment's voxel count (the SEG read back onto its series,
:func:`~hsmla_med.io.dicom_seg.read_seg`, as the burned-in series is) times the volume of one
voxel of the series' grid, so the report and the SEG cannot disagree. Its UIDs derive from the
SEG's, so a job run again writes the same report: a destination that received it once stores it once.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hsmla_med.io.atomic import atomic_path

__all__ = ["write_volume_report", "voxel_volume_ml", "SERIES_NUMBER", "REPORT_NAME"]

SERIES_NUMBER = 302  # beside the SEG's 300 and the burned-in series' 301
REPORT_NAME = "volumes.sr.dcm"
# the imaging procedure reported, by the source series' modality (LOINC's "unspecified body region" codes)
_PROCEDURES = {"CT": "CTUnspecifiedBodyRegion", "MR": "MRIUnspecifiedBodyRegion", "PT": "PETUnspecifiedBodyRegion",
               "NM": "NMUnspecifiedBodyRegion"}


def voxel_volume_ml(files: Sequence[Path]) -> float:
    """The volume of one voxel of the series (its files in slice order), in mL: the determinant
    of its grid's affine (mm³), over 1000."""
    from hsmla_med.io.dicom import series_geometry

    return float(abs(np.linalg.det(series_geometry(files)[1][:3, :3]))) / 1000.0


def write_volume_report(seg_path: Path, files: Sequence[Path], path: Path) -> Path:
    """Write the report of the SEG at ``seg_path`` over its series (``files``, sorted along the
    slice normal) to ``path``, atomically; returns ``path``."""
    import highdicom as hd
    import pydicom
    from pydicom.sr.codedict import codes
    from pydicom.uid import ExplicitVRLittleEndian, generate_uid

    from hsmla_med import __version__
    from hsmla_med.io.dicom_seg import ALGORITHM_NAME, read_seg

    seg = pydicom.dcmread(seg_path)
    uid = str(seg.SOPInstanceUID)
    numbers = read_seg(seg_path, files)  # each voxel's segment number (0: none)
    counts = np.bincount(numbers.ravel(), minlength=max(int(s.SegmentNumber) for s in seg.SegmentSequence) + 1)
    voxel_ml = voxel_volume_ml(files)
    algorithm = hd.sr.AlgorithmIdentification(name=ALGORITHM_NAME, version=__version__)
    millilitre = hd.sr.CodedConcept("mL", "UCUM", "milliliter")
    source_series = hd.sr.SourceSeriesForSegmentation(str(seg.ReferencedSeriesSequence[0].SeriesInstanceUID))

    def segment_of(number: int):
        # by its source series: a segment's frames are listed where each frame says its segment,
        # which a SEG of one segment may say once for all (shared functional groups)
        return hd.sr.ReferencedSegment(str(seg.SOPClassUID), uid, number, source_series=source_series)

    groups = []
    for segment in seg.SegmentSequence:
        number = int(segment.SegmentNumber)
        volume = hd.sr.Measurement(name=codes.SCT.Volume, value=float(counts[number] * voxel_ml), unit=millilitre, algorithm_id=algorithm)
        groups.append(hd.sr.VolumetricROIMeasurementsAndQualitativeEvaluations(
            tracking_identifier=hd.sr.TrackingIdentifier(uid=generate_uid(entropy_srcs=[uid, "segment", str(number)]),
                                                         identifier=str(segment.SegmentLabel)),
            referenced_segment=segment_of(number),
            finding_type=hd.sr.CodedConcept.from_dataset(segment.SegmentedPropertyTypeCodeSequence[0]),
            algorithm_id=algorithm, measurements=[volume]))
    device = hd.sr.DeviceObserverIdentifyingAttributes(uid=generate_uid(entropy_srcs=[ALGORITHM_NAME, "device"]), name=ALGORITHM_NAME,
                                                       manufacturer_name=ALGORITHM_NAME, model_name=__version__)
    context = hd.sr.ObservationContext(observer_device_context=hd.sr.ObserverContext(codes.DCM.Device, device))
    sources = [pydicom.dcmread(f, stop_before_pixels=True) for f in files]  # the evidence of the segments' source images
    modality = str(sources[0].get("Modality", "CT"))
    report = hd.sr.MeasurementReport(observation_context=context, procedure_reported=getattr(codes.LN, _PROCEDURES.get(modality, "CTUnspecifiedBodyRegion")),
                                     imaging_measurements=groups)
    sr = hd.sr.Comprehensive3DSR(
        evidence=[seg, *sources], content=report, series_instance_uid=generate_uid(entropy_srcs=[uid, "volume report series"]),
        series_number=SERIES_NUMBER, sop_instance_uid=generate_uid(entropy_srcs=[uid, "volume report"]), instance_number=1,
        manufacturer=ALGORITHM_NAME, is_complete=True, series_description=f"{ALGORITHM_NAME} volumes", transfer_syntax_uid=ExplicitVRLittleEndian,
    )
    with atomic_path(path) as tmp:
        sr.save_as(tmp, enforce_file_format=True)
    return path
