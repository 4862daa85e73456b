"""HSMLA-B2 with the refinement on (alpha 0.3) and off, this working tree against a git revision,
in one process, interleaved: the change's effect on the refinement's cost without the drift of
a shared machine between two runs.

    hsmla-med bench --only ab-revision REV [ROUNDS]

The revision's ``hsmla_med``, ``kernels`` and ``configs`` are extracted into a temporary folder
and imported as ``hsmla_med_old``. Prints the median latency of each of the four networks and,
per version, the median over rounds of the gated / off ratio.
"""

from __future__ import annotations

import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hsmla_med.bench.common import own_parser, positive_int

ROOT = Path(__file__).resolve().parents[2]  # the checkout this hsmla_med is imported from


def _old_package(archive: bytes, folder: Path) -> None:
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    package = folder / "hsmla_med_old"
    (folder / "hsmla_med").rename(package)
    (folder / "kernels").rename(package / "kernels")
    (folder / "configs").rename(package / "configs")
    for source in package.rglob("*.py"):
        source.write_text(source.read_text().replace("hsmla_med.", "hsmla_med_old.").replace("from hsmla_med ", "from hsmla_med_old "))


def main(argv: list[str]) -> int:
    parser = own_parser("ab-revision", __doc__)
    parser.add_argument("rev", metavar="REV", help="the git revision to compare the working tree with")
    parser.add_argument("rounds", metavar="ROUNDS", nargs="?", type=positive_int, default=30, help="interleaved rounds (default 30)")
    args = parser.parse_args(argv)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.rev, "hsmla_med", "kernels", "configs"], capture_output=True)
    if archive.returncode:
        parser.error(f"REV {args.rev}: git archive in {ROOT} failed: {' '.join(archive.stderr.decode(errors='replace').split())}")
    with tempfile.TemporaryDirectory(prefix="bench_ab_") as folder:
        _old_package(archive.stdout, Path(folder))
        sys.path.insert(0, folder)
        _compare(args.rev, args.rounds)
    return 0


def _compare(rev: str, rounds: int) -> None:
    import torch

    from hsmla_med.runtime import tune_cpu_allocator

    tune_cpu_allocator()
    torch.set_grad_enabled(False)
    x = torch.randn(1, 1, 512, 512)
    nets = {}
    for tag, package in (("old", "hsmla_med_old"), ("new", "hsmla_med")):
        config, nn = importlib.import_module(f"{package}.config"), importlib.import_module(f"{package}.nn")
        for routing in ("gate", "off"):
            torch.manual_seed(0)
            net = config.build_network(config.model_config("b2"), 2, 1, 14).eval()
            net.set_routing(routing)
            if routing == "gate":
                nn.calibrate_tau(net, x, 0.3)
            nets[tag, routing] = net
    for net in nets.values():
        for _ in range(2):
            net(x)
    times = {key: [] for key in nets}
    for _ in range(rounds):
        for key, net in nets.items():
            start = time.perf_counter()
            net(x)
            times[key].append(time.perf_counter() - start)
    for (tag, routing), t in times.items():
        print(f"{tag} {routing}: {statistics.median(t) * 1e3:.1f} ms")
    for tag in ("old", "new"):
        ratio = statistics.median(g / o for g, o in zip(times[tag, "gate"], times[tag, "off"]))
        print(f"{tag} ({rev if tag == 'old' else 'working tree'}): gated / off {ratio:.3f}")
