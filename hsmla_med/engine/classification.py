"""The patch-classification ``LightningModule`` (whole-slide pathology): cross-entropy plus the
gate regularisers; validation over every tissue patch of the validation slides, reporting patch
AUC, slide AUC and lesion-level FROC (the official CAMELYON16 rules: :mod:`hsmla_med.metrics.pathology`). Across processes the patches are reduced into per-slide
maps on the patch grid, never gathered whole (a real CAMELYON16 validation has millions)."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from hsmla_med.engine.base import GatedModule, item_keys, plain
from hsmla_med.engine.calibration import TemperatureScaled
from hsmla_med.errors import ConfigError
from hsmla_med.nn import GatedNetwork
from hsmla_med.metrics.pathology import auc, detect_lesions, lesion_froc, slide_fp_tp, slide_score

__all__ = ["COLUMNS", "ClassificationModule", "final_linear", "patch_images", "penultimate", "slide_maps"]

# of a validation row; "lesion": the evaluation-mask label at the patch centre, the point a detection
# there is scored at; "num_lesions"/"num_labels": the slide's lesions to detect and its largest label
# (ITCs above num_lesions), the same on every row of a slide
COLUMNS = ("slide", "row", "col", "prob", "label", "lesion", "slide_label", "num_lesions", "num_labels")


def _all_max(values: np.ndarray, device: torch.device | str = "cpu") -> np.ndarray:
    """The elementwise maximum of ``values`` over the processes of ``torch.distributed`` (the
    array itself in a single process); ``device``: where the backend reduces (CUDA for NCCL)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return values
    tensor = torch.from_numpy(np.ascontiguousarray(values)).to(device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.cpu().numpy()


def slide_maps(rows: np.ndarray, device: torch.device | str = "cpu") -> list[dict]:
    """The validation patches as maps on each slide's patch grid, from every process.

    Args:
        rows: ``(n, 9)`` this process's patches, columns :data:`COLUMNS` (slide index, grid row
            and column, tumour probability, patch label, evaluation-mask label at the patch
            centre, slide label, the slide's number of lesions and largest label).
        device: where ``torch.distributed`` reduces (the module's device).

    Returns:
        Per slide with patches (slide-index order): ``prob`` (float64 ``(H, W)``, NaN where no
        patch), ``label`` (int64, -1 where no patch), ``lesion`` (int64, 0 = none),
        ``slide_label``, ``num_lesions`` and ``num_labels``. Under ``torch.distributed`` every process gets the maps of all
        processes' patches: the grid shapes, then the maps, are max-reduced (empty cells hold
        -inf), so the traffic is a few numbers per grid cell, not a record per patch; a patch
        validated twice (the distributed sampler's padding) falls on its own cell with the same
        values. Every patch has its own cell (the grid of
        :func:`~hsmla_med.data.slides.patch_grid`), so nothing is lost.
    """
    rows = np.asarray(rows, np.float64).reshape(-1, len(COLUMNS))
    slide, row, col = (rows[:, i].astype(np.int64) for i in range(3))
    count = int(_all_max(np.array([slide.max() + 1 if len(rows) else 0]), device)[0])
    shape = np.full((count, 5), -1, np.int64)  # grid rows, grid columns, slide label, num_lesions, num_labels
    for k, values in enumerate((row + 1, col + 1, *rows[:, 6:9].T.astype(np.int64))):
        np.maximum.at(shape[:, k], slide, values)
    shape = _all_max(shape, device)
    sizes = shape[:, 0].clip(0) * shape[:, 1].clip(0)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    flat = np.full((3, offsets[-1]), -np.inf, np.float32)  # float32: the probabilities are, ids < 2**24
    cell = offsets[slide] + row * shape[slide, 1] + col
    flat[:, cell] = rows[:, [3, 4, 5]].T
    flat = _all_max(flat, device)
    maps = []
    for s in np.flatnonzero(sizes):
        prob, label, lesion = flat[:, offsets[s] : offsets[s + 1]].reshape(3, *shape[s, :2]).astype(np.float64)
        empty = np.isneginf(prob)
        maps.append({
            "prob": np.where(empty, np.nan, prob),
            "label": np.where(empty, -1, label).astype(np.int64),
            "lesion": np.where(empty, 0, lesion).astype(np.int64),
            "slide_label": int(shape[s, 2]),
            "num_lesions": int(shape[s, 3]),
            "num_labels": int(shape[s, 4]),
        })
    return maps


class ClassificationModule(GatedModule):
    """Train :class:`~hsmla_med.nn.HSMLAClassifier` on patches; validate per slide.

    Args:
        config: see :class:`~hsmla_med.engine.base.GatedModule`; ``inference`` also holds
            ``slide_sigma`` (smoothing of the probability map before the slide score, in grid
            cells), ``lesion_threshold`` and ``lesion_radius`` (detections: local maxima above the
            threshold, at least that many cells apart, each scored at its patch's centre).
        network: use this network instead of building one from ``config["network"]``.

    Training batches: ``image`` ``(B, C, h, w)`` float in 0..1, ``label`` ``(B,)`` (1 = tumour).
    Validation and prediction batches may carry ``image`` as uint8 0..255 (scaled on the
    module's device, :func:`patch_images`). Validation
    batches also carry ``case`` (patch index), ``slide_index``, ``row``/``col`` (the
    patch's cell on the slide's grid), ``lesion`` (the slide's evaluation-mask label at the
    patch centre, 0 = none), ``slide_label``, ``num_lesions`` and ``num_labels`` (see
    :data:`COLUMNS`). The validation records of a batch are one array, a row per patch
    (:data:`COLUMNS`), and :meth:`collect_records` reduces them into per-slide maps
    (:func:`slide_maps`), the same on every process, which :meth:`summarize_records` scores.
    """

    monitor = "auc"
    #: with it, :meth:`predict_step` also returns each patch's ``features``, the network's
    #: penultimate activations (:func:`penultimate`): ``wsi-features``
    predict_features: bool = False

    def __init__(self, config: dict, network: nn.Module | None = None) -> None:
        super().__init__(config, network, "classification")
        self.loss = nn.CrossEntropyLoss()

    def task_loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        return self.loss(logits, plain(batch["label"]).long().reshape(-1))

    def predict_step(self, batch: dict, batch_idx: int = 0) -> dict:
        """A batch of whole-slide patches (``image``, ``slide_index``, ``row``, ``col``) -> their
        tumour ``prob`` and ``alpha`` (share of gate tiles refined, ``None`` without gates), on
        the CPU with the patches' places; with :attr:`predict_features` also their ``features``
        ``(B, D)`` float32 (:func:`penultimate`)."""
        if self.predict_features:
            logits, features = self.graphed(self._logits_and_features)(patch_images(batch))
        else:
            logits, features = self.graphed()(patch_images(batch)), None
        prob = torch.softmax(logits.float(), dim=1)[:, 1]
        alpha = patch_alpha(self.network)
        place = {k: torch.as_tensor(batch[k]).reshape(-1).cpu() for k in ("slide_index", "row", "col")}
        extra = {} if features is None else {"features": features.float().cpu()}
        return {**place, "prob": prob.cpu(), "alpha": None if alpha is None else alpha.float().cpu(), **extra}

    def _logits_and_features(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`penultimate` of the network, which checks that the features make the logits on
        the first call only (a comparison read on the host, which a CUDA graph cannot hold; the
        first call is the graph's eager warm-up)."""
        checked = self.__dict__.get("_features_checked", False)
        out = penultimate(self.network, images, check=not checked)
        self.__dict__["_features_checked"] = True
        return out

    def validation_records(self, batch: dict) -> np.ndarray:
        """``(B, 9)`` float64, a row per patch of the batch: :data:`COLUMNS`."""
        logits = self.graphed()(patch_images(batch)).float()
        if self.calibration_sample is not None:
            self.calibration_sample.add_logits(logits, plain(batch["label"]), item_keys(batch))
        columns = {"prob": torch.softmax(logits, dim=1)[:, 1]}
        for name in COLUMNS[:3] + COLUMNS[4:]:
            columns[name] = torch.as_tensor(batch["slide_index" if name == "slide" else name]).reshape(-1)
        return torch.stack([columns[name].double().cpu() for name in COLUMNS], dim=1).numpy()

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        # one array per batch: per-patch dicts would hold millions of Python objects per validation
        self._records.append(self.validation_records(batch))

    def collect_records(self, records: list[np.ndarray]) -> list[dict]:
        """This process's batches of rows -> every process's patches as per-slide maps (:func:`slide_maps`)."""
        rows = np.concatenate(records) if records else np.zeros((0, len(COLUMNS)))
        return slide_maps(rows, self.device)

    def summarize_records(self, maps: list[dict]) -> dict:
        """Slide AUC (``auc``, of :func:`slide_score`), patch AUC and lesion FROC from the slide
        maps of :meth:`collect_records`. A detection (a local maximum of the map) is scored at
        its patch's centre, the point ``wsi-heatmap`` writes into the slide's lesion CSV, so
        ``evaluate --predictions`` of those CSVs gives this FROC."""
        inference = self.config["inference"]
        scores = [slide_score(m["prob"], inference["slide_sigma"]) for m in maps]
        froc = lesion_froc([_slide_counts(m, inference) for m in maps])
        patch = [m["label"] >= 0 for m in maps]
        probs = np.concatenate([m["prob"][has] for m, has in zip(maps, patch)]) if maps else np.zeros(0)
        labels = np.concatenate([m["label"][has] for m, has in zip(maps, patch)]) if maps else np.zeros(0, np.int64)
        finite = lambda v: None if v is None or not np.isfinite(v) else float(v)  # noqa: E731
        return {
            "auc": finite(auc(scores, [m["slide_label"] for m in maps])),
            "patch_auc": finite(auc(probs, labels)),
            "froc": finite(froc["froc"]),
            "froc_sensitivity": froc["sensitivity"],
            "slides": len(maps),
            "cases": len(probs),
        }


def _slide_counts(slide_map: dict, inference: dict) -> tuple[np.ndarray, np.ndarray, int]:
    """A slide map's false-positive and per-label confidences (:func:`slide_fp_tp`) and its number
    of lesions: its detections hit the evaluation-mask label stored at their cells."""
    found = detect_lesions(slide_map["prob"], inference["lesion_threshold"], inference["lesion_radius"])
    cells = found[:, 1:].astype(np.int64)
    fp, tp = slide_fp_tp(found[:, 0], slide_map["lesion"][cells[:, 0], cells[:, 1]], slide_map["num_lesions"], slide_map["num_labels"])
    return fp, tp, slide_map["num_lesions"]


def patch_images(batch: dict) -> torch.Tensor:
    """The batch's ``image`` as the network takes it: float in 0..1. Patches read as bytes
    (``ReadPatchd(uint8=True)``) are scaled here, on the module's device."""
    image = plain(batch["image"])
    return image.float().div_(255.0) if image.dtype == torch.uint8 else image


def final_linear(network: nn.Module, source: str = "the network") -> tuple[str, nn.Linear]:
    """The name and module of the linear layer that makes a classifier's logits: the last
    ``nn.Linear`` registered in ``network`` (:class:`~hsmla_med.nn.HSMLAClassifier`'s
    ``head.4``; MONAI's DenseNet ``class_layers.out``, ResNet ``fc``, EfficientNet ``_fc``).
    :func:`penultimate` checks on every batch that its output is the network's.

    Raises:
        ConfigError: naming ``source`` (a checkpoint) when the network has no linear layer: its
            penultimate features are then not defined here.
    """
    linears = [(name, module) for name, module in network.named_modules() if isinstance(module, nn.Linear)]
    if not linears:
        raise ConfigError(f"{source}: its {type(network).__name__} network has no final linear layer (torch.nn.Linear) whose input "
                          "would be the patch features; use a classifier that ends in one (HSMLA, or model {monai: DenseNet121} or ResNet)")
    return linears[-1]


def penultimate(network: nn.Module, images: torch.Tensor, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A classifier's logits ``(B, classes)`` on ``images`` and its penultimate activations
    ``(B, D)``: the input of its final linear layer (:func:`final_linear`), as computed (under
    autocast, in its dtype). A network with timm's ``forward_features`` / ``forward_head``
    split (:class:`~hsmla_med.nn.HSMLAClassifier`) gives them by those methods; any other
    (MONAI's DenseNet and ResNet each end differently, and expose neither) through a forward
    hook on that layer.

    ``check``: for a hooked network, compare the logits with that layer's output (on the host;
    once per network is enough, and a CUDA graph cannot hold it).

    Raises:
        ConfigError: when the logits are not that layer's output (a layer after it changes
            them, so its input is not the features they are made of).
    """
    if isinstance(network, TemperatureScaled):  # a calibrated network: its features are the wrapped one's
        logits, features = penultimate(network.network, images, check)
        return network.scale(logits), features
    if hasattr(network, "forward_features") and hasattr(network, "forward_head"):
        features = network.forward_features(images)
        return network.forward_head(features), features.flatten(1)
    name, layer = final_linear(network)
    seen: dict[str, torch.Tensor] = {}
    handle = layer.register_forward_hook(lambda _module, args, output: seen.update(features=args[0], output=output))
    try:
        logits = network(images)
    finally:
        handle.remove()
    output = seen.get("output")
    if output is None or (check and (output.numel() != logits.numel() or not torch.equal(output.reshape(logits.shape), logits))):
        raise ConfigError(f"{type(network).__name__}: its logits are not the output of its last linear layer {name!r} (a layer "
                          "after it changes them), so that layer's input is not the patch features; use a classifier that ends in its linear layer")
    return logits, seen["features"].flatten(1)


def patch_alpha(network: nn.Module) -> torch.Tensor | None:
    """Per sample of the last forward: the share of gate tiles above tau, over all HSMLA layers."""
    if not isinstance(network, GatedNetwork):
        return None
    shares = [
        (layer.last_gate > layer.tau).flatten(1).float().mean(1)
        for layer in network.hsmla_layers().values()
        if layer.last_gate is not None
    ]
    return torch.stack(shares).mean(0) if shares else None
