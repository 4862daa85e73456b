"""Atomic writes: a failure midway leaves neither a partial file nor a temporary one, and keeps
the previous complete file."""

from __future__ import annotations

import pytest

from hsmla_med.io import atomic_path, write_json


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
