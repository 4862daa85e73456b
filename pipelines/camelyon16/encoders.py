"""Patch encoders for whole-slide features: a timm model with its weights from a local file (UNI
and Virchow are timm ViTs) or a TorchScript file, as one :class:`PatchEncoder` that takes the
patches as they are read (uint8 RGB) and gives their features, and :func:`encode_slides`, which
writes them for slides in CLAM's layout through the same grid, patch reading, predict loop and
writer as a checkpoint's features (:func:`~hsmla_med.pipelines.camelyon16.extract_features`).
Nothing is downloaded: timm builds the architecture only, and the weights come from the file
given (or, for a smoke run, from a fixed seed)."""

from __future__ import annotations

import difflib
import logging
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from hsmla_med.config import task_config
from hsmla_med.engine.base import plain
from hsmla_med.engine.checkpoint import read_torchscript
from hsmla_med.errors import DataError, InputError
from hsmla_med.inference.cuda_graph import GraphedCallable, weights_version
from hsmla_med.io import file_sha256
from hsmla_med.pipelines.camelyon16 import _run_slides, _write_features
from hsmla_med.pipelines.camelyon16.data import _grid_params
from hsmla_med.pipelines.task import InferenceOptions

__all__ = ["DEFAULT_ENCODER", "DEFAULT_WEIGHTS", "PatchEncoder", "EncoderModule", "load_encoder", "encode_slides"]

log = logging.getLogger("hsmla_med")

#: the encoder of the synthetic path when no features are given: resnet18 keeps 2 CPUs fast
DEFAULT_ENCODER = "timm:resnet18"
#: its weights: random, from a fixed seed (a smoke run, not a real encoder)
DEFAULT_WEIGHTS = "random"
#: the weights of no file: timm's initialisation from a fixed seed
RANDOM_SEED = 0
#: the normalisation of an encoder without a config (TorchScript): ImageNet's, as timm's models take
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")


def _message(err: BaseException) -> str:
    """An exception as one line: its type and its message's first line."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


class PatchEncoder(nn.Module):
    """A patch encoder with its preprocessing: uint8 RGB patches ``(B, 3, H, W)`` -> float32
    features ``(B, D)``. The patches are scaled to 0..1, resized to ``input_size`` (bilinear,
    antialiased, as PIL resizes) unless they have that size, normalised by ``mean`` and ``std``
    and run through ``network``, whose output may carry trailing 1s (``(B, D, 1, 1)``).

    Args:
        network: float ``(B, 3, S, S)`` normalised images -> ``(B, D)`` (in eval mode).
        spec: ``timm:NAME`` or ``torchscript:PATH``, as given.
        mean, std: per channel (R, G, B), of images in 0..1.
        input_size: ``S``; ``None``: the patches' own size (no resize).
        description: what made the features, for the h5's ``encoder`` attribute.

    Attributes:
        spec, mean, std, input_size, description: as given.
        dim: ``D``; ``None`` until the first :meth:`probe` (which :func:`load_encoder` runs where
            the input size is known, :func:`encode_slides` at the patch size otherwise).
    """

    def __init__(self, network: nn.Module, spec: str, mean: tuple[float, ...], std: tuple[float, ...], input_size: int | None,
                 description: str) -> None:
        super().__init__()
        self.network = network.eval()
        self.spec, self.description, self.input_size = spec, description, input_size
        self.mean, self.std = tuple(float(v) for v in mean), tuple(float(v) for v in std)
        # buffers: they follow the module to the predict loop's device; not weights (no state-dict entries)
        self.register_buffer("_mean", torch.tensor(self.mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("_std", torch.tensor(self.std).view(1, 3, 1, 1), persistent=False)
        self.dim: int | None = None

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """uint8 ``(B, 3, H, W)`` patches -> float32 ``(B, D)`` features."""
        images = patches.float().div(255.0)
        size = self.input_size
        if size is not None and tuple(images.shape[-2:]) != (size, size):
            images = F.interpolate(images, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        features = self.network((images - self._mean) / self._std)
        shape = tuple(features.shape) if isinstance(features, torch.Tensor) else type(features).__name__
        if isinstance(features, torch.Tensor):
            while features.dim() > 2 and features.shape[-1] == 1:
                features = features.squeeze(-1)
        if not isinstance(features, torch.Tensor) or features.dim() != 2 or len(features) != len(patches):
            raise DataError(f"{self.spec}: maps a batch {tuple(images.shape)} to {shape}, not to features (B, D) (or (B, D, 1, 1)); "
                            "pool or select the tokens inside the encoder")
        return features.float()

    def probe(self, size: int) -> int:
        """``D``, from one blank ``size`` x ``size`` patch (sets :attr:`dim`): an encoder that
        fails on that size, or whose output is no ``(B, D)``, is refused before any slide is read.

        Raises:
            DataError: naming the encoder and the problem, in one line.
        """
        blank = torch.zeros(1, 3, size, size, dtype=torch.uint8, device=self._mean.device)
        try:
            with torch.no_grad():
                self.dim = int(self(blank).shape[1])
        except DataError:
            raise
        except Exception as err:  # noqa: BLE001 - whatever the encoder raises: named in one line
            raise DataError(f"{self.spec}: fails on a (1, 3, {size}, {size}) batch of patches ({_message(err)}); "
                            "give --input-size of the size it takes") from None
        return self.dim


def _state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The state dict in a weights file: ``.safetensors``, or a ``torch.save`` file (``.pth``,
    ``.pt``, ``.bin``) read with ``weights_only``; one in a ``state_dict`` or ``model`` entry of
    the file is taken."""
    if not path.is_file():
        raise DataError(f"{path}: --encoder-weights file not found")
    if path.suffix.lower() not in WEIGHT_SUFFIXES:
        raise InputError(f"{path}: --encoder-weights takes a state dict in {', '.join(WEIGHT_SUFFIXES)} (or random)")
    try:
        if path.suffix.lower() == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path), device="cpu")
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - a corrupt or foreign file, whichever reader it meets
        raise DataError(f"{path}: not a readable weights file ({_message(err)})") from None
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not (isinstance(state, dict) and state and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items())):
        raise DataError(f"{path}: not a state dict (names to tensors, or one in a 'state_dict' or 'model' entry)")
    return state


def _load_weights(model: nn.Module, state: dict[str, torch.Tensor], path: Path, spec: str) -> None:
    """Load ``state`` (read from ``path``) into a timm ``model`` built without its classifier:
    every weight must be there with its shape; the file may hold the classifier too (left out)."""
    own = model.state_dict()
    classifier = model.pretrained_cfg.get("classifier") or ()
    head = tuple(f"{name}." for name in ([classifier] if isinstance(classifier, str) else classifier))
    # a BatchNorm's batch counter does not change what eval computes, and some files leave it out
    missing = [k for k in own if k not in state and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state if k not in own and not k.startswith(head)]
    shapes = [f"{k} {tuple(state[k].shape)} for {tuple(own[k].shape)}" for k in own if k in state and state[k].shape != own[k].shape]
    problems = [f"{what} {', '.join(keys[:3])}{f' (+{len(keys) - 3} more)' if len(keys) > 3 else ''}"
                for what, keys in (("missing", missing), ("unexpected", unexpected), ("other shapes:", shapes)) if keys]
    if problems:
        raise DataError(f"{path}: not weights of {spec} ({'; '.join(problems)})")
    model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)


def _timm_encoder(name: str, weights: str | None) -> tuple[nn.Module, dict, str]:
    """A timm model without classifier (``num_classes=0``), its weights and its data config
    (``mean``, ``std``, ``input_size``: timm's ``resolve_data_config``), and its description."""
    spec = f"timm:{name}"
    if weights is None:
        raise InputError(f"--encoder {spec}: pass the weights file with --encoder-weights PATH (timm would download them, and nothing "
                         f"is downloaded here), or --encoder-weights {DEFAULT_WEIGHTS} for a smoke run")
    import timm  # (its torchvision imports beside the CPU torch: hsmla_med/torchvision_ops.py)
    if not name or not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=3)
        raise InputError(f"--encoder {spec}: timm {timm.__version__} has no model {name!r}"
                         + (f" (close: {', '.join(close)})" if close else " (timm.list_models() lists them)"))
    state = None if weights == DEFAULT_WEIGHTS else _state_dict(Path(weights))  # a bad file is named before the model is built
    with torch.random.fork_rng(devices=[]):  # the initialisation from a fixed seed, the caller's generator untouched
        torch.manual_seed(RANDOM_SEED)
        try:
            model = timm.create_model(name, pretrained=False, num_classes=0)
        except Exception as err:  # noqa: BLE001 - a model timm lists but cannot build without arguments
            raise InputError(f"--encoder {spec}: timm cannot build it ({_message(err)})") from None
    if state is None:
        log.warning("%s: random weights: a smoke run, not a real encoder", spec)
        description = f"{spec} (random weights, seed {RANDOM_SEED})"
    else:
        path = Path(weights)
        _load_weights(model, state, path, spec)
        description = f"{spec} (weights {path.name}, sha256 {file_sha256(path)})"
    config = timm.data.resolve_data_config({}, model=model)
    return model, {"mean": config["mean"], "std": config["std"], "input_size": int(config["input_size"][-1])}, description


def _torchscript_encoder(path: Path) -> tuple[nn.Module, dict, str]:
    """A TorchScript encoder (on the CPU) with ImageNet's normalisation and no input size of its
    own (the patches' size), and its description."""
    if not path.is_file():
        raise DataError(f"{path}: --encoder torchscript file not found")
    network, _ = read_torchscript(path)
    return network, {"mean": IMAGENET_MEAN, "std": IMAGENET_STD, "input_size": None}, f"torchscript:{path.name} (sha256 {file_sha256(path)})"


def load_encoder(spec: str, weights: str | None = None, *, mean=None, std=None, input_size: int | None = None) -> PatchEncoder:
    """The patch encoder ``spec`` names, on the CPU in eval mode.

    Args:
        spec: ``timm:NAME`` (a model of timm's registry, built with ``pretrained=False,
            num_classes=0``) or ``torchscript:PATH`` (a traced or scripted encoder: float
            ``(B, 3, H, W)`` -> ``(B, D)`` or ``(B, D, 1, 1)``).
        weights: for timm, a state-dict file (``.safetensors``, ``.pth``, ``.pt``, ``.bin``;
            a ``state_dict`` or ``model`` entry in it is taken; the classifier's weights may be
            in it), or ``random`` (timm's initialisation from seed 0: a smoke run, logged as a
            warning); required, since timm would otherwise download them. None for TorchScript,
            whose file holds them.
        mean, std: three values each (R, G, B, of patches scaled to 0..1); default: timm's
            ``pretrained_cfg`` of the model, ImageNet's for TorchScript.
        input_size: the side the patches are resized to; default: timm's ``pretrained_cfg``,
            the patches' own size for TorchScript.

    Raises:
        InputError: an unknown spec or timm model, timm without weights, weights for TorchScript,
            bad ``mean``/``std``/``input_size``.
        DataError: naming a file that does not load (missing, corrupt, not a state dict, weights
            of another architecture, not TorchScript) or an encoder whose output is no ``(B, D)``.
    """
    for option, values in (("--mean", mean), ("--std", std)):
        if values is not None and len(values) != 3:
            raise InputError(f"{option}: give three values (R G B), got {len(values)}")
    if std is not None and min(std) <= 0:
        raise InputError(f"--std: each value must be positive, got {' '.join(map(str, std))}")
    if input_size is not None and input_size < 1:
        raise InputError(f"--input-size: a positive number of pixels, got {input_size}")
    kind, _, name = spec.partition(":")
    if kind == "timm":
        network, config, description = _timm_encoder(name, weights)
    elif kind == "torchscript" and name:
        if weights is not None:
            raise InputError(f"--encoder-weights {weights}: a TorchScript encoder holds its weights ({spec})")
        network, config, description = _torchscript_encoder(Path(name))
    else:
        raise InputError(f"--encoder {spec!r}: give timm:NAME (a timm model, with --encoder-weights FILE) or torchscript:PATH")
    given = {"mean": mean, "std": std, "input_size": input_size}
    encoder = PatchEncoder(network, spec, description=description, **{k: config[k] if v is None else v for k, v in given.items()})
    if encoder.input_size is not None:
        encoder.probe(encoder.input_size)
    return encoder


class EncoderModule(L.LightningModule):
    """A :class:`PatchEncoder` in the whole-slide predict loop
    (:func:`~hsmla_med.pipelines.task.predict_cases`), as a checkpoint's module runs there: a
    batch of patches -> their ``features`` with their places. On CUDA the encoder runs as CUDA
    graphs, one per batch shape (:class:`~hsmla_med.inference.cuda_graph.GraphedCallable`),
    unless :meth:`use_cuda_graphs` turns them off.

    Args:
        encoder: the encoder.
        data: the data section the patch grid is cut by (as a checkpoint's).
        batch_size: patches per forward pass when the run's options give none.

    ``config`` (``encoder``: its description and preprocessing; ``data``; ``inference``) is
    part of the digest that the outputs are recorded with, so a folder written with another
    encoder or grid is not taken as done; ``checkpoint_path`` says in words what that digest
    stands for (a refused folder's message names it).
    """

    cuda_graphs: bool = True
    run_inference: dict | None = None  # (predict_cases holds a run's settings here; an encoder has none)

    def __init__(self, encoder: PatchEncoder, data: dict, batch_size: int) -> None:
        super().__init__()
        self.network = encoder
        where = f"{data['mpp']} µm/px" if data["mpp"] else f"level {data['level']}"
        # what outputs record as their model and a refused folder names: the grid and preprocessing too
        self.checkpoint_path = (f"{encoder.description} on {data['patch_size']}-px patches at {where} (min_tissue {data['min_tissue']}), "
                                f"input {encoder.input_size or data['patch_size']} px, mean {encoder.mean}, std {encoder.std}")
        self.config = {"encoder": {"description": encoder.description, "mean": encoder.mean, "std": encoder.std,
                                   "input_size": encoder.input_size}, "data": data, "inference": {"batch_size": batch_size}}
        self._graphed = GraphedCallable(encoder, version=lambda: weights_version(encoder))

    def use_cuda_graphs(self, on: bool) -> None:
        self.cuda_graphs = on

    def predict_step(self, batch: dict, batch_idx: int = 0) -> dict:
        """A batch of patches (``image`` uint8 ``(B, 3, H, W)``, ``slide_index``, ``row``, ``col``)
        -> their ``features`` ``(B, D)`` float32 with their places, on the CPU."""
        self._graphed.enabled = self.cuda_graphs
        features = self._graphed(plain(batch["image"]))
        place = {k: torch.as_tensor(batch[k]).reshape(-1).cpu() for k in ("slide_index", "row", "col")}
        return {**place, "features": features.cpu()}


def encode_slides(encoder: PatchEncoder, slides: str | Path | list, output: str | Path, *, patch_size: int = 256, level: int | None = None,
                  mpp: float | None = None, min_tissue: float | None = None, batch_size: int = 64, options: InferenceOptions | None = None,
                  cache_dir: str | Path | None = None) -> list[Path]:
    """Features of the tissue patches of a slide, a folder of slides or a list of them, by
    ``encoder``, in CLAM's layout under ``output`` (``h5_files/<slide>.h5``,
    ``pt_files/<slide>.pt``: :class:`~hsmla_med.pipelines.camelyon16.SlideFeatures`, whose
    ``features`` attributes record the encoder, ``mean``, ``std``, ``input_size``, ``patch_size``
    and the patches' ``mpp``), through the whole-slide predict loop (processes, shards, workers,
    precision of ``options``). Resumable: a slide whose h5 exists from the same encoder, grid and
    preprocessing is skipped (the h5 is written last, atomically); a folder of another encoder or
    other settings is refused unless ``options.overwrite``.

    Args:
        encoder: from :func:`load_encoder`.
        slides: a slide file, a folder of slides or a list of them.
        output: the run's folder.
        patch_size: the grid's patches (and step), in pixels at the grid's level.
        level: the pyramid level of the patches (default 0); ``options.level``, when set,
            overrides it (and ``mpp``), as for a checkpoint.
        mpp: instead of ``level``, µm per pixel: each slide's level whose resolution is nearest.
        min_tissue: the share of a patch that must be tissue (default: the task config's).
        batch_size: patches per forward pass when ``options.batch_size`` is not set.
        options: the run's options (default: :class:`InferenceOptions`' defaults).
        cache_dir: where the slides' patch grids are cached (default: the task config's
            ``data.cache_dir``).

    Returns:
        (first process) every slide's h5; on other processes, the files they wrote.

    Raises:
        InputError: bad grid options.
        DataError: naming a slide OpenSlide cannot read, or no slides found.
    """
    options = options or InferenceOptions()
    if level is not None and mpp is not None:
        raise InputError(f"--level {level} and --mpp {mpp}: give one (--mpp picks each slide's level nearest that resolution)")
    if patch_size < 1:
        raise InputError(f"--patch-size: a positive number of pixels, got {patch_size}")
    if mpp is not None and not mpp > 0:
        raise InputError(f"--mpp: a positive number of µm per pixel, got {mpp}")
    if min_tissue is not None and not 0.0 <= min_tissue <= 1.0:
        raise InputError(f"--min-tissue: a share of the patch in [0, 1], got {min_tissue}")
    defaults = task_config("camelyon16")["data"]
    data = {**_grid_params(defaults), "level": level or 0, "mpp": mpp, "patch_size": patch_size, "stride": patch_size,
            "cache_dir": str(cache_dir or defaults["cache_dir"]), "stain_normalization": None}
    if min_tissue is not None:
        data["min_tissue"] = min_tissue
    width = encoder.dim if encoder.input_size and encoder.dim else encoder.probe(patch_size)  # (load_encoder probed a known size)
    module = EncoderModule(encoder, data, batch_size)
    files, data = _run_slides(module, slides, options, "features")
    described = {"encoder": encoder.description, "mean": encoder.mean, "std": encoder.std, "input_size": encoder.input_size or patch_size}
    return _write_features(module, files, data, width, described, output, options)
