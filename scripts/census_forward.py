"""Kernels and host syncs of one inference forward per network, counted without a GPU.

HSMLA networks run their CUDA path (``backend="triton"``) under Triton's interpreter on the CPU:
the same Python code, operations and launches as on a GPU. The peers run their ordinary forward.
:func:`hsmla_med.bench.census.census` counts kernel-launching ATen operations, Triton launches
and syncing operations (issue 50's budgets; the GPU profiler's count is in ``hsmla-med bench
--only gpu --tables kernels``).

    python scripts/census_forward.py [--size 512] [--networks HSMLA-B2,SegFormer-B2,SwinUNETR-2D]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is decorated

import torch  # noqa: E402

from hsmla_med.bench.census import census  # noqa: E402
from hsmla_med.bench.models import build_models  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=512, help="square input side (default 512)")
    parser.add_argument("--networks", default="HSMLA-B2,SegFormer-B2,SwinUNETR-2D", help="names of hsmla_med.bench.models.build_models")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    x = torch.randn(1, 1, args.size, args.size)
    makers = build_models(x)
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


if __name__ == "__main__":
    raise SystemExit(main())
