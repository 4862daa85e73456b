"""The model registry: a model's name and the model config it stands for, what ``--model NAME``
trains and ``hsmla_med.config.model_config(NAME)`` returns (timm's ``register_model``, in
small).

One definition per model: the HSMLA sizes are registered from
:data:`~hsmla_med.nn.hsmla_net.VARIANTS` (their widths and depths), each with the layer's own
defaults (:class:`~hsmla_med.nn.HSMLA`'s signature) as its ``attention`` config, so a size or a
default changes in one place. The config is what a checkpoint records and what
:func:`hsmla_med.config.build_network` builds (:class:`~hsmla_med.nn.HSMLASegNet` or
:class:`~hsmla_med.nn.HSMLAClassifier` by the task's kind; a ``{monai: NAME}`` config builds a
MONAI network instead); another family of networks registers its names here with
:func:`register_model`.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable

from hsmla_med.nn.attention import HSMLA
from hsmla_med.nn.hsmla_net import VARIANTS

__all__ = ["MODELS", "ATTENTION_DEFAULTS", "register_model", "registered_config"]

# the attention options a model config spells out (a checkpoint records them), in this order
_ATTENTION_KEYS = ("scales", "window", "block", "tau", "rho", "routing")
_SIGNATURE = inspect.signature(HSMLA).parameters
#: the HSMLA layer's defaults, as a model config writes them (lists, not tuples: YAML and JSON)
ATTENTION_DEFAULTS = {k: list(_SIGNATURE[k].default) if isinstance(_SIGNATURE[k].default, tuple) else _SIGNATURE[k].default for k in _ATTENTION_KEYS}

#: model name -> a function returning its model config
MODELS: dict[str, Callable[[], dict]] = {}


def register_model(name: str, config: Callable[[], dict]) -> None:
    """Register ``name`` for the model config ``config()`` returns; a name is registered once."""
    if name in MODELS:
        raise ValueError(f"model {name!r} is already registered")
    MODELS[name] = config


def registered_config(name: str) -> dict:
    """A fresh copy of the model config of ``name`` (KeyError for an unknown name)."""
    return copy.deepcopy(MODELS[name]())


for _name in VARIANTS:  # HSMLA-B0, -B1, -B2: EfficientViT's widths and depths, HSMLA in the last two stages
    register_model(_name, lambda name=_name: {"variant": name, "attention": dict(ATTENTION_DEFAULTS)})
