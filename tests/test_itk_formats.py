"""MetaImage (.mha, .mhd) and NRRD (.nrrd, .nhdr) volumes, nnU-Net v2's other ``file_ending``s:
read on the grid a NIfTI file of the same voxels and affine gives (the LPS <-> RAS conversion
written out by hand here), trained on, predicted in their own format on their own grid, scored,
and refused with one line naming the file when broken."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import SimpleITK as sitk

from conftest import cli_error, phantom, tiny_yaml, write_nifti
from hsmla_med.data.checks import LoadCased
from hsmla_med.data.datalist import load_datalist, read_header
from hsmla_med.errors import DataError

ENDINGS = (".mha", ".mhd", ".nrrd", ".nhdr")
# oblique: a rotation about z and a flipped y, with an origin off zero (RAS, as nibabel keeps it)
_ANGLE = np.deg2rad(20.0)
OBLIQUE = np.array([[0.8 * np.cos(_ANGLE), 0.9 * np.sin(_ANGLE), 0.0, -12.5],
                    [0.8 * np.sin(_ANGLE), -0.9 * np.cos(_ANGLE), 0.0, 30.25],
                    [0.0, 0.0, 2.5, -7.0],
                    [0.0, 0.0, 0.0, 1.0]])
AFFINE = np.diag([1.5, 1.5, 2.0, 1.0])


def write_itk_file(path: Path, array: np.ndarray, affine: np.ndarray) -> Path:
    """``array`` (x, y, z) with the RAS ``affine`` as ITK stores it: LPS origin and direction
    (x and y negated), unit direction columns and the spacing apart; compressed where the format
    holds its voxels, a separate raw file for the detached headers."""
    lps = np.diag([-1.0, -1.0, 1.0]) @ affine[:3, :]
    spacing = np.linalg.norm(lps[:, :3], axis=0)
    image = sitk.GetImageFromArray(np.ascontiguousarray(array.transpose(2, 1, 0)))
    image.SetSpacing(spacing.tolist())
    image.SetDirection((lps[:, :3] / spacing).ravel().tolist())
    image.SetOrigin(lps[:, 3].tolist())
    path.parent.mkdir(parents=True, exist_ok=True)
    sitk.WriteImage(image, str(path), useCompression=path.suffix in (".mha", ".nrrd"))
    return path


@pytest.mark.parametrize("ending", ENDINGS)
def test_read_as_the_nifti_of_the_same_voxels(tmp_path, ending):
    """LoadCased (training's and infer's loader) gives an ITK file the voxels, affine and shape
    MONAI's NIfTI reader gives the NIfTI file of the same array and affine; read_header agrees."""
    rng = np.random.default_rng()
    array = rng.integers(-1000, 1000, (7, 6, 5)).astype(np.int16)
    nifti = write_nifti(tmp_path / "ref.nii.gz", array, OBLIQUE)
    itk = write_itk_file(tmp_path / f"vol{ending}", array, OBLIQUE)
    load = LoadCased(["image"], ensure_channel_first=True, image_only=True)
    expected, got = load({"image": str(nifti)})["image"], load({"image": str(itk)})["image"]
    assert got.shape == expected.shape == (1, 7, 6, 5)
    assert np.array_equal(got.numpy(), expected.numpy())
    assert np.allclose(got.affine.numpy(), expected.affine.numpy(), atol=1e-5)
    shape, affine = read_header(itk)
    assert shape == (7, 6, 5) and np.allclose(affine, OBLIQUE, atol=1e-5)


def _broken(tmp_path: Path, kind: str) -> Path:
    volume = np.zeros((6, 5, 4), np.int16)
    if kind == "truncated mha":
        path = tmp_path / "t.mha"
        sitk.WriteImage(sitk.GetImageFromArray(volume.transpose(2, 1, 0)), str(path), useCompression=False)
        path.write_bytes(path.read_bytes()[:-20])
        return path
    if kind == "missing raw":
        path = write_itk_file(tmp_path / "m.nhdr", volume, AFFINE)
        next(tmp_path.glob("m.raw*")).unlink()
        return path
    if kind == "2D":
        path = tmp_path / "flat.nrrd"
        sitk.WriteImage(sitk.GetImageFromArray(np.zeros((5, 4), np.uint8)), str(path))
        return path
    if kind == "vector":
        path = tmp_path / "rgb.mha"
        sitk.WriteImage(sitk.GetImageFromArray(np.zeros((4, 5, 6, 3), np.uint8), isVector=True), str(path))
        return path
    path = tmp_path / "junk.mha"
    path.write_text("not an image\n")
    return path


@pytest.mark.parametrize("kind, message", [
    ("truncated mha", r"t\.mha: 220 bytes of voxels after the header, the header t\.mha describes 240 \(6 x 5 x 4 MET_SHORT\)"),
    ("missing raw", r"m\.nhdr: cannot read as NRRD \(.*couldn't open"),
    ("2D", r"flat\.nrrd: a volume has three dimensions, this image has 2"),
    ("vector", r"rgb\.mha: 3 components per voxel; hsmla-med reads one channel per file"),
    ("junk", r"junk\.mha: not a MetaImage header \(no ElementDataFile\)"),
])
def test_broken_files_are_one_error_naming_them(tmp_path, kind, message):
    path = _broken(tmp_path, kind)
    with pytest.raises(DataError, match=message):
        read_header(path)
    with pytest.raises(DataError, match=message):
        LoadCased(["image"], ensure_channel_first=True)({"image": str(path)})


def itk_dataset(root: Path, ending: str, cases: int = 3, channels: int = 2) -> Path:
    """tests/test_nnunet_dataset.py's nnU-Net v2 dataset written in ``ending``."""
    rng = np.random.default_rng(0)
    for k in range(cases):
        image, label = phantom((40, 36, 6), rng)
        for c in range(channels):
            write_itk_file(root / "imagesTr" / f"case{k}_{c:04d}{ending}", (image * (c + 1)).astype(np.int16), AFFINE)
        write_itk_file(root / "labelsTr" / f"case{k}{ending}", label, AFFINE)
    (root / "dataset.json").write_text(json.dumps({"channel_names": {str(c): f"ch{c}" for c in range(channels)},
                                                   "labels": {"background": 0, "disc": 1, "bar": 2}, "numTraining": cases, "file_ending": ending}))
    return root


def test_file_ending_picks_the_files_and_the_fingerprint_is_the_niftis(tmp_path):
    """With file_ending ".mha" the cases are the .mha files only (a stray NIfTI beside them is not
    a case, as for nnU-Net), and the fingerprint equals that of the same dataset in NIfTI."""
    from hsmla_med.data.fingerprint import compute_fingerprint
    from tests.test_nnunet_dataset import nnunet_dataset

    data = itk_dataset(tmp_path / "mha", ".mha")
    write_nifti(data / "imagesTr" / "stray_0000.nii.gz", np.zeros((4, 4, 4), np.int16), AFFINE)
    cases = load_datalist(data)
    assert [[Path(f).name for f in c["image"]] for c in cases.training] == [[f"case{k}_0000.mha", f"case{k}_0001.mha"] for k in range(3)]
    assert [Path(c["label"]).name for c in cases.training] == ["case0.mha", "case1.mha", "case2.mha"]
    mha = compute_fingerprint(cases)
    nifti = compute_fingerprint(load_datalist(nnunet_dataset(tmp_path / "nii")))
    for key in ("foreground_intensity_properties_per_channel", "shapes_after_crop", "spacings", "median_relative_size_after_cropping"):
        assert mha[key] == nifti[key], key


@pytest.mark.parametrize("ending", [".png", ".tif", 5])
def test_a_file_ending_no_reader_takes_is_named(tmp_path, capsys, ending):
    """nnU-Net's 2D formats (and a malformed key) get one line naming the key and what to do."""
    from tests.test_nnunet_dataset import nnunet_dataset

    data = nnunet_dataset(tmp_path / "data", file_ending=ending)
    with pytest.raises(DataError, match=rf"dataset\.json: file_ending {ending!r}: hsmla-med reads volumes in NIfTI"):
        load_datalist(data)
    line = cli_error(capsys, ["train", "--task", "btcv", "--data-dir", str(data), "--output", str(tmp_path / "run")])
    assert "file_ending" in line and "convert the dataset to NIfTI" in line
    for nifti in (".nii", ".nii.gz"):  # NIfTI's endings name one format: .nii.gz files are read either way
        assert len(load_datalist(nnunet_dataset(tmp_path / nifti, file_ending=nifti)).training) == 3


@pytest.mark.parametrize("ending, written", [(".mha", ".mha"), (".nhdr", ".nrrd")])
def test_train_infer_and_evaluate_in_the_datasets_format(tmp_path, ending, written):
    """A 2-channel .mha (.nhdr) dataset trains 2 steps; infer writes each case's label map as
    .mha (.nrrd) on exactly its input's grid (ITK's origin, spacing and direction, not rounded
    through an affine); evaluate pairs them with labelsTr's files of the dataset's format."""
    from hsmla_med.cli import main
    from hsmla_med.evaluation import evaluate_folder

    data = itk_dataset(tmp_path / "data", ending)
    run = tmp_path / "run"
    assert main(["train", "--task", "btcv", "--data-dir", str(data), "--config", str(tiny_yaml(tmp_path / "tiny.yaml")),
                 "--max-steps", "2", "--output", str(run)]) == 0
    out = tmp_path / "pred"
    assert main(["infer", "--task", "btcv", "--checkpoint", str(run / "last.ckpt"), "--input", str(data / "imagesTr"),
                 "--output", str(out), "--uncertainty", "entropy"]) == 0
    assert sorted(p.name for p in out.glob(f"*{written}")) == [f"case{k}{written}" for k in range(3)]
    source = sitk.ReadImage(str(data / "imagesTr" / f"case1_0000{ending}"))
    labels = sitk.ReadImage(str(out / f"case1{written}"))
    assert labels.GetSize() == source.GetSize() and labels.GetPixelID() == sitk.sitkUInt8
    assert (labels.GetOrigin(), labels.GetSpacing(), labels.GetDirection()) == (source.GetOrigin(), source.GetSpacing(), source.GetDirection())
    uncertainty = nib.load(str(out / "uncertainty" / "case1_uncertainty.nii.gz"))  # NIfTI, on the same grid
    assert uncertainty.shape == (40, 36, 6) and np.allclose(uncertainty.affine, AFFINE)
    summary = evaluate_folder(out, data / "labelsTr", data / "dataset.json")
    assert set(summary["metric_per_case"][0]) >= {"reference_file", "prediction_file"}
    assert {Path(c["prediction_file"]).name for c in summary["metric_per_case"]} == {f"case{k}{written}" for k in range(3)}


def test_the_voxel_file_of_a_detached_header_stands_for_its_header(tmp_path, capsys):
    """infer --input CASE.raw: the .mhd beside it that names it is the case (as an .img is its
    NIfTI pair's); a .raw no header names is one error naming it."""
    from hsmla_med.cli import main

    data = itk_dataset(tmp_path / "data", ".mhd", channels=1)
    run = tmp_path / "run"
    assert main(["train", "--task", "btcv", "--data-dir", str(data), "--config", str(tiny_yaml(tmp_path / "tiny.yaml")),
                 "--max-steps", "2", "--output", str(run)]) == 0
    voxels = data / "imagesTr" / "case1_0000.raw"
    assert main(["infer", "--checkpoint", str(run / "last.ckpt"), "--input", str(voxels), "--output", str(tmp_path / "pred")]) == 0
    assert [p.name for p in (tmp_path / "pred").glob("*.mha")] == ["case1.mha"]
    (data / "imagesTr" / "case1_0000.mhd").unlink()
    line = cli_error(capsys, ["infer", "--checkpoint", str(run / "last.ckpt"), "--input", str(voxels), "--output", str(tmp_path / "pred2")])
    assert "case1_0000.raw: cannot read" in line


@pytest.mark.parametrize("ending, predicted, voxels", [(".nhdr", ".nrrd", ".raw"), (".hdr", ".nii.gz", ".img")])
def test_crossval_pools_detached_headers_with_their_voxels(tmp_path, ending, predicted, voxels):
    """cross-validate pools each fold's predictions and labels by link: a label in a detached
    format (an .nhdr's raw file, a NIfTI pair's .img) keeps its voxel file beside it, and the
    pooled folders score. (A NIfTI pair was pooled as a header named .nii.gz, without its .img.)"""
    from hsmla_med.evaluation import evaluate_folder
    from hsmla_med.pipelines import btcv

    data = itk_dataset(tmp_path / "data", ending, cases=2, channels=1)
    folder = tmp_path / "fold_0" / "validation"
    cases = load_datalist(data)
    cases.validation, cases.training = cases.training, []
    folder.mkdir(parents=True)
    for case in cases.validation:  # the fold's predictions, as validation names them: the labels themselves
        sitk.WriteImage(sitk.ReadImage(case["label"]), str(folder / f"{Path(case['label']).stem}{predicted}"))
    pooled = tmp_path / "pooled"
    btcv.crossval_score([(cases, folder)], pooled, {"inference": {}})
    assert sorted(p.name for p in (pooled / "labels").iterdir()) == [f"case{k}{suffix}" for k in range(2) for suffix in sorted((ending, voxels))]
    summary = evaluate_folder(pooled / "predictions", pooled / "labels", data / "dataset.json")
    assert len(summary["metric_per_case"]) == 2 and summary["foreground_mean"]["Dice"] == 1.0


def test_metaimage_header_size_and_slice_lists_are_not_refused(tmp_path):
    """A voxel file with a header of its own (``HeaderSize``) is not a size mismatch, and a
    per-slice file list is left to SimpleITK: neither is refused by the size check."""
    from hsmla_med.io.itk import check_metaimage

    volume = np.arange(120, dtype=np.int16).reshape(4, 5, 6)
    path = write_itk_file(tmp_path / "h.mhd", volume, AFFINE)
    raw = tmp_path / "h.raw"
    raw.write_bytes(b"\0" * 16 + raw.read_bytes())
    path.write_text(path.read_text().replace("ElementDataFile", "HeaderSize = 16\nElementDataFile"))
    check_metaimage(path)
    assert np.array_equal(read_header(path)[0], (4, 5, 6))
    from hsmla_med.io.itk import read_itk

    assert np.array_equal(read_itk(path)[0], volume)
    raw.write_bytes(raw.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"h\.raw: 238 bytes, the header h\.mhd describes 240"):
        check_metaimage(path)
    path.write_text(path.read_text().replace("ElementDataFile = h.raw", "ElementDataFile = LIST\nslice0.raw"))
    check_metaimage(path)  # (what SimpleITK makes of it is its own message)
