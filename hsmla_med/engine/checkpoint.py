"""Checkpoint files that survive any kill: written beside their final name and renamed.

Lightning's own :class:`~lightning.pytorch.plugins.io.TorchCheckpointIO` writes through an fsspec
transaction: a temporary file in ``$TMPDIR``, then moved onto the checkpoint's name. When
``$TMPDIR`` lies on another filesystem than the run folder, the move is a copy into the final
file, and a kill during that copy leaves ``last.ckpt`` empty or truncated in place of the good one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning.pytorch.plugins.io import TorchCheckpointIO

from hsmla_med.errors import DataError
from hsmla_med.io import atomic_path

__all__ = ["AtomicCheckpointIO"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """Saves with ``torch.save`` into a hidden temporary in the checkpoint's own folder
    (:func:`hsmla_med.io.atomic_path`), flushed and ``fsync``-ed, then renamed onto the final name
    with ``os.replace``: at every instant the final name holds the previous complete checkpoint or
    the new complete one. A kill leaves at most the temporary, which
    :func:`hsmla_med.io.remove_stale_temporaries` deletes at the start of the next run.

    Loading turns an unreadable file (empty, truncated, not a checkpoint) into a
    :class:`~hsmla_med.errors.DataError` naming it.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        import torch

        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        path = Path(path)
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
        _fsync_folder(path.parent)  # the rename itself survives a power cut

    def load_checkpoint(self, path, map_location: Any | None = lambda storage, loc: storage, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(path)
        if not path.is_file():
            raise DataError(f"{path}: checkpoint not found")
        if path.stat().st_size == 0:
            raise DataError(f"{path}: the checkpoint is empty (0 bytes); its run was killed while writing it")
        try:
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        except Exception as err:  # truncated zip, foreign pickle
            reason = (str(err).strip().splitlines() or [""])[0][:200]
            raise DataError(f"{path}: not a readable checkpoint, truncated or damaged ({type(err).__name__}: {reason})") from None


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
