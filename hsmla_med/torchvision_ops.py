"""torchvision's import beside a CPU build of torch that its wheel was not built for.

timm (the patch encoders of ``wsi-features``) needs torchvision, and torchmetrics (under
Lightning) imports it whenever it is installed. Where PyTorch's CPU wheel index is not reachable,
pip takes torchvision from PyPI: a CUDA build, whose C++ operators cannot load beside the CPU
torch. torchvision itself expects that (``torchvision.extension._has_ops()`` is then ``False`` and
its operators refuse to run), except that ``torchvision._meta_registrations`` registers fake
kernels for ``torchvision::nms`` and ``qnms`` unconditionally, and that import fails
("operator torchvision::nms does not exist"), taking Lightning's import with it.

So, just before that module is imported, and only when torchvision's operators did not load, the
two operators' schemas are declared without kernels: the import completes, and a call of
``torchvision.ops.nms`` still fails as it would (no kernel); nothing in hsmla-med calls it. With a
torchvision built for this torch (PyTorch's CPU index, which scripts/setup.sh uses where it can),
this does nothing. Written by hand: neither torch nor torchvision offers a switch for it.
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder

__all__ = ["declare_missing_operators_on_import"]

_MODULE = "torchvision._meta_registrations"
# torchvision's schemas (torchvision/csrc/ops/nms.cpp and quantized/cpu/qnms_kernel.cpp)
_SCHEMAS = {"nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"}


def _declare_missing_operators() -> None:
    import torch
    from torchvision import extension

    if extension._has_ops():
        return
    for name, schema in _SCHEMAS.items():
        try:
            getattr(torch.ops.torchvision, name)
        except (AttributeError, RuntimeError):
            torch.library.define(f"torchvision::{name}", schema)


class _BeforeMetaRegistrations(MetaPathFinder):
    """Finds nothing; when torchvision's ``_meta_registrations`` is looked for, declares the
    operators first (once) and lets the usual finders load it."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == _MODULE:
            sys.meta_path.remove(self)
            _declare_missing_operators()
        return None


def declare_missing_operators_on_import() -> None:
    """Arrange for :func:`_declare_missing_operators` to run when torchvision is imported (costs
    no import now: ``hsmla-med --help`` loads no torch)."""
    if _MODULE not in sys.modules and not any(isinstance(f, _BeforeMetaRegistrations) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeMetaRegistrations())
