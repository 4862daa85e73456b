"""YAML configuration: safe loading with clear errors, and networks built from model configs."""

from __future__ import annotations

import inspect
from importlib import resources
from pathlib import Path

import yaml

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


def build_network(
    config: dict, spatial_dims: int, in_channels: int, out_channels: int, kind: str = "segmentation"
) -> HSMLASegNet | HSMLAClassifier:
    """Build :class:`HSMLASegNet` (``kind="segmentation"``) or :class:`HSMLAClassifier` from a
    model config ``{variant: b0|b1|b2, head_stride: 8|4 (segmentation), attention: {...HSMLA
    keyword arguments}}``."""
    classes = {"segmentation": HSMLASegNet, "classification": HSMLAClassifier}
    if kind not in classes:
        raise ConfigError(f"kind must be one of {sorted(classes)}, got {kind!r}")
    attention = dict(config.get("attention") or {})
    unknown = sorted(set(attention) - _ATTENTION_KEYS)
    if unknown:
        raise ConfigError(f"unknown attention option(s) {unknown}; known: {sorted(_ATTENTION_KEYS)}")
    if "scales" in attention:
        attention["scales"] = tuple(attention["scales"])
    unknown = sorted(set(config) - {"variant", "attention", "head_stride"})
    if unknown:
        raise ConfigError(f"unknown model option(s) {unknown}; known: attention, head_stride, variant")
    if "head_stride" in config and kind == "segmentation":
        attention["head_stride"] = int(config["head_stride"])
    return classes[kind](spatial_dims, in_channels, out_channels, variant=config.get("variant", "b0"), **attention)


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
