"""Running the Lightning loop for any task: trainer construction, fit (its final step always
validated), resume, evaluation, and checkpoint loading with ``weights_only=True``."""

from __future__ import annotations

import os
import logging
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning_utilities.core.imports import module_available

from hsmla_med.engine.callbacks import LogSampleImages, MetricsWriter, StepProgressBar, ValidateFinalStep
from hsmla_med.engine.checkpoint import AtomicCheckpointIO, exported_file, load_exported, read_checkpoint, read_hparams
from hsmla_med.engine.distributed import ShareCPUs, check_cpu_processes, check_launcher, start_up_deadline
from hsmla_med.errors import ConfigError, DataError, InputError
from hsmla_med.io import remove_stale_temporaries

__all__ = ["PRECISIONS", "STRATEGIES", "build_trainer", "check_trainer_config", "fit", "evaluate", "load_module"]

# what hsmla_med.engine.base.hparams writes into every checkpoint
_HPARAMS = ("task", "network", "spatial_dims", "in_channels", "label_names", "optim", "loss", "inference", "data")

log = logging.getLogger("hsmla_med")


#: Lightning strategies these runs support. ddp_spawn/fork/notebook run fit in processes that do
#: not hand the module's summary back to the launching one; deepspeed and fsdp shard the network,
#: whose sharded checkpoints ``load_module`` cannot read whole.
STRATEGIES = ("auto", "ddp")
#: precisions these runs support. ``64-true`` is left out: it doubles every tensor, and HSMLA's
#: kernels take float32 and half precision only (validation falls back to the reference path),
#: at 2-3x the time of ``32-true`` for no gain (docs/design.md §6.3).
PRECISIONS = ("auto", "32-true", "16-mixed", "bf16-mixed")


def _choice(trainer_cfg: dict, key: str, supported: tuple[str, ...]) -> str:
    value = str(trainer_cfg.get(key, "auto"))
    if value not in supported:
        raise ConfigError(f"--{key} {value!r} (trainer.{key}): not supported; use one of {', '.join(supported)}")
    return value


def _precision(trainer_cfg: dict) -> str:
    """``auto``: mixed precision on CUDA (bf16 where supported), full float32 elsewhere."""
    precision = _choice(trainer_cfg, "precision", PRECISIONS)
    if precision != "auto":
        return precision
    on_cuda = torch.cuda.is_available() and trainer_cfg.get("accelerator", "auto") in ("auto", "gpu", "cuda")
    if not on_cuda:
        return "32-true"
    return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"


#: ``trainer.logger`` / ``--logger``: where the curves go besides the CSV, with what installs it
LOGGERS = {"csv": (), "tensorboard": ("tensorboard", "tensorboardX"), "mlflow": ("mlflow",)}  # name -> the modules, any of which serves


def _check_logger(name: str) -> None:
    """Refuse, before any work, a logger that is not one of :data:`LOGGERS` or not installed
    (one line with the command that installs it: TensorBoard and MLflow are optional extras)."""
    if name not in LOGGERS:
        raise ConfigError(f"--logger {name}: one of {', '.join(LOGGERS)}")
    needed = LOGGERS[name]
    if needed and not any(module_available(m) for m in needed):
        raise ConfigError(f"--logger {name}: {needed[0]} is not installed; pip install {needed[0]} (or pip install -e '.[{name}]')")


def _loggers(output: Path, name: str = "csv") -> list:
    """Lightning's CSV logger always (``OUTPUT/logs``: the curve, ``metrics.csv`` and the report
    read it), and TensorBoard's (``OUTPUT/tensorboard``) or MLflow's (the tracking server of
    ``MLFLOW_TRACKING_URI``, else a file store in ``OUTPUT/mlruns``) when ``name`` asks. Each run
    gets a new ``version_N`` folder, so a resumed run adds its rows beside the earlier ones
    instead of replacing them."""
    loggers = [CSVLogger(output, name="logs")]
    if name == "tensorboard":
        loggers.append(TensorBoardLogger(output, name="tensorboard", version=loggers[0].version))
    elif name == "mlflow":
        from lightning.pytorch.loggers import MLFlowLogger

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (Path(output).resolve() / "mlruns").as_uri()
        loggers.append(MLFlowLogger(experiment_name="hsmla-med", run_name=Path(output).name, tracking_uri=uri))
    return loggers


def _limit(trainer_cfg: dict, key: str) -> int | None:
    """``trainer.max_steps``/``trainer.max_epochs``: a positive whole number, or unset (None)."""
    value = trainer_cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"trainer.{key} must be a positive whole number (or null), got {value!r}")
    return value


def check_trainer_config(trainer_cfg: dict) -> None:
    """Refuse, before any work, a ``trainer`` section these runs cannot execute: an unsupported
    strategy or precision, more CPU processes than cores, several nodes without a launcher (one
    line each)."""
    _choice(trainer_cfg, "strategy", STRATEGIES)
    _choice(trainer_cfg, "precision", PRECISIONS)
    _check_logger(trainer_cfg.get("logger", "csv"))
    check_cpu_processes(trainer_cfg.get("accelerator", "auto"), trainer_cfg.get("devices", "auto"))
    check_launcher(trainer_cfg.get("num_nodes", 1))


def build_trainer(trainer_cfg: dict, output: Path, callbacks: list | None = None, loggers: list | None = None) -> L.Trainer:
    """A ``lightning.Trainer`` from the ``trainer`` config section; ``accelerator``, ``devices``,
    ``num_nodes`` and ``strategy`` pass straight through, so ``strategy: ddp`` with several
    devices or nodes runs Lightning's DDP.

    Training lasts ``max_steps`` optimizer steps or ``max_epochs`` epochs (100 when neither is
    set); a value below 1 raises :class:`~hsmla_med.errors.ConfigError`. Checkpoints are written
    atomically (:class:`~hsmla_med.engine.checkpoint.AtomicCheckpointIO`); the progress bar, when
    enabled, counts the run's optimizer steps, and prints plain lines where standard output is not
    a terminal (:class:`StepProgressBar`). With ``loggers``, Lightning's ``LearningRateMonitor``
    logs the learning rate of each logged step (``lr-AdamW``) to every one of them, beside the
    loss: the schedule as it ran. Without loggers (evaluation) there is nothing to log it to, and
    the monitor refuses to start.
    """
    max_steps, max_epochs = _limit(trainer_cfg, "max_steps"), _limit(trainer_cfg, "max_epochs")
    check_trainer_config(trainer_cfg)
    progress_bar = bool(trainer_cfg.get("progress_bar", True))
    return L.Trainer(
        default_root_dir=output,
        accelerator=trainer_cfg.get("accelerator", "auto"),
        devices=trainer_cfg.get("devices", "auto"),
        num_nodes=trainer_cfg.get("num_nodes", 1),
        strategy=_choice(trainer_cfg, "strategy", STRATEGIES),
        precision=_precision(trainer_cfg),
        max_steps=max_steps or -1,
        max_epochs=max_epochs or (None if max_steps else 100),
        gradient_clip_val=trainer_cfg.get("gradient_clip_val"),
        check_val_every_n_epoch=trainer_cfg.get("check_val_every_n_epoch", 1),
        log_every_n_steps=trainer_cfg.get("log_every_n_steps", 10),
        num_sanity_val_steps=0,
        enable_progress_bar=progress_bar,
        enable_model_summary=False,
        logger=loggers or False,
        callbacks=[*(callbacks or []), *([LearningRateMonitor(logging_interval="step")] if loggers else []),
                   *([StepProgressBar()] if progress_bar else []), ShareCPUs()],
        plugins=[AtomicCheckpointIO()],
    )


def fit(module: L.LightningModule, datamodule: L.LightningDataModule, output: str | Path, trainer_cfg: dict, resume: bool = False) -> dict:
    """Train and leave in ``output``: ``last.ckpt`` (the latest validated state), ``best.ckpt``
    (highest ``val/<module.monitor>``), ``metrics.json``, ``metrics.csv``, ``logs/metrics.csv`` and
    ``training_curve.png``. Returns the final validation's summary (``module.summary``).

    The final step is always validated, inside the fit loop (:class:`ValidateFinalStep`), so two
    ``ModelCheckpoint`` callbacks own the checkpoints: one keeps ``best.ckpt``, the other
    rewrites ``last.ckpt`` after every validation. Both write atomically, and temporaries that
    killed runs left in ``output`` are removed first (:func:`~hsmla_med.io.remove_stale_temporaries`).

    ``resume`` continues from ``output/last.ckpt``: weights, optimizer, learning-rate schedule,
    step count and the best score so far; ``max_steps``/``max_epochs`` are the totals to reach, not
    additional steps. A ``last.ckpt`` that is no checkpoint of train (empty, truncated, foreign)
    raises :class:`~hsmla_med.errors.DataError` saying what it is.
    """
    output = Path(output)
    last = output / "last.ckpt"
    if resume and not last.exists():
        raise InputError(f"{last}: no checkpoint to resume from")
    if resume:
        _check_resumable(last, module)
    remove_stale_temporaries(output)
    best_checkpoint = ModelCheckpoint(
        dirpath=output,
        filename="best",
        monitor=f"val/{module.monitor}",
        mode="max",
        save_top_k=1,
        auto_insert_metric_name=False,
        enable_version_counter=False,
        save_on_train_epoch_end=False,  # after validations only (a resumed epoch's end has no scores)
    )
    # no monitor: the one "top-1" checkpoint is rewritten at every validation
    last_checkpoint = ModelCheckpoint(dirpath=output, filename="last", save_top_k=1, enable_version_counter=False, save_on_train_epoch_end=False)
    loggers = _loggers(output, trainer_cfg.get("logger", "csv"))
    # the curve of a resumed run includes the rows of the runs it continues
    version = loggers[0].version
    logs = [output / "logs" / f"version_{v}" / "metrics.csv" for v in (range(version + 1) if resume else [version])]
    callbacks = [ValidateFinalStep(), MetricsWriter(output, logs), best_checkpoint, last_checkpoint]
    if trainer_cfg.get("logger", "csv") != "csv":  # sample predictions as images where the logger shows them
        module.log_samples = True
        callbacks.append(LogSampleImages())
    trainer = build_trainer(trainer_cfg, output, callbacks, loggers)
    with start_up_deadline(trainer):
        trainer.fit(module, datamodule=datamodule, ckpt_path=str(last) if resume else None, weights_only=True)
    if module.summary is None:  # resumed at or past its step limit: no step trained, none validated
        trainer.validate(module, datamodule=datamodule, verbose=False)
    return module.summary


#: the hyper-parameters that shape a network's weights: a checkpoint resumes only into the same
_SHAPES_WEIGHTS = ("task", "network", "spatial_dims", "in_channels", "label_names")


def _describe(config: dict) -> str:
    network = config.get("network") if isinstance(config.get("network"), dict) else {}
    model = network.get("variant") or network.get("monai") or "a custom model"
    return f"task {config.get('task')}, model {model} ({config.get('spatial_dims')}D, {len(config.get('label_names') or [])} labels)"


def _check_resumable(last: Path, module: L.LightningModule) -> None:
    """Refuse, before the trainer starts, to resume from a file that is no checkpoint of train
    (:func:`~hsmla_med.engine.checkpoint.read_hparams` says what it is) or from a checkpoint of
    another task or network (its weights would not fit: Lightning's ``size mismatch``
    traceback), naming the folder and both sides."""
    saved = read_hparams(last)
    wanted = module.config
    differ = [key for key in _SHAPES_WEIGHTS if not isinstance(saved, dict) or saved.get(key) != wanted.get(key)]
    if differ:
        raise InputError(f"--resume: {last.parent} holds a run of {_describe(saved if isinstance(saved, dict) else {})}, this run asks for "
                         f"{_describe(wanted)} ({', '.join(differ)} differ); give another --output, or the run's own task and model")


def evaluate(module: L.LightningModule, datamodule: L.LightningDataModule, trainer_cfg: dict, output: str | Path) -> dict:
    """Validate ``module`` on the datamodule's validation cases (across all processes of the
    configured strategy) and return the gathered summary."""
    trainer = build_trainer(trainer_cfg, Path(output))
    with start_up_deadline(trainer):
        trainer.validate(module, datamodule=datamodule, verbose=False)
    return module.summary


def _full_res_of(state: dict) -> str | None:
    """The ``full_res`` level (:data:`~hsmla_med.nn.hsmla_net.FULL_RES`) a unet decoder's weights
    hold; ``None`` when they hold no unet decoder. The weights sit under ``network.``, or
    ``network.network.`` inside a calibrated checkpoint's temperature wrapper."""
    for prefix in ("network.", "network.network."):
        if f"{prefix}decoder.refine.1.0.0.weight" not in state:
            continue
        if f"{prefix}decoder.refine.0.0.0.weight" in state:
            return "refine"  # a 3x3 convolution, then the DSConv
        return "light" if f"{prefix}decoder.refine.0.0.body.0.0.weight" in state else "sum"
    return None


def load_module(
    path: str | Path, module_class: type[L.LightningModule], task: str | None = None, inference: dict | None = None
) -> tuple[L.LightningModule, dict]:
    """Rebuild a module from a Lightning checkpoint, loaded with ``weights_only=True``, or
    around an exported TorchScript network (a ``.ts`` file or a bundle folder of ``hsmla-med
    export``: :func:`~hsmla_med.engine.checkpoint.load_exported`).

    ``task``: refuse a checkpoint that another task wrote (its hyper-parameters name the task);
    ``inference``: settings of this run over the checkpoint's ``inference`` section (``tta``).
    Returns the module (eval mode, CPU) and the checkpoint's ``epoch``/``global_step``.
    """
    path = Path(path)
    if exported_file(path) is not None:  # hsmla-med export's TorchScript file or bundle folder
        return load_exported(path, module_class, task, inference)
    checkpoint = read_checkpoint(path)
    config, state = checkpoint["hyper_parameters"], checkpoint["state_dict"]
    written_by = config.get("task") if isinstance(config, dict) else None
    missing = [k for k in _HPARAMS if not isinstance(config, dict) or k not in config]
    if task is not None and written_by != task:
        raise DataError(f"{path}: a {written_by or 'non-hsmla-med'} checkpoint, not one of task {task}; use --task {written_by}" if written_by else f"{path}: not an hsmla-med checkpoint of task {task}")
    if missing:
        raise DataError(f"{path}: checkpoint hyper-parameters are incomplete (missing {', '.join(missing)})")
    config = {**config, "inference": {**config["inference"], **(inference or {})}}
    network = config.get("network")
    level = _full_res_of(state) if isinstance(network, dict) and "full_res" not in network else None
    if level is not None:
        # A unet decoder whose hyper-parameters leave its full-resolution level to the default,
        # which changed for 3D (refine until commit 242743b, then light, now sum):
        # the level its weights hold.
        config["network"] = {**network, "full_res": level}
    try:
        module = module_class(config)
    except (KeyError, TypeError, ValueError) as err:
        raise DataError(f"{path}: checkpoint hyper-parameters are incomplete or invalid ({type(err).__name__}: {err})") from None
    try:
        module.load_state_dict(state)
    except RuntimeError as err:
        raise DataError(f"{path}: checkpoint weights do not fit the network it describes ({err})") from None
    module.eval()
    return module, {"epoch": checkpoint.get("epoch"), "step": checkpoint.get("global_step")}
