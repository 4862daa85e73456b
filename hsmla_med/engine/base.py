"""What every task's LightningModule shares: the network from a config, the gate regularisers
in the loss, AdamW with warm-up and cosine decay, tau calibration before validation (the same
inputs on every process), and per-item validation records gathered across processes."""

from __future__ import annotations

import logging
from abc import ABCMeta, abstractmethod

import lightning as L
from lightning.pytorch.trainer.states import TrainerFn
import torch
import torch.distributed as dist
from monai.data import MetaTensor
from torch import nn

from hsmla_med.config import build_network
from hsmla_med.defaults import GATE_REFINED
from hsmla_med.engine.calibration import CalibrationSample, with_temperature
from hsmla_med.engine.schedule import WarmupCosine
from hsmla_med.inference.cuda_graph import GraphedCallable, weights_version
from hsmla_med.nn import GatedNetwork, calibrate_tau, gate_snapshot

log = logging.getLogger("hsmla_med")

__all__ = ["GatedModule", "gather_records", "hparams", "item_keys", "plain"]


def plain(x: torch.Tensor) -> torch.Tensor:
    """The tensor without MONAI metadata: the network indexes its batch, and a batched
    MetaTensor refuses indexing when its items' metadata differ."""
    return x.as_tensor() if isinstance(x, MetaTensor) else x


def item_keys(batch: dict) -> list:
    """The item keys of a validation batch: its ``case`` entry (one int or string per item)."""
    case = batch["case"]
    if isinstance(case, torch.Tensor):
        return case.reshape(-1).tolist()
    if isinstance(case, (str, int)):
        return [case]
    return [c.item() if isinstance(c, torch.Tensor) else c for c in case]


def gather_records(records: list[dict]) -> list[dict]:
    """All processes' validation records, each item once, in key order.

    A record is a dict with ``"key"`` (the item's int or string key) and named, picklable fields.
    Under ``torch.distributed`` with more than one process every process receives every
    process's records (``all_gather_object``); the distributed sampler pads the validation set
    with repeated items so that every process gets as many, and the first record of each key is
    kept.
    """
    for record in records:
        if not isinstance(record, dict) or not isinstance(record.get("key"), (int, str)) or isinstance(record["key"], bool):
            raise TypeError(f"a validation record is a dict with an int or string 'key', got {record!r:.200}")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts: list[list[dict] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, records)
        records = [r for part in parts for r in part or []]
    unique: dict = {}
    for record in records:
        unique.setdefault(record["key"], record)
    return [unique[k] for k in sorted(unique, key=lambda k: (isinstance(k, str), k))]


def hparams(config: dict, model: dict, label_names, spatial_dims: int, in_channels: int, inference: dict, data: dict) -> dict:
    """The ``config`` of a :class:`GatedModule` from a task config: what every task saves in its
    checkpoints (task, network, dims, channels, labels, optimiser, loss) plus the task's own
    ``inference`` and ``data`` settings that inference needs to prepare inputs alike."""
    return {
        "task": config["task"],
        "network": model,
        "spatial_dims": spatial_dims,
        "in_channels": in_channels,
        "label_names": list(label_names),
        "optim": dict(config["optim"]),
        "loss": dict(config["loss"]),
        "inference": inference,
        "data": data,
    }


class GatedModule(L.LightningModule, metaclass=ABCMeta):
    """Base of the task modules.

    Args:
        config: hyper-parameters, saved so that a checkpoint rebuilds the module: ``network``
            (model config), ``spatial_dims``, ``in_channels``, ``label_names``, ``optim`` (``lr``,
            ``weight_decay``, ``warmup_steps``), ``loss`` (``lambda_budget``,
            ``lambda_smoothness``), ``inference`` (``target_alpha`` and task options).
        network: use this network instead of building one from ``config["network"]``.
        kind: ``"segmentation"`` or ``"classification"`` (which network the config builds).

    A ``calibration`` entry in ``config`` (written by ``hsmla-med calibrate``) wraps the built
    network in its temperature (:func:`~hsmla_med.engine.calibration.with_temperature`), so
    everything that runs ``network`` gets calibrated probabilities; a ``network`` handed in (an
    exported graph, an ensemble's members) already carries its own.

    Subclasses implement ``task_loss(logits, batch)``, ``validation_records(batch)`` (one record
    per validated item: a dict with the item's ``"key"``, see :func:`gather_records`, and named
    fields) and ``summarize_records(records)``, and name in ``monitor`` the summary key that
    selects ``best.ckpt`` (higher is better). A task whose records grow with the data overrides
    ``collect_records`` to reduce them across processes instead of gathering them whole.

    After each validation, on every process: ``records`` holds what ``collect_records`` made of
    the records (by default the gathered records, each item once, in key order), ``summary``
    their metrics (JSON-friendly), and ``calibrated_tau`` the ``{layer: tau}`` that the
    calibration before it set. With a :class:`~hsmla_med.engine.calibration.CalibrationSample`
    in ``calibration_sample`` (``evaluate``, ``calibrate``), the tasks that draw one fill it
    during validation, and ``summary`` adds its calibration metrics (``ece``, ``ece_foreground``,
    ``brier``, ``nll``, ...).
    """

    monitor = "dice"
    #: run the network as captured CUDA graphs outside training (``infer``, ``evaluate``,
    #: ``wsi-heatmap``, ``wsi-features`` on CUDA; ``--no-cuda-graphs`` sets it False):
    #: :meth:`graphed`
    cuda_graphs: bool = True
    #: the inference settings of the prediction running now: the checkpoint's with the run's
    #: options (``InferenceOptions.apply``), held here for the run by the task's ``infer``
    #: (:func:`~hsmla_med.pipelines.task.predict_cases`) rather than copied into every case;
    #: ``None`` outside a run (:meth:`inference_settings`: the checkpoint's own)
    run_inference: dict | None = None
    #: keep the first validated item as a picture (``validation_sample``: image, reference,
    #: prediction) for a TensorBoard or MLflow logger (:class:`~hsmla_med.engine.callbacks.LogSampleImages`);
    #: tasks whose items have a picture set it in their ``validation_records``
    log_samples: bool = False
    validation_sample = None

    def __init__(self, config: dict, network: nn.Module | None = None, kind: str = "segmentation") -> None:
        super().__init__()
        self.save_hyperparameters(config)
        self.config = config
        self.label_names = list(config["label_names"])
        self.network = network or build_network(
            config["network"], config["spatial_dims"], config["in_channels"], len(self.label_names), kind
        )
        if network is None and config.get("calibration"):
            self.network = with_temperature(self.network, config["calibration"], len(self.label_names))
        self.calibration_sample: CalibrationSample | None = None
        self._records: list[dict] = []  # this process's records of the running validation
        self._calibration_batch: torch.Tensor | None = None
        self.records: list[dict] | None = None  # the last validation's records, all processes'
        self.summary: dict | None = None  # the last validation's metrics
        self.calibrated_tau: dict[str, float] | None = None
        self._refined: dict[str, list] | None = None  # per HSMLA layer [tiles refined, tiles] of the running validation
        self._calls, self._gate_example = 0, None  # the running validation's network calls, and the example kept
        self._gated: dict = {}  # the running validation's gated layers, by name
        #: the last validation's example of the gates at work (:meth:`_count_refined`): ``call``
        #: of ``calls``, ``image`` (H, W) and per gated layer the ``refined`` tiles (h, w) bool
        self.validation_gates: dict | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)

    def inference_settings(self) -> dict:
        """The prediction run's settings (:attr:`run_inference`), else the checkpoint's."""
        return self.run_inference if self.run_inference is not None else self.config["inference"]

    def use_cuda_graphs(self, on: bool) -> None:
        """Set :attr:`cuda_graphs` here and on an ensemble's members (which run their own networks)."""
        for module in (self, *getattr(self, "members", ())):
            module.cuda_graphs = on

    def graphed(self, fn=None) -> GraphedCallable:
        """``fn`` (default: the network) as a :class:`~hsmla_med.inference.cuda_graph.GraphedCallable`,
        kept per function: on CUDA, outside ``fit`` (whose weights change between validations
        and whose validation the graphs would not pay off in), each window or patch-batch shape
        is captured once and replayed; on the CPU, in training or with :attr:`cuda_graphs` off it
        is ``fn`` itself. The graphs are captured again when a weight changes."""
        fn = self.network if fn is None else fn
        runners = self.__dict__.setdefault("_graph_runners", {})
        runner = runners.get(fn)
        if runner is None:
            runner = runners[fn] = GraphedCallable(fn, version=lambda: weights_version(self.network), state=lambda: gate_snapshot(self.network),
                                                   after=self._count_refined)
        fitting = self._trainer is not None and self.trainer.state.fn == TrainerFn.FITTING
        runner.enabled = self.cuda_graphs and not fitting and not self.training
        return runner

    @abstractmethod
    def task_loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        """The task's loss of float32 ``logits`` against the batch's targets."""

    @abstractmethod
    def validation_records(self, batch: dict) -> list[dict]:
        """One record per item of a validation batch: ``{"key": item key, **named fields}``."""

    @abstractmethod
    def summarize_records(self, records: list[dict]) -> dict:
        """Metrics (JSON-friendly) from the gathered validation records, one per item."""

    def collect_records(self, records: list[dict]):
        """This process's validation records -> what ``summarize_records`` takes, the same on
        every process: by default every process's records (:func:`gather_records`)."""
        return gather_records(records)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        image = plain(batch["image"])
        logits = self.network(image)
        loss = self.task_loss(logits.float(), batch)
        self.log("train/task_loss", loss, prog_bar=True, batch_size=image.shape[0])
        if isinstance(self.network, GatedNetwork) and self.network.hsmla_layers():
            reg = self.network.gate_regularization()
            weights = self.config["loss"]
            loss = loss + weights["lambda_budget"] * reg["budget"] + weights["lambda_smoothness"] * reg["smoothness"]
            self.log_dict({f"train/gate_{k}": v for k, v in reg.items()}, batch_size=image.shape[0])
        self.log("train/loss", loss, batch_size=image.shape[0])
        self._calibration_batch = image[:4].detach()
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        """Skip a step whose gradients are not all finite (drop them, so the optimizer moves no
        weight), with a warning, as torch.amp's GradScaler skips float16 steps. Under bf16-mixed
        there is no scaler: one non-finite gradient makes the clipped gradient norm NaN and every
        weight NaN (PyTorch's CPU bfloat16 depthwise 3D weight gradient did that now and then,
        worked around in :mod:`hsmla_med.nn.conv`; this guards the run against the next such op).
        After DDP's all-reduce, so every process skips the same steps."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if grads and not torch.isfinite(torch.nn.utils.get_total_norm(grads)):
            for param in self.parameters():
                param.grad = None
            log.warning("step %d: non-finite gradients (precision %s); the step was skipped", self.global_step,
                        self.trainer.precision if self._trainer is not None else "?")

    def on_validation_epoch_start(self) -> None:
        # Inference routes hard with threshold tau; put it where the gate of the current weights
        # selects the target share of tiles (docs/design.md §2.8), using recent training inputs.
        if self.trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            # DDP brings the buffers (BatchNorm statistics) into line at the start of each training
            # forward, so after the last one every process holds its own; validate with rank 0's,
            # the ones its checkpoints save
            for buffer in self.buffers():
                dist.broadcast(buffer.data, src=0)
        target = self.config["inference"].get("target_alpha")
        if target is not None and isinstance(self.network, GatedNetwork):
            batch = self._calibration_batch
            if self.trainer.world_size > 1:
                # each process trained on other inputs last; rank 0's set tau on every process
                batch = self.trainer.strategy.broadcast(None if batch is None else batch.cpu(), src=0)
            if batch is not None:
                self.calibrated_tau = calibrate_tau(self.network, batch.to(self.device), target)
        self._records = []
        self._refined = {} if isinstance(self.network, GatedNetwork) else None
        # the gated layers, walked once per validation rather than after every network call
        self._gated = self.network.hsmla_layers() if self._refined is not None else {}
        self._calls, self._gate_example = 0, None
        if self.calibration_sample is not None:
            self.calibration_sample.clear()

    def _count_refined(self, *inputs) -> None:
        """After each network call of a validation (:meth:`graphed`): add each gated layer's
        tiles refined and tiles to the running count (device tensors: no host read here), and
        keep the first item of the calls numbered 1, 2, 4, 8, ... with its refined tiles (a
        device copy): the last one kept, from the second half of the validation's calls, is
        :attr:`validation_gates`' example (the first calls are the corners of a volume, often air)."""
        if self._refined is None:
            return
        self._calls += 1
        maps = {}
        for name, layer in self._gated.items():
            refined = layer.refined_tiles()
            if refined is not None:
                count = self._refined.setdefault(name, [0, 0])
                count[0], count[1] = count[0] + refined.sum(), count[1] + refined.numel()
                maps[name] = refined[0]
        if maps and self._calls & (self._calls - 1) == 0 and inputs and isinstance(inputs[0], torch.Tensor):
            self._gate_example = (self._calls, inputs[0][0].detach().clone(), maps)

    def _finish_gate_example(self) -> None:
        """:attr:`validation_gates` from the kept call: the image's first channel and each
        layer's refined tiles, the middle axial slice of a volume, on the host."""
        if self._gate_example is None:
            self.validation_gates = None
            return
        call, image, maps = self._gate_example
        # volumes are (x, y, z) as MONAI loads them (RAS): the axial slice is the middle z, the plane
        # the report draws a volume's slices in (the middle x was a sagittal plane)
        middle = lambda t: t[..., t.shape[-1] // 2] if t.dim() == 3 else t  # noqa: E731 - (x, y, z) -> (x, y)
        self.validation_gates = {"call": call, "calls": self._calls, "image": middle(plain(image[0]).float()).cpu().numpy(),
                                 "refined": {name: middle(m).cpu().numpy() for name, m in maps.items()}}
        self._gate_example = None

    def refined_per_layer(self) -> dict[str, float]:
        """The share of tiles each gated HSMLA layer refined over the last validation's network
        calls (every window, patch batch or frame; all processes'), by layer name; empty
        without gates (``routing`` ``off`` or ``all``, or no HSMLA layer)."""
        names = sorted(self._refined or {})
        if not names:
            return {}
        counts = torch.stack([torch.as_tensor(self._refined[n][i], dtype=torch.float64, device=self.device)
                              for n in names for i in (0, 1)])
        if self._trainer is not None and self.trainer.world_size > 1:
            counts = self.trainer.strategy.reduce(counts, reduce_op="sum")
        counts = counts.view(-1, 2).tolist()
        return {name: refined / tiles for name, (refined, tiles) in zip(names, counts, strict=True)}

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._records.extend(self.validation_records(batch))

    def on_validation_epoch_end(self) -> None:
        self.records = self.collect_records(self._records)
        self._records = []
        self.summary = self.summarize_records(self.records)
        refined = self.refined_per_layer()
        self._refined = None
        self._finish_gate_example()
        if refined:
            self.summary[GATE_REFINED] = refined
        if self.calibration_sample is not None:
            self.calibration_sample.gather()
            self.summary.update(self.calibration_sample.metrics())
        # every rank holds the same gathered summary, so logging needs no further reduction
        for key, value in self.summary.items():
            if key == self.monitor and value is None:
                value = float("nan")  # undefined (e.g. AUC with one class): never the best
            if isinstance(value, (int, float)) and key not in ("cases", "slides"):
                self.log(f"val/{key}", float(value), prog_bar=key == self.monitor)

    def configure_optimizers(self):
        optim = self.config["optim"]
        optimizer = torch.optim.AdamW(self.parameters(), lr=optim["lr"], weight_decay=optim["weight_decay"])
        total = max(1, int(self.trainer.estimated_stepping_batches))
        schedule = WarmupCosine(optimizer, optim["warmup_steps"], total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
