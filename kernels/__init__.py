"""Kernels of HSMLA attention for the inference path, installed as ``hsmla_med.kernels``.

One public function per op, each in its own module beside its reference (the matching
:mod:`hsmla_med.ops_reference` op, named ``reference`` there) and tested against it:

- :func:`linear_attention` (:mod:`.linear`, Triton): fused global ReLU linear attention;
- :func:`local_refine` (:mod:`.refine`, Triton): tile-compacted local residual
  ``R = O_loc - O_linloc``;
- :func:`attention` (:mod:`.attention`, Triton): the two above in three launches, the gated
  refinement added into the linear output in place with no host sync (the CUDA inference path);
- :func:`local_refine_cpu` (:mod:`.refine_cpu`, C compiled at first use): the same on the CPU;
- :func:`block_gate_cpu` (:mod:`.gate_cpu`, C compiled at first use): the block gate on the CPU;
- :func:`instance_norm_act_cpu` (:mod:`.norm_cpu`, C compiled at first use): instance norm and
  Hardswish of the convolutional blocks at inference on the CPU (reference:
  :class:`hsmla_med.nn.blocks.InstanceNorm` then ``torch.nn.Hardswish``).

The same ops are registered as PyTorch custom operators by :mod:`.ops` (``torch.ops.hsmla.*``:
``linear_attention``, ``block_gate``, ``local_refine``, ``attention``, each with a fake implementation and a
CPU and a CUDA implementation that run the kernels above where they take the inputs, else the
references), so that ``torch.compile`` and ``torch.export`` see one node per op:
:func:`linear_attention_op`, :func:`block_gate_op`, :func:`local_refine_op` and :func:`attention_op` call them, and the
HSMLA layer's ``cpu`` and ``triton`` backends run through them.

Importing this package never needs triton, a GPU or a compiler; :func:`triton_available` says
whether the Triton kernels can run for a device, :func:`cpu_kernel_available` whether the C
kernel is built, and :func:`triton_unsupported` / :func:`cpu_kernel_unsupported` why either
would refuse features of a given device and dtype (``None`` when they take them): what
:func:`hsmla_med.nn.select_backend` decides by.

The kernels depend on their references in :mod:`hsmla_med.ops_reference` (public names only),
which :mod:`hsmla_med.nn.functional` imports too, and on nothing of :mod:`hsmla_med.nn`, which
uses this package through the names below only: imports run from the networks down.
"""

if __name__ != "hsmla_med.kernels":
    # The folder found again as a top-level ``kernels`` package: with the repository's root on
    # sys.path (pytest's pythonpath, ``python -m`` there) transformers, which MONAI's networks
    # import, imports it so while probing for a library of that name. A second copy would
    # register the torch.ops.hsmla operators again, over this package's (the last registration
    # runs), so that name is made this package instead.
    import importlib
    import sys

    sys.modules[__name__] = importlib.import_module("hsmla_med.kernels")
else:
    from ._runtime import triton_available, triton_unsupported
    from .linear import linear_attention
    from .gate_cpu import block_gate as block_gate_cpu
    from .norm_cpu import instance_norm_act as instance_norm_act_cpu
    from .refine import local_refine
    from .attention import attention
    from .refine_cpu import compiled as cpu_kernel_available
    from .refine_cpu import local_refine as local_refine_cpu
    from .refine_cpu import unsupported as cpu_kernel_unsupported
    from . import ops
    from .ops import block_gate as block_gate_op
    from .ops import linear_attention as linear_attention_op
    from .ops import local_refine as local_refine_op
    from .ops import attention_op

__all__ = [
    "linear_attention",
    "local_refine",
    "local_refine_cpu",
    "block_gate_cpu",
    "instance_norm_act_cpu",
    "triton_available",
    "triton_unsupported",
    "cpu_kernel_available",
    "cpu_kernel_unsupported",
    "ops",
    "linear_attention_op",
    "block_gate_op",
    "local_refine_op",
    "attention",
    "attention_op",
]
