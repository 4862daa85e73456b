"""Task pipelines, one module per benchmark; installed as ``hsmla_med.pipelines``.

Each module defines ``TASK``, an instance of its :class:`~hsmla_med.pipelines.task.Task`
subclass (data list, DataModule, module config, held-out inputs, prediction); the command line
drives them all through that interface alone.
"""

from __future__ import annotations

import importlib

from hsmla_med.errors import ConfigError

__all__ = ["TASKS", "get_task"]

TASKS = ("btcv", "camelyon16", "endovis", "luna16")


def get_task(name: str):
    """The :class:`~hsmla_med.pipelines.task.Task` of ``name``; :class:`ConfigError` for an unknown task."""
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; available: {', '.join(TASKS)}")
    return importlib.import_module(f"hsmla_med.pipelines.{name}").TASK
