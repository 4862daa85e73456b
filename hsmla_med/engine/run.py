"""Running the Lightning loop for any task: trainer construction, fit with a final validation,
resume, evaluation, and checkpoint loading with ``weights_only=True``."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from lightning_utilities.core.imports import module_available

from hsmla_med.engine.callbacks import MetricsWriter, training_curve
from hsmla_med.errors import DataError, InputError
from hsmla_med.io import atomic_path

__all__ = ["build_trainer", "fit", "evaluate", "load_module"]

log = logging.getLogger("hsmla_med")


def _precision(trainer_cfg: dict) -> str:
    """``auto``: mixed precision on CUDA (bf16 where supported), full float32 elsewhere."""
    precision = str(trainer_cfg.get("precision", "auto"))
    if precision != "auto":
        return precision
    on_cuda = torch.cuda.is_available() and trainer_cfg.get("accelerator", "auto") in ("auto", "gpu", "cuda")
    if not on_cuda:
        return "32-true"
    return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"


def _loggers(output: Path) -> list:
    """CSV always, TensorBoard when installed. Each run gets a new ``version_N`` folder, so a
    resumed run adds its rows beside the earlier ones instead of replacing them."""
    loggers = [CSVLogger(output, name="logs")]
    if module_available("tensorboard") or module_available("tensorboardX"):
        loggers.append(TensorBoardLogger(output, name="tensorboard", version=loggers[0].version))
    return loggers


def build_trainer(trainer_cfg: dict, output: Path, callbacks: list | None = None, loggers: list | None = None) -> L.Trainer:
    """A ``lightning.Trainer`` from the ``trainer`` config section; ``accelerator``, ``devices``,
    ``num_nodes`` and ``strategy`` pass straight through, so ``strategy: ddp`` with several
    devices or nodes runs Lightning's DDP."""
    return L.Trainer(
        default_root_dir=output,
        accelerator=trainer_cfg.get("accelerator", "auto"),
        devices=trainer_cfg.get("devices", "auto"),
        num_nodes=trainer_cfg.get("num_nodes", 1),
        strategy=trainer_cfg.get("strategy", "auto"),
        precision=_precision(trainer_cfg),
        max_steps=trainer_cfg.get("max_steps") or -1,
        max_epochs=trainer_cfg.get("max_epochs") or (None if trainer_cfg.get("max_steps") else 100),
        gradient_clip_val=trainer_cfg.get("gradient_clip_val"),
        check_val_every_n_epoch=trainer_cfg.get("check_val_every_n_epoch", 1),
        log_every_n_steps=trainer_cfg.get("log_every_n_steps", 10),
        num_sanity_val_steps=0,
        enable_progress_bar=trainer_cfg.get("progress_bar", True),
        enable_model_summary=False,
        logger=loggers or False,
        callbacks=callbacks or [],
    )


def fit(module: L.LightningModule, datamodule: L.LightningDataModule, output: str | Path, trainer_cfg: dict, resume: bool = False) -> dict:
    """Train, validate once more at the end if the last step was not validated, and leave
    ``last.ckpt``, ``best.ckpt`` (highest ``val/<module.monitor>``), ``metrics.json``, ``metrics.csv``,
    ``logs/metrics.csv`` and ``training_curve.png`` in ``output``. Returns the final summary.

    ``resume`` continues from ``output/last.ckpt``: weights, optimizer, learning-rate schedule and
    step count; ``max_steps``/``max_epochs`` are the totals to reach, not additional steps.
    """
    output = Path(output)
    last, best = output / "last.ckpt", output / "best.ckpt"
    if resume and not last.is_file():
        raise InputError(f"{last}: no checkpoint to resume from")
    checkpoints = ModelCheckpoint(
        dirpath=output,
        filename="best",
        monitor=f"val/{module.monitor}",
        mode="max",
        save_top_k=1,
        save_last=True,
        auto_insert_metric_name=False,
        enable_version_counter=False,
    )
    loggers = _loggers(output)
    trainer = build_trainer(trainer_cfg, output, [checkpoints, MetricsWriter(output)], loggers)
    trainer.fit(module, datamodule=datamodule, ckpt_path=str(last) if resume else None, weights_only=True)
    trainer.save_checkpoint(last, weights_only=False)  # the final state, whatever the checkpoint schedule saw
    if module.validated_step != trainer.global_step:
        best_before = checkpoints.best_model_score
        trainer.validate(module, datamodule=datamodule, verbose=False)
        score = module.summary.get(module.monitor)
        if score is not None and (best_before is None or score > float(best_before) or not best.exists()):
            _copy_rank_zero(last, best)
    # the curve of a resumed run includes the rows of the runs it continues
    version = loggers[0].version
    logs = [output / "logs" / f"version_{v}" / "metrics.csv" for v in (range(version + 1) if resume else [version])]
    _finish_rank_zero(trainer, logs, output / "training_curve.png", module.monitor)
    return module.summary


@rank_zero_only
def _copy_rank_zero(source: Path, target: Path) -> None:
    with atomic_path(target) as tmp:
        shutil.copyfile(source, tmp)


@rank_zero_only
def _finish_rank_zero(trainer: L.Trainer, logs: list[Path], curve: Path, monitor: str) -> None:
    for logger in trainer.loggers:
        logger.save()
    training_curve(logs, curve, monitor)


def evaluate(module: L.LightningModule, datamodule: L.LightningDataModule, trainer_cfg: dict, output: str | Path) -> dict:
    """Validate ``module`` on the datamodule's validation cases (across all processes of the
    configured strategy) and return the gathered summary."""
    trainer = build_trainer(trainer_cfg, Path(output))
    trainer.validate(module, datamodule=datamodule, verbose=False)
    return module.summary


def load_module(path: str | Path, module_class: type[L.LightningModule]) -> tuple[L.LightningModule, dict]:
    """Rebuild a module from a Lightning checkpoint, loaded with ``weights_only=True``.

    Returns the module (eval mode, CPU) and the checkpoint's ``epoch``/``global_step``.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: checkpoint not found")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        config = checkpoint["hyper_parameters"]
        state = checkpoint["state_dict"]
    except Exception as err:  # truncated file, foreign pickle, not a Lightning checkpoint
        raise DataError(f"{path}: not a readable hsmla-med checkpoint ({type(err).__name__}: {err})") from None
    module = module_class(dict(config))
    try:
        module.load_state_dict(state)
    except RuntimeError as err:
        raise DataError(f"{path}: checkpoint weights do not fit the network it describes ({err})") from None
    module.eval()
    return module, {"epoch": checkpoint.get("epoch"), "step": checkpoint.get("global_step")}
