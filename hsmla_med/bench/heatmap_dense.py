"""Heatmap throughput of HSMLA-B0 on the dense slide alone (6400 tissue patches, the scale of a
real CAMELYON16 slide at level 0): the ``--only wsi`` rows of that slide, without the smaller
slides and the slower models (about 45 minutes on two cores).

    hsmla-med bench --only heatmap-dense [--rounds 2] [--modes forward loop-0-cucim]
"""

from __future__ import annotations

from hsmla_med.bench.common import markdown, own_parser, positive_int
from hsmla_med.bench.wsi import bench_wsi


def main(argv: list[str]) -> int:
    parser = own_parser("heatmap-dense", __doc__)
    parser.add_argument("--rounds", type=positive_int, default=2, help="interleaved rounds, the best kept (default 2)")
    parser.add_argument("--modes", nargs="+", help="of bench_wsi (default: forward, each reader in the main process, one worker)")
    args = parser.parse_args(argv)
    print(markdown(bench_wsi(rounds=args.rounds, sizes=(), modes=tuple(args.modes) if args.modes else None)))
    return 0
