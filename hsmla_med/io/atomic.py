"""Atomic file output: write to a temporary name in the target folder, then rename.

An interrupted run (Ctrl-C, a crash, a full disk) therefore never leaves a half-written NIfTI,
JSON or image under its final name; a previous complete version stays in place until the new
one is complete. A process killed outright (``kill -9``, out of memory) leaves its hidden
temporary behind: :func:`is_temporary` recognises such files, and
:func:`remove_stale_temporaries` deletes those of processes that no longer run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_path", "is_temporary", "read_npz_cache", "remove_stale_temporaries", "write_json", "write_yaml"]

log = logging.getLogger("hsmla_med")

# ``.<stem>.<pid>.tmp<suffixes>``, the names that :func:`atomic_path` writes to
_TEMPORARY = re.compile(r"^\.(?P<stem>.+)\.(?P<pid>\d+)\.tmp(?P<suffixes>\..*)?$")


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (same suffixes, so writers pick the same format);
    rename it onto ``path`` when the block succeeds, delete it when the block raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    suffixes = "".join(path.suffixes)
    stem = path.name[: len(path.name) - len(suffixes)] if suffixes else path.name
    tmp = path.with_name(f".{stem}.{os.getpid()}.tmp{suffixes}")  # see is_temporary
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


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file's bytes (hex), read in 1 MiB blocks: a checkpoint is hundreds of MB."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_temporary(path: str | Path) -> bool:
    """Whether ``path`` names a temporary file of :func:`atomic_path` (``.<name>.<pid>.tmp<ext>``),
    complete or not, that is no result: listings of inputs and outputs should skip it."""
    return _TEMPORARY.match(Path(path).name) is not None


def _process_runs(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (or may: one of another user)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(folder: str | Path, below: int = 0) -> list[Path]:
    """Delete the temporaries of :func:`atomic_path` in ``folder`` (and in the folders up to
    ``below`` levels beneath it; symbolic links not followed) whose writing process no longer
    runs on this machine (left by ``kill -9`` or a power cut); those of running processes stay,
    as they may be writing them now. Returns the removed paths."""
    folder = Path(folder)
    removed = []
    for root, folders, files in os.walk(folder):
        if len(Path(root).relative_to(folder).parts) >= below:
            folders.clear()  # no deeper
        for name in sorted(files):
            match = _TEMPORARY.match(name)
            path = Path(root) / name
            if match is None or not path.is_file() or _process_runs(int(match["pid"])):
                continue
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def read_npz_cache(cache: Path, keys: set[str], what: str) -> dict | None:
    """The arrays of a cache file written with ``np.savez`` holding exactly ``keys``, or ``None``
    when there is none or it is damaged (truncated, foreign, other keys): then the caller
    computes it again and replaces the file, and a log line names the file and ``what`` it holds."""
    import numpy as np  # here: the writers above are imported where NumPy is not needed

    if not cache.is_file():
        return None
    try:
        with np.load(cache) as f:  # no pickles: a foreign file is refused, not run
            values = {k: f[k] for k in f.files}
        if set(values) == keys:
            return values
        problem = f"it holds {sorted(values)}"
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as err:
        problem = str(err) or type(err).__name__
    log.warning("%s: damaged %s cache (%s); computing it again", cache, what, problem)
    return None
