"""Task pipelines, one module per benchmark; installed as ``hsmla_med.pipelines``.

A task module provides ``datalist(config)``, ``datamodule(config, cases)``,
``module_config(config, model, label_names)``, ``MODULE`` (its LightningModule class),
``infer(module, inputs, output, ...)`` and ``held_out(cases)`` (the inputs that ``demo`` runs
``infer`` on); the command line drives them all the same way.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from hsmla_med.errors import ConfigError

__all__ = ["TASKS", "get_task"]

TASKS = ("btcv", "camelyon16", "endovis", "luna16")


def get_task(name: str) -> ModuleType:
    """The pipeline module of task ``name``; :class:`ConfigError` for an unknown task."""
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; available: {', '.join(TASKS)}")
    return importlib.import_module(f"hsmla_med.pipelines.{name}")
