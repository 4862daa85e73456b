"""Callbacks of a training run: its result files (``metrics.json``, ``metrics.csv``, the
training-curve PNG and the gates' example, all owned by :class:`MetricsWriter`), the validation of the final step
(:class:`ValidateFinalStep`) and a progress bar that counts the run's steps (:class:`StepProgressBar`)."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import lightning as L
import numpy as np
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm, convert_inf

from hsmla_med.io import atomic_path, write_json
from hsmla_med.io.overlays import gate_panels

__all__ = ["GATES_PICTURE", "MetricsWriter", "StepProgressBar", "ValidateFinalStep", "training_curve", "write_gate_example"]

GATES_PICTURE = "validation_gates.png"  # the report shows it with the slides' *_gates.png


def write_gate_example(module: L.LightningModule, output: Path) -> Path | None:
    """``OUTPUT/validation_gates.png``: where each gated layer refined for one input of the
    last validation (:attr:`~hsmla_med.engine.base.GatedModule.validation_gates`); nothing
    where no gate ran.

    A slice of a volume (the inputs of the volumetric segmentation modules are RAS voxel arrays,
    ``(x, y)`` slices in 2D mode) is drawn as the report draws the slices of a volume
    (:func:`hsmla_med.report.worst.volume_views`): its first axis across, its second upward, so
    that the gates and the worst cases above them in the report share one orientation. Frames
    and patches are pictures already, rows downward, and are drawn as they are."""
    gates = getattr(module, "validation_gates", None)
    if not gates:
        return None
    image, refined = gates["image"], gates["refined"]
    if getattr(module, "volume_slices", False):
        image, refined = _upright(image), {name: _upright(tiles) for name, tiles in refined.items()}
    return gate_panels(Path(output) / GATES_PICTURE, image, refined,
                       f"tiles refined (bright) for one validation input: network call {gates['call']} of {gates['calls']}")


def _upright(plane: np.ndarray) -> np.ndarray:
    """A slice ``(first axis, second axis)`` as picture rows (top down: the second axis from its
    end) and columns (the first axis): what ``imshow`` of the transpose with ``origin="lower"`` shows."""
    return np.flipud(np.asarray(plane).T)


class MetricsWriter(L.Callback):
    """The one writer of a run's metric files (rank zero writes).

    After every validation it (re)writes ``OUTPUT/metrics.json`` with the module's ``summary`` plus
    ``epoch`` and ``step``, and adds that step's row to ``OUTPUT/metrics.csv``; when training ends
    it draws ``OUTPUT/training_curve.png`` from the CSV logger files ``curve_logs`` (in run order:
    a resumed run lists those of the runs it continues).
    """

    def __init__(self, output: str | Path, curve_logs: list[Path] | None = None) -> None:
        self.output = Path(output)
        self.curve_logs = list(curve_logs or [])

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:  # flush the final validation's rows
            logger.save()
        if self.curve_logs:
            training_curve(self.curve_logs, self.output / "training_curve.png", module.monitor)

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.sanity_checking or module.summary is None or not trainer.is_global_zero:
            return
        record = {**module.summary, "epoch": trainer.current_epoch, "step": trainer.global_step}
        write_json(self.output / "metrics.json", record)
        write_gate_example(module, self.output)
        row = {"epoch": record["epoch"], "step": record["step"]}
        for key, value in module.summary.items():  # per-class dicts become columns key_name
            if isinstance(value, dict):
                row.update({f"{key.removesuffix('_per_class')}_{k}": v for k, v in value.items()})
            else:
                row[key] = value
        table = self.output / "metrics.csv"
        rows = []
        if table.exists():
            with table.open(newline="") as f:
                # a resumed run re-validating a step replaces that step's row
                rows = [r for r in csv.DictReader(f) if r["step"] != str(row["step"])]
        rows.append(row)
        columns = list(dict.fromkeys(key for r in rows for key in r))  # earlier rows may lack a column
        with atomic_path(table) as tmp, tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)


class ValidateFinalStep(L.Callback):
    """Validate after the last training step even where the schedule would not (``max_steps``
    reached within an epoch, or a final epoch that ``check_val_every_n_epoch`` skips).

    The validation runs inside the fit loop, so that ``ModelCheckpoint`` (which saves only while
    fitting) writes ``best.ckpt`` and ``last.ckpt`` of the final weights like any others. Lightning
    validates after a batch that asks the trainer to stop; in an epoch that the schedule skips it
    does so only once ``check_val_every_n_epoch`` is lifted, which this does on that last step.
    """

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        by_steps = trainer.max_steps is not None and trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps
        last_batch = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        by_epochs = trainer.max_epochs is not None and trainer.max_epochs > 0 and last_batch and trainer.current_epoch + 1 >= trainer.max_epochs
        if not (by_steps or by_epochs):
            return
        trainer.should_stop = True
        every = trainer.check_val_every_n_epoch
        if every is not None and (trainer.current_epoch + 1) % every != 0:
            trainer.check_val_every_n_epoch = None


def _val_batches(trainer: L.Trainer) -> list:
    """The batch count of each loader of the running validation (or sanity check)."""
    batches = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
    return batches if isinstance(batches, list) else [batches]


class _Lines:
    """A text stream for tqdm that turns its redraws into plain lines: tqdm always draws by
    carriage return (``\\r`` + text + blank padding, and ``\\r`` again on close), which a pipe or
    log file shows as one endless line; each non-blank drawing here becomes a line of its own."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").strip()
        if line:
            self.stream.write(line + "\n")
            self.stream.flush()

    def flush(self) -> None:
        self.stream.flush()


class StepProgressBar(TQDMProgressBar):
    """Lightning's tqdm progress bar with one training bar for the whole run and one bar per
    validation.

    Lightning's bar counts each epoch's batches: it resets at every epoch (``Epoch 3: 0/5``, its
    elapsed time and rate restart, so right after an epoch's slow first batch the ETA reads
    hours), draws ``Training: 0/?`` and ``Validation: 0/?`` before it knows the totals, and writes
    terminal redraws (``\\r``, cursor moves) into a pipe. Here the training bar counts optimizer
    steps up to the run's total (``max_steps``, or the steps of ``max_epochs``:
    ``trainer.estimated_stepping_batches``), created once with that total and never reset, so its
    rate and ETA average over the run (tqdm's ``smoothing=0``; a resumed run counts from its
    resumed step). The validation bar counts the batches of all validation loaders. When
    ``plain`` (default: standard output is not a terminal) each bar prints plain lines instead,
    at most one every ``interval`` seconds plus its final count.
    """

    PLAIN_FORMAT = "{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_noinv_fmt}{postfix}]"

    def __init__(self, plain: bool | None = None, interval: float = 30.0) -> None:
        super().__init__()
        self.plain = plain
        self.interval = interval

    def _bar(self, desc: str, total: float | None, position: int, leave: bool, **kwargs) -> Tqdm:
        plain = not sys.stdout.isatty() if self.plain is None else self.plain
        total = convert_inf(total) if total and total > 0 else None  # -1, 0 or inf: unknown
        common = {"desc": desc, "total": total, "disable": self.is_disabled, "miniters": 1, "smoothing": 0, **kwargs}
        if plain:  # one position (nested bars move the cursor); the final count is forced by _advance
            return Tqdm(position=0, leave=False, file=_Lines(sys.stdout), mininterval=self.interval, bar_format=self.PLAIN_FORMAT, **common)
        return Tqdm(position=position, leave=leave, file=sys.stdout, dynamic_ncols=True, bar_format=self.BAR_FORMAT, **common)

    @staticmethod
    def _advance(bar: Tqdm | None, n: int) -> None:
        """Move ``bar`` to ``n``, drawn as tqdm's ``mininterval`` allows, and always at its total."""
        if bar is None or bar.disable:
            return
        if not bar.update(n - bar.n) and n == bar.total:
            bar.refresh()

    def init_train_tqdm(self) -> Tqdm:
        trainer = self.trainer
        return self._bar(f"Epoch {trainer.current_epoch}", trainer.estimated_stepping_batches, 2 * self.process_position,
                         leave=True, initial=trainer.global_step, unit="step")

    def init_validation_tqdm(self) -> Tqdm:
        trainer = self.trainer
        has_main_bar = trainer.state.fn == "fit" and not trainer.sanity_checking  # below the training bar
        desc = self.sanity_check_description if trainer.sanity_checking else self.validation_description
        return self._bar(desc, sum(_val_batches(trainer)), 2 * self.process_position + has_main_bar, leave=not has_main_bar)

    def on_train_epoch_start(self, trainer: L.Trainer, *_) -> None:
        self.train_progress_bar.set_description_str(f"Epoch {trainer.current_epoch}", refresh=False)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        if self._train_progress_bar is not None:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, module), refresh=False)
            self._advance(self.train_progress_bar, trainer.global_step)

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.train_progress_bar.set_postfix(self.get_metrics(trainer, module), refresh=False)  # shown at the next drawing

    # Lightning draws the sanity check's bar before its loaders (and so its total) are known and
    # closes it again at the check's end; here the validation hooks, which run in the check too,
    # draw and close it like any validation bar.
    def on_sanity_check_start(self, *_) -> None:
        pass

    def on_sanity_check_end(self, *_) -> None:
        pass

    def on_validation_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.val_progress_bar = self.init_validation_tqdm()

    def on_validation_batch_start(self, *_, **__) -> None:
        pass  # Lightning resets its bar here, per loader, to learn that loader's total

    def on_validation_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._advance(self._val_progress_bar, sum(_val_batches(trainer)[:dataloader_idx]) + batch_idx + 1)

    def get_metrics(self, trainer: L.Trainer, module: L.LightningModule) -> dict:
        metrics = super().get_metrics(trainer, module)
        metrics.pop("v_num", None)  # the logger's version number: noise on the bar
        return metrics


def training_curve(csv_logs: list[Path], path: str | Path, monitor: str = "dice") -> None:
    """Plot the training loss and the validation ``monitor`` metric from CSV-logger
    ``metrics.csv`` files (in run order) into ``path`` (PNG), against the step."""
    loss, score = [], []
    for csv_log in csv_logs:
        if not csv_log.exists():
            continue
        with csv_log.open(newline="") as f:
            for r in csv.DictReader(f):
                if r.get("train/loss"):
                    loss.append((int(r["step"]), float(r["train/loss"])))
                if r.get(f"val/{monitor}"):
                    score.append((int(r["step"]), float(r[f"val/{monitor}"])))
    plot_curve(Path(path), loss, score, monitor)


def plot_curve(path: Path, loss: list[tuple[int, float]], score: list[tuple[int, float]], monitor: str) -> None:
    """Training loss (left axis) and the validation metric (right axis, 0..1) against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if loss:
        ax.plot(*zip(*loss), color="tab:blue", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss", color="tab:blue")
    right = ax.twinx()
    if score:
        right.plot(*zip(*score), "o-", color="tab:red")
    right.set_ylabel(f"validation {monitor}", color="tab:red")
    right.set_ylim(0, 1)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)


class LogSampleImages(L.Callback):
    """After each validation, the module's ``validation_sample`` (its first validated item: image,
    reference and prediction, :func:`~hsmla_med.io.overlays.sample_panels`) to the run's
    TensorBoard or MLflow logger, at the step it was taken: what those loggers show as sample
    predictions. Lightning's loggers log scalars only; images go through each one's experiment."""

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        sample, module.validation_sample = getattr(module, "validation_sample", None), None
        if sample is None or not trainer.is_global_zero:
            return
        from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger

        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_image("validation/sample", sample, trainer.global_step, dataformats="HWC")
            elif isinstance(logger, MLFlowLogger):
                logger.experiment.log_image(logger.run_id, sample, f"validation/sample_step{trainer.global_step:07d}.png")
