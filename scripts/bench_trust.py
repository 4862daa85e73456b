"""Issue 31's measurements on the real MRI of the learning benchmark: ECE before and after
``hsmla-med calibrate`` and Dice of both on the held-out slab and its perturbed copy, their mean
uncertainty (``infer --uncertainty``), and Spearman's rho of the HSMLA gate, the entropy and the
distance to the predicted boundary with the error rate of the gate's tiles
(:mod:`hsmla_med.bench.trust`). Seeds already done with the same settings are reused, so
``--seeds 1``, then ``--seeds 3`` adds two.

    python scripts/bench_trust.py --out /tmp/bench-trust [--seeds 3] [--steps 2000] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hsmla_med.bench.common import positive_int
from hsmla_med.bench.trust import bench_trust, default_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="working folder: runs, trust.json, trust.md")
    parser.add_argument("--seeds", type=positive_int, default=3, help="training seeds 0..N-1 (default 3)")
    parser.add_argument("--steps", type=positive_int, default=default_steps(),
                        help="training steps (default: the btcv task's trainer.max_steps, what `hsmla-med train` runs; 400 is the learning benchmark's)")
    parser.add_argument("--data-dir", type=Path, help="where the MNI dataset is written once (default ~/.cache/hsmla-med/mni-learning)")
    args = parser.parse_args()
    bench_trust(args.out, args.seeds, args.steps, args.data_dir)


if __name__ == "__main__":
    main()
