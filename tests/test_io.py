"""Atomic writes: a failure midway leaves neither a partial file nor a temporary one, and keeps
the previous complete file; temporaries that killed processes left are recognised and removed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hsmla_med.io import atomic_path, is_temporary, remove_stale_temporaries, write_json


def test_failed_write_keeps_previous_file(tmp_path):
    target = tmp_path / "case.nii.gz"
    target.write_bytes(b"complete old version")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        assert tmp.name.endswith(".nii.gz") and tmp.parent == tmp_path
        tmp.write_bytes(b"half of the new")
        raise RuntimeError("disk full")
    assert target.read_bytes() == b"complete old version"
    assert [p.name for p in tmp_path.iterdir()] == ["case.nii.gz"]


def test_successful_write_replaces(tmp_path):
    write_json(tmp_path / "sub" / "metrics.json", {"dice": 0.5})
    write_json(tmp_path / "sub" / "metrics.json", {"dice": 0.75})
    assert (tmp_path / "sub" / "metrics.json").read_text().strip().endswith("}")
    assert "0.75" in (tmp_path / "sub" / "metrics.json").read_text()
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["metrics.json"]


def test_is_temporary_names(tmp_path):
    assert is_temporary("out/.last.1234.tmp.ckpt") and is_temporary(".case.99.tmp.nii.gz") and is_temporary(Path(".notes.7.tmp"))
    assert not is_temporary("last.ckpt") and not is_temporary("case.nii.gz") and not is_temporary(".hidden.nii.gz")
    assert not is_temporary(".last.tmp.ckpt") and not is_temporary("x.1234.tmp.ckpt")
    for name in ("case.nii.gz", "metrics.json", "README"):  # the names atomic_path writes to
        with atomic_path(tmp_path / name) as tmp:
            assert is_temporary(tmp), tmp.name
            tmp.write_text("")
        assert not is_temporary(tmp_path / name)


def test_stale_temporaries_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f".last.{dead_pid}.tmp.ckpt"
    live = tmp_path / f".best.{os.getpid()}.tmp.ckpt"  # a write in progress in a running process
    for path in (stale, live, tmp_path / "last.ckpt", tmp_path / f"notes.{dead_pid}.tmp.txt"):
        path.write_bytes(b"x")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / f".case.{dead_pid}.tmp.nii.gz").write_bytes(b"x")
    assert remove_stale_temporaries(tmp_path) == [stale]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "last.ckpt", f"notes.{dead_pid}.tmp.txt", "sub"])
    assert remove_stale_temporaries(tmp_path / "missing") == []
