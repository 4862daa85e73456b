"""Training cost of the local window terms and of a whole training step, side by side.

1. ``R`` for every token, forward + backward, at the map sizes where HSMLA layers sit in
   training (batch 8, head_dim 16, window 7): the masked ``N x N`` form
   (``functional.dense_refine``, what training runs up to ``DENSE_TOKENS``) against the tile
   schedule (``functional.local_refine`` with ``gate=None``).
2. One optimizer step (batch 8, 1 -> 3 channels, 96 x 96, cross-entropy, AdamW) of MONAI's UNet
   (16..256, 2 residual units) and HSMLA-B0 with the U-shaped decoder, routing gate and off,
   timed in interleaved rounds (medians), so load from elsewhere hits them alike.

    hsmla-med bench --only training [--rounds 8]
"""

from __future__ import annotations

import statistics

import torch

from hsmla_med.bench.common import interleaved, own_parser, positive_int
from hsmla_med.config import build_network
from hsmla_med.nn import functional as HF
from hsmla_med.runtime import tune_cpu_allocator

NETWORKS = {
    "MONAI UNet": {"monai": "UNet", "args": {"channels": [16, 32, 64, 128, 256], "strides": [2, 2, 2, 2], "num_res_units": 2}},
    "HSMLA-B0 (gate)": {"variant": "b0"},
    "HSMLA-B0 (routing off)": {"variant": "b0", "attention": {"routing": "off"}},
}


def _interleaved(fns: dict, rounds: int) -> dict:
    """Median milliseconds per call of each function (:func:`~hsmla_med.bench.common.interleaved`)."""
    return {name: statistics.median(t) * 1e3 for name, t in interleaved(fns, rounds).items()}


def bench_refine(rounds: int) -> None:
    print("| map | heads | dense_refine ms | tile schedule ms | tiles / dense |\n|---|---|---|---|---|")
    for side, heads in [(3, 8), (6, 4), (12, 2), (24, 2)]:
        maps = [torch.randn(8, heads, side, side, 16, requires_grad=True) for _ in range(6)]
        grad = torch.randn(8, heads, side, side, 16)
        fns = {
            "dense": lambda: HF.dense_refine(*maps, 7).backward(grad),
            "tiles": lambda: HF.local_refine(*maps, None, 0.0, 4, 7).backward(grad),
        }
        t = _interleaved(fns, rounds)
        print(f"| {side}x{side} | {heads} | {t['dense']:.1f} | {t['tiles']:.1f} | {t['tiles'] / t['dense']:.1f} |")


def bench_steps(rounds: int) -> None:
    x, y = torch.randn(8, 1, 96, 96), torch.randint(0, 3, (8, 96, 96))
    fns = {}
    for name, config in NETWORKS.items():
        net = build_network(config, 2, 1, 3).train()
        opt = torch.optim.AdamW(net.parameters())

        def step(net=net, opt=opt):
            loss = torch.nn.functional.cross_entropy(net(x), y)
            if hasattr(net, "gate_regularization") and net.hsmla_layers():
                reg = net.gate_regularization()
                loss = loss + 0.01 * reg["budget"] + 0.005 * reg["smoothness"]
            opt.zero_grad()
            loss.backward()
            opt.step()

        fns[name] = step
    t = _interleaved(fns, rounds)
    base = t["MONAI UNet"]
    print("\n| network | ms per step | / UNet |\n|---|---|---|")
    for name, ms in t.items():
        print(f"| {name} | {ms:.0f} | {ms / base:.2f} |")


def main(argv: list[str]) -> int:
    parser = own_parser("training", __doc__)
    parser.add_argument("--rounds", type=positive_int, default=8, help="interleaved rounds after two warm-up calls each (default 8)")
    args = parser.parse_args(argv)
    tune_cpu_allocator()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    bench_refine(args.rounds)
    bench_steps(args.rounds)
    return 0
