"""The volume formats' registry (hsmla_med.io.volumes): a label map written for
an input of each format, in that input's geometry, reads back with the same values on the same
grid; the registry chooses each format by its file ending (the longest first) or a DICOM series
folder; one rule names every prediction; a name it does not know is read as NIfTI and refused
with nibabel's reason, as before."""

from __future__ import annotations

import re
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from hsmla_med.data.datalist import read_header
from hsmla_med.errors import DataError
from hsmla_med.evaluation import read_labels
from hsmla_med.io.volumes import (DICOM_SEG, DICOM_SERIES, METAIMAGE, NIFTI, NIFTI_PAIR, NRRD, VOLUME_FILE, case_name, file_ending, file_format,
                                  file_stem, label_suffix, prediction_path, volume_format, write_labels)
from tests.test_dicom_seg import MODEL, NAMES, itk_series, known_labels, write_series
from tests.test_itk_formats import OBLIQUE, write_itk_file

SHAPE = (11, 9, 6)


def _labels() -> np.ndarray:
    return known_labels(SHAPE)


def _reference(tmp_path: Path, kind: str) -> Path:
    """An int16 image of ``SHAPE`` on the oblique grid, in the format of ending ``kind``."""
    image = (np.arange(np.prod(SHAPE)).reshape(SHAPE) % 300).astype(np.int16)
    path = tmp_path / "ref" / f"case_0000{kind}"
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind in (".nii.gz", ".nii"):
        nib.save(nib.Nifti1Image(image, OBLIQUE), str(path))
    elif kind == ".hdr":
        nib.save(nib.Nifti1Pair(image, OBLIQUE), str(path))
    else:
        write_itk_file(path, image, OBLIQUE)
    return path


@pytest.mark.parametrize("kind, written", [(".nii.gz", ".nii.gz"), (".nii", ".nii.gz"), (".hdr", ".nii.gz"), (".mha", ".mha"), (".mhd", ".mha"),
                                           (".nrrd", ".nrrd"), (".nhdr", ".nrrd")])
def test_a_label_map_round_trips_in_the_geometry_of_each_format(tmp_path, kind, written):
    """Written where the naming rule puts it, in the format it names, on the reference's grid:
    read back (by the format its ending chooses) with the same values and the reference's affine."""
    reference = _reference(tmp_path, kind)
    labels = _labels()
    out = write_labels(prediction_path(tmp_path / "out", reference), labels, reference)
    assert out == tmp_path / "out" / f"case{written}"
    back, affine = volume_format(out).read(out)
    np.testing.assert_array_equal(back, labels)
    assert back.dtype == np.uint8
    np.testing.assert_allclose(affine, read_header(reference)[1], atol=1e-6)
    np.testing.assert_allclose(read_header(out)[1], read_header(reference)[1], atol=1e-6)
    np.testing.assert_array_equal(read_labels(out), labels)


def test_nifti_keeps_the_reference_header_forms_and_writes_float_maps(tmp_path):
    """A NIfTI reference's qform and sform codes are copied as they are (a code 0 stays
    undeclared); a float map is written on the same grid as 16-bit integers with a scale."""
    img = nib.Nifti1Image(np.zeros(SHAPE, np.int16), OBLIQUE)
    img.set_qform(OBLIQUE, code=0)
    img.set_sform(OBLIQUE, code=2)
    reference = tmp_path / "ref.nii.gz"
    nib.save(img, str(reference))
    written = nib.load(str(write_labels(tmp_path / "labels.nii.gz", _labels(), reference)))
    assert (int(written.header["qform_code"]), int(written.header["sform_code"])) == (0, 2)
    data = np.random.default_rng(0).random(SHAPE).astype(np.float32)
    mapped = nib.load(str(NIFTI.write_map(tmp_path / "map.nii.gz", data, reference)))
    assert mapped.get_data_dtype() == np.uint16
    np.testing.assert_allclose(mapped.get_fdata(), data, atol=2e-5)
    np.testing.assert_allclose(mapped.affine, OBLIQUE, atol=1e-6)


def test_a_dicom_series_folder_is_read_and_its_prediction_is_nifti_on_its_grid(tmp_path):
    """A folder is a DICOM series: read as SimpleITK reads it, its prediction ``.nii.gz`` on that
    grid (the affine of its reading: no NIfTI header to copy), the float map likewise."""
    truth = _labels()
    write_series(tmp_path / "series", truth * 10)
    _, volume, _ = itk_series(tmp_path / "series")
    assert volume_format(tmp_path / "series") is DICOM_SERIES
    voxels, affine = DICOM_SERIES.read(tmp_path / "series")
    np.testing.assert_array_equal(voxels, volume)
    shape, header_affine = DICOM_SERIES.header(tmp_path / "series")  # from two files' headers, no voxel read
    assert shape == SHAPE
    np.testing.assert_allclose(header_affine, affine, atol=1e-6)
    out = write_labels(prediction_path(tmp_path / "out", tmp_path / "series"), truth, tmp_path / "series")
    assert out == tmp_path / "out" / "series.nii.gz"
    back, back_affine = volume_format(out).read(out)
    np.testing.assert_array_equal(back, truth)
    np.testing.assert_allclose(back_affine, affine, atol=1e-6)
    np.testing.assert_allclose(nib.load(str(NIFTI.write_map(tmp_path / "map.nii.gz", truth / 5.0, affine))).affine, affine, atol=1e-6)


def test_a_dicom_seg_round_trips_on_its_series(tmp_path):
    """A SEG written for a series (named ``<case>.seg.dcm``) reads back onto the series' files
    with the same labels, on the series' grid."""
    truth = _labels()
    write_series(tmp_path / "series", truth * 10)
    files, _, _ = itk_series(tmp_path / "series")
    out = DICOM_SEG.write_labels(prediction_path(tmp_path / "out", tmp_path / "series", "P001_case", DICOM_SEG), truth, files, NAMES, MODEL)
    assert out == tmp_path / "out" / "P001_case.seg.dcm"
    assert file_format(out, seg=True) is DICOM_SEG
    labels, affine = DICOM_SEG.read(out, files, NAMES)
    np.testing.assert_array_equal(labels, truth)
    shape, series_affine = DICOM_SERIES.header(tmp_path / "series")
    assert DICOM_SEG.grid(files)[0] == shape == SHAPE
    np.testing.assert_allclose(affine, series_affine, atol=1e-6)


@pytest.mark.parametrize("name, seg, expected, ending", [
    ("a.nii.gz", False, NIFTI, ".nii.gz"), ("a.nii", False, NIFTI, ".nii"), ("a.hdr", False, NIFTI_PAIR, ".hdr"),
    ("a.mha", False, METAIMAGE, ".mha"), ("a.mhd", False, METAIMAGE, ".mhd"), ("a.nrrd", False, NRRD, ".nrrd"), ("a.nhdr", False, NRRD, ".nhdr"),
    ("a.seg.dcm", True, DICOM_SEG, ".seg.dcm"), ("a.dcm", True, DICOM_SEG, ".dcm"), ("A.SEG.DCM", True, DICOM_SEG, ".SEG.DCM"),
    ("a.seg.dcm", False, None, ""), ("a.dcm", False, None, ""),  # among volume files, a DICOM file is none
    ("a.gz", False, None, ""), ("a.img", False, None, ""), ("a.raw", False, None, ""), ("a.NII.GZ", False, None, ""), ("a.txt", True, None, ""),
])
def test_the_registry_chooses_by_the_longest_ending(name, seg, expected, ending):
    assert file_format(name, seg) is expected
    assert file_ending(name, seg) == ending
    assert file_stem(name, seg) == (name[: -len(ending)] if ending else name)
    assert bool(VOLUME_FILE.search(name)) == (expected is not None and expected.volume_file)


def test_the_volume_file_pattern_is_the_one_it_replaced():
    """VOLUME_FILE, built from the registry, matches as the pattern written out before did."""
    old = re.compile(r"\.(nii(\.gz)?|hdr|mha|mhd|nrrd|nhdr)$")
    for name in ["a.nii.gz", "a.nii", "a.hdr", "a.img", "a.mha", "a.mhd", "a.raw", "a.nrrd", "a.nhdr", "a.gz", "a.nii.nii.gz", "a.seg.dcm",
                 ".nii.gz", "nii.gz", "a.NII", "a.mha.gz"]:
        found, expected = VOLUME_FILE.search(name), old.search(name)
        assert (found and found.group(0)) == (expected and expected.group(0)), name
        assert VOLUME_FILE.sub("", name) == old.sub("", name)


def test_a_detached_metaimage_header_is_the_volume_and_its_voxel_file_is_none(tmp_path):
    reference = _reference(tmp_path, ".mhd")
    raw = tmp_path / "ref" / "case_0000.raw"
    assert raw.is_file()
    assert volume_format(reference) is METAIMAGE and file_format(raw) is None
    assert label_suffix(reference) == ".mha"
    shape, affine = METAIMAGE.header(reference)
    assert shape == SHAPE and np.allclose(affine, OBLIQUE, atol=1e-5)


def test_the_naming_rule_on_each_kind_of_source(tmp_path):
    out = tmp_path / "out"
    (tmp_path / "series.1.2.840").mkdir()
    assert prediction_path(out, tmp_path / "img0001.nii.gz") == out / "img0001.nii.gz"
    assert prediction_path(out, "img0001.nii") == out / "img0001.nii.gz"
    assert prediction_path(out, "scan.hdr") == out / "scan.nii.gz"  # a NIfTI pair's prediction: one file
    assert prediction_path(out, "case_0000.mhd") == out / "case.mha"
    assert prediction_path(out, "case.mha") == out / "case.mha"
    assert prediction_path(out, "case.nhdr") == out / "case.nrrd"
    assert prediction_path(out, str(tmp_path / "case_0000.nrrd")) == out / "case.nrrd"
    assert prediction_path(out, [tmp_path / "brain_0000.nii.gz", tmp_path / "brain_0001.nii.gz"]) == out / "brain.nii.gz"
    # a DICOM series: by its folder, or by the series' name; a SEG of it
    assert prediction_path(out, tmp_path / "series.1.2.840") == out / "series.1.2.840.nii.gz"
    assert prediction_path(out, tmp_path / "series.1.2.840", "P001_20260101_3_CT") == out / "P001_20260101_3_CT.nii.gz"
    assert prediction_path(out, tmp_path / "series.1.2.840", "P001_20260101_3_CT", DICOM_SEG) == out / "P001_20260101_3_CT.seg.dcm"
    assert prediction_path(out, "anything.txt") == out / "anything.txt.nii.gz"  # NIfTI for a name no format has
    assert case_name("case_0001.nii.gz") == "case" and case_name(["x_0000.mha", "x_0001.mha"]) == "x"


def test_an_unknown_ending_is_read_as_nifti_and_refused_as_before(tmp_path):
    """A name no format has is NIfTI's to read: nibabel refuses it, in the one line of before."""
    path = tmp_path / "scan.vol"
    path.write_bytes(b"not a volume")
    assert file_format(path) is None and volume_format(path) is NIFTI
    with pytest.raises(DataError, match=r"scan\.vol: cannot read as NIfTI \("):
        read_header(path)
    with pytest.raises(DataError, match=r"scan\.vol: cannot read as NIfTI \("):
        read_labels(path)
    with pytest.raises(DataError, match=r"missing\.nii\.gz: file not found"):
        read_header(tmp_path / "missing.nii.gz")
    with pytest.raises(DataError, match=r"missing\.mha: file not found"):
        read_header(tmp_path / "missing.mha")
    # among label maps a .dcm is a DICOM SEG; read alone, it has no grid: NIfTI's refusal, as before
    (tmp_path / "slice.dcm").write_bytes(b"")
    with pytest.raises(DataError, match=r"slice\.dcm: cannot read as NIfTI \("):
        read_header(tmp_path / "slice.dcm")
