"""Heatmap throughput of HSMLA-B0 on the dense slide alone (6400 tissue patches, the scale of a
real CAMELYON16 slide at level 0): the ``bench --only wsi`` rows of that slide, without the
smaller slides and the slower models (about 45 minutes on two cores).

    python scripts/bench_heatmap_dense.py [--rounds 2] [--modes forward loop-0-cucim]
"""

from __future__ import annotations

import argparse

from hsmla_med.runtime import configure_cpu_threads

# OpenMP's waiting as `hsmla-med` sets it before torch loads (and every heatmap process started
# from here inherits): started by `python`, this script and its children otherwise ran with
# libgomp's default spin, which `hsmla-med wsi-heatmap` never does (docs/benchmarks.md, session 22)
configure_cpu_threads()

from hsmla_med.bench.common import markdown  # noqa: E402 (after the OpenMP settings)
from hsmla_med.bench.wsi import bench_wsi  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--modes", nargs="+", help="of bench_wsi (default: forward, each reader in the main process, one worker)")
    args = p.parse_args(argv)
    print(markdown(bench_wsi(rounds=args.rounds, sizes=(), modes=tuple(args.modes) if args.modes else None)))


if __name__ == "__main__":
    main()
