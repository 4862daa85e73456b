"""Cross-validation and fold ensemble on the synthetic BTCV default: the pooled validation
scores, and each fold against the ensemble of the five on volumes none of them saw.

    hsmla-med bench --only crossval [--output runs/bench-crossval] [--max-steps N]

1. ``hsmla-med cross-validate --task btcv`` with the demo's settings (configs/btcv_demo.yaml: a 2D
   HSMLA-B0, 600 steps) over the 5 folds of the synthetic dataset's splits_final.json, timed:
   the pooled validation table (crossval/summary.json).
2. A second synthetic dataset (another generator seed: phantoms none of the folds saw) scored
   with each fold's last.ckpt alone and with the 5-fold ensemble (``infer --checkpoint`` with all
   five: probabilities averaged in float32), each by ``evaluate --predictions``.

Prints one Markdown table for docs/benchmarks.md; everything it writes stays under --output.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

from hsmla_med.bench.common import own_parser, positive_int
from hsmla_med.data.synthetic.btcv import generate_btcv


def _run(argv: list[str]) -> float:
    """``hsmla-med ARGV`` in a process of its own (the command line sits above the benchmarks),
    its output shown as it comes; the wall time."""
    started = time.perf_counter()
    if subprocess.run([sys.executable, "-m", "hsmla_med.cli", *argv]).returncode != 0:
        raise SystemExit(f"failed: hsmla-med {' '.join(argv)}")
    return time.perf_counter() - started


def _score(predictions: Path, test: Path) -> dict:
    _run(["evaluate", "--predictions", str(predictions), "--labels", str(test / "labelsTr"),
          "--dataset-json", str(test / "dataset_0.json"), "--output", str(predictions)])
    return json.loads((predictions / "summary.json").read_text())["foreground_mean"]


def main(argv: list[str]) -> int:
    parser = own_parser("crossval", __doc__)
    parser.add_argument("--output", type=Path, default=Path("runs/bench-crossval"), help="where everything is written (default runs/bench-crossval)")
    parser.add_argument("--max-steps", type=positive_int, help="steps per fold (default: the demo's)")
    args = parser.parse_args(argv)
    out = args.output
    cv = out / "cv"
    with resources.as_file(resources.files("hsmla_med.configs") / "btcv_demo.yaml") as demo:
        argv = ["cross-validate", "--task", "btcv", "--config", str(demo), "--output", str(cv)]
        seconds = _run(argv + (["--max-steps", str(args.max_steps)] if args.max_steps else []))
    report = json.loads((cv / "crossval.json").read_text())
    pooled = json.loads((cv / "crossval" / "summary.json").read_text())

    test = out / "unseen"
    generate_btcv(test, num_train=6, num_validation=0, num_test=0, shape=(128, 128, 48), seed=1)
    folds = sorted(cv.glob("fold_*/last.ckpt"))
    rows = []
    for checkpoint in folds:
        predictions = out / f"unseen-{checkpoint.parent.name}"
        _run(["infer", "--task", "btcv", "--checkpoint", str(checkpoint), "--input", str(test / "imagesTr"),
              "--output", str(predictions), "--postprocessing", "none", "--overwrite"])
        rows.append((checkpoint.parent.name, _score(predictions, test)))
    ensemble = out / "unseen-ensemble"
    _run(["infer", "--task", "btcv", "--checkpoint", *map(str, folds), "--input", str(test / "imagesTr"),
          "--output", str(ensemble), "--postprocessing", "none", "--overwrite"])
    rows.append((f"ensemble of {len(folds)}", _score(ensemble, test)))

    fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
    mean = pooled["foreground_mean"]
    print(f"\ncross-validate: {len(report['folds'])} folds, {seconds:.0f} s in all "
          f"(per fold: {', '.join(str(f.get('seconds', 'skipped')) for f in report['folds'])} s); postprocessing: {report.get('postprocessing')}")
    print("\n| model | cases | Dice | HD95 (mm) | NSD (2 mm) |\n|---|---|---|---|---|")
    print(f"| pooled 5-fold validation | {len(pooled['metric_per_case'])} | {fmt(mean['Dice'])} | {fmt(mean['HD95'])} | {fmt(mean['NSD'])} |")
    for name, scores in rows:
        print(f"| {name} on 6 unseen volumes | 6 | {fmt(scores['Dice'])} | {fmt(scores['HD95'])} | {fmt(scores['NSD'])} |")
    return 0
