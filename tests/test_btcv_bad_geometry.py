"""NIfTI headers that place no voxels (NaN affine, zero spacing, parallel axes) and BTCV config
values that cannot train (reversed CT window, tiny windows), refused in one line naming the
file or the option, at infer, train and evaluate."""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pytest
import yaml

from hsmla_med.data.datalist import load_datalist
from hsmla_med.errors import DataError
from tests.conftest import cli_error, make_dataset, tiny_config, tiny_yaml
from tests.test_export import checkpoint


def _broken(kind: str):
    """Edit a header in place (nibabel would rebuild the forms from a given affine)."""
    def nan_sform(h):
        row = h["srow_x"].copy()
        row[0] = np.nan
        h["srow_x"], h["qform_code"], h["sform_code"] = row, 0, 1

    def zero_sform(h):
        row = h["srow_y"].copy()
        row[1] = 0.0
        h["srow_y"], h["qform_code"], h["sform_code"] = row, 0, 1

    def nan_qform(h):
        h["quatern_b"], h["qform_code"], h["sform_code"] = np.nan, 1, 0

    def parallel_sform(h):  # two voxel axes along world x: no volume
        h["srow_x"], h["srow_y"] = np.array([1.5, 1.5, 0, 0], np.float32), np.zeros(4, np.float32)
        h["qform_code"], h["sform_code"] = 0, 1

    return {"nan": nan_sform, "zero": zero_sform, "nan-qform": nan_qform, "parallel": parallel_sform}[kind]


def _rewrite(path, kind: str) -> None:
    img = nib.load(str(path))
    header = img.header.copy()
    _broken(kind)(header)
    nib.save(nib.Nifti1Image(np.asarray(img.dataobj), None, header=header), str(path))


GEOMETRY = {"nan": "NaN or infinite", "zero": "zero voxel spacing along axis 1", "nan-qform": "NaN or infinite", "parallel": "singular"}


@pytest.mark.parametrize("kind", list(GEOMETRY))
def test_infer_refuses_an_affine_that_places_no_voxel(capsys, tmp_path, kind):
    data = make_dataset(tmp_path / "data", cases=2)
    source = data / "imagesTr" / "img0001.nii.gz"
    _rewrite(source, kind)
    path, _ = checkpoint(tmp_path / "btcv.ckpt", "btcv", tiny_config(data, tmp_path / "run"), ["background", "disc", "bar"])
    line = cli_error(capsys, ["infer", "--task", "btcv", "--checkpoint", str(path), "--input", str(source),
                              "--output", str(tmp_path / "pred"), "--device", "cpu"])
    assert "img0001.nii.gz" in line and GEOMETRY[kind] in line, line
    assert not list((tmp_path / "pred").glob("*.nii.gz"))


@pytest.mark.parametrize("kind", ["zero", "nan"])
@pytest.mark.parametrize("which", ["image", "label"])
def test_training_data_with_a_zero_spacing_is_refused(dataset, kind, which):
    meta = json.loads((dataset / "dataset.json").read_text())
    _rewrite(dataset / meta["training"][0][which], kind)
    with pytest.raises(DataError, match=rf"{meta['training'][0][which].split('/')[-1]}: .*{GEOMETRY[kind]}"):
        load_datalist(dataset)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"intensity": {"kind": "ct_window", "a_min": 250.0, "a_max": -175.0}}, "data.intensity.a_min and a_max"),
        ({"intensity": {"kind": "ct_window", "a_min": 100.0, "a_max": 100.0}}, "data.intensity.a_min and a_max"),
        ({"roi_size_2d": [4, 4]}, "data.roi_size_2d"),
        ({"roi_size_2d": [64, 8]}, "data.roi_size_2d"),
    ],
)
def test_train_refuses_a_reversed_window_and_tiny_windows_at_config_time(capsys, tmp_path, dataset, data, message):
    config = yaml.safe_load(tiny_yaml(tmp_path / "tiny.yaml").read_text())
    config["data"].update(data)
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config))
    line = cli_error(capsys, ["train", "--task", "btcv", "--data-dir", str(dataset), "--config", str(tmp_path / "bad.yaml"),
                              "--output", str(tmp_path / "run")])
    assert message in line, line
    assert not (tmp_path / "run" / "last.ckpt").exists()


def test_tiny_3d_window_is_refused(capsys, tmp_path, dataset):
    config = yaml.safe_load(tiny_yaml(tmp_path / "tiny.yaml").read_text())
    config["data"]["roi_size_3d"] = [32, 32, 2]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config))
    line = cli_error(capsys, ["train", "--task", "btcv", "--mode", "3d", "--data-dir", str(dataset), "--config", str(tmp_path / "bad.yaml"),
                              "--output", str(tmp_path / "run")])
    assert "data.roi_size_3d" in line, line


def test_evaluate_refuses_labels_larger_than_their_images(capsys, tmp_path):
    data = make_dataset(tmp_path / "data", cases=3)
    label = data / "labelsTr" / "label0000.nii.gz"  # the validation case
    img = nib.load(str(label))
    larger = np.zeros((44, 40, 8), np.uint8)
    larger[:40, :36, :6] = np.asarray(img.dataobj)
    nib.save(nib.Nifti1Image(larger, img.affine), str(label))
    path, _ = checkpoint(tmp_path / "btcv.ckpt", "btcv", tiny_config(data, tmp_path / "run"), ["background", "disc", "bar"])
    line = cli_error(capsys, ["evaluate", "--task", "btcv", "--checkpoint", str(path), "--data-dir", str(data),
                              "--output", str(tmp_path / "ev")])
    assert "label0000.nii.gz" in line and "does not match image shape" in line, line
    assert not (tmp_path / "ev" / "metrics.json").exists()
