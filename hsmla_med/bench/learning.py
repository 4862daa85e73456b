"""Learning benchmark on real MRI: grey/white matter on the MNI152 template (hsmla_med.data.mni),
every network trained and run through the command line a user runs.

Each (network, seed) runs ``hsmla-med train --task btcv`` on the same data, crops, steps and seed
(a YAML overlay differing only in ``model``), then ``hsmla-med infer`` with ``last.ckpt`` (the
validation case also picks ``best.ckpt``, so choosing it would leak) on the held-out slab and on
its perturbed copy (bias field, noise, other voxels and orientation). Dice, HD95 (mm) and NSD
(at 1 mm) per class are computed against the labels in their original geometry with MONAI's
metrics (:func:`hsmla_med.metrics.case_scores`, :func:`hsmla_med.metrics.summary.case_metrics`).
Times: the train command's wall time, ``fit_s`` (from the
run's ``config.yaml`` to its final ``last.ckpt``, read from the files' clocks: data caching and
training, without imports and the final validation) and inference per volume as ``infer``
reports it (without imports and model loading).

The 2D arms train on 1 mm axial slices with hand-set crops (``--roi``, ``--crops``); the planned
arm (``PLANNED_ARMS``) leaves every data setting to the plan of the data; the 3D arm
(``ARMS_3D``: HSMLA-B0-UNet with routing gate, off and all and with the ``light``
full-resolution level, UNet, SegResNet, SwinUNETR) trains
``--mode 3d`` on the plan's spacing and patches, 2 per step.

``NETWORKS`` run with seed 0; those in ``SEEDED`` (``ROUTING_ABLATION``, HSMLA-B0-UNet trained
with routing gate, off and all, in 2D and 3D; UNet in 2D and 3D; SegResNet and SwinUNETR in 3D,
the peers of the 3D targets; the planned arm) with
``--seeds`` seeds, summarised as mean and sd. Every run leaves
``OUT/<network>/seed<S>/result.json``; a run whose JSON holds the same settings (config overlay,
steps, slab thickness) is not run again, so an interrupted benchmark resumes; rows keep the
commit they ran at. Writes ``learning.csv`` (one row per run), ``learning_summary.csv`` (mean and
sd per network), ``learning.png`` and ``learning_machine.json`` into ``--out``.

    hsmla-med bench --only learning --out bench_out [--steps 400] [--seeds 3] [--networks unet,swinunetr]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import nibabel as nib
import numpy as np
import torch

from hsmla_med.bench.common import markdown, non_negative_int, positive_int, write_csv
from hsmla_med.data.mni import LABELS, write_mni_dataset
from hsmla_med.errors import ConfigError
from hsmla_med.io import atomic_path, write_json, write_yaml
from hsmla_med.metrics import case_scores, summarize
from hsmla_med.metrics.summary import case_metrics

__all__ = ["NETWORKS", "ARMS_3D", "ROUTING_ABLATION", "arm", "SEEDED", "overlay", "scores", "summary_rows", "bench_learning", "add_arguments", "run"]

# the norm named, as the plan would pick instance norm for this MRI (hsmla_med.data.plans): the
# arms compare the two norms, the planned arm takes what the plan gives
_UNET = {"variant": "b0", "decoder": "unet", "norm": "batch"}
_INSTANCE = {**_UNET, "norm": "instance"}
_UNET_3D = {**_UNET, "full_res": "sum"}  # the 3D default (hsmla_med.nn.HSMLASegNet)
# name -> the train config's `model` mapping (hsmla_med.config.build_network)
NETWORKS = {
    "hsmla-b0-unet": _UNET,
    "hsmla-b1-unet": {"variant": "b1", "decoder": "unet"},
    "hsmla-b0-head8": {"variant": "b0", "decoder": "fpn", "head_stride": 8},  # the paper's head
    "unet": {"monai": "UNet", "args": {"channels": [16, 32, 64, 128, 256], "strides": [2, 2, 2, 2], "num_res_units": 2}},
    "swinunetr": {"monai": "SwinUNETR", "args": {"feature_size": 24}},
    "hsmla-b0-unet-routing-off": {**_UNET, "attention": {"routing": "off"}},
    "hsmla-b0-unet-routing-all": {**_UNET, "attention": {"routing": "all"}},
    # instance normalisation, as MONAI's UNet and SwinUNETR normalise: the best network, so its
    # routing arms test the method's claim too
    "hsmla-b0-unet-in": _INSTANCE,
    "hsmla-b0-unet-in-routing-off": {**_INSTANCE, "attention": {"routing": "off"}},
    "hsmla-b0-unet-in-routing-all": {**_INSTANCE, "attention": {"routing": "all"}},
    # a window that is local on the 6 x 6 and 3 x 3 maps of 96 x 96 crops, with tiles to match
    "hsmla-b0-unet-in-w3": {**_INSTANCE, "attention": {"window": 3, "block": 2}},
    # HSMLA also at stride 8, where a 3-mm cortex is still a token or two wide
    "hsmla-b0-unet-s8": {**_UNET, "attention_strides": [8, 16, 32]},
    "hsmla-b0-unet-s8-routing-off": {**_UNET, "attention_strides": [8, 16, 32], "attention": {"routing": "off"}},
    "hsmla-b0-unet-s8-routing-all": {**_UNET, "attention_strides": [8, 16, 32], "attention": {"routing": "all"}},
    "hsmla-b0-unet-planned": {"variant": "b0", "decoder": "unet"},
    # the 3D arm: the default network in 3D against MONAI's 3D networks (MONAI's BTCV tutorials
    # and Model Zoo bundle train 3D); full_res named, so that a result of an earlier 3D default
    # (refine, then light) is not taken for the current one's
    "hsmla-b0-unet-3d": _UNET_3D,
    "hsmla-b0-unet-3d-routing-off": {**_UNET_3D, "attention": {"routing": "off"}},
    "hsmla-b0-unet-3d-routing-all": {**_UNET_3D, "attention": {"routing": "all"}},
    # the full-resolution level refined by a DSConv, the former 3D default (docs/benchmarks.md)
    "hsmla-b0-unet-3d-light": {**_UNET, "full_res": "light"},
    # the plan's norm for MRI, in 3D
    "hsmla-b0-unet-3d-in": {**_UNET_3D, "norm": "instance"},
    "unet-3d": {"monai": "UNet", "args": {"channels": [16, 32, 64, 128, 256], "strides": [2, 2, 2, 2], "num_res_units": 2}},
    "segresnet-3d": {"monai": "SegResNet", "args": {"init_filters": 16}},
    "swinunetr-3d": {"monai": "SwinUNETR", "args": {"feature_size": 24}},
}
# trained with no data settings at all: spacing, intensity, crops and batch planned from the data
# (hsmla_med.data.plans), against the hand-set ones of overlay(); the crops per case stay the default
PLANNED_ARMS = {"hsmla-b0-unet-planned"}
# trained in 3D with the plan's spacing, intensity, patch and batch; 2 crops per case (nnU-Net's
# 3D batch of 2) where the 2D arms take 8 slices
ARMS_3D = (
    "hsmla-b0-unet-3d", "unet-3d", "segresnet-3d", "swinunetr-3d", "hsmla-b0-unet-3d-routing-off", "hsmla-b0-unet-3d-routing-all",
    "hsmla-b0-unet-3d-light", "hsmla-b0-unet-3d-in",
)
# run with every seed (the arms without a routing suffix are the "gate" arms: gate is the default)
ROUTING_ABLATION = (
    "hsmla-b0-unet", "hsmla-b0-unet-routing-off", "hsmla-b0-unet-routing-all",
    "hsmla-b0-unet-s8", "hsmla-b0-unet-s8-routing-off", "hsmla-b0-unet-s8-routing-all",
    "hsmla-b0-unet-in", "hsmla-b0-unet-in-routing-off", "hsmla-b0-unet-in-routing-all",
    "hsmla-b0-unet-3d", "hsmla-b0-unet-3d-routing-off", "hsmla-b0-unet-3d-routing-all",
)
# the comparison the issue's targets name, seed to seed: the best HSMLA network against UNet
SEEDED = (*ROUTING_ABLATION, "unet", *PLANNED_ARMS, "unet-3d", "segresnet-3d", "swinunetr-3d", "hsmla-b0-unet-3d-light", "hsmla-b0-unet-3d-in")
INTENSITY = "zscore_foreground"  # Otsu foreground: the perturbed copy has Rician noise, no zero background
CLASSES = [name for key, name in sorted(LABELS.items()) if key != "0"]
SPLITS = {"": "validation", "perturbed_": "perturbed"}  # column prefix -> dataset.json list
# NSD tolerance: one voxel of the 1 mm template, since the cortex is 2-4 voxels thick (the task's
# 2 mm default would count most of a misplaced cortical boundary as right)
NSD_TOLERANCE_MM = 1.0


def overlay(model: dict, roi: int, crops: int, arm: str = "2d") -> dict:
    """The train config shared by all networks but for ``model``, validation only once at the end.
    ``arm``: ``2d``, axial slices at 1 mm, ``crops`` random ``roi`` x ``roi`` crops per step;
    ``planned``, no data settings: what the plan of the data gives (``plans.json`` of the run);
    ``3d``, the plan's 3D patches, 2 per step."""
    data = {
        "2d": {"spacing": [1.0, 1.0, 1.0], "intensity": {"kind": INTENSITY}, "roi_size_2d": [roi, roi], "samples_per_case": crops,
               "batch_size": 1},
        "planned": {},
        "3d": {"samples_per_case": 2, "batch_size": 1},
    }[arm]
    return {
        **({"2d": {"mode": "2d"}, "3d": {"mode": "3d"}}.get(arm, {})),
        "model": model,
        "data": {**data, "num_workers": 0},
        "trainer": {"check_val_every_n_epoch": 1_000_000, "progress_bar": False},
        "inference": {"target_alpha": 0.3},
    }


def arm(name: str) -> str:
    """The :func:`overlay` arm a network of ``NETWORKS`` trains in."""
    return "planned" if name in PLANNED_ARMS else "3d" if name in ARMS_3D else "2d"


def _cli(args: list, log: Path) -> tuple[float, str]:
    """Run ``hsmla-med ARGS`` in a fresh process; its wall time and output (also kept in
    ``log``). A failure raises with the output's tail."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "hsmla_med.cli", *map(str, args)], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    with atomic_path(log) as tmp:
        tmp.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"hsmla-med {args[0]} failed ({log}):\n{(done.stdout + done.stderr)[-3000:]}")
    return seconds, done.stdout


def _eval_inputs(data: Path, meta: dict, folder: Path) -> Path:
    """A folder linking the held-out and perturbed images, so one ``infer`` call segments both."""
    folder.mkdir(parents=True, exist_ok=True)
    for split in SPLITS.values():
        for entry in meta[split]:
            link = folder / Path(entry["image"]).name
            tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
            tmp.unlink(missing_ok=True)
            tmp.symlink_to((data / entry["image"]).resolve())
            os.replace(tmp, link)
    return folder


def _label_map(img: nib.Nifti1Image) -> torch.Tensor:
    return torch.as_tensor(np.asarray(img.dataobj).round().astype(np.int64))[None, None]


def scores(data: Path, entries: list[dict], predictions: Path) -> dict:
    """Dice, HD95 and NSD (at :data:`NSD_TOLERANCE_MM`) of the predictions against the labels,
    each in the label's own geometry (voxel sizes from its affine)."""
    dice, hd95, nsd = [], [], []
    for entry in entries:
        truth = nib.load(str(data / entry["label"]))
        pred = nib.load(str(predictions / Path(entry["image"]).name))
        spacing = nib.affines.voxel_sizes(truth.affine).tolist()
        d, h = case_scores(_label_map(pred), _label_map(truth), len(LABELS), spacing=spacing)
        dice.append(d)
        hd95.append(h)
        metrics = case_metrics(_label_map(truth)[0, 0].numpy(), _label_map(pred)[0, 0].numpy(), range(1, len(LABELS)), spacing,
                               NSD_TOLERANCE_MM)
        nsd.append(torch.tensor([[metrics[c]["NSD"] for c in range(1, len(LABELS))]], dtype=torch.float32))
    return summarize(torch.cat(dice), torch.cat(hd95), CLASSES, nsd=torch.cat(nsd))


def _columns(prefix: str, summary: dict) -> dict:
    row = {f"{prefix}dice": summary["dice"], f"{prefix}hd95": summary["hd95"], f"{prefix}nsd": summary["nsd"]}
    for metric in ("dice", "hd95", "nsd"):
        row.update({f"{prefix}{metric}_{name}": value for name, value in summary[f"{metric}_per_class"].items()})
    return row


def _params_m(checkpoint: Path) -> float:
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    return sum(v.numel() for k, v in state.items() if k.startswith("network.") and v.is_floating_point()) / 1e6


@dataclass
class Setup:
    """What every run shares: the dataset, the folder of images to segment, the training size,
    the code's commit."""

    data: Path
    meta: dict
    inputs: Path
    steps: int
    roi: int
    crops: int
    commit: str

    def settings(self, name: str) -> dict:
        """What a run's result depends on besides its seed: a saved result with other settings
        is not reused."""
        return {"overlay": overlay(NETWORKS[name], self.roi, self.crops, arm(name)), "steps": self.steps, "slices": self.meta["slices"]}


def run_one(name: str, seed: int, setup: Setup, folder: Path) -> dict:
    """Train, infer and score one network and seed in ``folder``; the row, also saved there as
    ``result.json``."""
    train, predictions = folder / "train", folder / "predictions"
    settings = setup.settings(name)
    write_yaml(folder / "overlay.yaml", settings["overlay"])
    train_s, _ = _cli(["train", "--task", "btcv", "--data-dir", setup.data, "--config", folder / "overlay.yaml", "--max-steps", setup.steps,
                       "--seed", seed, "--output", train, "--accelerator", "cpu"], folder / "train.log")
    _, printed = _cli(["infer", "--task", "btcv", "--checkpoint", train / "last.ckpt", "--input", setup.inputs,
                       "--output", predictions, "--device", "cpu"], folder / "infer.log")
    volumes = sum(len(setup.meta[split]) for split in SPLITS.values())
    row = {
        "network": name, "seed": seed, "steps": setup.steps, "commit": setup.commit, "params_m": _params_m(train / "last.ckpt"),
        "train_s": train_s, "fit_s": (train / "last.ckpt").stat().st_mtime - (train / "config.yaml").stat().st_mtime,
        "infer_s_per_volume": float(re.search(r"output file\(s\) in .* \(([\d.]+) s\)", printed).group(1)) / volumes,
    }
    for prefix, split in SPLITS.items():
        row.update(_columns(prefix, scores(setup.data, setup.meta[split], predictions)))
    write_json(folder / "result.json", {"settings": settings, "row": row})
    return row


def _finished(folder: Path, settings: dict, setup: Setup) -> dict | None:
    """The row of a run finished before with the same settings, if any; one scored before NSD
    was measured is scored again from its predictions (and saved so)."""
    result = folder / "result.json"
    saved = json.loads(result.read_text()) if result.is_file() else {}
    if saved.get("settings") != settings:
        return None
    row = saved["row"]
    if "nsd" not in row:
        for prefix, split in SPLITS.items():
            row.update(_columns(prefix, scores(setup.data, setup.meta[split], folder / "predictions")))
        write_json(result, {"settings": settings, "row": row})
    return row


def summary_rows(rows: list[dict]) -> list[dict]:
    """Mean and sd (over seeds; 0 with one seed) of every measured column, per network."""
    table = []
    for name in dict.fromkeys(r["network"] for r in rows):
        group = [r for r in rows if r["network"] == name]
        entry = {"network": name, "seeds": len(group)}
        for key in [k for k in group[0] if k not in ("network", "seed", "steps", "commit")]:
            values = [r[key] for r in group if r[key] is not None]
            entry[f"{key}_mean"] = statistics.fmean(values) if values else None
            entry[f"{key}_sd"] = statistics.stdev(values) if len(values) > 1 else 0.0
        table.append(entry)
    return table


def _readable(summary: list[dict]) -> list[dict]:
    """The summary's headline columns as ``mean ± sd`` strings, for the printed table."""
    keys = ["dice", *(f"dice_{c}" for c in CLASSES), "hd95", "nsd", "perturbed_dice", "perturbed_hd95", "perturbed_nsd", "train_s",
            "infer_s_per_volume"]
    fmt = lambda m, s: "n/a" if m is None else f"{m:.3g} ± {s:.2g}"  # noqa: E731
    return [{"network": s["network"], "seeds": s["seeds"], **{k: fmt(s[f"{k}_mean"], s[f"{k}_sd"]) for k in keys}} for s in summary]


def plot(path: Path, summary: list[dict]) -> None:
    """Mean Dice on the clean and the perturbed held-out case (sd error bars), and train time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s["network"] for s in summary]
    x = np.arange(len(names))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(10, 1.6 * len(names)), 5))
    for offset, (prefix, label) in zip((-0.2, 0.2), (("", "held-out"), ("perturbed_", "perturbed held-out"))):
        means = [s[f"{prefix}dice_mean"] or 0.0 for s in summary]
        ax1.bar(x + offset, means, 0.4, yerr=[s[f"{prefix}dice_sd"] for s in summary], capsize=3, label=label)
    ax1.set(ylabel="mean Dice (grey, white matter)", ylim=(0, 1), title="MNI152 grey/white matter, last.ckpt")
    ax1.legend()
    ax2.bar(x, [s["train_s_mean"] for s in summary], yerr=[s["train_s_sd"] for s in summary], capsize=3, color="tab:gray")
    ax2.set(ylabel="train command wall time (s)", title="Training, CPU")
    for ax in (ax1, ax2):
        ax.set_xticks(x, names, rotation=30, ha="right")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)


def machine() -> dict:
    """Where and at which commit the benchmark ran (rows resumed from earlier runs may predate it)."""
    repo = Path(__file__).resolve().parent.parent
    git = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "commit": git.stdout.strip() or "unknown"}


def bench_learning(out: Path, steps: int = 400, seeds: int = 3, networks: list[str] | None = None, data_dir: Path | None = None,
                   slices: int = 24, roi: int = 96, crops: int = 8, first_seed: int = 0) -> list[dict]:
    """Every requested network (default all of ``NETWORKS``) trained and scored; the rows. The
    networks of ``SEEDED`` run seeds ``first_seed .. first_seed + seeds - 1``, the others
    ``first_seed`` (a long arm's seeds can be split between runs)."""
    networks = networks or list(NETWORKS)
    unknown = sorted(set(networks) - set(NETWORKS))
    if unknown:
        raise ConfigError(f"--networks: unknown network(s) {unknown}; known: {', '.join(NETWORKS)}")
    try:
        data = write_mni_dataset(data_dir, slices)
    except OSError as err:  # an unwritable home (the default folder) or --data-dir
        raise ConfigError(f"--data-dir {data_dir or '~/.cache/hsmla-med/mni-learning'}: cannot write the MNI dataset there "
                          f"({err.strerror or err}); give --data-dir a writable folder") from None
    meta = json.loads((data / "dataset.json").read_text())
    setup = Setup(data, meta, _eval_inputs(data, meta, out / "eval_inputs"), steps, roi, crops, machine()["commit"])
    rows = []
    for name in networks:
        for seed in range(first_seed, first_seed + (seeds if name in SEEDED else 1)):
            folder = out / name / f"seed{seed}"
            row = _finished(folder, setup.settings(name), setup)
            if row is not None:
                rows.append(row)
                print(f"  {name} seed {seed}: done before ({folder / 'result.json'}, commit {row['commit']})", flush=True)
                continue
            rows.append(run_one(name, seed, setup, folder))
            print(f"  {name} seed {seed}: Dice {rows[-1]['dice']:.3f} (perturbed {rows[-1]['perturbed_dice']:.3f}), "
                  f"train {rows[-1]['train_s']:.0f} s", flush=True)
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("learning benchmark (--only learning)")
    g.add_argument("--steps", type=positive_int, default=400, help="training steps per network (default 400)")
    g.add_argument("--seeds", type=positive_int, default=3, help="seeds of the routing ablation and the other seeded arms (default 3); other networks run one seed")
    g.add_argument("--first-seed", type=non_negative_int, default=0, help="the first seed (default 0): --first-seed 1 --seeds 2 runs seeds 1 and 2")
    g.add_argument("--networks", help=f"comma-separated subset of: {', '.join(NETWORKS)}")
    g.add_argument("--data-dir", type=Path, help="where the MNI dataset is written once (default ~/.cache/hsmla-med/mni-learning)")
    g.add_argument("--slices", type=positive_int, default=24, help="axial slab thickness of each case in 1 mm slices (default 24)")
    g.add_argument("--roi", type=positive_int, default=96, help="side of the 2D training crops and inference windows (default 96)")
    g.add_argument("--crops", type=positive_int, default=8, help="random crops per training step (default 8)")


def run(args: argparse.Namespace) -> int:
    """``hsmla-med bench --only learning``: the rows, their summary, the figure and tables."""
    info = machine()
    print(f"learning benchmark at commit {info['commit']} on {info['platform']}, {info['cpus']} CPUs; "
          f"{args.steps} steps; 2D arms {args.crops} {args.roi}x{args.roi} crops per step, 3D arms the plan's patches, 2 per step:",
          flush=True)
    write_json(args.out / "learning_machine.json", info)
    networks = args.networks.split(",") if args.networks else None
    rows = bench_learning(args.out, args.steps, args.seeds, networks, args.data_dir, args.slices, args.roi, args.crops, args.first_seed)
    summary = summary_rows(rows)
    write_csv(args.out / "learning.csv", rows)
    write_csv(args.out / "learning_summary.csv", summary)
    plot(args.out / "learning.png", summary)
    print("\n" + markdown(_readable(summary)) + "\n")
    print(f"wrote learning.csv, learning_summary.csv, learning.png into {args.out}")
    return 0
