"""Real NIfTI files that ship inside nibabel's wheel (its own test data, written by other tools)
through ``hsmla-med infer``: big-endian int16 (``anatomical.nii``, LAS, q/sform code 2), an unset
qform with a set sform on a 4 x 5 x 7 uint8 volume (``standard.nii.gz``), and a 4D time series
(``example4d.nii.gz``) and SPM2's Analyze header (``analyze.hdr``), refused in one line. The label map keeps the input's grid and codes."""

from __future__ import annotations

import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from hsmla_med.cli import main

DATA = Path(nib.__file__).parent / "tests" / "data"


@pytest.mark.parametrize("name", ["anatomical.nii", "standard.nii.gz"])
def test_label_map_of_a_real_file_keeps_its_grid_and_codes(tiny_btcv_checkpoint, tmp_path, name):
    if not (DATA / name).is_file():
        pytest.skip(f"nibabel's test data lacks {name}")
    source = shutil.copy(DATA / name, tmp_path / name)
    out = tmp_path / "out"
    assert main(["infer", "--task", "btcv", "--checkpoint", tiny_btcv_checkpoint, "--input", str(source), "--output", str(out)]) == 0
    image = nib.load(str(source))
    label = nib.load(str(out / (name if name.endswith(".gz") else name + ".gz")))
    assert label.shape == image.shape
    np.testing.assert_allclose(label.affine, image.affine, atol=1e-4)
    for code in ("qform_code", "sform_code"):
        assert int(label.header[code]) == int(image.header[code])
    assert set(np.unique(np.asarray(label.dataobj))) <= {0, 1, 2}


def test_a_4d_series_is_refused_in_one_line(tiny_btcv_checkpoint, tmp_path, capsys):
    name = "example4d.nii.gz"
    if not (DATA / name).is_file():
        pytest.skip(f"nibabel's test data lacks {name}")
    source = shutil.copy(DATA / name, tmp_path / name)
    assert main(["infer", "--task", "btcv", "--checkpoint", tiny_btcv_checkpoint, "--input", str(source),
                 "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"hsmla-med: error: {source}: image has 2 channel(s), the model expects 1"


def test_a_real_analyze_header_is_refused_in_one_line(tiny_btcv_checkpoint, tmp_path, capsys):
    # SPM2's Analyze 7.5 header (the wheel ships it without its .img; the header alone decides):
    # nibabel reads it with a guessed left-right flip; before, the header went to the DICOM reader
    # and the error spoke of a missing DICM prefix
    if not (DATA / "analyze.hdr").is_file():
        pytest.skip("nibabel's test data lacks analyze.hdr")
    shutil.copy(DATA / "analyze.hdr", tmp_path / "analyze.hdr")
    assert main(["infer", "--task", "btcv", "--checkpoint", tiny_btcv_checkpoint, "--input", str(tmp_path),
                 "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"hsmla-med: error: {tmp_path / 'analyze.hdr'}: an Analyze 7.5 image, not NIfTI")
