"""Callbacks of a training run: its result files (``metrics.json``, ``metrics.csv`` and the
training-curve PNG, all owned by :class:`MetricsWriter`), the validation of the final step
(:class:`ValidateFinalStep`) and a progress bar that counts steps (:class:`StepProgressBar`)."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar

from hsmla_med.io import atomic_path, write_json

__all__ = ["MetricsWriter", "StepProgressBar", "ValidateFinalStep", "training_curve"]


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


class StepProgressBar(TQDMProgressBar):
    """Lightning's tqdm progress bar; training by ``max_steps``, its training bar counts optimizer
    steps up to ``max_steps`` (``Epoch 7: 120/300 step``) instead of an epoch's batches."""

    def on_train_epoch_start(self, trainer: L.Trainer, *args) -> None:
        if self._train_progress_bar is not None:
            self._train_progress_bar.initial = 0  # Lightning's reset shows n = 0: no negative rate
        super().on_train_epoch_start(trainer, *args)
        if trainer.max_steps > 0:
            bar = self.train_progress_bar
            bar.total, bar.unit = trainer.max_steps, "step"
            # counted from here: the rate is this epoch's steps over this epoch's time
            bar.initial = bar.n = bar.last_print_n = trainer.global_step
            bar.last_print_t = bar.start_t = bar._time()
            bar.refresh()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        if trainer.max_steps <= 0:
            return super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)
        bar, n = self.train_progress_bar, trainer.global_step
        if bar is not None and self._should_update(n, bar.total):
            bar.n = n
            bar.set_postfix(self.get_metrics(trainer, module))


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
