"""The network registry (timm's ``register_model``, in small): network families by name, each a
builder of networks, and the model names a config may give for a whole model config.

A builder is ``build(spatial_dims, in_channels, out_channels, kind, **options) -> nn.Module``: the
task fills in the first four (its data's dims and channels, its labels, ``kind``
``"segmentation"`` or ``"classification"``), the model config the options. A model config, what
``model:`` resolves to and what a checkpoint records under ``network``, names its family:

- ``{network: NAME, ...options}``: the family registered as ``NAME`` (:func:`register_network`);
  an option its builder's signature does not name is a ``ConfigError`` naming it and the ones it
  takes (a builder with ``**options`` checks its own);
- ``{monai: NAME, args: {...}}``: ``monai.networks.nets.NAME`` (the ``monai`` family);
- any other mapping: an HSMLA network, ``{variant, decoder, head_stride, attention_strides,
  norm, full_res, attention}`` (the ``hsmla`` family). These two forms predate ``network:``
  and every checkpoint records them, so they stay as they are.

Model names (``model: NAME``): the HSMLA sizes ``b0``, ``b1``, ``b2``, registered from
:data:`~hsmla_med.nn.hsmla_net.VARIANTS` (their widths and depths) with the layer's own defaults
(:class:`~hsmla_med.nn.HSMLA`'s signature) as their ``attention`` config, so a size or a default
changes in one place; and every family registered with :func:`register_network`, which names
``{network: NAME}``, its builder's defaults. Another package's family registers through the entry
point group ``hsmla_med.networks`` (loaded when a config names a family not registered yet), so
the command line, and ``infer`` on a checkpoint of that family, find it without an import.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from importlib.metadata import entry_points

from torch import nn

from hsmla_med.errors import ConfigError
from hsmla_med.nn.attention import HSMLA
from hsmla_med.nn.hsmla_net import VARIANTS, HSMLAClassifier, HSMLASegNet

__all__ = ["NETWORKS", "MODELS", "KINDS", "ENTRY_POINTS", "ATTENTION_DEFAULTS", "register_network", "register_model", "registered_config",
           "family", "create_network"]

#: the kinds of network a task's module asks for
KINDS = ("segmentation", "classification")
#: the entry point group through which an installed package registers its families
ENTRY_POINTS = "hsmla_med.networks"
#: the arguments a builder takes from the task, not from the model config
_TASK_ARGUMENTS = ("spatial_dims", "in_channels", "out_channels", "kind")

# the attention options a model config spells out (a checkpoint records them), in this order
_ATTENTION_KEYS = ("scales", "window", "block", "tau", "rho", "routing")
_SIGNATURE = inspect.signature(HSMLA).parameters
#: the HSMLA layer's defaults, as a model config writes them (lists, not tuples: YAML and JSON)
ATTENTION_DEFAULTS = {k: list(_SIGNATURE[k].default) if isinstance(_SIGNATURE[k].default, tuple) else _SIGNATURE[k].default for k in _ATTENTION_KEYS}

#: family name -> its builder
NETWORKS: dict[str, Callable[..., nn.Module]] = {}
#: model name -> a function returning its model config
MODELS: dict[str, Callable[[], dict]] = {}


def register_network(name: str) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Decorator: register the builder it decorates as the network family ``name``, which a
    model config then names as ``{network: name, ...options}`` (or ``model: name`` for the
    builder's defaults). A name is registered once."""
    def register(builder: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        if name in NETWORKS or name in MODELS:
            raise ValueError(f"network {name!r} is already registered")
        NETWORKS[name] = builder
        return builder
    return register


def register_model(name: str, config: Callable[[], dict]) -> None:
    """Register ``name`` for the model config ``config()`` returns; a name is registered once."""
    if name in MODELS or name in NETWORKS:
        raise ValueError(f"model {name!r} is already registered")
    MODELS[name] = config


def _load_entry_points() -> None:
    """Import the modules of the installed packages' families (their decorators register them)."""
    for point in entry_points(group=ENTRY_POINTS):
        point.load()


def registered_config(name: str) -> dict:
    """A fresh copy of the model config of the model name ``name``: a registered size, or
    ``{network: name}`` for a registered family; KeyError for an unknown name."""
    if name not in MODELS and name not in NETWORKS:
        _load_entry_points()
    if name in MODELS:
        return copy.deepcopy(MODELS[name]())
    if name in NETWORKS:
        return {"network": name}
    raise KeyError(name)


def family(config: dict) -> tuple[str, dict]:
    """The family that builds the model config ``config`` and the options its builder takes."""
    if "network" in config:
        return str(config["network"]), {k: v for k, v in config.items() if k != "network"}
    return ("monai" if "monai" in config else "hsmla"), config


def create_network(config: dict, spatial_dims: int, in_channels: int, out_channels: int, kind: str = "segmentation") -> nn.Module:
    """The network of the model config ``config`` (timm's ``create_model``), built by its
    family's builder; a ``ConfigError`` names what the config gets wrong."""
    if kind not in KINDS:
        raise ConfigError(f"kind must be one of {list(KINDS)}, got {kind!r}")
    if not isinstance(config, dict):
        raise ConfigError(f"model config must be a mapping, got {type(config).__name__}")
    name, options = family(config)
    if name not in NETWORKS:
        _load_entry_points()
    if name not in NETWORKS:
        raise ConfigError(f"model.network: {name!r} is no registered network family; registered: {', '.join(NETWORKS)} "
                          f"(hsmla_med.nn.registry.register_network, or a package's entry point in {ENTRY_POINTS})")
    builder = NETWORKS[name]
    parameters = inspect.signature(builder).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        accepted = [k for k in parameters if k not in _TASK_ARGUMENTS]
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            raise ConfigError(f"model: the {name} network takes no option(s) {unknown}; it takes: {', '.join(accepted) or 'none'}")
    try:
        return builder(spatial_dims, in_channels, out_channels, kind, **options)
    except (TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"model config: {err}") from None


#: the options of an HSMLA model config, by kind (a classifier has no decoder)
_HSMLA_OPTIONS = {
    "segmentation": ("variant", "attention", "decoder", "head_stride", "attention_strides", "norm", "full_res"),
    "classification": ("variant", "attention", "attention_strides"),
}


@register_network("hsmla")
def hsmla_network(spatial_dims: int, in_channels: int, out_channels: int, kind: str, **config) -> nn.Module:
    """:class:`~hsmla_med.nn.HSMLASegNet` (segmentation) or :class:`~hsmla_med.nn.HSMLAClassifier`
    (classification) of ``{variant, decoder, head_stride, attention_strides, norm, full_res,
    attention: {...HSMLA keyword arguments}}`` (a classifier takes ``variant``,
    ``attention_strides`` and ``attention``); what the config leaves out is the network's default."""
    unknown = sorted(set(config) - set(_HSMLA_OPTIONS[kind]))
    if unknown:
        raise ConfigError(f"unknown model option(s) {unknown} for a {kind} network; known: {', '.join(sorted(_HSMLA_OPTIONS[kind]))}, "
                          "or monai, or network")
    attention = dict(config.get("attention") or {})
    known = set(_SIGNATURE) - {"spatial_dims", "in_channels"}
    unknown = sorted(set(attention) - known)
    if unknown:
        raise ConfigError(f"unknown attention option(s) {unknown}; known: {sorted(known)}")
    if "scales" in attention:
        attention["scales"] = tuple(attention["scales"])
    options = {k: config[k] for k in _HSMLA_OPTIONS[kind] if k in config and k != "attention"}
    if "attention_strides" in options:
        options["attention_strides"] = tuple(options["attention_strides"])
    cls = HSMLASegNet if kind == "segmentation" else HSMLAClassifier
    return cls(spatial_dims, in_channels, out_channels, **options, **attention)


_FROM_TASK = ("spatial_dims", "in_channels", "out_channels")


@register_network("monai")
def monai_network(spatial_dims: int, in_channels: int, out_channels: int, kind: str, **config) -> nn.Module:
    """``monai.networks.nets.<config["monai"]>(**config["args"])`` with the task's dims and
    channels where its constructor takes them (e.g. ``{monai: SwinUNETR, args: {feature_size:
    24}}``), so baselines run through the same pipelines. Such networks have no gates: no gate
    regularisers, no tau calibration."""
    from monai.networks import nets

    name, args = config.get("monai"), config.get("args") or {}
    unknown = sorted(set(config) - {"monai", "args"})
    if unknown:
        raise ConfigError(f"unknown model option(s) {unknown} beside 'monai'; known: monai, args")
    network = getattr(nets, str(name), None)
    if not (isinstance(network, type) and issubclass(network, nn.Module)):
        raise ConfigError(f"model.monai: {name!r} is not a network in monai.networks.nets")
    if not isinstance(args, dict):
        raise ConfigError(f"model.args must be a mapping of {name} arguments, got {type(args).__name__}")
    parameters = inspect.signature(network).parameters
    taken = [k for k in _FROM_TASK if k in args]
    if taken:
        raise ConfigError(f"model.args: {taken} come from the task (its data and labels); remove them")
    if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        unknown = sorted(set(args) - set(parameters))
        if unknown:
            raise ConfigError(f"model.args: {name} takes no argument(s) {unknown}")
    given = dict(zip(_FROM_TASK, (spatial_dims, in_channels, out_channels)))
    kwargs = {**{k: v for k, v in given.items() if k in parameters}, **args}
    try:
        return network(**kwargs)
    except (TypeError, ValueError, AssertionError) as err:
        raise ConfigError(f"model: cannot build monai {name} with {args}: {err}") from None


for _name in VARIANTS:  # HSMLA-B0, -B1, -B2: EfficientViT's widths and depths, HSMLA in the last two stages
    register_model(_name, lambda name=_name: {"variant": name, "attention": dict(ATTENTION_DEFAULTS)})
