"""DICOM SEG out (hsmla_med.io.dicom_seg) and SEG references in evaluate, on series written here
with pydicom: the label map read back through highdicom equals ours voxel for voxel, and each
SEG frame lies on the slice of the source instance it references."""

from __future__ import annotations

import json
from pathlib import Path

import highdicom as hd
import nibabel as nib
import numpy as np
import pydicom
import pytest
import SimpleITK as sitk
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, generate_uid

from hsmla_med import __version__
from hsmla_med.errors import DataError, InputError
from hsmla_med.io.dicom_seg import read_seg, write_seg

NAMES = ["background", "spleen", "right_kidney", "left_kidney", "gallbladder", "tumour"]
MODEL = {"sha256": "ab" * 32, "checkpoint": "/somewhere/best.ckpt"}
# (category, type, modifier) code values, SNOMED CT, as pydicom's dictionary gives them
# (codes.SCT.AnatomicalStructure, .Spleen, .Kidney, .Right, .Left, .Tissue)
ANATOMY, TISSUE = "91723000", "85756007"
EXPECTED = {"spleen": (ANATOMY, "78961009", None), "right_kidney": (ANATOMY, "64033007", "24028007"),
            "left_kidney": (ANATOMY, "64033007", "7771000"), "tumour": (TISSUE, TISSUE, None)}

LPS = ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0))
# rows and columns rotated about two axes: no axis of the grid is a patient axis
_c, _s = np.cos(0.5), np.sin(0.5)
_ROT = np.array([[_c, -_s, 0], [_s, _c, 0], [0, 0, 1]]) @ np.array([[1, 0, 0], [0, np.cos(0.3), -np.sin(0.3)], [0, np.sin(0.3), np.cos(0.3)]])
OBLIQUE = (tuple(_ROT[:, 0]), tuple(_ROT[:, 1]))


def write_series(folder: Path, volume: np.ndarray, orientation=LPS, spacing=(0.8, 0.9, 2.5), origin=(-20.0, 15.0, 40.0)) -> list[Path]:
    """A CT series, one file per slice under random names: slice ``k`` of ``volume`` (x, y, z)
    at ``origin + k * spacing[2] * normal``, its pixel ``[row, column]`` = ``volume[column, row, k]``
    (a DICOM frame is rows x columns). Returns the files in slice order."""
    folder.mkdir(parents=True, exist_ok=True)
    study, series, frame = generate_uid(), generate_uid(), generate_uid()
    row, col = (np.asarray(v, float) for v in orientation)
    files = []
    for k in range(volume.shape[2]):
        ds = Dataset()
        ds.file_meta = FileMetaDataset()
        ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
        ds.file_meta.MediaStorageSOPClassUID = ds.SOPClassUID = CTImageStorage
        ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID = generate_uid()
        ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.FrameOfReferenceUID = study, series, frame
        ds.PatientID, ds.PatientName, ds.PatientBirthDate, ds.PatientSex = "P001", "Phantom^Test", "", "O"
        ds.StudyDate, ds.StudyTime, ds.StudyID, ds.AccessionNumber, ds.ReferringPhysicianName = "20260101", "120000", "1", "", ""
        ds.Modality, ds.SeriesNumber, ds.InstanceNumber, ds.Manufacturer = "CT", 3, k + 1, "pydicom"
        ds.ImageOrientationPatient = [float(v) for v in (*row, *col)]
        ds.ImagePositionPatient = [float(v) for v in np.asarray(origin) + k * spacing[2] * np.cross(row, col)]
        ds.PixelSpacing = [spacing[1], spacing[0]]  # between rows (y), between columns (x)
        ds.SliceThickness = spacing[2]
        ds.Rows, ds.Columns = volume.shape[1], volume.shape[0]
        ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
        ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 1
        ds.RescaleSlope, ds.RescaleIntercept = 1, 0
        ds.PixelData = np.ascontiguousarray(volume[:, :, k].T.astype(np.int16)).tobytes()
        path = folder / f"{generate_uid()[-12:]}.dcm"
        ds.save_as(path, enforce_file_format=True)
        files.append(path)
    return files


def known_labels(shape=(11, 9, 6), seed=0) -> np.ndarray:
    """Classes 1, 2, 3 and 5 present, 4 absent; one slice without any foreground; no symmetry."""
    labels = np.random.default_rng(seed).choice([0, 1, 2, 3, 5], size=shape).astype(np.uint8)
    labels[:, :, 2] = 0
    return labels


def itk_series(folder: Path) -> tuple[list[Path], np.ndarray, sitk.Image]:
    """SimpleITK's reading of a series folder, the reference reader: its file order (sorted by
    position along the normal), the voxels as (x, y, z), and the image."""
    files = [Path(f) for f in sitk.ImageSeriesReader.GetGDCMSeriesFileNames(str(folder))]
    image = sitk.ReadImage([str(f) for f in files])
    return files, sitk.GetArrayFromImage(image).transpose(2, 1, 0), image


@pytest.mark.parametrize("orientation", [LPS, OBLIQUE], ids=["lps", "oblique"])
def test_seg_round_trip_voxel_for_voxel_and_on_the_source_slices(tmp_path, orientation):
    truth = known_labels()
    write_series(tmp_path / "series", truth * 10, orientation)
    files, volume, _ = itk_series(tmp_path / "series")
    labels = (volume // 10).astype(np.uint8)  # the label map as our NIfTI of the series holds it
    np.testing.assert_array_equal(labels, truth)  # the writer above and SimpleITK agree on the grid
    out = write_seg(labels, files, NAMES, tmp_path / "out" / "case.seg.dcm", MODEL)

    np.testing.assert_array_equal(read_seg(out, files, NAMES), labels)
    # independently of our index mapping: highdicom's frame for each source instance is that
    # instance's own pixels, class by class (segment labels -> class values by name)
    seg = hd.seg.segread(out)
    value = {int(s.SegmentNumber): NAMES.index(s.SegmentLabel) for s in seg.SegmentSequence}
    for path in files:
        source = pydicom.dcmread(path)
        for number, cls in value.items():
            frame = seg.get_pixels_by_source_instance([source.SOPInstanceUID], segment_numbers=[number])[0, :, :, 0]
            np.testing.assert_array_equal(frame.astype(bool), source.pixel_array == cls * 10, err_msg=f"{path.name} class {cls}")


def test_seg_segments_codes_references_and_algorithm(tmp_path):
    labels = known_labels()
    files = write_series(tmp_path / "series", labels * 10)
    files, _, _ = itk_series(tmp_path / "series")
    seg = hd.seg.segread(write_seg(labels, files, NAMES, tmp_path / "case.seg.dcm", MODEL))
    sources = [pydicom.dcmread(f) for f in files]

    assert seg.SegmentationType == "BINARY"
    segments = {s.SegmentLabel: s for s in seg.SegmentSequence}
    assert list(segments) == ["spleen", "right_kidney", "left_kidney", "tumour"]  # gallbladder (absent) left out
    assert [int(s.SegmentNumber) for s in seg.SegmentSequence] == [1, 2, 3, 4]
    for name, (category, kind, modifier) in EXPECTED.items():
        s = segments[name]
        got_type = s.SegmentedPropertyTypeCodeSequence[0]
        assert (s.SegmentedPropertyCategoryCodeSequence[0].CodeValue, got_type.CodeValue) == (category, kind)
        modifiers = [m.CodeValue for m in got_type.get("SegmentedPropertyTypeModifierCodeSequence", [])]
        assert modifiers == ([modifier] if modifier else [])
        assert s.SegmentAlgorithmType == "AUTOMATIC"
        algorithm = s.SegmentationAlgorithmIdentificationSequence[0]
        assert (algorithm.AlgorithmName, algorithm.AlgorithmVersion) == ("hsmla-med", __version__)
        assert MODEL["sha256"] in algorithm.AlgorithmParameters

    schemes = set()
    seg.walk(lambda ds, elem: schemes.add(elem.value) if elem.keyword == "CodingSchemeDesignator" else None)
    assert "SCT" in schemes and "SRT" not in schemes

    (series,) = seg.ReferencedSeriesSequence
    assert series.SeriesInstanceUID == sources[0].SeriesInstanceUID
    assert {i.ReferencedSOPInstanceUID for i in series.ReferencedInstanceSequence} == {d.SOPInstanceUID for d in sources}
    assert seg.FrameOfReferenceUID == sources[0].FrameOfReferenceUID
    assert seg.StudyInstanceUID == sources[0].StudyInstanceUID
    assert seg.PatientID == sources[0].PatientID


def test_write_seg_refuses_a_label_map_off_the_series_grid_and_unsorted_files(tmp_path):
    labels = known_labels()
    files = write_series(tmp_path / "series", labels * 10)
    with pytest.raises(ValueError, match="grid"):
        write_seg(labels.transpose(1, 0, 2), files, NAMES, tmp_path / "a.seg.dcm", MODEL)
    with pytest.raises(ValueError, match="sorted"):
        write_seg(labels, files[::-1], NAMES, tmp_path / "b.seg.dcm", MODEL)
    assert not list(tmp_path.glob("*.seg.dcm"))


def test_read_seg_names_an_unknown_segment_label(tmp_path):
    labels = known_labels()
    files = write_series(tmp_path / "series", labels * 10)
    out = write_seg(labels, files, NAMES, tmp_path / "case.seg.dcm", MODEL)
    with pytest.raises(DataError, match="tumour"):
        read_seg(out, files, NAMES[:5])


def _nifti_like(image: sitk.Image, labels: np.ndarray, path: Path) -> Path:
    """``labels`` (x, y, z) as NIfTI on ``image``'s grid, written by SimpleITK (the reference
    conversion of a series to NIfTI)."""
    out = sitk.GetImageFromArray(labels.transpose(2, 1, 0).astype(np.uint8))
    out.CopyInformation(image)
    path.parent.mkdir(parents=True, exist_ok=True)
    sitk.WriteImage(out, str(path))
    return path


def test_evaluate_with_seg_files_equals_evaluate_with_their_nifti(tmp_path):
    from hsmla_med.evaluation import evaluate_folder

    truth = known_labels(shape=(14, 12, 7))
    write_series(tmp_path / "dicom" / "case", truth * 10, OBLIQUE)
    files, _, image = itk_series(tmp_path / "dicom" / "case")
    predicted = truth.copy()
    predicted[3:9, 2:7, 1:5] = 1  # a wrong block: Dice below 1, HD95 above 0
    dataset = tmp_path / "dataset.json"
    dataset.write_text(json.dumps({"labels": {str(i): n for i, n in enumerate(NAMES)}}))
    _nifti_like(image, truth, tmp_path / "labels_nifti" / "case.nii.gz")
    _nifti_like(image, predicted, tmp_path / "pred_nifti" / "case.nii.gz")
    write_seg(truth, files, NAMES, tmp_path / "labels_seg" / "case.seg.dcm", MODEL)
    write_seg(predicted, files, NAMES, tmp_path / "pred_seg" / "case.seg.dcm", MODEL)

    def scores(predictions, labels):
        summary = evaluate_folder(tmp_path / predictions, tmp_path / labels, dataset, tmp_path / "out" / f"{predictions}-{labels}",
                                  draws=10, dicom=tmp_path / "dicom")
        return summary["metric_per_case"][0]["metrics"], summary["foreground_mean"]

    expected = scores("pred_nifti", "labels_nifti")
    assert 0 < expected[1]["Dice"] < 1
    assert scores("pred_nifti", "labels_seg") == expected  # a SEG reference
    assert scores("pred_seg", "labels_nifti") == expected  # a SEG prediction


def test_evaluate_names_a_seg_whose_series_is_missing_and_needs_label_names(tmp_path):
    from hsmla_med.evaluation import evaluate_folder

    truth = known_labels()
    files = write_series(tmp_path / "dicom" / "case", truth * 10)
    _, _, image = itk_series(tmp_path / "dicom" / "case")
    write_seg(truth, files, NAMES, tmp_path / "labels" / "case.seg.dcm", MODEL)
    _nifti_like(image, truth, tmp_path / "pred" / "case.nii.gz")
    dataset = tmp_path / "dataset.json"
    dataset.write_text(json.dumps({"labels": {str(i): n for i, n in enumerate(NAMES)}}))
    with pytest.raises(DataError, match="is not under --dicom"):
        evaluate_folder(tmp_path / "pred", tmp_path / "labels", dataset, tmp_path / "out")  # default: the labels folder
    with pytest.raises(InputError, match="--dataset-json is needed"):
        evaluate_folder(tmp_path / "pred", tmp_path / "labels", None, tmp_path / "out", dicom=tmp_path / "dicom")


def test_seg_of_an_anonymised_series_without_type2_patient_and_study_attributes(tmp_path):
    labels = known_labels()
    files = write_series(tmp_path / "series", labels * 10)
    for path in files:  # as anonymisers export them: the type 2 attributes dropped, not emptied
        ds = pydicom.dcmread(path)
        for keyword in ("PatientBirthDate", "PatientSex", "AccessionNumber", "StudyID", "StudyTime", "ReferringPhysicianName"):
            delattr(ds, keyword)
        ds.save_as(path)
    out = write_seg(labels, files, NAMES, tmp_path / "case.seg.dcm", MODEL)
    seg = hd.seg.segread(out)
    assert seg.PatientBirthDate == "" and seg.StudyID == "" and seg.PatientID == "P001"
    np.testing.assert_array_equal(read_seg(out, files, NAMES), labels)
    assert "PatientSex" not in pydicom.dcmread(files[0])  # the sources are left as they are


def _tiny_module(tmp_path):
    from tests.test_original_geometry import _module

    return _module(tmp_path / "data", tmp_path / "run")[1]


def test_infer_writes_a_seg_equal_to_its_nifti_voxel_for_voxel(tmp_path):
    from hsmla_med.engine.prediction import model_digest
    from hsmla_med.pipelines import btcv
    from hsmla_med.pipelines.task import InferenceOptions
    from tests.conftest import phantom

    image, _ = phantom((36, 32, 8), np.random.default_rng(3))
    write_series(tmp_path / "dicom" / "case", np.pad(image, ((4, 4), (4, 4), (0, 0)), constant_values=-1000), OBLIQUE)
    files, _, _ = itk_series(tmp_path / "dicom" / "case")
    module = _tiny_module(tmp_path)
    options = InferenceOptions(output_formats=("nifti", "dicom-seg"), progress=lambda _: None)
    (done,) = btcv.infer(module, tmp_path / "dicom", tmp_path / "out", options)
    nifti = tmp_path / "out" / done.name.replace(".seg.dcm", ".nii.gz")
    assert done.name.endswith(".seg.dcm") and nifti.is_file()
    labels = np.asarray(nib.load(str(nifti)).dataobj)
    assert {1, 2} <= set(np.unique(labels).tolist())  # not a comparison of empty maps
    np.testing.assert_array_equal(read_seg(done, files, module.label_names), labels)
    algorithm = hd.seg.segread(done).SegmentSequence[0].SegmentationAlgorithmIdentificationSequence[0]
    assert model_digest(module) in algorithm.AlgorithmParameters

    (only,) = btcv.infer(module, tmp_path / "dicom", tmp_path / "out_seg", InferenceOptions(output_formats=("dicom-seg",), progress=lambda _: None))
    written = sorted(p.name for p in (tmp_path / "out_seg").iterdir() if not p.name.startswith("."))
    assert written == [only.name, "provenance.json"]  # the SEG instead of the NIfTI


def test_infer_refuses_dicom_seg_for_a_nifti_input_in_one_line(tmp_path):
    from hsmla_med.pipelines import btcv
    from hsmla_med.pipelines.task import InferenceOptions
    from tests.conftest import phantom, write_nifti

    nifti = write_nifti(tmp_path / "in" / "case.nii.gz", phantom((36, 32, 8), np.random.default_rng(3))[0], np.diag([1.5, 1.5, 2.0, 1.0]))
    with pytest.raises(DataError, match=r"case.nii.gz: --output-format dicom-seg needs a DICOM series input") as err:
        btcv.infer(_tiny_module(tmp_path), nifti, tmp_path / "out", InferenceOptions(output_formats=("nifti", "dicom-seg")))
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()
    with pytest.raises(InputError, match="--output-format png: not an output format; use one or more of nifti, metaimage, nrrd, dicom-seg"):
        InferenceOptions(output_formats=("png",))


def test_label_overlay_draws_each_class_in_its_own_colour_over_the_image(tmp_path):
    from matplotlib import colormaps
    from PIL import Image

    from hsmla_med.io.overlays import label_overlay

    labels = np.zeros((40, 60), np.uint8)
    labels[5:35, 5:25], labels[5:35, 35:55] = 1, 3  # class 2 absent
    alpha = 0.5
    path = label_overlay(tmp_path / "o.png", np.zeros((40, 60)), labels, ["background", "a", "b", "c"], alpha=alpha)
    pixels = np.asarray(Image.open(path).convert("RGB")).reshape(-1, 3)
    colours, counts = np.unique(pixels, axis=0, return_counts=True)
    found = {tuple(c): n for c, n in zip(colours.tolist(), counts.tolist())}
    # a flat image is drawn black: class k is alpha times tab20's colour k - 1
    expected = {k: tuple(np.rint(255 * np.asarray(colormaps["tab20"](k - 1)[:3]) * alpha).astype(int).tolist()) for k in (1, 2, 3)}
    assert found.get(expected[1], 0) > 1000 and found.get(expected[3], 0) > 1000  # the two drawn regions (scaled to >= 512 px)
    assert found.get(expected[2], 0) == 0  # an absent class is not drawn
    with pytest.raises(ValueError, match="0..3"):
        label_overlay(tmp_path / "bad.png", np.zeros((40, 60)), labels + 1, ["background", "a", "b", "c"])


def test_cli_output_formats_and_evaluate_with_dicom(tmp_path, capsys, tiny_btcv_checkpoint):
    """``infer --output-format nifti --output-format dicom-seg`` (and the comma list) writes both;
    ``evaluate --dicom`` scores the SEG as its NIfTI; a NIfTI input and another task are refused
    in one line."""
    from hsmla_med.cli import main
    from tests.conftest import cli_error, phantom, write_nifti

    image, _ = phantom((36, 32, 6), np.random.default_rng(3))
    write_series(tmp_path / "dicom" / "case", image)
    infer = ["infer", "--task", "btcv", "--checkpoint", tiny_btcv_checkpoint, "--input", str(tmp_path / "dicom")]
    assert main([*infer, "--output", str(tmp_path / "a"), "--output-format", "nifti", "--output-format", "dicom-seg"]) == 0
    assert main([*infer, "--output", str(tmp_path / "b"), "--output-format", "dicom-seg,nifti"]) == 0
    for out in ("a", "b"):
        assert sorted(p.name for p in (tmp_path / out).glob("P001*")) == ["P001_20260101_3.nii.gz", "P001_20260101_3.seg.dcm"]
    capsys.readouterr()

    # the SEG as the reference of its own NIfTI: a perfect score (a class the tiny network predicts)
    (tmp_path / "ref").mkdir()
    (tmp_path / "ref" / "P001_20260101_3.seg.dcm").symlink_to(tmp_path / "a" / "P001_20260101_3.seg.dcm")
    (tmp_path / "pred").mkdir()
    (tmp_path / "pred" / "P001_20260101_3.nii.gz").symlink_to(tmp_path / "a" / "P001_20260101_3.nii.gz")
    dataset = tmp_path / "dataset.json"
    dataset.write_text(json.dumps({"labels": {"0": "background", "1": "disc", "2": "bar"}}))
    assert main(["evaluate", "--predictions", str(tmp_path / "pred"), "--labels", str(tmp_path / "ref"), "--dataset-json", str(dataset),
                 "--dicom", str(tmp_path / "dicom"), "--output", str(tmp_path / "scored")]) == 0
    summary = json.loads((tmp_path / "scored" / "summary.json").read_text())
    dice = [m["Dice"] for m in summary["metric_per_case"][0]["metrics"].values() if m["Dice"] is not None]
    assert dice and all(d == 1.0 for d in dice)

    nifti = write_nifti(tmp_path / "nifti" / "case.nii.gz", image, np.diag([1.5, 1.5, 2.0, 1.0]))
    line = cli_error(capsys, [*infer[:-1], str(nifti), "--output", str(tmp_path / "c"), "--output-format", "dicom-seg"])
    assert "case.nii.gz: --output-format dicom-seg needs a DICOM series input" in line
    line = cli_error(capsys, ["infer", "--task", "endovis", "--checkpoint", tiny_btcv_checkpoint, "--input", str(tmp_path / "dicom"),
                              "--output", str(tmp_path / "d"), "--output-format", "dicom-seg"])
    assert "--output-format dicom-seg: only --task btcv" in line
    line = cli_error(capsys, [*infer, "--output", str(tmp_path / "e"), "--output-format", "nifti,png"])
    assert "--output-format png: not an output format; use one or more of nifti, metaimage, nrrd, dicom-seg" in line


def test_seg_recommends_the_colours_of_our_pictures(tmp_path):
    from matplotlib import colormaps

    labels = known_labels()
    files = write_series(tmp_path / "series", labels * 10)
    seg = hd.seg.segread(write_seg(labels, files, NAMES, tmp_path / "case.seg.dcm", MODEL))
    for s in seg.SegmentSequence:  # class k: tab20's colour k - 1, as label_overlay draws it
        rgb = hd.color.CIELabColor.from_dicom_value(s.RecommendedDisplayCIELabValue).to_rgb()
        expected = np.asarray(colormaps["tab20"](NAMES.index(s.SegmentLabel) - 1)[:3]) * 255
        np.testing.assert_allclose(rgb, expected, atol=2)


def test_evaluate_takes_the_nifti_of_a_case_infer_wrote_in_both_formats(tmp_path):
    from hsmla_med.evaluation import pair_files

    for folder in ("pred", "ref"):
        (tmp_path / folder).mkdir()
    for name in ("a.nii.gz", "a.seg.dcm", "b.seg.dcm"):
        (tmp_path / "pred" / name).write_bytes(b"")
    for name in ("a.nii.gz", "b.nii.gz"):
        (tmp_path / "ref" / name).write_bytes(b"")
    pairs = pair_files(tmp_path / "pred", tmp_path / "ref", seg=True)
    assert [(r.name, p.name) for r, p in pairs] == [("a.nii.gz", "a.nii.gz"), ("b.nii.gz", "b.seg.dcm")]
    (tmp_path / "pred" / "b.dcm").write_bytes(b"")
    with pytest.raises(DataError, match="b.seg.dcm: b.dcm has the same name"):
        pair_files(tmp_path / "pred", tmp_path / "ref", seg=True)
