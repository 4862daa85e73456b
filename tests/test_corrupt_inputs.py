"""Broken inputs are refused in one line naming the file, never read silently.

Compressed voxels (a MetaImage ``.zraw`` or compressed ``.mha``, a ``.nii.gz``) that are cut off,
damaged or of another size than their header describes; headers of far more voxels than their
file holds, refused before anything is allocated; LUNA16 nodules outside their scan, reported
per file and line (refused in evaluation labels, warned and skipped in training); a LUNA16
folder of one subset, which trains with folds by scan. The LUNA16 cases come from the synthetic
generator's ``subsets`` and ``damage`` options."""

from __future__ import annotations

import csv
import gzip
import logging
import re
import shutil
import struct
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import SimpleITK as sitk
import yaml

from conftest import cli_error
from hsmla_med.cli import main
from hsmla_med.config import task_config
from hsmla_med.data.checks import LoadCased
from hsmla_med.data.datalist import read_header
from hsmla_med.data.luna16 import LoadScand, find_scans, read_geometry, world_to_voxel
from hsmla_med.data.synthetic.luna16 import generate_luna16
from hsmla_med.errors import DataError
from hsmla_med.evaluation import read_labels
from hsmla_med.io.itk import read_itk
from hsmla_med.pipelines import luna16

SHAPE = (48, 48, 16)  # x, y, z: 73728 bytes of int16
VOXEL_BYTES = 48 * 48 * 16 * 2


def _uid(index: int) -> str:
    return f"1.3.6.1.4.1.14519.5.2.1.6279.6001.000{index:06d}"


def _volume() -> np.ndarray:
    return np.random.default_rng(0).normal(0, 300, SHAPE[::-1]).astype(np.int16)  # z, y, x, as SimpleITK takes it


def _metaimage(path: Path, voxels: np.ndarray | None = None) -> Path:
    """A compressed MetaImage (``.mhd`` with its ``.zraw``, or one ``.mha``) of ``voxels``."""
    sitk.WriteImage(sitk.GetImageFromArray(_volume() if voxels is None else voxels), str(path), useCompression=True)
    return path


def test_cut_off_zraw_scan_is_refused_not_read_as_zeros(tmp_path):
    """The generator's cut-off scan (its header without CompressedDataSize, as ITK then reads
    whatever the file holds): read about half zeros, with "Uncompress failed" on stderr only."""
    root = generate_luna16(tmp_path / "luna", 2, SHAPE, 0, damage=["truncated-zraw"])
    scan = root / "subset0" / f"{_uid(0)}.mhd"
    assert scan.with_suffix(".zraw").is_file() and "CompressedDataSize" not in scan.read_text()
    expected = (rf"{re.escape(str(scan.with_suffix('.zraw')))}: its compressed data are cut off \(the file ends inside the stream\) "
                rf"after \d+ of the {VOXEL_BYTES} bytes the header {re.escape(scan.name)} describes \(48 x 48 x 16 MET_SHORT\)$")
    with pytest.raises(DataError, match=expected):
        LoadScand()({"image": str(scan)})
    assert len(find_scans(root)) == 2  # the header alone is sound: the scan is refused where its voxels are read


@pytest.mark.parametrize("damage, expected", [
    ("random bytes", r"its compressed data are damaged \(zlib: .+\); they should inflate to the 73728 bytes the header v\.mhd describes"),
    ("empty", r"its compressed data are cut off \(the file ends inside the stream\) after 0 of the 73728 bytes"),
    ("more voxels", r"its compressed data inflate to more than the 73728 bytes the header v\.mhd describes"),
    ("fewer voxels", r"its compressed data inflate to 36864 of the 73728 bytes the header v\.mhd describes"),
])
def test_compressed_metaimage_voxels_of_another_size_are_refused(tmp_path, damage, expected):
    """ITK reads a damaged stream as zeros (or what the memory held), and a stream of another
    size than the header's into the header's buffer: every reader of the voxels refuses it."""
    path = _metaimage(tmp_path / "v.mhd")
    zraw = tmp_path / "v.zraw"
    if damage == "random bytes":
        zraw.write_bytes(np.random.default_rng(1).bytes(zraw.stat().st_size))
    elif damage == "empty":
        zraw.write_bytes(b"")
    else:
        other = _metaimage(tmp_path / "other.mhd", np.concatenate([_volume()] * 2) if damage == "more voxels" else _volume()[:8])
        zraw.write_bytes(other.with_suffix(".zraw").read_bytes())
    path.write_text("".join(line for line in path.read_text().splitlines(keepends=True) if not line.startswith("CompressedDataSize")))
    for read in (read_itk, lambda p: LoadCased(["image"])({"image": str(p)})):
        with pytest.raises(DataError, match=f"^{re.escape(str(zraw))}: {expected}"):
            read(path)


def test_cut_off_compressed_mha_is_refused(tmp_path):
    """The stream after the header of one ``.mha`` file (CompressedDataSize kept: ITK's own
    message there was "No such file or directory")."""
    path = _metaimage(tmp_path / "v.mha")
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}: its compressed data are cut off .* of the {VOXEL_BYTES} bytes the header v\.mha"):
        read_itk(path)
    assert np.array_equal(read_itk(_metaimage(tmp_path / "whole.mha"))[0], _volume().transpose(2, 1, 0))  # a sound one is read


def _nifti_header_of(path: Path, shape: tuple[int, int, int]) -> bytes:
    """A NIfTI-1 file's bytes whose header claims ``shape`` over the voxels of ``path``."""
    data = bytearray(path.read_bytes())
    data[42:48] = struct.pack("<3h", *shape)  # dim[1..3]
    return bytes(data)


def test_headers_of_far_more_voxels_than_their_file_are_refused_before_allocating(tmp_path, monkeypatch):
    """A header of 2000^3 voxels over a small file: refused from the file's size (uncompressed) or
    as soon as its stream ends (compressed), never allocated (under a memory limit: a
    MemoryError after seconds). The readers' allocating calls fail the test if reached."""
    def allocates(*args, **kwargs):
        raise AssertionError("the voxels were allocated")

    monkeypatch.setattr(sitk.ImageFileReader, "Execute", allocates)
    monkeypatch.setattr(nib.arrayproxy, "array_from_file", allocates)
    huge = 2000 * 2000 * 2000 * 2
    mhd = _metaimage(tmp_path / "huge.mhd")
    mhd.write_text(mhd.read_text().replace("DimSize = 48 48 16", "DimSize = 2000 2000 2000"))
    with pytest.raises(DataError, match=rf"huge\.zraw: its compressed data inflate to {VOXEL_BYTES} of the {huge} bytes the header huge\.mhd"):
        read_itk(mhd)
    small = tmp_path / "small.nii"
    nib.save(nib.Nifti1Image(np.zeros((4, 4, 4), np.int16), np.eye(4)), str(small))
    nii, niigz = tmp_path / "huge.nii", tmp_path / "huge.nii.gz"
    nii.write_bytes(_nifti_header_of(small, (2000, 2000, 2000)))
    niigz.write_bytes(gzip.compress(nii.read_bytes()))
    message = rf"huge\.nii: the file is 480 bytes, its header describes {huge} bytes of voxels from byte 352 \(2000 x 2000 x 2000 int16\)"
    with pytest.raises(DataError, match=message):
        read_header(nii)  # the header pass of train, infer and evaluate, before any voxel
    with pytest.raises(DataError, match=message):
        LoadCased(["image"])({"image": str(nii)})
    with pytest.raises(DataError, match=rf"huge\.nii\.gz: its compressed data inflate to 480 of the {huge + 352} bytes its header describes"):
        LoadCased(["image"])({"image": str(niigz)})


@pytest.mark.parametrize("kind, expected", [
    ("cut-off .nii.gz", rf"t\.nii\.gz: its compressed data are cut off \(the file ends inside the stream\) after \d+ of the {352 + VOXEL_BYTES} "
                        r"bytes its header describes \(352 before the voxels, then 16 x 48 x 48 int16\)$"),
    ("damaged .nii.gz", rf"t\.nii\.gz: its compressed data are damaged \(zlib: incorrect data check\); they should inflate to the "
                        rf"{352 + VOXEL_BYTES} bytes its header describes \(352 before the voxels, then 16 x 48 x 48 int16\)$"),
    ("short .nii", rf"t\.nii: the file is {(352 + VOXEL_BYTES) // 2} bytes, its header describes {VOXEL_BYTES} bytes of voxels from byte 352 "
                   r"\(16 x 48 x 48 int16\)$"),
])
def test_cut_off_or_damaged_nifti_is_named(tmp_path, kind, expected):
    """nibabel's own words were zlib's EOFError, or an OSError of two lines; a damaged stream that
    still inflates was read unseen, and is caught by its checksum (the stream is inflated to its
    end)."""
    path = tmp_path / ("t.nii" if kind == "short .nii" else "t.nii.gz")
    nib.save(nib.Nifti1Image(_volume(), np.eye(4)), str(path))
    data = path.read_bytes()
    if kind == "damaged .nii.gz":  # its checksum (the gzip trailer's CRC-32) does not match: nibabel never reads it
        path.write_bytes(data[:-8] + bytes(b ^ 0xFF for b in data[-8:-4]) + data[-4:])
    else:
        path.write_bytes(data[: len(data) // 2])
    for read in (lambda p: LoadCased(["image"])({"image": str(p)}), read_labels):
        with pytest.raises(DataError, match=expected):
            read(path)


def _submission(path: Path, root: Path) -> Path:
    """A submission of one candidate on the first nodule of annotations.csv."""
    with (root / "CSVFILES" / "annotations.csv").open(newline="") as f:
        first = next(csv.DictReader(f))
    path.write_text(f"seriesuid,coordX,coordY,coordZ,probability\n{first['seriesuid']},{first['coordX']},{first['coordY']},{first['coordZ']},0.9\n")
    return path


def _outside_line(csv_path: Path, uid: str) -> int:
    """The line of ``csv_path`` of the generator's nodule outside scan ``uid``: its last row."""
    return max(n for n, line in enumerate(csv_path.read_text().splitlines(), 1) if line.startswith(uid))


def test_nodule_outside_its_scan_is_refused_in_evaluation_labels(tmp_path, capsys):
    """Its scans found in the LUNA16 folder of --labels (the folder, or its annotations.csv in
    CSVFILES/), or in --data-dir: the row named by file, line and series."""
    root = generate_luna16(tmp_path / "luna", 2, SHAPE, 0, damage=["nodule-outside"])
    notes = root / "CSVFILES" / "annotations.csv"
    submission = _submission(tmp_path / "submission.csv", root)
    elsewhere = Path(shutil.copyfile(notes, tmp_path / "elsewhere.csv"))
    line = _outside_line(notes, _uid(0))
    for labels, named in (([root], notes), ([notes], notes), ([elsewhere, "--data-dir", root], elsewhere)):
        error = cli_error(capsys, ["evaluate", "--task", "luna16", "--predictions", str(submission), "--labels", *map(str, labels),
                                  "--output", str(tmp_path / "eval")])
        assert re.fullmatch(rf"hsmla-med: error: {re.escape(str(named))}, line {line}: the nodule of series {re.escape(_uid(0))} at "
                            rf"\(-?[\d.]+, -?[\d.]+, -?[\d.]+\) mm lies outside its scan {re.escape(str(root / 'subset0' / _uid(0)))}\.mhd "
                            r"\(voxel -10\.0, 24\.0, 8\.0 of 48 x 48 x 16\)", error), error
    # a CSV without its scans is scored as it is: nothing to check it against
    assert luna16.score_predictions(submission, elsewhere, tmp_path / "eval", {})["nodules"] > 0


def _config(root: Path, output: Path) -> dict:
    config = task_config("luna16")
    config["data"]["data_dir"], config["output"] = str(root), str(output)
    return config


def test_nodules_outside_their_scan_are_warned_per_scan_and_skipped_in_training(tmp_path, caplog):
    """One nodule of scan 0 outside it; every nodule of scan 1 moved outside (that scan trains
    without nodules, and says so); one warning per scan, counting them, with their lines."""
    root = generate_luna16(tmp_path / "luna", 3, SHAPE, 0, damage=["nodule-outside"])
    notes = root / "CSVFILES" / "annotations.csv"
    lines = notes.read_text().splitlines()
    geometry = read_geometry(find_scans(root)[_uid(1)])
    moved = [n for n, row in enumerate(lines, 1) if row.startswith(_uid(1))]
    for n in moved:  # 1000 mm further along x: outside the scan
        uid, x, *rest = lines[n - 1].split(",")
        lines[n - 1] = ",".join([uid, str(float(x) + 1000), *rest])
        index = world_to_voxel([[float(v) for v in lines[n - 1].split(",")[1:4]]], geometry)
        assert ((index < -0.5) | (index > np.array(SHAPE) - 0.5)).any()
    notes.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING, logger="hsmla_med"):
        cases = luna16.datalist(_config(root, tmp_path / "run"))
    nodules = {c["seriesuid"]: c["nodules"] for c in cases.training + cases.validation}
    count = sum(row.startswith(_uid(0)) for row in lines)
    warnings = [r.getMessage() for r in caplog.records if "outside its scan" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert f"{notes}: series {_uid(0)}: 1 of its {count} nodules lies outside its scan (line {_outside_line(notes, _uid(0))}); skipped" in warnings
    assert (f"{notes}: series {_uid(1)}: all its {len(moved)} nodules lie outside its scan (lines {', '.join(map(str, moved))}); "
            "skipped: the scan trains without nodules") in warnings
    assert len(nodules[_uid(0)]) == count - 1 and len(nodules[_uid(1)]) == 0 and len(nodules[_uid(2)]) > 0


def test_one_subset_trains_with_folds_by_scan(tmp_path, caplog, capsys):
    """LUNA16's folds are its subsets; with subset0 alone each scan is a unit of its own (the
    split used to refuse: "cannot make two folds of 1 unit(s) (3 cases)")."""
    root = generate_luna16(tmp_path / "luna", 3, SHAPE, 0, subsets=1, damage=["nodule-outside"])
    assert {p.parent.name for p in find_scans(root).values()} == {"subset0"}
    with caplog.at_level(logging.INFO, logger="hsmla_med"):
        cases = luna16.datalist(_config(root, tmp_path / "run"))
    assert "one subset: folds by scan within subset0" in caplog.text
    assert len(cases.validation) == 1 and len(cases.training) == 2 and cases.split["folds"] == 3
    # the command itself: trains on the scans (the nodule outside scan 0 warned about and skipped)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({"data": {"roi_size_2d": [48, 48], "num_workers": 0},
                                      "trainer": {"check_val_every_n_epoch": 1, "accelerator": "cpu", "progress_bar": False}}))
    capsys.readouterr()
    run = ["train", "--task", "luna16", "--data-dir", str(root), "--config", str(config), "--max-steps", "1", "--output", str(tmp_path / "run")]
    assert main(run) == 0
    err = capsys.readouterr().err
    assert "hsmla-med: one subset: folds by scan within subset0" in err
    assert f"series {_uid(0)}: 1 of its " in err and f"lies outside its scan (line {_outside_line(root / 'CSVFILES' / 'annotations.csv', _uid(0))}); skipped" in err
    assert (tmp_path / "run" / "best.ckpt").is_file()
