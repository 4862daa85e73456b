"""Time of ``metrics.detection.froc_band`` (the bootstrap band of the LUNA16 evaluation script,
1000 draws) on a random submission of the full size: 888 scans x 100 marks, nodules (2 each) in
600 scans. The options make it smaller.

    hsmla-med bench --only froc-band [--scans 888] [--nodule-scans 600] [--marks 100] [--draws 1000] [--rounds 3]
"""

from __future__ import annotations

import time

import numpy as np

from hsmla_med.bench.common import own_parser, positive_int
from hsmla_med.metrics.detection import DRAWS, froc_band, submission_matches


def main(argv: list[str]) -> int:
    parser = own_parser("froc-band", __doc__)
    parser.add_argument("--scans", type=positive_int, default=888, help="scans of the submission (default 888, LUNA16's)")
    parser.add_argument("--nodule-scans", type=positive_int, default=600, help="scans with nodules, at most --scans (default 600)")
    parser.add_argument("--marks", type=positive_int, default=100, help="candidates per scan (default 100)")
    parser.add_argument("--draws", type=positive_int, default=DRAWS, help=f"bootstrap draws (default {DRAWS}, the script's)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="timed calls (default 3)")
    args = parser.parse_args(argv)
    if args.nodule_scans > args.scans:
        parser.error(f"--nodule-scans {args.nodule_scans} is more than --scans {args.scans}")
    rng = np.random.default_rng(0)
    uids = [f"s{i}" for i in range(args.scans)]
    candidates = {u: np.c_[rng.uniform(-150, 150, (args.marks, 3)), rng.uniform(0, 1, args.marks)] for u in uids}
    nodules = {u: np.c_[rng.uniform(-150, 150, (2, 3)), rng.uniform(4, 20, 2)] for u in uids[: args.nodule_scans]}
    matches = submission_matches(candidates, nodules, {}, uids)
    for _ in range(args.rounds):
        start = time.perf_counter()
        froc_band(matches, draws=args.draws, seed=0)
        print(f"froc_band {args.draws} draws, {args.scans} scans x {args.marks} marks: {time.perf_counter() - start:.2f} s", flush=True)
    return 0
