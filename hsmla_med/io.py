"""Atomic file output: write to a temporary name in the target folder, then rename.

An interrupted run (Ctrl-C, a crash, a full disk) therefore never leaves a half-written NIfTI,
JSON or image under its final name; a previous complete version stays in place until the new
one is complete.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_path", "write_json", "write_yaml"]


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (same suffixes, so writers pick the same format);
    rename it onto ``path`` when the block succeeds, delete it when the block raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    suffixes = "".join(path.suffixes)
    stem = path.name[: len(path.name) - len(suffixes)] if suffixes else path.name
    tmp = path.with_name(f".{stem}.{os.getpid()}.tmp{suffixes}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: str | Path, data) -> None:
    """Write ``data`` as indented JSON, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2) + "\n")


def write_yaml(path: str | Path, data: dict) -> None:
    """Write ``data`` as YAML (safe dumper, keys in insertion order), atomically."""
    import yaml

    with atomic_path(path) as tmp:
        tmp.write_text(yaml.safe_dump(data, sort_keys=False))
