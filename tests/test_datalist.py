"""Dataset JSON reading: MSD lists, nnU-Net v2 folders, splits and every bad-input error."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hsmla_med.data.datalist import case_name, load_datalist
from hsmla_med.errors import DataError
from tests.conftest import LABELS, make_dataset, write_nifti


def test_msd_lists_and_label_names(dataset):
    cases = load_datalist(dataset)
    assert cases.label_names == ["background", "disc", "bar"]
    assert len(cases.training) == 3 and len(cases.validation) == 1
    assert cases.validation[0]["image"].endswith("img0000.nii.gz")
    assert all(c["image"].startswith(str(dataset)) for c in cases.training)


def test_nnunet_v2_folders(tmp_path):
    rng = np.random.default_rng(0)
    for i in range(5):
        write_nifti(tmp_path / "imagesTr" / f"case_{i:03d}_0000.nii.gz", rng.normal(size=(8, 8, 3)).astype(np.float32), np.eye(4))
        write_nifti(tmp_path / "labelsTr" / f"case_{i:03d}.nii.gz", np.zeros((8, 8, 3), np.uint8), np.eye(4))
    (tmp_path / "dataset.json").write_text(json.dumps({"labels": {"background": 0, "liver": 1}, "channel_names": {"0": "CT"}}))
    a = load_datalist(tmp_path)
    assert a.label_names == ["background", "liver"]
    assert len(a.training) == 5 and a.validation == []  # the folds come from splits_final.json (tests/test_splits.py)
    assert {case_name(c["image"]) for c in a.training + a.validation} == {f"case_{i:03d}" for i in range(5)}
    assert all(case_name(c["label"]) == case_name(c["image"]) for c in a.training)


def _edit_json(root, **changes):
    path = root / "dataset.json"
    meta = json.loads(path.read_text())
    meta.update(changes)
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"labels": {"0": "background", "2": "x"}}, "without gaps"),
        ({"training": []}, "no training cases"),
        ({"training": [{"image": "imagesTr/nope.nii.gz", "label": "labelsTr/label0001.nii.gz"}]}, "nope.nii.gz: image file"),
        ({"training": [{"image": "imagesTr/img0001.nii.gz"}]}, "needs image and label"),
    ],
)
def test_bad_dataset_json(dataset, change, message):
    _edit_json(dataset, **change)
    with pytest.raises(DataError, match=message):
        load_datalist(dataset)


def test_malformed_json_names_file(dataset):
    (dataset / "dataset.json").write_text('{"labels": {"0": "background",}')
    with pytest.raises(DataError, match=r"dataset\.json: malformed JSON"):
        load_datalist(dataset)


def test_missing_directory_and_json(tmp_path):
    with pytest.raises(DataError, match="data directory not found"):
        load_datalist(tmp_path / "absent")
    with pytest.raises(DataError, match="no dataset JSON"):
        load_datalist(tmp_path)


def test_shape_and_affine_mismatch_name_the_label(dataset):
    write_nifti(dataset / "labelsTr" / "label0002.nii.gz", np.zeros((40, 36, 5), np.uint8), np.diag([1.5, 1.5, 2.0, 1.0]))
    with pytest.raises(DataError, match=r"label0002\.nii\.gz: label shape"):
        load_datalist(dataset)
    write_nifti(dataset / "labelsTr" / "label0002.nii.gz", np.zeros((40, 36, 6), np.uint8), np.diag([1.5, 1.5, 3.0, 1.0]))
    with pytest.raises(DataError, match=r"label0002\.nii\.gz: label affine does not match"):
        load_datalist(dataset)


def test_unreadable_nifti(dataset):
    (dataset / "imagesTr" / "img0001.nii.gz").write_bytes(b"not a nifti file")
    with pytest.raises(DataError, match=r"img0001\.nii\.gz: cannot read as NIfTI"):
        load_datalist(dataset)


def test_labels_mapping_forms_agree(tmp_path):
    a = make_dataset(tmp_path / "a", cases=2)
    _edit_json(a, labels={name: int(value) for value, name in LABELS.items()})
    assert load_datalist(a).label_names == ["background", "disc", "bar"]
