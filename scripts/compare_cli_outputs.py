"""Every command's outputs on the synthetic demo data, before and after a restructuring, so that a
refactor is shown to leave behaviour unchanged: outputs identical, compared file by file.

    .venv/bin/python scripts/compare_cli_outputs.py run OUT [--tree CHECKOUT]
    .venv/bin/python scripts/compare_cli_outputs.py diff A B

``run`` runs the demo of every task, then ``evaluate``, ``calibrate`` and ``export`` on its
checkpoints, writing under ``OUT`` (give both runs the same ``OUT`` and move it aside between
them: outputs record their own paths). ``--tree`` runs another checkout of this repository
(``git worktree add``) with this virtual environment, by pointing the editable install's finder
at it. ``diff`` compares two such folders file by file: JSON with timing and host fields dropped,
CSV/text line by line after the same, everything else byte for byte; exit status 1 on any
difference, listed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# fields that measure the run, not its result
VOLATILE = {"seconds", "time", "elapsed", "duration", "wall_s", "started", "finished", "date", "created", "host", "pid",
            "seconds_per_case", "throughput", "timestamp", "epoch_seconds"}
# files that record the run itself (logs, timings, caches)
SKIPPED_SUFFIXES = (".log", ".tmp")
SKIPPED_NAMES = {"events.out.tfevents", "hparams.yaml", "report.html"}  # the HTML report embeds timings


def _commands(out: Path) -> list[list[str]]:
    demo = out / "demo"
    commands = [["demo", "--task", "all", "--output", str(demo)]]
    for task in ("btcv", "camelyon16", "endovis", "luna16"):
        commands.append(["evaluate", "--checkpoint", str(demo / task / "best.ckpt"), "--output", str(out / f"evaluate_{task}"), "--allow-training-cases"])
    cache = Path.home() / ".cache" / "hsmla-med"  # the demo's synthetic datasets (configs: data.cache_dir)
    # evaluate --predictions: LUNA16's demo submission; EndoVis masks of a labelled video (the
    # demo's predictions include the unlabelled test video, which has nothing to be scored against)
    commands += [
        ["evaluate", "--task", "luna16", "--predictions", str(demo / "luna16" / "predictions"), "--labels", str(cache / "luna16-synthetic"),
         "--output", str(out / "score_luna16")],
        ["infer", "--checkpoint", str(demo / "endovis" / "best.ckpt"), "--input", str(cache / "endovis-synthetic" / "instrument_dataset_1" / "left_frames"),
         "--output", str(out / "infer_endovis")],
        ["evaluate", "--task", "endovis", "--predictions", str(out / "infer_endovis"), "--labels", str(cache / "endovis-synthetic"),
         "--output", str(out / "score_endovis")],
    ]
    commands += [
        ["calibrate", "--checkpoint", str(demo / "btcv" / "best.ckpt"), "--output", str(out / "calibrate_btcv"), "--allow-training-cases"],
        ["export", "--checkpoint", str(demo / "btcv" / "best.ckpt"), "--format", "bundle", "--output", str(out / "bundle_btcv")],
        ["export", "--checkpoint", str(demo / "endovis" / "best.ckpt"), "--format", "torchscript", "--output", str(out / "ts_endovis")],
    ]
    return commands


def run(out: Path, tree: Path | None) -> int:
    runner = [sys.executable, str(Path(__file__).resolve()), "_cli"]
    env = {**os.environ, "HSMLA_TREE": str(tree or ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    for command in _commands(out):
        print("hsmla-med", " ".join(command), flush=True)
        done = subprocess.run([*runner, *command], env=env, capture_output=True, text=True)
        (out / "logs").mkdir(parents=True, exist_ok=True)
        (out / "logs" / f"{command[0]}_{len(list((out / 'logs').iterdir()))}.log").write_text(done.stdout + done.stderr)
        if done.returncode:
            print(done.stderr[-2000:], file=sys.stderr)
            return done.returncode
    return 0


def _cli(argv: list[str]) -> int:
    """hsmla-med from the checkout ``HSMLA_TREE`` (the editable finder's folders re-pointed)."""
    tree = os.environ["HSMLA_TREE"]
    finder = next(module for name, module in sys.modules.items() if name.startswith("__editable___hsmla_med"))
    finder.MAPPING.update({k: v.replace(str(ROOT), tree) for k, v in finder.MAPPING.items()})
    finder.NAMESPACES.update({k: [p.replace(str(ROOT), tree) for p in v] for k, v in finder.NAMESPACES.items()})
    from hsmla_med.cli import main
    import hsmla_med

    if not hsmla_med.__file__.startswith(tree):
        raise SystemExit(f"imported {hsmla_med.__file__}, not from {tree}")
    return main(argv)


def _clean(value):
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if k not in VOLATILE and not k.endswith("_seconds")}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _tensors(value):
    """A loaded checkpoint or state dict as comparable plain data (tensors as bytes and shape)."""
    import torch

    if isinstance(value, torch.Tensor):
        return (str(value.dtype), tuple(value.shape), value.detach().cpu().contiguous().numpy().tobytes())
    if isinstance(value, dict):
        return {k: _tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_tensors(v) for v in value]
    return value


def _content(path: Path):
    """What a file holds, as it should compare: serialised models by their weights and code (their
    zip archives differ run to run), TIFFs by pixels and tags less the OME UUID (random per file)."""
    if path.suffix in (".ckpt", ".pt"):
        import torch

        return _tensors(torch.load(path, map_location="cpu", weights_only=True))
    if path.suffix == ".ts":
        import torch

        model = torch.jit.load(str(path), map_location="cpu")
        return _tensors(model.state_dict()), model.code
    if path.suffix in (".tif", ".tiff"):
        import re

        import tifffile

        with tifffile.TiffFile(path) as tif:
            return [(page.asarray().tobytes(), {t.name: re.sub(r"urn:uuid:[0-9a-f-]+", "", str(t.value)) for t in page.tags.values()})
                    for page in tif.pages]
    if path.suffix == ".json":
        try:
            return _clean(json.loads(path.read_text()))
        except ValueError:
            pass
    if path.suffix in (".csv", ".txt", ".md", ".geojson", ".xml", ".yaml"):
        return path.read_text()
    return hashlib.sha256(path.read_bytes()).hexdigest()


def diff(a: Path, b: Path) -> int:
    files = lambda root: {p.relative_to(root) for p in root.rglob("*")  # noqa: E731
                          if p.is_file() and "logs" not in p.relative_to(root).parts and p.suffix not in SKIPPED_SUFFIXES
                          and p.name not in SKIPPED_NAMES}
    left, right = files(a), files(b)
    problems = [f"only in {a}: {p}" for p in sorted(left - right)] + [f"only in {b}: {p}" for p in sorted(right - left)]
    for rel in sorted(left & right):
        if _content(a / rel) != _content(b / rel):
            problems.append(f"differs: {rel}")
    print("\n".join(problems) if problems else f"identical: {len(left)} files")
    return 1 if problems else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["_cli"]:
        return _cli(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("run")
    p.add_argument("out", type=Path)
    p.add_argument("--tree", type=Path)
    p = sub.add_parser("diff")
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    args = parser.parse_args(argv)
    return run(args.out, args.tree) if args.verb == "run" else diff(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
