"""Prediction through Lightning's predict loop, for every task: the cases of one run split across
processes (DDP, several nodes, ``torchrun``/SLURM launches) and across independent jobs
(``--shard I/N``), each output written once by the process that owns its case, finished cases
skipped, so a killed run resumes where it stopped (docs/design.md §7.1).

A task describes its cases as *items* (dicts with at least ``name``, unique in the run, and
``output``, the file whose presence means the case is done and which is written last); a
:class:`PredictionDataModule` turns a process's share of them into batches with the task's
loading transform (in DataLoader workers); the module's ``predict_step`` runs the network; a
:class:`PredictionWriter` hands each prediction to the task's ``write`` function on the process
that computed it. Lightning's own ``BasePredictionWriter`` and predict loop do the rest; what is
written here is only the split of whole cases (Lightning's distributed sampler splits the
loader's samples, and for whole-slide inference a case is a slide of many patches).

Outputs know where they came from (:func:`claim_outputs`): before predicting, the output folder
gets ``provenance.json`` (the model's digest and the options that shape the outputs) and every
output about to be written a record of its own under ``.provenance/``, written before the
output itself. An output is skipped only when its record matches this run; a folder or an output
of another model or other options is refused unless the run overwrites.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from monai.data import DataLoader, Dataset

from hsmla_med.errors import InputError
from hsmla_med.io import write_json

__all__ = [
    "Shard", "PredictionDataModule", "PredictionWriter", "PROVENANCE", "RECORDS", "claim_outputs", "model_digest", "model_record", "output_folder",
    "run_prediction", "first", "holds_outputs",
]

log = logging.getLogger("hsmla_med")


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` (``--shard I/N``, 0 <= I < N): the cases whose position in
    the run's sorted list is ``I`` modulo ``N``, for array jobs without a process group."""

    index: int = 0
    count: int = 1

    @classmethod
    def parse(cls, text: str | None) -> Shard:
        if text is None:
            return cls()
        try:
            index, count = (int(v) for v in str(text).split("/"))
        except ValueError:
            raise InputError(f"--shard {text!r}: expected I/N, e.g. 0/4 (shard I of N, counted from 0)") from None
        if count < 1 or not 0 <= index < count:
            raise InputError(f"--shard {text!r}: need N >= 1 and 0 <= I < N")
        return cls(index, count)

    def select(self, items: Sequence[dict]) -> list[dict]:
        names = [item["name"] for item in items]
        duplicate = next((name for name, n in Counter(names).items() if n > 1), None)
        if duplicate is not None:
            raise InputError(f"two inputs would write the same output {duplicate!r}; give them different names or separate runs")
        mine = set(sorted(names)[self.index :: self.count])
        return [item for item in items if item["name"] in mine]  # in the given order


PROVENANCE = "provenance.json"  # the output folder's record
RECORDS = ".provenance"  # one record per output: <folder>/.provenance/<output relative to folder>.json


def model_digest(module: torch.nn.Module) -> str:
    """sha256 of what makes a model's outputs: its weights (name, dtype, shape and bytes of every
    tensor of the state dict, in order) and its hyper-parameters (``module.config``, if any).
    The same weights give the same digest whether they come from a checkpoint, an exported
    network or memory; a file hash would tell last.ckpt from best.ckpt of the same weights.
    An ensemble (a module with ``members``, :func:`~hsmla_med.inference.ensemble.ensemble`):
    the digest of its members' digests, in order."""
    members = getattr(module, "members", None)
    if members:
        return hashlib.sha256(b"ensemble:" + ",".join(model_digest(m) for m in members).encode()).hexdigest()
    digest = hashlib.sha256()
    digest.update(json.dumps(getattr(module, "config", None), sort_keys=True, default=str).encode())
    for name, tensor in module.state_dict().items():
        tensor = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def model_record(module: torch.nn.Module) -> dict:
    """The ``model`` entry of a provenance record: the weights' digest and the checkpoint
    (``module.checkpoint_path``; None for a network in memory); an ensemble's also lists every
    member's."""
    record = {"sha256": model_digest(module), "checkpoint": getattr(module, "checkpoint_path", None)}
    members = getattr(module, "members", None)
    if members:
        record["members"] = [model_record(m) for m in members]
    return record


def output_folder(items: Sequence[dict]) -> Path | None:
    """The folder that holds every item's ``output`` (their deepest common folder)."""
    return Path(os.path.commonpath([Path(item["output"]).parent for item in items])) if items else None


def _read_record(path: Path) -> dict | None:
    """A provenance record, None if there is none; an unreadable one reads as ``{}``, which
    matches no run."""
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _difference(old: dict, new: dict) -> str | None:
    """What ``old`` (a record read back) has that differs from this run's ``new``, in words;
    None when they match. Only the model's digest and the options are compared."""
    if not old:
        return "an unreadable provenance record"
    parts = []
    model, before = new["model"], old.get("model") if isinstance(old.get("model"), dict) else {}
    if before.get("sha256") != model["sha256"]:
        name = lambda m: f"{str(m.get('sha256'))[:12]} of {m.get('checkpoint') or 'a network in memory'}"  # noqa: E731
        parts.append(f"another checkpoint (weights sha256 {name(before)}; this run: {name(model)})")
    options = old.get("options") if isinstance(old.get("options"), dict) else {}
    changed = [f"{key} {options.get(key)!r} -> {value!r}" for key, value in new["options"].items() if options.get(key, ...) != value]
    if changed:
        parts.append(f"other options ({', '.join(changed)})")
    return " and ".join(parts) or None


def claim_outputs(items: Sequence[dict], folder: str | Path, record: dict, overwrite: bool = False, write: bool = True) -> list[dict]:
    """The items still to predict into ``folder`` for a run described by ``record`` (``model``:
    ``sha256`` and ``checkpoint``; ``options``: those that shape the outputs).

    An item whose output exists is done when the output's own record matches ``record``. A
    folder whose ``provenance.json`` differs, or an existing output whose record differs or is
    missing (written before outputs were recorded, or by something else), is an
    :class:`~hsmla_med.errors.InputError` naming the folder and the difference; with
    ``overwrite`` such outputs (and, since the user asked for it, also matching ones) are
    predicted again. With ``write`` (the first process) the records are written before
    anything is predicted: overwritten outputs removed, each pending output's record, then the
    folder's; an output's record is thus older than the output, and an output without a
    matching record is never taken for this run's.
    """
    folder = Path(folder)
    record = json.loads(json.dumps(record))  # as it reads back (tuples as lists)
    old = _read_record(folder / PROVENANCE)
    if old is not None and not overwrite and holds_outputs(folder) and (difference := _difference(old, record)):
        raise InputError(f"{folder}: holds outputs of {difference}; give --overwrite to replace them, or another --output")
    todo, stale = [], []
    for item in items:
        output = Path(item["output"])
        if not output.exists():
            todo.append(item)
            continue
        own = _read_record(_record_path(folder, output))
        difference = "no provenance record (an older hsmla-med's or another program's)" if own is None else _difference(own, record)
        if difference and not overwrite:
            raise InputError(f"{folder}: holds {output.relative_to(folder)} with {difference}; "
                             "give --overwrite to replace it, or another --output")
        if difference or overwrite:
            todo.append(item)
            stale.append(output)
    if write:
        for output in stale:
            output.unlink(missing_ok=True)
        for item in todo:
            write_json(_record_path(folder, Path(item["output"])), record)
        write_json(folder / PROVENANCE, record)
    return todo


def holds_outputs(folder: str | Path) -> bool:
    """Whether an output that a record under ``folder/.provenance/`` was written for exists. A
    run that failed before its first output leaves ``provenance.json`` and the records of outputs
    that never came; such a folder holds nothing to protect and is no other run's."""
    records = Path(folder) / RECORDS
    return records.is_dir() and any((Path(folder) / r.relative_to(records).as_posix().removesuffix(".json")).exists()
                                    for r in records.rglob("*.json"))


def _record_path(folder: Path, output: Path) -> Path:
    return folder / RECORDS / f"{output.relative_to(folder).as_posix()}.json"


def first(batch: list):
    """Collate of one-case batches: the case itself (volumes of different sizes do not stack)."""
    return batch[0]


class PredictionDataModule(L.LightningDataModule):
    """The pending cases of a run; process ``r`` of ``w`` predicts ``items[r::w]`` of rank 0's
    list (broadcast, so every process splits the same list).

    Args:
        items: the cases (see the module docstring); with ``expand``, what the loader yields.
        transform: applied to each item in the loader's workers (reading and preprocessing).
        batch_size, num_workers, collate: of the DataLoader (default one case per batch).
        expand: maps a process's share of items to the dataset the loader reads (whole-slide
            inference: a slide to its patches).
    """

    def __init__(
        self,
        items: Sequence[dict],
        transform: Callable | None = None,
        batch_size: int = 1,
        num_workers: int = 0,
        collate: Callable = first,
        expand: Callable[[list[dict]], Sequence] | None = None,
    ) -> None:
        super().__init__()
        self.items, self.transform = list(items), transform
        self.batch_size, self.num_workers, self.collate, self.expand = batch_size, num_workers, collate, expand
        self.share: list[dict] = self.items
        self._data: Sequence | None = None
        # a process may have nothing to read (fewer cases than processes, a resumed run, slides
        # without tissue): it goes through the loop with an empty loader, which Lightning would refuse
        self.allow_zero_length_dataloader_with_multiple_devices = True

    def setup(self, stage: str) -> None:
        trainer = self.trainer
        if trainer is not None and trainer.world_size > 1:
            self.items = trainer.strategy.broadcast(self.items, src=0)
            self.share, self._data = self.items[trainer.global_rank :: trainer.world_size], None
        else:
            self.share = self.items

    def data(self) -> Sequence:
        """What this process's loader reads: its share of the items, expanded (once: expanding a
        slide computes its tissue grid)."""
        if self._data is None:
            self._data = self.expand(self.share) if self.expand else self.share
        return self._data

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(
            Dataset(self.data(), self.transform), batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers,
            collate_fn=self.collate, persistent_workers=False,
        )


class PredictionWriter(BasePredictionWriter):
    """Hands every prediction to ``write`` (returns the paths it wrote) on the process that
    computed it, batch by batch, so nothing waits for the end of the run; at the end of the
    loop ``flush`` (if any) waits for writes left to a background thread."""

    def __init__(self, write: Callable[[dict], list[Path]], flush: Callable[[], list[Path]] | None = None) -> None:
        super().__init__(write_interval="batch")
        self.write, self.flush = write, flush
        self.written: list[Path] = []

    def write_on_batch_end(self, trainer, module, prediction, batch_indices, batch, batch_idx, dataloader_idx=0) -> None:
        self.written += self.write(prediction)

    def on_predict_end(self, trainer, module) -> None:
        if self.flush is not None:
            self.written += self.flush()


@contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Lightning's set-up notes ("GPU available: ...", a logging tip, the DDP banner) and its
    pytree deprecation under torch 2.13 are printed on every run; ``infer`` reports its own
    lines instead. Warnings and errors still show."""
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    level = rank_zero.level
    rank_zero.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
            yield
    finally:
        rank_zero.setLevel(level)


def _accelerator(device: str, devices: int | None = None) -> tuple[str, int | list[int]]:
    """Lightning's ``accelerator`` and ``devices`` for ``--device`` and ``--devices``: ``cuda:N``
    is GPU ``N``. ``cuda:N`` with more than one process is refused rather than guessed at (GPUs
    N, N+1, ...? Lightning would take 0, 1, ...): ``CUDA_VISIBLE_DEVICES`` chooses the GPUs."""
    kind, _, index = device.partition(":")
    if index and devices is not None and devices > 1:
        raise InputError(f"--device {device} names one GPU, --devices {devices} asks for {devices} processes: give --device cuda "
                         f"--devices {devices} (choose the GPUs with CUDA_VISIBLE_DEVICES), or --device {device} alone")
    if index:
        return "gpu", [int(index)]
    return ("gpu" if kind == "cuda" else "cpu"), devices or 1


def run_prediction(
    module: L.LightningModule,
    data: PredictionDataModule,
    write: Callable[[dict], list[Path]],
    device: str = "cpu",
    devices: int | None = None,
    strategy: str = "auto",
    num_nodes: int = 1,
    precision: str = "auto",
    finish: Callable[[], list[Path]] | None = None,
    flush: Callable[[], list[Path]] | None = None,
) -> tuple[list[Path], list[Path], bool]:
    """Predict ``data`` with ``module`` in Lightning's predict loop, writing as it goes.

    ``device`` (``cpu``, ``cuda``, ``cuda:N``) with ``devices`` (processes per node; default 1),
    ``strategy`` and ``num_nodes`` pass to the ``Trainer``; ``precision`` ``auto`` is mixed
    precision on CUDA (bf16 where supported) and float32 on the CPU. After every process is done,
    the first runs ``finish`` (merging per-case files, say). ``flush``: see
    :class:`PredictionWriter`.

    Returns the paths this process wrote, those ``finish`` wrote (on the first process; else
    none) and whether this is the first process (the one that reports).
    """
    from hsmla_med.engine.distributed import ShareCPUs, check_cpu_processes, start_up_deadline
    from hsmla_med.engine.run import _precision

    accelerator, devices = _accelerator(device, devices)
    check_cpu_processes(accelerator, devices)
    with _quiet_lightning():
        trainer = L.Trainer(
            accelerator=accelerator,
            devices=devices,
            strategy=strategy,
            num_nodes=num_nodes,
            precision=_precision({"precision": precision, "accelerator": accelerator}),
            logger=False,
            callbacks=[writer := PredictionWriter(write, flush), ShareCPUs()],
            use_distributed_sampler=False,  # whole cases per process: PredictionDataModule splits them
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        # several processes all enter the loop, where PredictionDataModule.setup gives every one
        # rank 0's list: deciding here on each process's own list could leave one waiting alone.
        # One process skips a loop with nothing to read (slides without a tissue patch), which
        # Lightning would run only to warn that its loader is empty.
        if trainer.world_size > 1 or data.items and len(data.data()):
            with start_up_deadline(trainer):
                trainer.predict(module, datamodule=data, return_predictions=False)
        else:
            log.info("nothing to predict: %s", "the inputs hold nothing to read" if data.items else "every output exists")
    if trainer.world_size > 1:
        trainer.strategy.barrier("prediction-written")
    finished = finish() if trainer.is_global_zero and finish is not None else []
    return writer.written, finished, trainer.is_global_zero

