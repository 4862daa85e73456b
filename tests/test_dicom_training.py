"""DICOM series as training and evaluation images (labels NIfTI or DICOM SEG), header-only
series geometry, and the rules that pick a series by its attributes (MONAI Deploy's format)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
import pytest
import torch

from hsmla_med.config import merge_config, task_config, validate_config
from hsmla_med.data.datalist import load_datalist, read_header
from hsmla_med.data.synthetic.dicom_series import write_ct_series
from hsmla_med.errors import ConfigError, DataError
from hsmla_med.io.dicom import SeriesRules, _pydicom_volume, _sitk_volume, find_series, read_series, select_series, series_geometry
from hsmla_med.io.dicom_seg import write_seg
from hsmla_med.pipelines import btcv
from tests.conftest import LABELS, TINY, cli_error, make_dataset, tiny_yaml

NAMES = [LABELS[str(i)] for i in range(len(LABELS))]


def _jittered_series(folder: Path) -> list[Path]:
    """A 10-slice series whose slice positions wander by up to 0.5% of the 2.5 mm step (within
    the regularity tolerance, as scanners write them)."""
    image = np.random.default_rng(0).integers(-100, 100, (20, 16, 10)).astype(np.int16)
    affine = np.diag([0.7, 0.8, 2.5, 1.0])
    affine[:3, 3] = [10.0, -20.0, 30.0]
    files = write_ct_series(folder, image, affine, np.random.default_rng(1), "P1")
    for k, f in enumerate(files):
        ds = pydicom.dcmread(f)
        position = [float(v) for v in ds.ImagePositionPatient]
        position[2] += [0, 0.01, -0.01, 0.012, 0, 0, 0.01, 0, -0.01, 0.011][k]
        ds.ImagePositionPatient = position
        ds.save_as(f)
    return files


def test_header_geometry_and_pydicom_decoding_land_on_simpleitks_grid_of_a_jittered_series(tmp_path):
    """ITK places the slices at the mean step from the first to the last: the header-only
    geometry and the pydicom fallback must use the same grid (the fallback used the first
    step, 2.51 mm here against ITK's 2.5012)."""
    files = _jittered_series(tmp_path / "s")
    (series,) = find_series(tmp_path / "s")
    volume, affine = _sitk_volume(series.files)
    shape, header_affine = series_geometry(series)
    assert shape == volume.shape
    np.testing.assert_allclose(header_affine, affine, atol=1e-5)
    fallback_volume, fallback_affine = _pydicom_volume(series.files)
    np.testing.assert_allclose(fallback_affine, affine, atol=1e-5)
    np.testing.assert_array_equal(fallback_volume, volume)
    assert len(files) == 10


def _dicom_twin(nifti: Path, twin: Path, seg_label: bool) -> Path:
    """``twin``: the dataset ``nifti`` with every image a DICOM series folder
    (``imagesTr/imgNNNN/``) and the validation case's label a DICOM SEG (with ``seg_label``)."""
    meta = json.loads((nifti / "dataset.json").read_text())
    shutil.copytree(nifti / "labelsTr", twin / "labelsTr")
    for i, entry in enumerate(meta["validation"] + meta["training"]):
        img = nib.load(str(nifti / entry["image"]))
        folder = entry["image"].removesuffix(".nii.gz")
        files = write_ct_series(twin / folder, np.asarray(img.dataobj), img.affine, np.random.default_rng(i), f"P{i}")
        entry["image"] = folder
        if seg_label and i == 0:
            labels = np.asarray(nib.load(str(nifti / entry["label"])).dataobj).astype(np.uint8)
            entry["label"] = entry["label"].replace(".nii.gz", ".seg.dcm")
            write_seg(labels, sorted(files, key=lambda f: float(pydicom.dcmread(f).ImagePositionPatient[2])), NAMES, twin / entry["label"],
                      {"sha256": "0" * 64})
    (twin / "dataset.json").write_text(json.dumps(meta))
    return twin


def test_series_images_and_a_seg_label_preprocess_as_their_nifti_do(tmp_path):
    nifti = make_dataset(tmp_path / "nifti", cases=3)
    twin = _dicom_twin(nifti, tmp_path / "dicom", seg_label=True)
    cases, twin_cases = load_datalist(nifti), load_datalist(twin)
    assert Path(twin_cases.validation[0]["image"]).is_dir() and twin_cases.validation[0]["label"].endswith(".seg.dcm")
    assert read_header(twin_cases.validation[0]["image"])[0] == read_header(cases.validation[0]["image"])[0]
    config = merge_config(task_config("btcv"), TINY)
    _, val = btcv.transforms(config, 1, 3, NAMES)
    for case, twin_case in zip(cases.validation + cases.training, twin_cases.validation + twin_cases.training, strict=True):
        ours, theirs = val(dict(case)), val(dict(twin_case))
        torch.testing.assert_close(theirs["image"].as_tensor(), ours["image"].as_tensor())
        torch.testing.assert_close(theirs["label"].as_tensor(), ours["label"].as_tensor())


def test_train_and_evaluate_on_series_score_as_on_their_nifti(tmp_path, capsys):
    """A checkpoint trained on the DICOM twin scores its validation case (a series with a SEG
    label) exactly as it scores the NIfTI original, and writes the label map on the series' grid."""
    from hsmla_med.cli import main

    nifti = make_dataset(tmp_path / "nifti", cases=3)
    twin = _dicom_twin(nifti, tmp_path / "dicom", seg_label=True)
    tiny = str(tiny_yaml(tmp_path / "tiny.yaml"))
    assert main(["train", "--task", "btcv", "--data-dir", str(twin), "--config", tiny, "--max-steps", "2", "--output", str(tmp_path / "run")]) == 0
    checkpoint = str(tmp_path / "run" / "last.ckpt")
    for name, data in (("nifti", nifti), ("dicom", twin)):
        assert main(["evaluate", "--task", "btcv", "--data-dir", str(data), "--checkpoint", checkpoint, "--output", str(tmp_path / name)]) == 0
    summaries = [json.loads((tmp_path / name / "summary.json").read_text()) for name in ("nifti", "dicom")]
    for ours, theirs in zip(*(s["metric_per_case"] for s in summaries), strict=True):
        for c in ("1", "2"):
            assert theirs["metrics"][c]["Dice"] == pytest.approx(ours["metrics"][c]["Dice"], abs=1e-6, nan_ok=True)
            assert theirs["metrics"][c]["n_ref"] == ours["metrics"][c]["n_ref"]
    written = nib.load(str(tmp_path / "dicom" / "validation" / "img0000.nii.gz"))
    original = nib.load(str(tmp_path / "nifti" / "validation" / "img0000.nii.gz"))
    np.testing.assert_allclose(written.affine, original.affine, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(written.dataobj), np.asarray(original.dataobj))


def test_a_seg_label_of_another_series_is_refused_in_one_line(tmp_path):
    nifti = make_dataset(tmp_path / "nifti", cases=3)
    twin = _dicom_twin(nifti, tmp_path / "dicom", seg_label=True)
    meta = json.loads((twin / "dataset.json").read_text())
    meta["training"][0]["label"] = meta["validation"][0]["label"]  # the SEG of img0000 as img0001's label
    (twin / "dataset.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"label0000\.seg\.dcm: a DICOM SEG label of series .*, but its image .*img0001 is series "):
        load_datalist(twin)


def _study(folder: Path) -> dict[str, str]:
    """Three series in one folder, as a PACS exports a study: a localizer, an arterial and a
    venous CT; returns their UIDs by description."""
    image = np.zeros((8, 6, 3), np.int16)
    uids = {}
    for number, (description, image_type) in enumerate((("Scout", ["ORIGINAL", "PRIMARY", "LOCALIZER"]),
                                                        ("Abdomen arterial", ["ORIGINAL", "PRIMARY", "AXIAL"]),
                                                        ("Abdomen VENOUS 2.5mm", ["DERIVED", "SECONDARY", "AXIAL"])), start=1):
        files = write_ct_series(folder, image, np.diag([1.0, 1.0, 2.5, 1.0]), np.random.default_rng(number), "P", description, number)
        for f in files:
            ds = pydicom.dcmread(f)
            ds.ImageType = image_type
            ds.save_as(f)
        uids[description] = str(pydicom.dcmread(files[0]).SeriesInstanceUID)
    return uids


def test_rules_pick_a_series_by_regex_list_and_number_in_order_of_preference(tmp_path):
    uids = _study(tmp_path / "study")
    series = find_series(tmp_path / "study")
    deploy = {"selections": [{"name": "venous", "conditions": {"Modality": "(?i)^ct$", "SeriesDescription": "(?i)venous"}},
                             {"name": "any axial", "conditions": {"ImageType": ["original", "AXIAL"]}}]}
    assert [s.uid for s in select_series(series, tmp_path, rules=SeriesRules(deploy, "rules.json"))] == [uids["Abdomen VENOUS 2.5mm"]]
    # the first selection matches nothing: the second's series
    second = [{"conditions": {"SeriesDescription": "portal"}}, {"conditions": {"ImageType": ["ORIGINAL", "AXIAL"], "SeriesNumber": 2}}]
    assert [s.uid for s in select_series(series, tmp_path, rules=SeriesRules(second, "rules.yaml"))] == [uids["Abdomen arterial"]]
    with pytest.raises(DataError, match=r"the rules of r\.yaml match 2; pick one with --series-uid or series selection rules: "):
        select_series(series, tmp_path, rules=SeriesRules([{"conditions": {"SeriesDescription": "Abdomen"}}], "r.yaml"))
    with pytest.raises(DataError, match="no DICOM series matches the series selection rules of r.yaml; the series are: .*Scout"):
        select_series(series, tmp_path, rules=SeriesRules([{"conditions": {"Modality": "MR"}}], "r.yaml"))
    # --series-uid overrides the rules
    assert [s.uid for s in select_series(series, tmp_path, uids["Scout"], SeriesRules(deploy, "r"))] == [uids["Scout"]]


@pytest.mark.parametrize("rules, message", [
    ([], "a non-empty list of selections"),
    ([{"name": "x"}], "selection 1 needs 'conditions'"),
    ([{"conditions": {"SeriesDescriptin": "venous"}}], "'SeriesDescriptin' is not a DICOM attribute keyword"),
    ([{"conditions": {"SeriesDescription": "(venous"}}], "is not a regular expression"),
])
def test_malformed_rules_in_the_config_are_refused_naming_the_key(rules, message):
    config = merge_config(task_config("btcv"), {"inference": {"series_selection": rules}})
    with pytest.raises(ConfigError, match=rf"user.yaml: inference.series_selection: .*{message}"):
        validate_config(config, "user.yaml")


def test_cli_infer_picks_the_series_of_the_rules_file(tmp_path, capsys, tiny_btcv_checkpoint):
    from hsmla_med.cli import main

    uids = _study(tmp_path / "study")
    (tmp_path / "rules.json").write_text(json.dumps({"selections": [{"name": "venous", "conditions": {"SeriesDescription": "(?i)venous"}}]}))
    line = cli_error(capsys, ["infer", "--task", "btcv", "--checkpoint", tiny_btcv_checkpoint, "--input", str(tmp_path / "study"),
                              "--output", str(tmp_path / "out")])
    assert "3 DICOM series in one folder" in line and all(uid in line for uid in uids.values())
    assert main(["infer", "--task", "btcv", "--checkpoint", tiny_btcv_checkpoint, "--input", str(tmp_path / "study"),
                 "--series-rules", str(tmp_path / "rules.json"), "--output", str(tmp_path / "out")]) == 0
    written = sorted(p.name for p in (tmp_path / "out").glob("*.nii.gz"))
    assert written == ["P_20240101_3_Abdomen-VENOUS-2.5mm.nii.gz"]
    volume, affine = read_series(next(s for s in find_series(tmp_path / "study") if s.uid == uids["Abdomen VENOUS 2.5mm"]))
    assert nib.load(str(tmp_path / "out" / written[0])).shape == volume.shape


def test_cli_infer_on_a_lone_non_image_dicom_file_is_one_line(tmp_path, capsys, tiny_btcv_checkpoint):
    """A report (SR) given as --input is no slice of any series: one line, not a StopIteration traceback."""
    files = write_ct_series(tmp_path / "study", np.zeros((8, 6, 3), np.int16), np.eye(4), np.random.default_rng(0), "P")
    ds = pydicom.dcmread(files[0])
    ds.Modality = "SR"
    ds.save_as(tmp_path / "study" / "report.dcm")
    line = cli_error(capsys, ["infer", "--task", "btcv", "--checkpoint", tiny_btcv_checkpoint, "--input", str(tmp_path / "study" / "report.dcm"),
                              "--output", str(tmp_path / "out")])
    assert "report.dcm: not a slice of a DICOM image series" in line
