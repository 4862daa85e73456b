"""``hsmla-med bench --only volume``'s DICOM row at a small size: the same CT as NIfTI
and as a DICOM series segmented into a DICOM SEG, both tables written. The
timings are recorded in docs/benchmarks.md, never asserted."""

import csv
import functools

import pytest

from hsmla_med.bench import main as bench_main
from hsmla_med.bench import volume

SHAPE = (64, 48, 20)  # not square: a SEG read back with rows and columns swapped could not match


def test_volume_dicom_row_at_a_small_size(monkeypatch, tmp_path, capsys):
    """``--only volume`` writes volume.csv and volume_dicom.csv; the series row names its 20 files,
    its ratios are its time and peak over the NIfTI run's, and the SEG read back onto the series
    gives the NIfTI labels in at least 99.9 % of the voxels."""
    monkeypatch.setattr(volume, "bench_volume", functools.partial(volume.bench_volume, shape=SHAPE, modes=("per-class",)))
    # in this process: a fresh one (the benchmark's) spends ~13 s importing torch and MONAI
    monkeypatch.setattr(volume, "_run", lambda source, out, mode: volume._measure(str(source), str(out), mode))
    assert bench_main.main(["--only", "volume", "--out", str(tmp_path), "--threads", "1"]) == 0
    with (tmp_path / "volume.csv").open() as f:
        assert [row["mode"] for row in csv.DictReader(f)] == ["per-class"]
    with (tmp_path / "volume_dicom.csv").open() as f:
        nifti, series = csv.DictReader(f)
    assert (nifti["input"], nifti["output"]) == ("NIfTI (1 file)", "NIfTI")
    assert (series["input"], series["output"]) == (f"DICOM series ({SHAPE[2]} files)", "DICOM SEG")
    for row in (nifti, series):
        assert float(row["seconds"]) > 0 and float(row["peak_gib"]) > 0
    assert float(series["seconds_ratio"]) == pytest.approx(float(series["seconds"]) / float(nifti["seconds"]))
    assert float(series["peak_ratio"]) == pytest.approx(float(series["peak_gib"]) / float(nifti["peak_gib"]))
    assert int(series["voxels_differing"]) <= 0.001 * SHAPE[0] * SHAPE[1] * SHAPE[2]
    assert float(series["fraction_differing"]) == pytest.approx(int(series["voxels_differing"]) / (SHAPE[0] * SHAPE[1] * SHAPE[2]))
    assert "volume_dicom.csv:" in capsys.readouterr().out
