"""Forward + backward cost of ``R`` for every token (the soft training path) at the shapes of
the HSMLA layers in training: batched window attention over all tiles
(``functional.window_refine``) against the tile schedule that training runs above
``DENSE_TOKENS`` (``functional.local_refine`` with ``gate=None``) and the masked ``N x N`` form
that it runs below (``functional.dense_refine``).

Shapes: HSMLA-B2 in 2D at 512 x 512, batch 8 (stride 16: 32 x 32 tokens, 6 heads of 32;
stride 32: 16 x 16, 12 heads of 32), and 3D at 96^3, batch 2 (stride 16: 6^3 tokens, 4 heads;
stride 32: 3^3, 8 heads); block 4, window 7, float32, on the CPU. Timed in interleaved rounds
(medians), so load from elsewhere hits the three alike.

    hsmla-med bench --only window-refine [--rounds 7] [--threads 2]
"""

from __future__ import annotations

import statistics

import torch

from hsmla_med.bench.common import interleaved, own_parser, positive_int
from hsmla_med.nn import functional as HF
from hsmla_med.runtime import tune_cpu_allocator

BLOCK, WINDOW = 4, 7
SHAPES = {
    "2D 32x32 (B2 stride 16)": (8, 6, 32, 32, 32),
    "2D 16x16 (B2 stride 32)": (8, 12, 16, 16, 32),
    "3D 6^3 (stride 16)": (2, 4, 6, 6, 6, 32),
    "3D 3^3 (stride 32)": (2, 8, 3, 3, 3, 32),
}


def bench(shape: tuple[int, ...], rounds: int) -> dict[str, float]:
    """Median milliseconds of forward + backward of each form on fresh random features."""
    maps = [torch.randn(shape, requires_grad=True) for _ in range(6)]
    grad = torch.randn(shape)
    fns = {
        "window_refine": lambda: HF.window_refine(*maps, BLOCK, WINDOW).backward(grad),
        "local_refine": lambda: HF.local_refine(*maps, None, 0.0, BLOCK, WINDOW).backward(grad),
        "dense_refine": lambda: HF.dense_refine(*maps, WINDOW).backward(grad),
    }
    return {name: statistics.median(t) * 1e3 for name, t in interleaved(fns, rounds).items()}


def main(argv: list[str]) -> int:
    parser = own_parser("window-refine", __doc__)
    parser.add_argument("--rounds", type=positive_int, default=7, help="interleaved rounds after two warm-up calls each (default 7)")
    parser.add_argument("--threads", type=positive_int, default=2, help="torch CPU threads (default 2)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tune_cpu_allocator()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, block {BLOCK}, window {WINDOW}, "
          f"float32, forward + backward, median of {args.rounds} interleaved rounds\n")
    print("| map | features (b, h, *S, d) | window_refine ms | local_refine ms | dense_refine ms "
          "| local / window | dense / window |\n|---|---|---|---|---|---|---|")
    for name, shape in SHAPES.items():
        t = bench(shape, args.rounds)
        w = t["window_refine"]
        print(f"| {name} | {shape} | {w:.1f} | {t['local_refine']:.1f} | {t['dense_refine']:.1f} "
              f"| {t['local_refine'] / w:.2f} | {t['dense_refine'] / w:.2f} |", flush=True)
    return 0
