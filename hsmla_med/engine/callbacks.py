"""A run's result files: ``metrics.json``/``metrics.csv`` after every validation (a callback) and
the training-curve PNG."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L

from hsmla_med.io import atomic_path, write_json

__all__ = ["MetricsWriter", "training_curve"]


class MetricsWriter(L.Callback):
    """After every validation, (re)write ``OUTPUT/metrics.json`` with the module's ``summary`` plus
    ``epoch`` and ``step``, and append a row to ``OUTPUT/metrics.csv``. Rank zero writes."""

    def __init__(self, output: str | Path) -> None:
        self.output = Path(output)

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
        with atomic_path(table) as tmp, tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(row))
            writer.writeheader()
            writer.writerows(rows)


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
