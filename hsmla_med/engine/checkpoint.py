"""Checkpoint files that survive any kill: written beside their final name and renamed; read
with ``weights_only=True`` by one function, which says what a file is when it is none
(:func:`read_checkpoint`); and inference from an exported network (a TorchScript file, a MONAI
Bundle or an ONNX model of ``hsmla-med export``).

Lightning's own :class:`~lightning.pytorch.plugins.io.TorchCheckpointIO` writes through an fsspec
transaction: a temporary file in ``$TMPDIR``, then moved onto the checkpoint's name. When
``$TMPDIR`` lies on another filesystem than the run folder, the move is a copy into the final
file, and a kill during that copy leaves ``last.ckpt`` empty or truncated in place of the good one.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import stat
import warnings
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning.pytorch.plugins.io import TorchCheckpointIO

from hsmla_med.engine.onnx_runtime import onnx_metadata, onnx_network
from hsmla_med.errors import DataError
from hsmla_med.io import atomic_path

__all__ = ["AtomicCheckpointIO", "EXPORT_META", "FORMAT_VERSION", "exported_file", "load_exported", "quiet_torchscript", "read_checkpoint", "read_torchscript", "read_hparams"]

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

    Loading (``train --resume``) is :func:`read_checkpoint`'s: a file that is no checkpoint of
    train is a :class:`~hsmla_med.errors.DataError` saying what it is.
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
        """:func:`read_checkpoint` (always ``weights_only``: a resumed file is as foreign as any)."""
        return read_checkpoint(path, map_location=map_location)


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


#: what to give instead of a file that is no checkpoint of train
_INSTEAD = "give the .ckpt file that train wrote (best.ckpt or last.ckpt)"
#: ... and, for an exported network, where it is taken
_EXPORTED = f"{_INSTEAD}; infer --checkpoint runs exported networks as they are"
_ZIP, _PICKLE = b"PK\x03\x04", 0x80  # the first bytes of torch.save's zip archive, and of a pickle (protocol 2+: torch.save's older format)


def _not_a_checkpoint(path: Path) -> str | None:
    """What ``path`` is, in words, when it is plainly no checkpoint of train (read without
    unpickling anything); ``None`` when it may be one: a zip archive with ``data.pkl``, or a
    pickle."""
    if not path.exists():
        return "checkpoint not found"
    if path.is_dir():
        if (path / "models" / "model.ts").is_file():
            return f"a MONAI bundle of hsmla-med export, not a checkpoint; {_EXPORTED}"
        inside = [name for name in ("best.ckpt", "last.ckpt") if (path / name).is_file()]
        return f"a folder, not a checkpoint; give the checkpoint file in it: {', '.join(str(path / n) for n in inside)}" if inside \
            else f"a folder, not a checkpoint; {_INSTEAD}"
    if not stat.S_ISREG(path.stat().st_mode):  # /dev/zero never ends, a FIFO blocks: never read
        return f"not a regular file (a device, pipe or socket); {_INSTEAD}"
    if path.stat().st_size == 0:
        return f"not a readable hsmla-med checkpoint: empty (0 bytes), as a write or copy that did not finish leaves it; {_INSTEAD}"
    if path.suffix.lower() == ".onnx":
        return f"an ONNX model of hsmla-med export, not a checkpoint; {_EXPORTED}"
    try:
        with path.open("rb") as f:
            head = f.read(4)
    except OSError as err:
        return f"cannot be read ({err.strerror})"
    if head == _ZIP:
        if not zipfile.is_zipfile(path):  # the archive's directory is at its end
            return "not a readable hsmla-med checkpoint: truncated or damaged (a zip archive without its end)"
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
        except (OSError, zipfile.BadZipFile) as err:
            return f"not a readable hsmla-med checkpoint: truncated or damaged ({err})"
        if any(name.split("/")[1:2] == ["code"] for name in names):
            return f"a TorchScript network of hsmla-med export, not a checkpoint; {_EXPORTED}"
        if not any(name.split("/")[1:] == ["data.pkl"] for name in names):
            return f"a zip archive but not a checkpoint (no data.pkl, as a checkpoint has); {_INSTEAD}"
        return None
    if head[0] != _PICKLE:
        return f"not a readable hsmla-med checkpoint: neither a zip archive nor a pickle, the formats of checkpoints; {_INSTEAD}"
    return None


def _pickled_globals(path: Path) -> list[str] | None:
    """``module.name`` of every function or class that the pickle file ``path`` imports, read
    with :mod:`pickletools` (which parses the opcodes and executes nothing); ``None`` when the
    stream does not parse."""
    import pickletools

    names: list[str] = []
    strings: list[str] = []  # the string arguments so far: STACK_GLOBAL takes its module and name from the last two
    try:
        with path.open("rb") as f:
            for opcode, arg, _ in pickletools.genops(f):
                if opcode.name in ("GLOBAL", "INST"):
                    names.append(arg.replace(" ", "."))
                elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                    names.append(".".join(strings[-2:]))
                if isinstance(arg, str):
                    strings.append(arg)
    except Exception:  # truncated or not a pickle: ValueError, EOFError, struct.error
        return None
    return names


def read_checkpoint(path: str | Path, mmap: bool = False, map_location: Any = "cpu") -> dict:
    """The contents of a checkpoint written by ``train`` (a dict with ``hyper_parameters`` and
    ``state_dict``), loaded with ``weights_only=True``: tensors and plain values only, nothing
    that could run code. ``mmap``: tensors mapped from the file, not read (for the
    hyper-parameters alone).

    Anything else is a :class:`~hsmla_med.errors.DataError` naming the file and saying what it is
    and what to give instead, never PyTorch's message (which advises ``weights_only=False``): not
    found; a folder (an exported bundle, a run folder); a device, pipe or socket, never read; an
    empty, truncated or damaged file; no checkpoint at all; a TorchScript or ONNX network of
    ``export``; objects that ``weights_only`` loading refuses (named); a state dict without
    train's hyper-parameters."""
    import torch

    path = Path(path)
    problem = _not_a_checkpoint(path)
    if problem is not None:
        raise DataError(f"{path}: {problem}")
    archive = zipfile.is_zipfile(path)
    try:
        with warnings.catch_warnings():  # a pickle of protocol 3+: the refusal below says what matters
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            checkpoint = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap and archive)
    except pickle.UnpicklingError as err:
        # torch wraps its restricted unpickler's own message between advice to load unrestricted
        inner = (str(err).partition("WeightsUnpickler error:")[2].strip().splitlines() or [""])[0]
        named = re.findall(r"GLOBAL ([\w.]+)", str(err))  # the function or class it refused to call
        if inner.startswith(("Unsupported operand", "String is too long")):
            # a stream the restricted unpickler cannot parse (a pickle of protocol 4+, whose
            # framing it lacks, or a damaged one): what it would import tells which
            named = _pickled_globals(path) if not archive else None
            if not named:
                raise DataError(f"{path}: not a readable hsmla-med checkpoint: truncated or damaged, or a pickle of other objects ({inner})") from None
        refused = f" ({', '.join(sorted(set(named)))})" if named else ""
        raise DataError(f"{path}: holds objects that weights_only loading refuses{refused}: not loaded, as it could run code") from None
    except Exception as err:  # EOFError, a zip member's CRC, a cut stream
        reason = (str(err).strip().split(". ")[0].splitlines() or [""])[0][:200]
        raise DataError(f"{path}: not a readable hsmla-med checkpoint: truncated or damaged ({type(err).__name__}{': ' + reason if reason else ''})") from None
    if not isinstance(checkpoint, dict) or not {"hyper_parameters", "state_dict"} <= set(checkpoint):
        bare = isinstance(checkpoint, dict) and checkpoint and all(isinstance(v, torch.Tensor) for v in checkpoint.values())
        what = "a state dict without the hyper-parameters that train writes (a bundle's models/model.pt?)" if bare \
            else f"a PyTorch file without the hyper-parameters and weights that train writes ({type(checkpoint).__name__})"
        raise DataError(f"{path}: {what}; {_INSTEAD}")
    return checkpoint


def read_hparams(path: str | Path) -> dict:
    """The hyper-parameters of a checkpoint written by ``train`` (:func:`read_checkpoint`, its
    tensors mapped, not read)."""
    return read_checkpoint(path, mmap=True)["hyper_parameters"]


def exported_file(path: str | Path) -> Path | None:
    """The file behind ``infer --checkpoint PATH`` when ``PATH`` is an exported network: a
    bundle folder (its ``models/model.ts``), a TorchScript archive (a zip with ``code/``, which
    ``torch.save`` checkpoints lack) or an ONNX model (``*.onnx``, which onnxruntime reads:
    :mod:`.onnx_runtime`); ``None`` for anything else."""
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
        network, meta = onnx_network(ts)
        kind, carrier = "an ONNX model", "metadata"
    else:
        network, meta = read_torchscript(ts)
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


def read_torchscript(ts: Path):
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
