"""Task pipelines, one module per benchmark; installed as ``hsmla_med.pipelines``.

Each module defines ``TASK``, an instance of its :class:`~hsmla_med.pipelines.task.Task`
subclass (data list, DataModule, module config, held-out inputs, prediction); the command line
drives them all through that interface alone. What a task is and can do is declared on its card
in the task registry, :data:`hsmla_med.tasks.CARDS` (help texts and capabilities; re-exported
here), so that ``hsmla-med --help`` answers without importing the pipelines (they load torch,
MONAI and Lightning: seconds), and so that the command line and the engine ask the card, never
a task's name, what a task supports.
"""

from __future__ import annotations

import importlib

from hsmla_med.tasks import ALIASES, CARDS, TASKS, TaskCard, task_name, tasks_with

__all__ = ["TASKS", "ALIASES", "CARDS", "TaskCard", "task_name", "get_task", "tasks_with"]


def get_task(name: str):
    """The :class:`~hsmla_med.pipelines.task.Task` of ``name`` (a task or an alias);
    :class:`ConfigError` for an unknown task."""
    return importlib.import_module(f"hsmla_med.pipelines.{task_name(name)}").TASK
