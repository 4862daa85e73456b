"""Inference latency of HSMLA-SegNet with batch norm (folded into the convolutions), with
instance norm as the blocks run it at CPU inference (the C kernel of
:mod:`hsmla_med.kernels.norm_cpu`), with the same network running the modules the kernel
replaces (:class:`hsmla_med.nn.blocks.InstanceNorm` then Hardswish) and with
``torch.nn.InstanceNorm2d`` (what the blocks used before), interleaved in one process, batch 1,
1 -> 14 channels; medians and the median of the per-round ratios to batch norm.

    hsmla-med bench --only norm [--variant b2] [--size 512] [--rounds 5]
"""

from __future__ import annotations

import statistics
import time

import torch

from hsmla_med.bench.common import own_parser, positive_int
from hsmla_med.nn import VARIANTS, HSMLASegNet, blocks
from hsmla_med.runtime import tune_cpu_allocator


class _WithoutKernel(torch.nn.Module):
    """``net`` with its blocks' instance norm kernel declined (they run the modules)."""

    class _Declines:
        @staticmethod
        def instance_norm_act_cpu(*args, **kwargs):
            return None

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = blocks.kernels  # the blocks look the kernel up there at each call
        blocks.kernels = self._Declines
        try:
            return self.net(x)
        finally:
            blocks.kernels = kernels


def networks(variant: str) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    nets = {norm: HSMLASegNet(2, 1, 14, variant=variant, decoder="unet", norm=norm).eval() for norm in ("batch", "instance")}
    nets["instance (modules, no C kernel)"] = _WithoutKernel(nets["instance"])
    ours = blocks.InstanceNorm
    blocks.InstanceNorm = lambda channels: torch.nn.InstanceNorm2d(channels, affine=True)  # the blocks' norm before
    try:
        nets["instance (torch.nn.InstanceNorm2d)"] = HSMLASegNet(2, 1, 14, variant=variant, decoder="unet", norm="instance").eval()
    finally:
        blocks.InstanceNorm = ours
    return nets


def main(argv: list[str]) -> int:
    parser = own_parser("norm", __doc__)
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="b2", help="HSMLA variant (default b2)")
    parser.add_argument("--size", type=positive_int, default=512, help="input side (default 512)")
    parser.add_argument("--rounds", type=positive_int, default=5, help="interleaved rounds after two warm-up calls (default 5)")
    args = parser.parse_args(argv)
    tune_cpu_allocator()  # the heap top pad every hsmla-med command applies
    nets = networks(args.variant)
    x = torch.randn(1, 1, args.size, args.size)
    times: dict[str, list[float]] = {name: [] for name in nets}
    with torch.inference_mode():
        for net in nets.values():  # warm-up: allocator, oneDNN primitives, the folded convolutions
            net(x)
            net(x)
        for _ in range(args.rounds):
            for name, net in nets.items():
                started = time.perf_counter()
                net(x)
                times[name].append(time.perf_counter() - started)
    print(f"HSMLA-{args.variant.upper()} (U-Net decoder) at {args.size}^2, {torch.get_num_threads()} threads, {args.rounds} rounds")
    for name, values in times.items():
        paired = statistics.median(a / b for a, b in zip(values, times["batch"]))
        print(f"  {name:<36} {1000 * statistics.median(values):7.0f} ms   x{paired:.2f} batch norm (paired)")
    return 0
