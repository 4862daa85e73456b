"""nnU-Net v2's ``dataset.json`` read in full: several input channels (``CASE_0000``,
``CASE_0001``, ...), an ``ignore`` label, region labels with ``regions_class_order``."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from conftest import cli_error, phantom, tiny_yaml, write_nifti
from hsmla_med.data.datalist import load_datalist
from hsmla_med.errors import DataError

AFFINE = np.diag([1.5, 1.5, 2.0, 1.0])


def nnunet_dataset(root: Path, cases: int = 3, channels: int = 2, labels: dict | None = None, shape=(40, 36, 6), **meta) -> Path:
    """nnU-Net v2 layout: ``imagesTr/case_k_000C.nii.gz`` per channel (channel C: the phantom's
    image scaled by C + 1), ``labelsTr/case_k.nii.gz``, no lists in the JSON."""
    rng = np.random.default_rng(0)
    for k in range(cases):
        image, label = phantom(shape, rng)
        for c in range(channels):
            write_nifti(root / "imagesTr" / f"case{k}_{c:04d}.nii.gz", (image * (c + 1)).astype(np.int16), AFFINE)
        write_nifti(root / "labelsTr" / f"case{k}.nii.gz", label, AFFINE)
    names = {str(c): f"ch{c}" for c in range(channels)}
    (root / "dataset.json").write_text(json.dumps({"channel_names": names, "labels": labels or {"background": 0, "disc": 1, "bar": 2},
                                                   "numTraining": cases, "file_ending": ".nii.gz", **meta}))
    return root


def test_channels_group_into_cases(tmp_path):
    cases = load_datalist(nnunet_dataset(tmp_path / "data"))
    assert cases.channels == 2
    assert [[Path(f).name for f in c["image"]] for c in cases.training] == [[f"case{k}_0000.nii.gz", f"case{k}_0001.nii.gz"] for k in range(3)]
    assert [Path(c["label"]).name for c in cases.training] == ["case0.nii.gz", "case1.nii.gz", "case2.nii.gz"]


def test_missing_or_odd_channel_file_refused(tmp_path):
    data = nnunet_dataset(tmp_path / "data")
    (data / "imagesTr" / "case1_0001.nii.gz").unlink()
    with pytest.raises(DataError, match=r"case1: the case has channel files case1_0000\.nii\.gz; the dataset has 2 channels"):
        load_datalist(data)
    write_nifti(data / "imagesTr" / "case1_0001.nii.gz", np.zeros((40, 36, 5), np.int16), AFFINE)
    with pytest.raises(DataError, match=r"case1_0001\.nii\.gz: channel file of shape \(40, 36, 5\), the case's first channel case1_0000\.nii\.gz has \(40, 36, 6\)"):
        load_datalist(data)
    write_nifti(data / "imagesTr" / "case1_0001.nii.gz", np.zeros((40, 36, 6), np.int16), np.diag([1.0, 1.5, 2.0, 1.0]))
    with pytest.raises(DataError, match=r"case1_0001\.nii\.gz: channel file affine .* differs from the case's first channel"):
        load_datalist(data)


def test_msd_list_entries_are_multichannel_cases(tmp_path):
    """MSD's lists: an entry's image as one file per modality."""
    data = nnunet_dataset(tmp_path / "data")
    entries = [{"image": [f"imagesTr/case{k}_0000.nii.gz", f"imagesTr/case{k}_0001.nii.gz"], "label": f"labelsTr/case{k}.nii.gz"} for k in range(3)]
    (data / "dataset.json").write_text(json.dumps({"modality": {"0": "T1", "1": "T2"}, "labels": {"0": "background", "1": "disc", "2": "bar"},
                                                   "training": entries}))
    cases = load_datalist(data)
    assert cases.channels == 2 and [len(c["image"]) for c in cases.training] == [2, 2, 2]
    entries[0]["image"] = entries[0]["image"][:1] * 3
    (data / "dataset.json").write_text(json.dumps({"modality": {"0": "T1", "1": "T2"}, "labels": {"0": "background", "1": "disc", "2": "bar"},
                                                   "training": entries}))
    with pytest.raises(DataError, match="lists 3 files, the dataset has 2 channel"):
        load_datalist(data)


def test_two_channels_train_and_infer(tmp_path, capsys):
    """A 2-channel dataset trains 2 steps; the checkpoint's network takes 2 channels, and infer
    groups an input folder's CASE_000K files into cases; a channel file of another shape is one line."""
    from hsmla_med.cli import main
    from hsmla_med.pipelines import get_task

    data = nnunet_dataset(tmp_path / "data")
    run = tmp_path / "run"
    assert main(["train", "--task", "btcv", "--data-dir", str(data), "--config", str(tiny_yaml(tmp_path / "tiny.yaml")),
                 "--max-steps", "2", "--output", str(run)]) == 0
    module, _ = get_task("btcv").load(run / "last.ckpt")
    assert module.config["in_channels"] == 2
    assert module(torch.zeros(1, 2, 32, 32)).shape == (1, 3, 32, 32)  # 2D by default: 2 channels in, 3 classes out
    out = tmp_path / "pred"
    assert main(["infer", "--task", "btcv", "--checkpoint", str(run / "last.ckpt"), "--input", str(data / "imagesTr"), "--output", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.nii.gz")) == ["case0.nii.gz", "case1.nii.gz", "case2.nii.gz"]
    written = nib.load(str(out / "case1.nii.gz"))
    assert written.shape == (40, 36, 6) and np.allclose(written.affine, AFFINE)
    write_nifti(data / "imagesTr" / "case2_0001.nii.gz", np.zeros((40, 36, 5), np.int16), AFFINE)
    line = cli_error(capsys, ["infer", "--task", "btcv", "--checkpoint", str(run / "last.ckpt"), "--input", str(data / "imagesTr"),
                              "--output", str(tmp_path / "pred2")])
    assert "case2_0001.nii.gz: channel file of shape (40, 36, 5)" in line
