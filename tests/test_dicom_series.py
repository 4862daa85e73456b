"""DICOM series in: series written here with pydicom (random file names, LPS axial and oblique,
one slice, several series, a missing slice, mixed spacing, a tilt, an SR mixed in) and pydicom's
own CT_small / MR_small are read on the grid placed by hand from the headers and by SimpleITK;
``infer`` on a series gives the labels of its NIfTI conversion."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
import pytest
import SimpleITK as sitk
from pydicom.data import get_testdata_file
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, JPEGBaseline8Bit, generate_uid

from hsmla_med.errors import DataError
from hsmla_med.io import dicom
from hsmla_med.io.dicom import find_series, read_series, select_series
from hsmla_med.pipelines import btcv
from hsmla_med.pipelines.task import InferenceOptions
from tests.conftest import phantom
from tests.test_original_geometry import _module

LPS_AXIAL = ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0))
_a, _b = np.radians(20), np.radians(15)
_ROTATION = np.array([[1, 0, 0], [0, np.cos(_b), -np.sin(_b)], [0, np.sin(_b), np.cos(_b)]]) @ np.array(
    [[np.cos(_a), -np.sin(_a), 0], [np.sin(_a), np.cos(_a), 0], [0, 0, 1]])
OBLIQUE = (tuple(_ROTATION[:, 0]), tuple(_ROTATION[:, 1]))  # rotated 20 degrees in-plane, then tilted 15 degrees out of the axial plane
SPACING = (0.7, 0.9, 3.0)  # x (along a row), y (along a column), between slices: mm
ORIGIN = (-20.0, 35.0, -40.0)  # LPS, mm


def write_series(folder: Path, volume: np.ndarray, orientation=LPS_AXIAL, spacing=SPACING, origin=ORIGIN, uid: str | None = None,
                 number: int = 3, description: str = "CT abdomen", shift=None, pixel_spacing=None, transfer_syntax=ExplicitVRLittleEndian,
                 seed: int = 0) -> list[Path]:
    """``volume`` ``(x, y, z)`` in HU as one CT file per slice under random names (the slices
    written in a random order): slice ``k`` at ``origin + k * spacing[2] * normal`` (plus
    ``shift[k]``: a tilt), stored values HU + 1024 with RescaleIntercept -1024."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    row, col = (np.asarray(v, dtype=np.float64) for v in orientation)
    normal = np.cross(row, col)
    uid, study, frame = uid or generate_uid(), generate_uid(), generate_uid()
    files = []
    for k in rng.permutation(volume.shape[2]):
        position = np.asarray(origin) + k * spacing[2] * normal + (0 if shift is None else shift[k])
        meta = FileMetaDataset()
        meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID, meta.TransferSyntaxUID = CTImageStorage, generate_uid(), transfer_syntax
        ds = Dataset()
        ds.file_meta = meta
        ds.SOPClassUID, ds.SOPInstanceUID = CTImageStorage, meta.MediaStorageSOPInstanceUID
        ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.FrameOfReferenceUID = study, uid, frame
        ds.PatientID, ds.PatientName, ds.StudyDate, ds.Modality = "P 01", "Test^Patient", "20240102", "CT"
        ds.SeriesNumber, ds.SeriesDescription, ds.InstanceNumber = number, description, int(rng.integers(1, 10_000))  # InstanceNumber: no order
        ds.ImagePositionPatient = [float(v) for v in position]
        ds.ImageOrientationPatient = [float(v) for v in (*row, *col)]
        ds.PixelSpacing = list(pixel_spacing[k]) if pixel_spacing is not None else [spacing[1], spacing[0]]  # between rows, between columns
        ds.SliceThickness = spacing[2]
        ds.Rows, ds.Columns = volume.shape[1], volume.shape[0]
        ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
        ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 0
        ds.RescaleIntercept, ds.RescaleSlope = -1024, 1
        stored = (volume[:, :, k].T.astype(np.int32) + 1024).astype(np.uint16)  # rows are y
        ds.PixelData = stored.tobytes() if transfer_syntax == ExplicitVRLittleEndian else pydicom.encaps.encapsulate([b"\xff\xd8 not a JPEG \xff\xd9"])
        path = folder / uuid.UUID(int=int(rng.integers(2**62)) << 64).hex
        ds.save_as(path, enforce_file_format=True)
        files.append(path)
    return files


def hand_affine(orientation=LPS_AXIAL, spacing=SPACING, origin=ORIGIN) -> np.ndarray:
    """The RAS affine of a series written by :func:`write_series`, from its definition: voxel
    ``(i, j, k)`` at ``origin + i*sx*row + j*sy*col + k*sz*normal`` in LPS, x and y negated."""
    row, col = (np.asarray(v, dtype=np.float64) for v in orientation)
    affine = np.eye(4)
    affine[:3, :3] = np.stack([row * spacing[0], col * spacing[1], np.cross(row, col) * spacing[2]], axis=1)
    affine[:3, 3] = origin
    return np.diag([-1.0, -1.0, 1.0, 1.0]) @ affine


def _volume(shape=(12, 10, 5), seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(-1000, 1500, shape).astype(np.int16)


@pytest.mark.parametrize("orientation", [LPS_AXIAL, OBLIQUE], ids=["lps-axial", "oblique"])
def test_series_is_read_sorted_by_position_on_the_hand_placed_grid(tmp_path, orientation):
    """Random file names, slices written in random order, InstanceNumbers at random: the volume
    is the written one (HU, rescale applied) on the grid placed by hand from the definition, and
    the files are sorted by position along the normal."""
    volume = _volume()
    write_series(tmp_path / "s", volume, orientation)
    (series,) = find_series(tmp_path / "s")
    normal = np.cross(*orientation)
    along = [float(np.dot(pydicom.dcmread(f, stop_before_pixels=True).ImagePositionPatient, normal)) for f in series.files]
    assert along == sorted(along) and len(series.files) == 5
    array, affine = read_series(series)
    assert np.array_equal(array, volume)
    np.testing.assert_allclose(affine, hand_affine(orientation), atol=1e-5)
    assert series.name == "P-01_20240102_3_CT-abdomen" and series.number == "3" and series.modality == "CT"


def test_one_slice_series_is_a_one_slice_volume(tmp_path):
    volume = _volume((12, 10, 1))
    write_series(tmp_path / "s", volume)
    array, affine = read_series(find_series(tmp_path / "s")[0])
    assert array.shape == (12, 10, 1) and np.array_equal(array, volume)
    np.testing.assert_allclose(affine[:3, 3], hand_affine()[:3, 3], atol=1e-5)


@pytest.mark.parametrize("name", ["CT_small.dcm", "MR_small.dcm"])
def test_pydicom_test_files_land_on_simpleitks_nifti_grid(tmp_path, name):
    """pydicom's real CT and MR files: our volume and affine are SimpleITK's reading written as
    NIfTI by SimpleITK and read by nibabel (the RAS the pipeline sees for a NIfTI file)."""
    source = tmp_path / "series"
    source.mkdir()
    (source / "a1b2c3").write_bytes(Path(get_testdata_file(name)).read_bytes())
    array, affine = read_series(find_series(source)[0])
    sitk.WriteImage(sitk.ReadImage(str(source / "a1b2c3")), str(tmp_path / "ref.nii.gz"))
    ref = nib.load(str(tmp_path / "ref.nii.gz"))
    assert np.array_equal(array, np.asarray(ref.dataobj).reshape(array.shape))
    np.testing.assert_allclose(affine, ref.affine, atol=1e-4)
    ds = pydicom.dcmread(get_testdata_file(name))
    hu = ds.pixel_array * float(ds.get("RescaleSlope", 1)) + float(ds.get("RescaleIntercept", 0))
    assert np.array_equal(array[:, :, 0], hu.T)  # rescale applied, rows along y


@pytest.mark.parametrize("orientation", [LPS_AXIAL, OBLIQUE], ids=["lps-axial", "oblique"])
@pytest.mark.parametrize("slices", [5, 1])
def test_pydicom_decoding_gives_simpleitks_volume(tmp_path, monkeypatch, orientation, slices):
    """The path for pixel data SimpleITK cannot decode (pydicom and its plugins) gives the volume
    and grid of SimpleITK's reading."""
    write_series(tmp_path / "s", _volume((12, 10, slices)), orientation)
    series = find_series(tmp_path / "s")[0]
    expected = read_series(series)

    def fail(files):
        raise RuntimeError("no decoder")

    monkeypatch.setattr(dicom, "_sitk_volume", fail)
    array, affine = read_series(series)
    assert np.array_equal(array, expected[0])
    np.testing.assert_allclose(affine, expected[1], atol=1e-5)


def test_undecodable_pixel_data_names_the_transfer_syntax_and_the_decoder(tmp_path):
    write_series(tmp_path / "s", _volume((12, 10, 2)), transfer_syntax=JPEGBaseline8Bit)
    with pytest.raises(DataError, match=r"transfer syntax JPEG Baseline \(Process 1\), 1\.2\.840\.10008\.1\.2\.4\.50\).*pylibjpeg-libjpeg.*dicom-codecs"):
        read_series(find_series(tmp_path / "s")[0])


def test_missing_slice_is_refused(tmp_path):
    files = write_series(tmp_path / "s", _volume((12, 10, 6)))
    middle = sorted(files, key=lambda f: float(pydicom.dcmread(f).ImagePositionPatient[2]))[3]
    middle.unlink()
    with pytest.raises(DataError, match=r"s: series .*: 1 missing slice\(s\) between .* \(a gap of 6\.000 mm where slices are 3\.000 mm apart\)"):
        find_series(tmp_path / "s")


def test_mixed_pixel_spacing_is_refused(tmp_path):
    spacings = [[0.9, 0.7]] * 4 + [[0.8, 0.7]]
    write_series(tmp_path / "s", _volume(), pixel_spacing=spacings)
    with pytest.raises(DataError, match="inconsistent pixel spacing or size within the series"):
        find_series(tmp_path / "s")


def test_mixed_orientation_is_refused(tmp_path):
    uid = generate_uid()
    write_series(tmp_path / "s", _volume((12, 10, 3)), uid=uid)
    write_series(tmp_path / "s", _volume((12, 10, 2)), OBLIQUE, origin=(0.0, 0.0, 100.0), uid=uid, seed=1)
    with pytest.raises(DataError, match="inconsistent orientation within the series"):
        find_series(tmp_path / "s")


def test_gantry_tilt_is_refused_not_resampled(tmp_path):
    shift = [np.array([0.0, k * 3.0 * np.tan(np.radians(10)), 0.0]) for k in range(5)]  # a 10 degree tilt about x
    write_series(tmp_path / "s", _volume(), shift=shift)
    with pytest.raises(DataError, match=r"gantry tilt of 10\.00 degrees .*refused, not resampled"):
        find_series(tmp_path / "s")


def test_non_image_objects_are_skipped_with_a_note(tmp_path, caplog):
    write_series(tmp_path / "s", _volume())
    sr = pydicom.dcmread(get_testdata_file("test-SR.dcm"))
    sr.save_as(tmp_path / "s" / "zz_report")
    (tmp_path / "s" / "README").write_text("not DICOM")
    with caplog.at_level(logging.WARNING, logger="hsmla_med.io.dicom"):
        (series,) = find_series(tmp_path / "s")
    assert len(series.files) == 5
    assert "skipped 1 non-image DICOM object(s): zz_report (SR)" in caplog.text


def test_two_series_in_one_folder_are_refused_unless_one_is_picked(tmp_path):
    first, second = generate_uid(), generate_uid()
    write_series(tmp_path / "s", _volume(), uid=first, number=2, description="arterial")
    write_series(tmp_path / "s", _volume((12, 10, 3)), uid=second, number=5, description="venous", seed=1)
    series = find_series(tmp_path / "s")
    with pytest.raises(DataError, match="2 DICOM series in one folder; pick one with --series-uid") as refused:
        select_series(series, tmp_path / "s")
    assert f"{first} (number 2, 'arterial', 5 slice(s)); {second} (number 5, 'venous', 3 slice(s))" in str(refused.value)
    (picked,) = select_series(series, tmp_path / "s", second)
    assert picked.uid == second and len(picked.files) == 3
    with pytest.raises(DataError, match="no series with --series-uid 1.2.3; the series are: "):
        select_series(series, tmp_path / "s", "1.2.3")


def test_a_folder_of_series_folders_is_one_case_per_series(tmp_path):
    write_series(tmp_path / "in" / "a", _volume(), description="same")
    write_series(tmp_path / "in" / "b" / "deeper", _volume((12, 10, 2)), description="same", seed=1)
    series = select_series(find_series(tmp_path / "in"), tmp_path / "in")
    assert [s.name for s in series] == ["P-01_20240102_3_same", "P-01_20240102_3_same-2"]
    assert [len(s.files) for s in series] == [5, 2]


def _agreement_case(root: Path, orientation) -> tuple[Path, Path]:
    """The conftest phantom in an air border as a DICOM series and as SimpleITK's NIfTI
    conversion of that series."""
    image, _ = phantom((36, 32, 8), np.random.default_rng(3))
    image = np.pad(image, ((4, 4), (4, 4), (0, 0)), constant_values=-1000)
    files = write_series(root / "dicom" / "case", image, orientation)
    reader = sitk.ImageSeriesReader()
    reader.SetFileNames(sitk.ImageSeriesReader.GetGDCMSeriesFileNames(str(files[0].parent)))
    nifti = root / "nifti" / "case.nii.gz"
    nifti.parent.mkdir(parents=True)
    sitk.WriteImage(reader.Execute(), str(nifti))
    return root / "dicom", nifti


@pytest.mark.parametrize("orientation", [LPS_AXIAL, OBLIQUE], ids=["lps-axial", "oblique"])
def test_infer_on_a_series_equals_infer_on_its_nifti_conversion(tmp_path, orientation):
    """The target: a series and its NIfTI conversion (by SimpleITK) give the same labels in at
    least 99.9% of voxels (a fixed-rule network with smooth borders), on the same grid; the
    output is named after the series and the item keeps the sorted source files."""
    folder, nifti = _agreement_case(tmp_path, orientation)
    _, module = _module(tmp_path / "data", tmp_path / "run")
    quiet = InferenceOptions(progress=lambda _: None)
    (from_series,) = btcv.infer(module, folder, tmp_path / "out_dicom", quiet)
    (from_nifti,) = btcv.infer(module, nifti, tmp_path / "out_nifti", quiet)
    assert from_series.name == "P-01_20240102_3_CT-abdomen.nii.gz"
    a, b = nib.load(str(from_series)), nib.load(str(from_nifti))
    np.testing.assert_allclose(a.affine, b.affine, atol=1e-4)
    labels_a, labels_b = np.asarray(a.dataobj), np.asarray(b.dataobj)
    assert {1, 2} <= set(np.unique(labels_b).tolist())  # the comparison is not one of two empty maps
    assert np.mean(labels_a == labels_b) >= 0.999


def test_infer_item_keeps_the_sorted_source_files(tmp_path):
    files = write_series(tmp_path / "s", _volume())
    (series,) = find_series(tmp_path / "s")
    item = btcv._case(series, tmp_path / "out")
    assert item["dicom_files"] == [str(f) for f in series.files] and sorted(item["dicom_files"]) == sorted(map(str, files))
    assert item["output"] == tmp_path / "out" / "P-01_20240102_3_CT-abdomen.nii.gz"


def test_a_dicom_file_named_img_is_its_series_not_a_nifti_pair(tmp_path):
    # NIfTI pairs' voxel files end in .img too; one given alone stands for its pair only where the
    # pair's .hdr is beside it
    files = write_series(tmp_path / "s", _volume())
    named = files[0].rename(files[0].with_suffix(".img"))
    (series,) = find_series(tmp_path / "s")
    item = btcv._case(named, tmp_path / "out")
    assert item["dicom_files"] == [str(f) for f in series.files] and str(named) in item["dicom_files"]


def test_cli_infer_refuses_two_series_then_segments_the_picked_one(tmp_path, capsys, tiny_btcv_checkpoint):
    from hsmla_med.cli import main
    from tests.conftest import cli_error

    first, second = generate_uid(), generate_uid()
    write_series(tmp_path / "s", _volume((40, 36, 6)), uid=first, number=2, description="arterial")
    write_series(tmp_path / "s", _volume((40, 36, 4)), uid=second, number=5, description="venous", seed=1)
    argv = ["infer", "--task", "btcv", "--checkpoint", tiny_btcv_checkpoint, "--input", str(tmp_path / "s"), "--output", str(tmp_path / "out")]
    line = cli_error(capsys, argv)
    assert f"2 DICOM series in one folder; pick one with --series-uid or series selection rules: {first} (number 2, 'arterial', 6 slice(s)); {second}" in line
    assert main([*argv, "--series-uid", second]) == 0
    written = nib.load(str(tmp_path / "out" / "P-01_20240102_5_venous.nii.gz"))
    assert written.shape == (40, 36, 4)
    np.testing.assert_allclose(written.affine, hand_affine(), atol=1e-4)


def test_synthetic_btcv_ships_its_first_test_case_as_a_dicom_series(tmp_path):
    """The synthetic dataset's DICOM case is its first test image, voxel for voxel on the same
    grid, listed as ``test_dicom`` and segmented by ``demo`` (:func:`btcv.held_out`)."""
    from hsmla_med.data.datalist import load_datalist
    from hsmla_med.data.synthetic.btcv import generate_btcv

    json_path = generate_btcv(tmp_path / "btcv", num_train=1, num_validation=1, num_test=1, shape=(24, 20, 10))
    (series,) = find_series(tmp_path / "btcv" / "imagesTs_dicom")
    assert series.folder == tmp_path / "btcv" / "imagesTs_dicom" / "img0003" and series.name == "SYN0003_20240101_1_synthetic-CT"
    array, affine = read_series(series)
    nifti = nib.load(str(tmp_path / "btcv" / "imagesTs" / "img0003.nii.gz"))
    assert np.array_equal(array, np.asarray(nifti.dataobj))
    np.testing.assert_allclose(affine, nifti.affine, atol=1e-4)
    cases = load_datalist(tmp_path / "btcv", json_path.name)
    assert btcv.held_out(cases)[-1] == str(series.folder)


def test_cli_infer_refuses_a_series_with_a_missing_slice_in_one_line(tmp_path, capsys, tiny_btcv_checkpoint):
    from tests.conftest import cli_error

    files = write_series(tmp_path / "in" / "s", _volume((40, 36, 6)))
    sorted(files, key=lambda f: float(pydicom.dcmread(f).ImagePositionPatient[2]))[2].unlink()
    line = cli_error(capsys, ["infer", "--task", "btcv", "--checkpoint", tiny_btcv_checkpoint, "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out")])
    assert f"{tmp_path / 'in' / 's'}: series " in line and "1 missing slice(s) between" in line


def test_rescale_slope_of_each_slice_is_applied(tmp_path):
    """A slice whose rescale slope differs from the first slice's (0.5: half-HU values): its
    values are stored * slope + intercept, not truncated to the first slice's integer type."""
    volume = _volume((12, 10, 4))
    write_series(tmp_path / "s", volume)
    (series,) = find_series(tmp_path / "s")
    ds = pydicom.dcmread(series.files[-1])
    ds.RescaleSlope = 0.5
    ds.PixelData = (2 * (volume[:, :, -1].T.astype(np.int32) + 1024) + 1).astype(np.uint16).tobytes()  # HU + 0.5
    ds.save_as(series.files[-1])
    expected = volume.astype(np.float64)
    expected[:, :, -1] += 0.5
    assert np.array_equal(read_series(series)[0], expected)


def test_loading_volumes_is_quiet_without_nvimagecodec(caplog, recwarn):
    """With pydicom installed MONAI builds its NvImgCodecPydicomReader in every LoadImaged, which
    logs and warns where nvImageCodec (a GPU JPEG decoder) is missing: LoadCased stays quiet."""
    from hsmla_med.data.checks import LoadCased

    with caplog.at_level(logging.DEBUG):
        LoadCased(["image"], ensure_channel_first=True, image_only=True)
    assert "nvImageCodec" not in caplog.text and not [w for w in recwarn if "NvImgCodec" in str(w.message)]


def test_orientation_that_is_no_rotation_is_refused(tmp_path):
    write_series(tmp_path / "s", _volume((12, 10, 3)), ((1.0, 0.0, 0.0), (0.6, 0.8, 0.0)))  # unit vectors 53 degrees apart
    with pytest.raises(DataError, match=r"ImageOrientationPatient \[1\.0, 0\.0, 0\.0, 0\.6, 0\.8, 0\.0\] is not two orthogonal unit vectors"):
        find_series(tmp_path / "s")
