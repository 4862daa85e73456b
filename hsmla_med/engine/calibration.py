"""Temperature scaling (Guo et al., 2017) of a checkpoint's probabilities: ``hsmla-med calibrate``.

The temperature ``T`` becomes part of the network: :class:`TemperatureScaled` divides the
wrapped network's logits by ``T`` (a buffer, saved in the state dict), and a module whose
hyper-parameters carry a ``calibration`` entry wraps the network it builds
(:func:`with_temperature`). Every path that runs ``module.network`` then applies it: ``infer``
and its ``--save-probabilities`` (softmax of the sliding window's blended logits, which are
linear in the window logits, so ``softmax(blend(z / T)) = softmax(blend(z) / T)``), sigmoid
(region) outputs alike, ``wsi-heatmap``, ``evaluate``, ensembles of calibrated members, and the
ONNX / TorchScript / MONAI Bundle exports, which trace the wrapper. A checkpoint without the
entry builds the bare network, so its state-dict keys load as before.

One temperature is the default: dividing every logit by the same positive number keeps their
order, so the argmax, the label maps and Dice are unchanged. ``--per-class`` fits one per class,
which can move the argmax.

Fitting: :func:`fit_temperature`, L-BFGS on ``log T`` (so ``T > 0``) minimising the NLL of a
:class:`CalibrationSample` of the validation cases of the checkpoint's persisted split, drawn by
the validation loop that ``evaluate`` runs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hsmla_med.defaults import CALIBRATION_SAMPLES as DEFAULT_SAMPLES
from hsmla_med.errors import ConfigError, DataError, InputError
from hsmla_med.metrics.calibration import BINS, NLL_FLOOR, calibration_metrics, foreground, reliability
from hsmla_med.nn import GatedNetwork
from hsmla_med.tasks import tasks_with

__all__ = ["DEFAULT_SAMPLES", "CalibrationSample", "TemperatureScaled", "calibrate", "check_calibratable",
           "fit_temperature", "plot_reliability", "with_temperature"]

#: fitted temperatures are kept within [1 / LIMIT, LIMIT]: on separable samples the NLL falls
#: for ever as T -> 0
LIMIT = 100.0


class TemperatureScaled(GatedNetwork):
    """A network whose logits are divided by a temperature.

    Args:
        network: the network ``(B, in, *spatial) -> (B, C, *spatial)`` logits.
        temperature: one positive value, or one per output channel.

    A :class:`~hsmla_med.nn.GatedNetwork` whose HSMLA layers are the wrapped network's (none for
    a MONAI network), so regularisers, routing, backends and tau calibration reach them through
    the wrapper. State-dict keys: the wrapped network's under ``network.``, and ``temperature``.
    """

    def __init__(self, network: nn.Module, temperature: float | Sequence[float] | torch.Tensor) -> None:
        super().__init__()
        self.network = network
        self.register_buffer("temperature", torch.as_tensor(temperature, dtype=torch.float32).detach().clone().reshape(-1))

    def scale(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``(B, C, *spatial)`` of the wrapped network divided by the temperature, in
        the temperature's float32 at least (half-precision logits under autocast are promoted,
        rather than the temperature rounded to 8 bits of mantissa).

        One temperature per class divides ``log_softmax(logits)`` instead, the log-probabilities
        :func:`fit_temperature` was fitted on (:class:`CalibrationSample` keeps those): the
        per-voxel constant ``logsumexp(logits)`` that separates them from the logits cancels in the
        softmax only when every class is divided by the same T. (Divided raw logits were another
        model than the fitted one: on the real MRI it cost 9 Dice points where the fit promised a
        higher accuracy, docs/benchmarks.md.)"""
        if self.temperature.numel() > 1:
            logits = torch.log_softmax(logits.float(), 1)
        return logits / self.temperature.reshape((1, -1) + (1,) * (logits.dim() - 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(self.network(x))


def with_temperature(network: nn.Module, calibration: dict, classes: int) -> TemperatureScaled:
    """``network`` wrapped with the temperature of a checkpoint's ``calibration`` entry
    (``{"temperature": [T] or [T_1, ..., T_C], ...}``); a :class:`~hsmla_med.errors.ConfigError`
    when it holds no positive temperature, or not one or ``classes`` of them."""
    values = calibration.get("temperature") if isinstance(calibration, dict) else None
    try:
        temperature = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    except (TypeError, ValueError, RuntimeError):
        temperature = torch.zeros(0)
    if temperature.numel() not in (1, classes) or not bool(torch.isfinite(temperature).all() & (temperature > 0).all()):
        raise ConfigError(f"calibration.temperature {values!r}: give one positive number, or one per class ({classes})")
    return TemperatureScaled(network, temperature)


def fit_temperature(logits, labels, per_class: bool = False, max_iter: int = 100) -> torch.Tensor:
    """The temperature that minimises the NLL of ``softmax(logits / T)``.

    Args:
        logits: ``(N, C)`` logits, or log-probabilities (the same up to a constant per sample,
            which the softmax ignores with one temperature; per class it does not, and
            :class:`TemperatureScaled` divides the log-probabilities, as calibrate fits them).
        labels: ``(N,)`` class indices.
        per_class: one temperature per class (which can move the argmax) instead of one.
        max_iter: L-BFGS iterations.

    Returns:
        float64 ``(1,)`` or ``(C,)``: ``exp`` of the fitted ``log T`` (strong-Wolfe line search,
        float64, all samples in one batch), within ``[1 / LIMIT, LIMIT]``.
    """
    # copies: tensors made under inference mode (the validation loop's) cannot enter autograd
    logits = torch.as_tensor(logits, dtype=torch.float64).clone()
    labels = torch.as_tensor(labels).long().reshape(-1).clone()
    log_t = torch.zeros(logits.shape[1] if per_class else 1, dtype=torch.float64, requires_grad=True)
    bound = float(np.log(LIMIT))
    optimizer = torch.optim.LBFGS([log_t], lr=1.0, max_iter=max_iter, line_search_fn="strong_wolfe", tolerance_grad=1e-9, tolerance_change=1e-12)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(logits / log_t.clamp(-bound, bound).exp(), labels)
        loss.backward()
        return loss

    with torch.enable_grad():  # callers may run under no_grad/inference mode
        optimizer.step(closure)
    return log_t.detach().clamp(-bound, bound).exp()


def _item_seed(key) -> int:
    """A 64-bit number of an item key (a case name or a patch index), the same in every process
    and run (Python's ``hash`` of a string is salted per process)."""
    return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little")


def _uniform(ids: np.ndarray) -> np.ndarray:
    """float64 in [0, 1), one per uint64 id: SplitMix64's finaliser, a counter-based hash, so a
    voxel's draw depends on its id alone and any voxel's is computed without the others' (numpy's
    generators draw sequences; one per patch would cost microseconds each)."""
    z = np.asarray(ids, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


class CalibrationSample:
    """A uniform random sample of at most ``limit`` validation samples (voxels or patches):
    their float32 log-probabilities ``(n, C)`` and labels, for the calibration metrics of
    ``evaluate`` and the fit of ``calibrate``.

    Each sample has a 64-bit id (its item's key hashed, plus the voxel's index in the item's
    preprocessed volume) and a uniform draw computed from the id (:func:`_uniform`); the sample
    keeps the ``limit`` smallest draws (bottom-k sampling). That set does not depend on the order
    in which items arrive nor on how they are split across processes, so merging samples (batch
    after batch, process with process in :meth:`gather`) is exact, and an item validated twice
    (the distributed sampler's padding) counts once. Memory stays at ``limit`` samples however
    many voxels the validation holds: an item gives at most ``limit`` before it is merged.
    """

    def __init__(self, limit: int = DEFAULT_SAMPLES) -> None:
        if limit < 1:
            raise InputError(f"--samples must be a positive number of samples, got {limit}")
        self.limit = int(limit)
        self.clear()

    def clear(self) -> None:
        self.ids = np.zeros(0, np.uint64)
        self.log_probs: torch.Tensor | None = None
        self.labels = torch.zeros(0, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.ids)

    def _merge(self, ids: np.ndarray, log_probs: torch.Tensor, labels: torch.Tensor) -> None:
        if self.log_probs is not None:
            ids = np.concatenate([self.ids, ids])
            log_probs, labels = torch.cat([self.log_probs, log_probs]), torch.cat([self.labels, labels])
        ids, first = np.unique(ids, return_index=True)  # in id order; repeats once
        if len(ids) > self.limit:
            keep = np.sort(np.argpartition(_uniform(ids), self.limit - 1)[: self.limit])
            ids, first = ids[keep], first[keep]
        index = torch.from_numpy(first)
        self.ids, self.log_probs, self.labels = ids, log_probs[index].float(), labels[index].long()

    def add_maps(self, probs: torch.Tensor, labels: torch.Tensor, keys: Sequence, ignore_label: int | None = None) -> None:
        """Sample the voxels of probability maps.

        Args:
            probs: ``(B, C, *spatial)`` class probabilities (softmax), as inference writes them.
            labels: ``(B, 1, *spatial)`` label maps on the same grid.
            keys: the ``B`` items' keys (case names).
            ignore_label: label value whose voxels are left out.

        Kept: ``log(max(p, NLL_FLOOR))``, the logits up to a constant per voxel, exact but where
        a float32 probability underflowed (a logit gap over 87).
        """
        probs, labels = torch.as_tensor(probs), torch.as_tensor(labels)
        for key, p, label in zip(keys, probs, labels, strict=True):
            label = label.reshape(-1)
            voxels = np.arange(label.numel(), dtype=np.uint64)
            if ignore_label is not None:
                voxels = voxels[(label != ignore_label).numpy()]
            ids = np.uint64(_item_seed(key)) + voxels
            if len(ids) > self.limit:
                pick = np.argpartition(_uniform(ids), self.limit - 1)[: self.limit]
                ids, voxels = ids[pick], voxels[pick]
            index = torch.from_numpy(voxels.astype(np.int64))
            flat = p.reshape(p.shape[0], -1)[:, index].T.float()
            self._merge(ids, flat.clamp_min(NLL_FLOOR).log(), label[index])

    def add_logits(self, logits: torch.Tensor, labels: torch.Tensor, keys: Sequence) -> None:
        """Sample classified items: ``logits`` ``(B, C)``, ``labels`` ``(B,)``, ``keys`` their
        ``B`` keys (patch indices)."""
        ids = np.array([_item_seed(k) for k in keys], dtype=np.uint64)
        self._merge(ids, torch.log_softmax(torch.as_tensor(logits).float().cpu(), 1), torch.as_tensor(labels).reshape(-1).cpu())

    def gather(self) -> None:
        """Merge every process's sample into each (under ``torch.distributed``; else nothing)."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        parts: list = [None] * dist.get_world_size()
        mine = None if self.log_probs is None else (self.ids, self.log_probs.numpy(), self.labels.numpy())
        dist.all_gather_object(parts, mine)
        self.clear()
        for part in parts:
            if part is not None:
                self._merge(part[0], torch.from_numpy(part[1]), torch.from_numpy(part[2]))

    def probabilities(self, temperature: torch.Tensor | None = None) -> torch.Tensor:
        """float64 ``(n, C)``: ``softmax(log_probs / temperature)`` (no temperature: 1)."""
        logits = self.log_probs.double()
        if temperature is not None:
            logits = logits / torch.as_tensor(temperature, dtype=torch.float64).reshape(1, -1)
        return torch.softmax(logits, 1)

    def metrics(self, temperature: torch.Tensor | None = None) -> dict:
        """:func:`~hsmla_med.metrics.calibration.calibration_metrics` of the sample's probabilities
        (at ``temperature``); empty without samples."""
        return {} if self.log_probs is None or not len(self) else calibration_metrics(self.probabilities(temperature), self.labels)


def check_calibratable(config: dict, checkpoint: str | Path) -> None:
    """Refuse, before any work, a checkpoint whose task draws no calibration sample (its card
    declares no ``calibration``) or whose outputs are sigmoid regions (fitted here on softmax
    outputs only)."""
    task = config.get("task") if isinstance(config, dict) else None
    calibrated = tasks_with("calibration")
    if task not in calibrated:
        raise InputError(f"--checkpoint {checkpoint}: a {task} checkpoint; calibrate fits the softmax outputs of {', '.join(calibrated)} checkpoints")
    if config.get("regions"):
        raise InputError(f"--checkpoint {checkpoint}: its network predicts overlapping regions (sigmoid outputs); calibrate fits softmax outputs only")


def calibrate(task, module, datamodule, trainer_cfg: dict, checkpoint: str | Path, output: str | Path, per_class: bool = False,
              samples: int = DEFAULT_SAMPLES, split: dict | None = None) -> dict | None:
    """Fit a temperature on the validation cases of ``datamodule`` and write the calibrated
    checkpoint.

    Args:
        task: the checkpoint's :class:`~hsmla_med.pipelines.task.Task`.
        module: the checkpoint's module (:meth:`Task.load`, without test-time augmentation).
        datamodule: the task's data of the checkpoint's split; its validation cases are used.
        trainer_cfg: the ``trainer`` config of the validation run (devices, precision).
        checkpoint: the Lightning checkpoint ``module`` was loaded from.
        output: folder for ``<checkpoint name>`` (the calibrated checkpoint), ``calibration.json``
            and ``reliability.png``.
        per_class: one temperature per class instead of one.
        samples: at most this many voxels or patches (:class:`CalibrationSample`).
        split: the fold record of the validation cases (``fold``, ``file``, ``val``).

    The validation runs as in ``evaluate`` (its scores are kept under ``validation``). A
    checkpoint calibrated before is fitted again from its uncalibrated network, and the new
    temperature replaces the old one (kept in ``calibration.json`` as ``replaced_temperature``):
    fitted on top of a per-class temperature, or per class on top of one, the product of the two
    would be another model than either fit.
    Returns the ``calibration.json`` document on the first process, ``None`` on the others.
    """
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    from hsmla_med.engine.checkpoint import read_checkpoint
    from hsmla_med.engine.run import evaluate
    from hsmla_med.io import atomic_path, write_json

    checkpoint, output = Path(checkpoint), Path(output)
    target = output / checkpoint.name
    if target.resolve() == checkpoint.resolve():
        raise InputError(f"--output {output}: the calibrated checkpoint would replace {checkpoint}; give another folder")
    replaced = None
    if isinstance(module.network, TemperatureScaled):  # calibrated before: fitted anew from the uncalibrated network
        replaced = [float(t) for t in module.network.temperature]
        module.network = module.network.network
    sample = module.calibration_sample = CalibrationSample(samples)
    summary = evaluate(module, datamodule, trainer_cfg, output)
    if rank_zero_only.rank != 0:
        return None
    if not len(sample):
        raise DataError(f"--checkpoint {checkpoint}: its validation cases gave no samples to calibrate on")
    fitted = fit_temperature(sample.log_probs, sample.labels, per_class)
    before, after = sample.metrics(), sample.metrics(fitted)
    probs = [sample.probabilities(), sample.probabilities(fitted)]
    masks = [foreground(p, sample.labels) for p in probs]  # a per-class temperature can move the argmax
    tables = {"all": [reliability(p, sample.labels) for p in probs],
              "foreground": [reliability(p[m], sample.labels[m]) for p, m in zip(probs, masks)]}
    module.cpu()
    module.network = TemperatureScaled(module.network, fitted)
    temperature = [float(t) for t in module.network.temperature]
    record = {
        "checkpoint": str(checkpoint),
        "task": task.name,
        "split": {k: (split or {}).get(k) for k in ("fold", "file", "val")},
        "temperature": temperature,
        "per_class": per_class,
        "replaced_temperature": replaced,
        "samples": before["samples"],
        "foreground_samples": before["foreground_samples"],
        "sampling": f"uniform over the validation {task.card.calibration} "
                    f"(ignore label left out), at most {sample.limit}",
        "bins": BINS,
        "before": before,
        "after": after,
        "validation": {k: v for k, v in summary.items() if not isinstance(v, dict) and k not in before},  # the task's own scores
    }
    entry = {"temperature": temperature, "per_class": per_class, "fitted_on": {"checkpoint": checkpoint.name, **record["split"]},
             "samples": before["samples"], "ece_before": before["ece"], "ece_after": after["ece"]}
    state = read_checkpoint(checkpoint)
    # the loaded network config: load_module fills in what older checkpoints leave to defaults
    state["hyper_parameters"] = {**state["hyper_parameters"], "network": module.config["network"], "calibration": entry}
    state["state_dict"] = module.state_dict()
    with atomic_path(target) as tmp:
        torch.save(state, tmp)
    write_json(output / "calibration.json", {**record, "calibrated_checkpoint": str(target)})
    plot_reliability(tables, {"before": before, "after": after}, output / "reliability.png")
    return record


def plot_reliability(tables: dict[str, list[dict]], metrics: dict[str, dict], path: str | Path) -> None:
    """Reliability diagrams (PNG): per subset (``all``, ``foreground``) the accuracy of each
    equal-mass bin against its mean confidence, before and after calibration, over the diagonal
    of perfect calibration; the legend gives each curve's ECE.

    Args:
        tables: subset -> ``[before, after]`` tables of
            :func:`~hsmla_med.metrics.calibration.reliability`.
        metrics: ``before``/``after`` -> :func:`~hsmla_med.metrics.calibration.calibration_metrics`.
        path: the PNG, written atomically.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from hsmla_med.io import atomic_path

    fig = Figure(figsize=(5 * len(tables), 4.6))
    FigureCanvasAgg(fig)
    for i, (subset, pair) in enumerate(tables.items()):
        ax = fig.add_subplot(1, len(tables), i + 1)
        ax.plot([0, 1], [0, 1], ls="--", color="grey", lw=1)
        for (when, colour), table in zip((("before", "tab:red"), ("after", "tab:blue")), pair):
            ece = metrics[when]["ece" if subset == "all" else "ece_foreground"]
            ax.plot(table["confidence"].numpy(), table["accuracy"].numpy(), "o-", color=colour,
                    label=f"{when}: ECE {'n/a' if ece is None else f'{ece:.4f}'} ({int(table['count'].sum())} samples)")
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence (mean of an equal-mass bin)", ylabel="accuracy", title=subset)
        ax.legend(loc="best")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=100)
