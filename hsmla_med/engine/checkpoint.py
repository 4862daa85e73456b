"""Checkpoint files that survive any kill: written beside their final name and renamed; and
inference from an exported network (a TorchScript file, a MONAI Bundle or an ONNX model of
``hsmla-med export``).

Lightning's own :class:`~lightning.pytorch.plugins.io.TorchCheckpointIO` writes through an fsspec
transaction: a temporary file in ``$TMPDIR``, then moved onto the checkpoint's name. When
``$TMPDIR`` lies on another filesystem than the run folder, the move is a copy into the final
file, and a kill during that copy leaves ``last.ckpt`` empty or truncated in place of the good one.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning.pytorch.plugins.io import TorchCheckpointIO

from hsmla_med.errors import DataError
from hsmla_med.io import atomic_path

__all__ = ["AtomicCheckpointIO", "EXPORT_META", "FORMAT_VERSION", "exported_file", "load_exported", "quiet_torchscript", "read_hparams"]

#: extra file of an exported TorchScript network holding its checkpoint's hyper-parameters
EXPORT_META = "hsmla_med.json"
#: version of that file's layout
FORMAT_VERSION = 1


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


def read_hparams(path: str | Path) -> dict:
    """The hyper-parameters of a checkpoint written by ``train`` (``weights_only=True``), or a
    :class:`~hsmla_med.errors.DataError` naming the file."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: checkpoint not found")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return checkpoint["hyper_parameters"]
    except pickle.UnpicklingError:
        raise DataError(f"{path}: holds Python objects beyond tensors and plain values; refused, since loading them could run code") from None
    except Exception as err:
        raise DataError(f"{path}: not a readable hsmla-med checkpoint ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None


def exported_file(path: str | Path) -> Path | None:
    """The file behind ``infer --checkpoint PATH`` when ``PATH`` is an exported network: a
    bundle folder (its ``models/model.ts``), a TorchScript archive (a zip with ``code/``, which
    ``torch.save`` checkpoints lack) or an ONNX model (``*.onnx``, which onnxruntime reads:
    :mod:`hsmla_med.export.runtime`); ``None`` for anything else."""
    path = Path(path)
    if path.suffix.lower() == ".onnx" and path.is_file():
        return path
    if path.is_dir():
        ts = path / "models" / "model.ts"
        if not ts.is_file():
            raise DataError(f"{path}: a folder, but not a bundle of hsmla-med export (no models/model.ts)")
        return ts
    if not path.is_file() or not zipfile.is_zipfile(path):
        return None
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile):
        return None
    return path if any(n.split("/")[1:2] == ["code"] for n in names) else None


def load_exported(path: str | Path, module_class, task: str | None = None, inference: dict | None = None):
    """The task module around an exported network (``path``: a ``.ts`` file, a bundle folder or
    a ``.onnx`` model of ``hsmla-med export``, :func:`exported_file`), rebuilt from the
    hyper-parameters it carries (:data:`EXPORT_META`; an ONNX model's ``metadata_props``): eval
    mode, CPU. ``task`` refuses a network of another task;
    ``inference`` overrides the checkpoint's inference settings (``tta``). Returns the module
    and ``{"epoch": None, "step": None, "exported": file}``.

    The sliding window feeds it windows of its exported size (``inference.roi_size``), the
    only size a TorchScript network takes; its HSMLA layers run the dense backend. An ONNX
    model runs under onnxruntime on the CPU.
    """
    path = Path(path)
    ts = exported_file(path)
    if ts is None:
        raise DataError(f"{path}: not a TorchScript file of hsmla-med export")
    if ts.suffix.lower() == ".onnx":
        from hsmla_med.export.runtime import onnx_network

        network, meta = onnx_network(ts)
        kind, carrier = "an ONNX model", "metadata"
    else:
        network, meta = _torchscript(ts)
        kind, carrier = "a TorchScript file", EXPORT_META
    try:
        config = meta["hparams"]
        int(meta["format_version"])
    except (TypeError, KeyError, ValueError):
        raise DataError(f"{ts}: {kind} without hsmla-med's {carrier} (export it with hsmla-med export)") from None
    if meta["format_version"] > FORMAT_VERSION:
        raise DataError(f"{ts}: exported by a newer hsmla-med (format {meta['format_version']}, this one reads {FORMAT_VERSION})")
    written_by = config.get("task")
    if task is not None and written_by != task:
        raise DataError(f"{path}: an exported {written_by} network, not one of task {task}; use --task {written_by}")
    config = {**config, "inference": {**config["inference"], **(inference or {})}}
    try:
        module = module_class(config, network=network)
    except (KeyError, TypeError, ValueError) as err:
        raise DataError(f"{ts}: its hyper-parameters are incomplete or invalid ({type(err).__name__}: {err})") from None
    module.eval()
    return module, {"epoch": None, "step": None, "exported": str(ts)}


@contextmanager
def quiet_torchscript():
    """torch 2.13 deprecates ``torch.jit.trace``, ``save`` and ``load`` (in favour of
    ``torch.export``); we keep TorchScript on purpose, for what loads it: MONAI bundles
    (``models/model.ts``), MONAI Deploy, Triton's PyTorch backend and libtorch C++ services
    (a ``torch.export`` program needs AOTInductor to leave Python). Silenced at our calls only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.\w+. is deprecated", category=DeprecationWarning)
        yield


def _torchscript(ts: Path):
    """``(network, metadata)`` of an exported TorchScript file: the network on the CPU and the
    :data:`EXPORT_META` it carries (``None`` when absent or not JSON)."""
    import torch

    extra = {EXPORT_META: ""}
    try:
        with quiet_torchscript():
            network = torch.jit.load(str(ts), map_location="cpu", _extra_files=extra)
    except Exception as err:
        raise DataError(f"{ts}: not a readable TorchScript file ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None
    try:
        return network, json.loads(extra[EXPORT_META] or "null")
    except ValueError:
        return network, None


def written_task(path: str | Path) -> str | None:
    """The task that ``path`` was made for, as ``infer`` and ``evaluate`` take it when ``--task``
    is left out: ``config["task"]`` of a checkpoint of ``train``, or of the hyper-parameters an
    exported network of ``hsmla-med export`` carries (:data:`EXPORT_META`, read from the archive
    without loading the network); ``None`` where the file records none. A missing or unreadable
    checkpoint is a :class:`~hsmla_med.errors.DataError` naming it."""
    ts = exported_file(path)
    if ts is None:
        config = read_hparams(path)
        return config.get("task") if isinstance(config, dict) else None
    if ts.suffix.lower() == ".onnx":
        from hsmla_med.export.runtime import onnx_metadata

        meta = onnx_metadata(ts)
    else:
        try:
            with zipfile.ZipFile(ts) as archive:
                # TorchScript keeps _extra_files under <archive>/extra/<name>
                entry = next((n for n in archive.namelist() if n.split("/")[1:] == ["extra", EXPORT_META]), None)
                meta = json.loads(archive.read(entry)) if entry is not None else None
        except (OSError, zipfile.BadZipFile, ValueError):
            return None
    config = meta.get("hparams") if isinstance(meta, dict) else None
    return config.get("task") if isinstance(config, dict) else None
