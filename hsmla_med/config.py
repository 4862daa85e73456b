"""YAML configuration: safe loading with clear errors, and networks built from model configs."""

from __future__ import annotations

import inspect
from importlib import resources
from pathlib import Path

import yaml
from torch import nn

from hsmla_med.errors import ConfigError
from hsmla_med.nn import HSMLA, VARIANTS, HSMLAClassifier, HSMLASegNet

__all__ = ["ConfigError", "load_yaml", "model_config", "build_network", "task_config", "merge_config"]


def load_yaml(path: str | Path) -> dict:
    """Read a YAML mapping with the safe loader; raise :class:`ConfigError` naming the file."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
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


def model_config(name_or_path: str | Path | dict) -> dict:
    """A model config: a packaged size (``"b0"``, ``"b1"``, ``"b2"``), a YAML file path, or the
    mapping itself (a task config may give the model inline)."""
    if isinstance(name_or_path, dict):
        return dict(name_or_path)
    if str(name_or_path) in VARIANTS:
        return load_yaml(resources.files("hsmla_med.configs") / "model" / f"{name_or_path}.yaml")
    if not str(name_or_path).endswith((".yaml", ".yml")):
        raise ConfigError(f"unknown model {str(name_or_path)!r}: use one of {', '.join(VARIANTS)} or a model YAML file")
    return load_yaml(name_or_path)


_ATTENTION_KEYS = set(inspect.signature(HSMLA).parameters) - {"spatial_dims", "in_channels"}
_MODEL_KEYS = {
    "segmentation": {"variant", "attention", "decoder", "head_stride", "attention_strides", "norm"},
    "classification": {"variant", "attention", "attention_strides"},
}
_INJECTED = ("spatial_dims", "in_channels", "out_channels")


def build_network(config: dict, spatial_dims: int, in_channels: int, out_channels: int, kind: str = "segmentation") -> nn.Module:
    """The network of a model config.

    - HSMLA: ``{variant: b0|b1|b2, decoder: unet|fpn, head_stride: 8|4, attention_strides: [16, 32],
      attention: {...HSMLA keyword arguments}}`` builds :class:`HSMLASegNet`
      (``kind="segmentation"``) or :class:`HSMLAClassifier` (``kind="classification"``; no
      decoder options).
    - Any MONAI network: ``{monai: NAME, args: {...}}`` builds ``monai.networks.nets.NAME``
      with ``spatial_dims``, ``in_channels`` and ``out_channels`` filled in by the task where
      its constructor takes them (e.g. ``{monai: SwinUNETR, args: {feature_size: 24}}``), so
      baselines run through the same pipelines. Such networks have no gates: no gate
      regularisers, no tau calibration.
    """
    if kind not in _MODEL_KEYS:
        raise ConfigError(f"kind must be one of {sorted(_MODEL_KEYS)}, got {kind!r}")
    if not isinstance(config, dict):
        raise ConfigError(f"model config must be a mapping, got {type(config).__name__}")
    if "monai" in config:
        return _monai_network(config, spatial_dims, in_channels, out_channels)
    attention = dict(config.get("attention") or {})
    unknown = sorted(set(attention) - _ATTENTION_KEYS)
    if unknown:
        raise ConfigError(f"unknown attention option(s) {unknown}; known: {sorted(_ATTENTION_KEYS)}")
    if "scales" in attention:
        attention["scales"] = tuple(attention["scales"])
    unknown = sorted(set(config) - _MODEL_KEYS[kind])
    if unknown:
        raise ConfigError(f"unknown model option(s) {unknown} for a {kind} network; known: {', '.join(sorted(_MODEL_KEYS[kind]))}, or monai")
    options = {k: config[k] for k in _MODEL_KEYS[kind] - {"variant", "attention"} if k in config}
    if "attention_strides" in options:
        options["attention_strides"] = tuple(options["attention_strides"])
    cls = HSMLASegNet if kind == "segmentation" else HSMLAClassifier
    try:
        return cls(spatial_dims, in_channels, out_channels, variant=config.get("variant", "b0"), **options, **attention)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"model config: {err}") from None


def _monai_network(config: dict, spatial_dims: int, in_channels: int, out_channels: int) -> nn.Module:
    """``monai.networks.nets.<config["monai"]>(**args)`` with the task's dims and channels."""
    from monai.networks import nets

    name, args = config["monai"], config.get("args") or {}
    unknown = sorted(set(config) - {"monai", "args"})
    if unknown:
        raise ConfigError(f"unknown model option(s) {unknown} beside 'monai'; known: monai, args")
    network = getattr(nets, str(name), None)
    if not (isinstance(network, type) and issubclass(network, nn.Module)):
        raise ConfigError(f"model.monai: {name!r} is not a network in monai.networks.nets")
    if not isinstance(args, dict):
        raise ConfigError(f"model.args must be a mapping of {name} arguments, got {type(args).__name__}")
    parameters = inspect.signature(network).parameters
    taken = [k for k in _INJECTED if k in args]
    if taken:
        raise ConfigError(f"model.args: {taken} come from the task (its data and labels); remove them")
    if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        unknown = sorted(set(args) - set(parameters))
        if unknown:
            raise ConfigError(f"model.args: {name} takes no argument(s) {unknown}")
    given = dict(zip(_INJECTED, (spatial_dims, in_channels, out_channels)))
    kwargs = {**{k: v for k, v in given.items() if k in parameters}, **args}
    try:
        return network(**kwargs)
    except (TypeError, ValueError, AssertionError) as err:
        raise ConfigError(f"model: cannot build monai {name} with {args}: {err}") from None


def task_config(task: str) -> dict:
    """The packaged default config of a task (``configs/<task>.yaml``)."""
    path = resources.files("hsmla_med.configs") / f"{task}.yaml"
    if not path.is_file():
        raise ConfigError(f"no packaged config for task {task!r}")
    return load_yaml(path)


def merge_config(base: dict, override: dict, source: str = "override", _prefix: str = "") -> dict:
    """``override`` merged over ``base`` (recursively, new dict). Keys that ``base`` lacks are
    refused with a :class:`ConfigError` naming ``source`` and the dotted key, so that a typo in a
    user's YAML is an error rather than a silently ignored setting."""
    merged = dict(base)
    for key, value in override.items():
        name = f"{_prefix}{key}"
        if key not in base:
            raise ConfigError(f"{source}: unknown config key {name!r}; known here: {sorted(base)}")
        if isinstance(base[key], dict) and base[key] and isinstance(value, dict):
            merged[key] = merge_config(base[key], value, source, f"{name}.")
        elif isinstance(base[key], dict) and base[key] and value is not None:
            raise ConfigError(f"{source}: {name!r} must be a mapping, got {type(value).__name__}")
        else:
            merged[key] = value
    return merged
