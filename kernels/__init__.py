"""Triton kernels of HSMLA attention for the inference path, installed as ``hsmla_med.kernels``.

One public function per op, each in its own module beside its reference (the matching
:mod:`hsmla_med.nn.functional` op, named ``reference`` there) and tested against it:

- :func:`linear_attention` (:mod:`.linear`): fused global ReLU linear attention;
- :func:`local_refine` (:mod:`.refine`): tile-compacted local residual ``R = O_loc - O_linloc``.

Importing this package never needs triton or a GPU; :func:`triton_available` says whether the
kernels can run for a device.
"""

from ._runtime import triton_available
from .linear import linear_attention
from .refine import local_refine

__all__ = ["linear_attention", "local_refine", "triton_available"]
