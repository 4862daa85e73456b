"""Every module's ``__all__`` names what the module defines, so that ``from module import *``
works (``hsmla_med.pipelines.camelyon16`` once named a ``heatmap`` it lacked)."""

from __future__ import annotations

import importlib

import pytest

from tests.test_layout import _modules

# modules that run a program when imported (``python -m``), not libraries
_SCRIPTS = {name for name in _modules() if name.endswith(".__main__")}


@pytest.mark.parametrize("name", sorted(set(_modules()) - _SCRIPTS))
def test_every_name_in_all_exists(name):
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    if exported is None:
        return
    assert len(set(exported)) == len(exported), f"{name}.__all__ repeats a name"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what the module does not define: {missing}"
    namespace: dict = {}
    exec(f"from {name} import *", namespace)  # noqa: S102 -- the statement under test
    assert set(exported) <= set(namespace)


def test_the_camelyon16_pipeline_star_import():
    namespace: dict = {}
    exec("from hsmla_med.pipelines.camelyon16 import *", namespace)  # noqa: S102
    assert {"TASK", "infer", "slide_patches"} <= set(namespace)
