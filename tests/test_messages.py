"""What the commands print: per-case lines that say what they are (input, size, output), each
flushed as it is printed (so that ``| tee`` keeps the order of stdout and stderr), and no
warning that our own code causes."""

from __future__ import annotations

import io
import sys
import warnings

import nibabel as nib
import numpy as np
import torch

from hsmla_med.cli import main
from hsmla_med.data.intensity import otsu_foreground
from tests.conftest import phantom, write_nifti


def test_otsu_foreground_of_a_volume_three_voxels_deep_is_no_rgb_image():
    """A volume whose last axis is 3 voxels long (a thin slab) is no RGB image: no warning, and
    the mask is the one of the same voxels in another axis order (Otsu sees only the values)."""
    rng = np.random.default_rng(0)
    volume = rng.normal(10.0, 2.0, (1, 24, 20, 3)).astype(np.float32)
    volume[0, 6:18, 5:15] += 100.0  # a bright box over the whole slab
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mask = otsu_foreground(torch.from_numpy(volume))
    assert [str(w.message) for w in caught] == []
    reference = otsu_foreground(torch.from_numpy(np.ascontiguousarray(volume.transpose(0, 3, 1, 2))))
    np.testing.assert_array_equal(mask.numpy(), reference.numpy().transpose(0, 2, 3, 1))
    box = torch.zeros_like(mask)
    box[0, 6:18, 5:15] = True
    assert mask[box].all() and mask[~box].float().mean() < 0.01  # the box, and at most the noise's top


class _Chunks(io.RawIOBase):
    """What a pipe receives: one chunk per flush of the stream above it."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.chunks.append(bytes(data))
        return len(data)


def test_infer_prints_each_case_labelled_and_flushed(tiny_btcv_checkpoint, tmp_path, monkeypatch):
    """``infer`` into a pipe: each volume's line names the input, its size in voxels and the file
    written, and reaches the pipe by itself (block-buffered, it would come with the rest at exit,
    after the log lines written to stderr meanwhile)."""
    image, _ = phantom((40, 36, 6), np.random.default_rng(1))
    source = write_nifti(tmp_path / "in" / "case7.nii.gz", image, np.diag([1.5, 1.5, 2.0, 1.0]))
    pipe = _Chunks()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BufferedWriter(pipe), encoding="utf-8"))
    out = tmp_path / "out"
    assert main(["infer", "--task", "btcv", "--checkpoint", tiny_btcv_checkpoint, "--input", str(source), "--output", str(out)]) == 0
    sys.stdout.flush()
    written = out / "case7.nii.gz"
    assert nib.load(str(written)).shape == image.shape
    assert f"case7.nii.gz: {'x'.join(map(str, image.shape))} voxels -> {written}\n".encode() in pipe.chunks


def test_our_warnings_print_as_one_line_others_as_python_prints_them(capsys, monkeypatch, tmp_path):
    """A warning of hsmla-med's own code about the user's data (here tissue_mask's, as a blank
    slide gives it) is one ``hsmla-med: warning:`` line, without Python's file, line number and
    source line; another library's goes to Python's ``showwarning`` as before, and under
    ``--debug`` ours does too."""
    from hsmla_med.cli import evaluate
    from hsmla_med.data import slides

    def command(args, invocation):
        warnings.warn_explicit("blank.tif: blank slide (uniform colour), no tissue found", UserWarning, slides.__file__, 228)
        warnings.warn_explicit("a library's own warning", UserWarning, np.__file__, 1)
        return 0

    shown = []  # what Python's showwarning (here a recorder standing in for it) is given
    record = lambda message, category, filename, lineno, file=None, line=None: shown.append((str(message), filename))  # noqa: E731
    monkeypatch.setattr(warnings, "showwarning", record)
    monkeypatch.setattr(evaluate, "run", command)
    argv = ["evaluate", "--task", "btcv", "--predictions", str(tmp_path), "--labels", str(tmp_path)]
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert main(argv) == 0
        err = capsys.readouterr().err.splitlines()
        assert err == ["hsmla-med: warning: blank.tif: blank slide (uniform colour), no tissue found"]
        assert shown == [("a library's own warning", np.__file__)]
        assert main(["--debug", *argv]) == 0
        assert capsys.readouterr().err == ""
        assert [m for m, _ in shown[1:]] == ["blank.tif: blank slide (uniform colour), no tissue found", "a library's own warning"]
    assert warnings.showwarning is record  # restored when the command ends
