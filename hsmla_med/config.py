"""YAML configuration: safe loading with clear errors, and networks built from model configs."""

from __future__ import annotations

import inspect
from importlib import resources
from pathlib import Path

import yaml

from hsmla_med.errors import ConfigError

# torch, MONAI and the networks are imported where a network is built, not here: the command
# line reads its configs through this module and answers --help without loading them.

__all__ = ["ConfigError", "DEFAULT_MODEL", "load_yaml", "model_config", "build_network", "check_model_settings", "task_config", "merge_config", "merge_user_config", "validate_config"]


def load_yaml(path: str | Path) -> dict:
    """Read a YAML mapping with the safe loader; raise :class:`ConfigError` naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")  # YAML's own encoding, whatever the locale's
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); save the config as UTF-8") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config file ({err.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: malformed YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


#: the model a config trains where its ``model`` is left null: HSMLA-B0 (named here, once; the
#: packaged task configs leave ``model`` null, and :func:`task_config` writes this name in)
DEFAULT_MODEL = "b0"


def model_config(entry: str | Path | dict | None) -> dict:
    """The resolved model config of a config's ``model`` entry, what the network is built from
    (:func:`build_network`) and a checkpoint records: a model name (``"b0"``, ``"b1"``,
    ``"b2"``, or a registered network family: :mod:`hsmla_med.nn.registry`), a YAML file path,
    the mapping itself (a task config may give the model inline), or ``None``
    (:data:`DEFAULT_MODEL`)."""
    from hsmla_med.nn.registry import MODELS, NETWORKS, registered_config

    if entry is None:
        entry = DEFAULT_MODEL
    if isinstance(entry, dict):
        return dict(entry)
    try:
        return registered_config(str(entry))
    except KeyError:
        pass
    if not str(entry).endswith((".yaml", ".yml")):
        raise ConfigError(f"unknown model {str(entry)!r}: use one of {', '.join([*MODELS, *NETWORKS])} or a model YAML file") from None
    return load_yaml(entry)


def build_network(config: dict, spatial_dims: int, in_channels: int, out_channels: int, kind: str = "segmentation") -> nn.Module:
    """The network of a resolved model config (:func:`model_config`), built by the family the
    config names (:func:`hsmla_med.nn.registry.create_network`), with ``spatial_dims``,
    ``in_channels`` and ``out_channels`` from the task and ``kind`` (``"segmentation"`` or
    ``"classification"``) from its module:

    - HSMLA: ``{variant: b0|b1|b2, decoder: unet|fpn, head_stride: 8|4, attention_strides: [16, 32],
      norm: batch|instance, full_res, attention: {...HSMLA keyword arguments}}`` builds
      :class:`HSMLASegNet` or :class:`HSMLAClassifier` (no decoder options, no ``norm``).
    - Any MONAI network: ``{monai: NAME, args: {...}}`` builds ``monai.networks.nets.NAME``
      with the task's dims and channels where its constructor takes them (e.g. ``{monai:
      SwinUNETR, args: {feature_size: 24}}``), so baselines run through the same pipelines.
      Such networks have no gates: no gate regularisers, no tau calibration.
    - A registered family: ``{network: NAME, ...options}``.

    An option the network does not take is a :class:`ConfigError` naming it. (A MONAI Bundle's
    ``network_def_hsmla`` item calls this function by name.)
    """
    from hsmla_med.nn.registry import create_network

    return create_network(config, spatial_dims, in_channels, out_channels, kind)


def check_model_settings(config: dict, network: dict, plan: dict | None = None) -> None:
    """Refuse a task config's ``norm`` (``batch`` or ``instance``, set by the user) that the
    module's ``network`` config does not carry: the network would be built without it, as the
    config did not ask (a MONAI network or a classifier take no ``norm``; a task's
    ``module_config`` that does not apply it; a model mapping naming another). A norm the data
    planned (``plan``, :mod:`hsmla_med.data.plans`, without ``norm`` in its ``kept``) is advice
    and is not checked."""
    norm = config.get("norm")
    if norm in (None, "auto") or (plan is not None and "norm" not in plan.get("kept", ())):
        return
    if network.get("norm") != norm:
        takes = "takes no norm" if "norm" not in network else f"names its own, norm: {network['norm']}"
        raise ConfigError(f"norm: {norm} does not reach the network: its model config {network} {takes}, so the setting would be "
                          f"ignored; set norm: auto, or give the normalisation in the model config")


def task_config(task: str) -> dict:
    """The packaged default config of a task: ``configs/<task>.yaml`` merged over
    ``configs/common.yaml`` (the sections every task shares, defined once there); the task's
    file may add keys of its own."""
    path = resources.files("hsmla_med.configs") / f"{task}.yaml"
    if not path.is_file():
        raise ConfigError(f"no packaged config for task {task!r}")
    common = load_yaml(resources.files("hsmla_med.configs") / "common.yaml")
    config = merge_config(common, load_yaml(path), f"{task}.yaml", allow_new=True)
    if config.get("model") is None:  # a run's config.yaml names the model it trained
        config["model"] = DEFAULT_MODEL
    return config


def merge_config(base: dict, override: dict, source: str = "override", _prefix: str = "", allow_new: bool = False) -> dict:
    """``override`` merged over ``base`` (recursively, new dict). Keys that ``base`` lacks are
    refused with a :class:`ConfigError` naming ``source`` and the dotted key, so that a typo in a
    user's YAML is an error rather than a silently ignored setting (``allow_new``: added, for
    the packaged task files over the common one)."""
    merged = dict(base)
    for key, value in override.items():
        name = f"{_prefix}{key}"
        if key not in base:
            if allow_new:
                merged[key] = value
                continue
            raise ConfigError(f"{source}: unknown config key {name!r}; known here: {sorted(base)}")
        if isinstance(base[key], dict) and base[key] and isinstance(value, dict):
            merged[key] = merge_config(base[key], value, source, f"{name}.", allow_new)
        elif isinstance(base[key], dict) and base[key] and value is not None:
            raise ConfigError(f"{source}: {name!r} must be a mapping, got {type(value).__name__}")
        else:
            merged[key] = value
    return merged


def merge_user_config(config: dict, path: str | Path, asked: str) -> dict:
    """``config``, a task's packaged config, with the user's YAML ``path`` (``--config``) merged
    over it and checked (:func:`validate_config`). ``asked``: how the command chose the task
    (``--task segmentation``), named where the file disagrees.

    Refused in one line naming the file, where merging would go on silently: a ``task:`` of
    another pipeline (its settings are another task's; the run would fail later on a section
    this task lacks), and a normalisation's values without its ``kind`` (the default kind,
    ``auto``, plans its own from the data and would replace them)."""
    from hsmla_med.tasks import ALIASES, TASKS

    user = load_yaml(path)
    if "task" in user:
        given = user["task"]
        if given not in (*TASKS, *ALIASES):
            raise ConfigError(f"{path}: task: {given!r} is no task; available: {', '.join([*TASKS, *ALIASES])} (or leave task: out)")
        if ALIASES.get(given, given) != config["task"]:
            raise ConfigError(f"{path}: task: {given} differs from {asked}; the file's settings are for the {given} pipeline: "
                              f"pass --task {given}, or remove task: from the file")
        user = {**user, "task": config["task"]}  # a generic name (segmentation) is this pipeline
    config = validate_config(merge_config(config, user, source=str(path)), str(path))
    intensity = (user.get("data") or {}).get("intensity")
    if isinstance(intensity, dict) and intensity and "kind" not in intensity and config["data"]["intensity"]["kind"] == "auto":
        keys = set(intensity)
        kind = "percentile" if keys & {"lower", "upper"} else "ct_zscore" if keys & {"mean", "std"} else "ct_window"
        raise ConfigError(f"{path}: data.intensity sets {', '.join(intensity)} but no kind, and kind auto plans the normalisation from the "
                          f"data, which would replace them; add kind: {kind} to use yours, or remove them")
    return config


# -- validation ------------------------------------------------------------------------------
# Types come from the packaged defaults (a value must have its default's type: a number, a
# flag, a string, a list of as many numbers); this table adds ranges and choices, and the
# types of keys whose default is null.


def _number(low=None, high=None, integer=False, low_open=False, high_open=False, nullable=False):
    def check(value, key):
        if value is None and nullable:
            return
        kinds = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise ConfigError(f"{key} must be {'an integer' if integer else 'a number'}{' or null' if nullable else ''}, got {value!r}")
        if low is not None and (value < low or (low_open and value == low)):
            raise ConfigError(f"{key} must be {'>' if low_open else '>='} {low}, got {value!r}")
        if high is not None and (value > high or (high_open and value == high)):
            raise ConfigError(f"{key} must be {'<' if high_open else '<='} {high}, got {value!r}")
    return check


def _choice(*options):
    def check(value, key):
        if value not in options:
            raise ConfigError(f"{key} must be one of {', '.join(map(str, options))}, got {value!r}")
    return check


def _devices(value, key):
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return
    if isinstance(value, str) and all(part.strip().isdigit() for part in value.split(",")):
        return
    raise ConfigError(f"{key} must be a positive number of devices, a list of device indices (0,1) or auto, got {value!r}")


def _accelerator(value, key):
    _choice("auto", "cpu", "gpu", "cuda")(value, key)
    if value in ("gpu", "cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"{key} {value}: this machine has no CUDA GPU; use cpu or auto")


def _crop(value, key):
    """``data.crop`` (EndoVis): null (whole frames) or ``[top, left, height, width]`` in whole
    pixels, offsets >= 0 (a frame without a top border has top 0)."""
    pixels = isinstance(value, list) and len(value) == 4 and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if value is not None and (not pixels or min(value[:2]) < 0 or min(value[2:]) < 1):
        raise ConfigError(f"{key} must be null or [top, left, height, width] in whole pixels (offsets >= 0, sizes >= 1), got {value!r}")


def _auto_or(check):
    """``auto`` (a value planned from the data: hsmla_med.data.plans) or what ``check`` accepts."""
    def checked(value, key):
        if value != "auto":
            check(value, key)
    return checked


def _positive_list(length: int):
    def check(value, key):
        if not (isinstance(value, list) and len(value) == length and all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in value)):
            raise ConfigError(f"{key} must be auto or a list of {length} positive numbers, got {value!r}")
    return check


def _series_selection(value, key):
    if value is not None:
        from hsmla_med.io.dicom import SeriesRules  # pydicom: imported only for a config that has rules

        SeriesRules(value, key, ConfigError)


def _optional_string(value, key):
    if value is not None:
        _string(value, key)


def _string(value, key):
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key} must be a non-empty string, got {value!r}")


_CHECKS = {
    "task": _string,
    "mode": _choice("2d", "3d", "auto"),
    "norm": _choice("batch", "instance", "auto"),
    "seed": _number(0, integer=True),
    "fold": _number(0, integer=True),
    "output": _string,
    "optim.lr": _number(0, low_open=True),
    "optim.weight_decay": _number(0),
    "optim.warmup_steps": _number(0, integer=True),
    "loss.lambda_budget": _number(0),
    "loss.lambda_smoothness": _number(0),
    "inference.target_alpha": _number(0, 1, nullable=True),
    "inference.overlap": _number(0, 1, high_open=True),
    "inference.sw_batch_size": _number(1, integer=True),
    "inference.slab": _number(1, integer=True),
    "inference.batch_size": _number(1, integer=True),
    "inference.series_selection": _series_selection,
    "inference.region_threshold": _number(0, 1),
    "inference.region_sigma": _number(0),
    "trainer.max_steps": _number(1, integer=True, nullable=True),
    "trainer.max_epochs": _number(1, integer=True, nullable=True),
    "trainer.check_val_every_n_epoch": _number(1, integer=True),
    "trainer.log_every_n_steps": _number(1, integer=True),
    "trainer.gradient_clip_val": _number(0, low_open=True, nullable=True),
    "trainer.accelerator": _accelerator,
    "trainer.devices": _devices,
    "trainer.num_nodes": _number(1, integer=True),
    "trainer.strategy": _string,
    "trainer.logger": _choice("csv", "tensorboard", "mlflow"),
    "trainer.precision": _choice("auto", "32-true", "32", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true"),
    "data.folds": _number(2, integer=True),
    "data.splits_file": _optional_string,
    "data.batch_size": _auto_or(_number(1, integer=True)),
    "data.spacing": _auto_or(_positive_list(3)),
    "data.roi_size_2d": _auto_or(_positive_list(2)),
    "data.roi_size_3d": _auto_or(_positive_list(3)),
    "data.num_workers": _number(0, integer=True),
    "data.cache_rate": _number(0, 1),
    "data.samples_per_case": _number(1, integer=True),
    "data.samples_per_epoch": _number(1, integer=True),
    "data.patch_size": _number(1, integer=True),
    "data.stride": _number(1, integer=True),
    "data.level": _number(0, integer=True),
    "data.mpp": _number(0, low_open=True, nullable=True),
    "data.crop": _crop,
}
_TYPED_BY_CHECK = {"data.crop", "data.splits_file", "inference.series_selection", "data.batch_size", "data.spacing", "data.roi_size_2d",
                   "data.roi_size_3d"}  # keys whose check above is their whole type check (their default's type is not)


def _same_type(value, default, key: str) -> None:
    """``value`` has the type of the packaged ``default`` (numbers: int or float alike)."""
    def kind(v):
        if isinstance(v, bool):
            return "true or false"
        if isinstance(v, (int, float)):
            return "a number"
        if isinstance(v, str):
            return "a string"
        if isinstance(v, list):
            return "a list"
        return type(v).__name__

    if default is None or value is None and not isinstance(default, (list, dict)):
        return
    if kind(value) != kind(default):
        raise ConfigError(f"{key} must be {kind(default)} like its default {default!r}, got {value!r}")
    if isinstance(default, list) and default and all(isinstance(d, (int, float)) and not isinstance(d, bool) for d in default):
        if len(value) != len(default) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            raise ConfigError(f"{key} must be a list of {len(default)} numbers like its default {default}, got {value!r}")
        if any(v <= 0 for v in value) and all(d > 0 for d in default):
            raise ConfigError(f"{key} must hold positive numbers, got {value!r}")


def _check_trainable_backend(model, source: str) -> None:
    """Refuse a model whose HSMLA layers are forced onto a kernel backend (``cpu``, ``triton``):
    the kernels have no backward, so the first training step would raise (on any machine; on
    one without CUDA the Triton kernels cannot run at all). The rest of the model section is
    checked when the network is built."""
    if model is None:
        return
    attention = model_config(model).get("attention")
    backend = attention.get("backend", "auto") if isinstance(attention, dict) else "auto"
    if backend in ("cpu", "triton"):
        where = model if isinstance(model, (str, Path)) and str(model).endswith((".yaml", ".yml")) else source
        raise ConfigError(
            f"{where}: model.attention.backend {backend}: the {'C' if backend == 'cpu' else 'Triton'} kernels have no "
            "backward, so a network cannot train on them; use auto (they run at inference where they can), reference or dense"
        )


def validate_config(config: dict, source: str = "config") -> dict:
    """Check every value of a merged task config against the task's packaged defaults (types)
    and the range table above; one :class:`ConfigError` naming ``source`` and the dotted key.
    Returns ``config``. The ``model`` section is checked when the network is built."""
    defaults = task_config(config.get("task", ""))

    def walk(values: dict, reference: dict, prefix: str) -> None:
        for key, value in values.items():
            name = f"{prefix}{key}"
            if name == "model":
                continue
            default = reference.get(key)
            if isinstance(default, dict) and default:
                if not isinstance(value, dict):
                    raise ConfigError(f"{source}: {name} must be a mapping, got {value!r}")
                walk(value, default, f"{name}.")
                continue
            try:
                if name not in _TYPED_BY_CHECK:
                    _same_type(value, default, name)
                if name in _CHECKS:
                    _CHECKS[name](value, name)
            except ConfigError as err:
                raise ConfigError(f"{source}: {err}") from None

    walk(config, defaults, "")
    _check_trainable_backend(config.get("model"), source)
    trainer = config["trainer"]
    if trainer.get("max_steps") is None and trainer.get("max_epochs") is None:
        raise ConfigError(f"{source}: trainer.max_steps or trainer.max_epochs must be set")
    return config
