"""3D inference on the CPU: the default HSMLA-B0 3D network against MONAI's 3D networks on one
volume (the target: at 96^3 HSMLA-B0 stays at least 10 times faster than SwinUNETR).

One forward pass (eval, no gradients, batch 1, 1 -> 14 channels) per network and round, the
networks interleaved in each round so that load from elsewhere hits them alike; medians and the
median of the per-round ratios to SwinUNETR. HSMLA-B0's gate is calibrated (alpha 0.3) on the
input first, as ``train`` leaves it. SwinUNETR and SegResNet as the learning benchmark's 3D arm
builds them (``feature_size`` 24, ``init_filters`` 16), SwinUNETR also at ``feature_size`` 48
(MONAI's BTCV tutorial).

    hsmla-med bench --only inference-3d [--side 96] [--rounds 3]
"""

from __future__ import annotations

import statistics

import torch
from monai.networks.nets import SegResNet, SwinUNETR, UNet

from hsmla_med.bench.common import interleaved, own_parser, positive_int
from hsmla_med.config import build_network, model_config
from hsmla_med.runtime import tune_cpu_allocator

CLASSES = 14


def networks(side: int) -> dict[str, torch.nn.Module]:
    hsmla = build_network(model_config("b0"), 3, 1, CLASSES).eval()
    hsmla.calibrate_tau(torch.randn(1, 1, side, side, side), 0.3)
    return {
        "HSMLA-B0 3D": hsmla,
        "MONAI UNet-3D": UNet(3, 1, CLASSES, channels=(16, 32, 64, 128, 256), strides=(2, 2, 2, 2), num_res_units=2).eval(),
        "SegResNet (16)": SegResNet(spatial_dims=3, in_channels=1, out_channels=CLASSES, init_filters=16).eval(),
        "SwinUNETR (24)": SwinUNETR(in_channels=1, out_channels=CLASSES, feature_size=24, spatial_dims=3).eval(),
        "SwinUNETR (48)": SwinUNETR(in_channels=1, out_channels=CLASSES, feature_size=48, spatial_dims=3).eval(),
    }


def main(argv: list[str]) -> int:
    parser = own_parser("inference-3d", __doc__)
    parser.add_argument("--side", type=positive_int, default=96, help="cube side of the volume (default 96)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="timed rounds after two warm-up calls each (default 3)")
    args = parser.parse_args(argv)
    tune_cpu_allocator()
    torch.manual_seed(0)
    x = torch.randn(1, 1, args.side, args.side, args.side)
    nets = networks(args.side)

    def forward(net):
        def call() -> None:
            with torch.inference_mode():
                net(x)

        return call

    times = interleaved({name: forward(net) for name, net in nets.items()}, args.rounds)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.side}^3, {args.rounds} rounds\n")
    print("| network | median s | rounds (s) | SwinUNETR (24) / it | SwinUNETR (48) / it |\n|---|---|---|---|---|")
    for name, t in times.items():
        ratios = [statistics.median(s / a for s, a in zip(times[ref], t)) for ref in ("SwinUNETR (24)", "SwinUNETR (48)")]
        print(f"| {name} | {statistics.median(t):.2f} | {', '.join(f'{s:.2f}' for s in t)} | {ratios[0]:.1f} | {ratios[1]:.1f} |")
    return 0
