"""A census of what a forward dispatches: kernels, host syncs and launch grids, on any device.

On a GPU a small network's batch-1 forward costs what the host spends launching kernels and
waiting on syncs (docs/design.md §4), so both are budgets (per HSMLA layer at most 8
operations outside the attention kernels and 3 kernels inside, no host sync at all). They can
be counted without a GPU: every ATen operation goes through PyTorch's dispatcher, where a
``TorchDispatchMode`` sees it, and every Triton launch through :class:`~hsmla_med.kernels._runtime.lazy_jit`,
where :func:`census` records it with its grid (under Triton's interpreter on the CPU).

Counted as a kernel: an ATen operation that computes (not a view, an allocation or a
dtype/shape query). What runs inside a Triton launch (the interpreter's own copies) is not
counted; the launch is. A sync is an operation that makes the host wait for the device's values
(``nonzero``, ``item``, ``equal``, ...): it forbids CUDA graph capture.

``hsmla-med bench --only census`` counts one inference forward per network without a GPU: HSMLA
networks run their CUDA path (``backend="triton"``) under Triton's interpreter on the CPU, the
same Python code, operations and launches as on a GPU; the peers run their ordinary forward. (The
GPU profiler's count is in ``hsmla-med bench --only gpu --tables kernels``.)

    hsmla-med bench --only census [--size 512] [--networks HSMLA-B2,SegFormer-B2,SwinUNETR-2D]
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hsmla_med.bench.common import own_parser, positive_int
from hsmla_med.bench.models import build_models

__all__ = ["Census", "census", "SYNCING", "is_kernel", "main"]

#: ATen operations that read a device value on the host (or size an output from one)
SYNCING = frozenset({
    "aten::nonzero", "aten::_local_scalar_dense", "aten::item", "aten::bincount", "aten::masked_select",
    "aten::unique", "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
    "aten::is_nonzero", "aten::equal", "aten::masked_scatter", "aten::_assert_async", "aten::allclose",
    "aten::repeat_interleave", "aten::histc",
})
#: ATen operations that allocate or describe without computing
_NOT_KERNELS = frozenset({
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided",
    "aten::_unsafe_view", "aten::promote_types", "aten::result_type", "aten::lift_fresh", "aten::sym_size",
    "aten::sym_stride", "aten::sym_numel", "aten::sym_storage_offset", "aten::is_same_size", "aten::_has_compatible_shallow_copy_type",
})


def _name(func) -> str:
    return func._schema.name


def is_kernel(func) -> bool:
    """Whether ATen operation ``func`` launches work (on a GPU: a kernel)."""
    return not func.is_view and _name(func) not in _NOT_KERNELS


def _bool_index(func, args) -> bool:
    """``x[mask]``: advanced indexing with a boolean mask sizes its output from the mask's values."""
    if _name(func) not in ("aten::index", "aten::index_put", "aten::index_put_"):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


@dataclass
class Census:
    """What one call dispatched.

    Attributes:
        ops: kernel-launching ATen operations by name, outside Triton launches and custom
            operators (a custom operator that launches no Triton kernel counts as one).
        syncs: the syncing operations, in order (:data:`SYNCING`, boolean-mask indexing).
        launches: Triton launches by kernel name.
        grids: ``(kernel name, grid)`` of every Triton launch, in order.
        custom: calls of ``hsmla::*`` operators by name (each counted once in ``ops`` too).
    """

    ops: Counter = field(default_factory=Counter)
    syncs: list = field(default_factory=list)
    launches: Counter = field(default_factory=Counter)
    grids: list = field(default_factory=list)
    custom: Counter = field(default_factory=Counter)

    @property
    def kernels(self) -> int:
        """Kernels of the call: :attr:`ops` plus Triton launches."""
        return sum(self.ops.values()) + sum(self.launches.values())


class _Recorder(TorchDispatchMode):
    def __init__(self, result: Census) -> None:
        super().__init__()
        self.result = result
        self.inside_launch = 0
        self.inside_custom = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.inside_launch:
            name = _name(func)
            if name.startswith("hsmla::"):
                self.result.custom[name] += 1
                launched = sum(self.result.launches.values())
                self.inside_custom += 1
                try:
                    return func(*args, **kwargs)
                finally:
                    self.inside_custom -= 1
                    if sum(self.result.launches.values()) == launched:  # a C kernel or a reference: one
                        self.result.ops[name] += 1
            if name in SYNCING or _bool_index(func, args):
                self.result.syncs.append(name)
            if not self.inside_custom and is_kernel(func):
                self.result.ops[name] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def _recording_launches(result: Census, recorder: _Recorder) -> Iterator[None]:
    """Record every Triton launch through :class:`~hsmla_med.kernels._runtime.lazy_jit` (and
    ignore the operations the launch itself dispatches: the interpreter's copies)."""
    try:
        from hsmla_med.kernels import _runtime
    except ImportError:  # pragma: no cover - the kernels package is part of hsmla_med
        yield
        return
    original = _runtime.lazy_jit.__getitem__

    def getitem(kernel, grid):
        launch = original(kernel, grid)

        def run(*args, **kwargs):
            result.launches[kernel.name] += 1
            result.grids.append((kernel.name, tuple(grid) if isinstance(grid, (tuple, list)) else grid))
            recorder.inside_launch += 1
            try:
                return launch(*args, **kwargs)
            finally:
                recorder.inside_launch -= 1

        return run

    _runtime.lazy_jit.__getitem__ = getitem
    try:
        yield
    finally:
        _runtime.lazy_jit.__getitem__ = original


def census(fn: Callable, *args, **kwargs) -> tuple[object, Census]:
    """Run ``fn(*args, **kwargs)`` and return its result with the :class:`Census` of what it
    dispatched."""
    result = Census()
    recorder = _Recorder(result)
    with _recording_launches(result, recorder), recorder:
        out = fn(*args, **kwargs)
    return out, result


def main(argv: list[str]) -> int:
    parser = own_parser("census", __doc__)
    parser.add_argument("--size", type=positive_int, default=512, help="square input side (default 512)")
    parser.add_argument("--networks", default="HSMLA-B2,SegFormer-B2,SwinUNETR-2D",
                        help="comma-separated names of hsmla_med.bench.models.build_models (default HSMLA-B2,SegFormer-B2,SwinUNETR-2D)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    x = torch.randn(1, 1, args.size, args.size)
    makers = build_models(x)
    unknown = [n for n in args.networks.split(",") if n not in makers]
    if unknown:
        parser.error(f"--networks: unknown network(s) {unknown}; known: {', '.join(makers)}")
    # the kernels are decorated at their first launch (lazy_jit), reading this then: in time here
    os.environ.setdefault("TRITON_INTERPRET", "1")
    print(f"| network ({args.size}², batch 1, eval) | kernels | ATen ops | Triton launches | host syncs | most frequent ops |")
    print("|---|---|---|---|---|---|")
    for name in args.networks.split(","):
        net = makers[name]().eval()
        if hasattr(net, "set_backend"):
            net.set_backend("triton")
        with torch.no_grad():
            net(x)  # caches (folded weights, merged kernels) built before the count, as before a capture
            _, seen = census(net, x)
        top = ", ".join(f"{op.removeprefix('aten::')} {n}" for op, n in seen.ops.most_common(5))
        print(f"| {name} | {seen.kernels} | {sum(seen.ops.values())} | {sum(seen.launches.values())} | {len(seen.syncs)} | {top} |", flush=True)
    return 0
