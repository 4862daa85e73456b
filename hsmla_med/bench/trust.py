"""Calibration, uncertainty and the gate as a signal on the real MRI of the learning benchmark:
whether the networks' probabilities, their uncertainty and the HSMLA gate can be trusted to say
where a segmentation is wrong.

    hsmla-med bench --only trust --out /tmp/bench-trust [--seeds 3] [--steps 2000] [--data-dir DIR]

Seeds already done with the same settings are reused: ``--seeds 1``, then ``--seeds 3`` adds two.

Per seed, the learning benchmark's default 2D arm (``hsmla-b0-unet``: HSMLA-B0, U-shaped decoder,
its :func:`~hsmla_med.bench.learning.overlay` and crops) is trained through ``hsmla-med train
--task btcv`` on the MNI152 grey/white-matter slabs for as many steps as that command trains by
default (:func:`default_steps`: a network trained for the learning benchmark's 400 steps is
nearly calibrated already, one trained as users train it is over-confident, docs/benchmarks.md),
calibrated with ``hsmla-med calibrate``
(one temperature, fitted on the validation case of the recorded split: the held-out slab; and,
opt-in, one per class), and the checkpoints segment the held-out slab and its perturbed "other scanner" copy with ``hsmla-med
infer --save-probabilities --uncertainty entropy`` (the calibrated one also ``--tta --uncertainty
mutual-information``). Then, in the labels' own geometry:

* ``ece``/``ece_foreground``/``brier``/``nll`` of the written probabilities against the label
  file (:func:`hsmla_med.metrics.calibration.calibration_metrics`, every voxel), before and after
  calibration, and Dice (:func:`hsmla_med.bench.learning.scores`) of both label maps;
* each case's mean uncertainty over the predicted foreground, from ``uncertainty.csv``.

And, in the network's grid (the checkpoint's preprocessing applied to image and label), the gate
as a signal of error (:func:`gate_signal`): the calibrated network slides over every axial slice as
``infer`` does (MONAI's sliding window, Gaussian blending, the checkpoint's window and overlap),
keeping each window's position and the block gate ``M`` of every HSMLA layer. The error map
(stitched argmax != label), the predictive entropy and the in-plane distance to the predicted
boundary are **averaged down to each window's gate tiles** (:func:`tile_samples`), and Spearman's
rho per case relates each signal to the tiles' error rate: the gate (mean of a stage's layers),
the entropy, and minus the distance (near the boundary = likely wrong), so that a useful signal
has a positive rho for all three.
"""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import nibabel as nib
import numpy as np
import torch
from monai.inferers import sliding_window_inference
from scipy.ndimage import distance_transform_edt, maximum_filter, minimum_filter
from scipy.stats import spearmanr

from hsmla_med.bench.common import markdown, own_parser, positive_int
from hsmla_med.bench.learning import NETWORKS, SPLITS, _cli, _eval_inputs, machine, overlay, scores
from hsmla_med.data.mni import write_mni_dataset
from hsmla_med.inference.uncertainty import predictive_entropy
from hsmla_med.io import atomic_path, write_json, write_yaml
from hsmla_med.metrics.calibration import calibration_metrics, flatten_maps
from hsmla_med.nn.attention import HSMLA
from hsmla_med.nn.functional import tile_average

__all__ = ["NETWORK", "default_steps", "boundary_distance", "tile_samples", "correlations", "gate_signal", "run_seed", "measure", "summary",
           "bench_trust", "main"]

#: the learning benchmark's default 2D arm
NETWORK = "hsmla-b0-unet"
#: ``hsmla-med calibrate`` runs: folder under ``calibrate/`` -> options (the default one temperature;
#: one per class, opt-in as it may change the argmax)
TEMPERATURES = {"single": [], "per_class": ["--per-class"]}
#: the signals compared with the error rate of the gate's tiles (larger = more likely wrong)
SIGNALS = ("gate", "entropy", "boundary")


def boundary_distance(labels: np.ndarray) -> np.ndarray:
    """In-plane distance (pixels) of every voxel of a label map ``(H, W, D)`` to the nearest
    boundary voxel of its axial slice, a boundary voxel being one whose 3 x 3 in-plane
    neighbourhood holds another label (0 on the boundary). A slice without a boundary gets
    ``H + W``, farther than any distance within it."""
    plane = (3, 3, 1)
    boundary = maximum_filter(labels, size=plane, mode="nearest") != minimum_filter(labels, size=plane, mode="nearest")
    distance = np.full(labels.shape, float(labels.shape[0] + labels.shape[1]))
    for z in range(labels.shape[2]):
        if boundary[..., z].any():
            distance[..., z] = distance_transform_edt(~boundary[..., z])
    return distance


def tile_samples(windows: list[tuple], maps: dict[str, np.ndarray], tile: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Gate values and the maps averaged over the same tiles, one sample per tile of every window.

    Args:
        windows: ``(z, rows, cols, gate)`` per window: the axial slice ``z``, the window's
            ``slice`` objects in-plane and its gate ``(tiles_h, tiles_w)`` (one layer's, or a
            stage's mean).
        maps: name -> ``(H, W, D)`` per-voxel map on the grid the windows index.
        tile: a gate tile's side in pixels (the layer's tile of ``block`` tokens times its
            stride); partial edge tiles average the pixels they hold
            (:func:`~hsmla_med.nn.functional.tile_average`, the gate's own pooling).

    Returns:
        ``(N,)`` gate values and name -> ``(N,)`` tile means, in the same order.
    """
    gates, means = [], {name: [] for name in maps}
    for z, rows, cols, gate in windows:
        gate = torch.as_tensor(gate)
        for name, values in maps.items():
            patch = torch.as_tensor(np.ascontiguousarray(values[rows, cols, z]), dtype=torch.float64)[None, None]
            pooled = tile_average(patch, tile)[0, 0]
            if pooled.shape != gate.shape:
                raise ValueError(f"a window of {tuple(patch.shape[2:])} pixels in tiles of {tile} gives {tuple(pooled.shape)} tiles, "
                                 f"the gate has {tuple(gate.shape)}")
            means[name].append(pooled.flatten().numpy())
        gates.append(gate.double().flatten().numpy())
    return np.concatenate(gates), {name: np.concatenate(parts) for name, parts in means.items()}


def correlations(gate: np.ndarray, means: dict[str, np.ndarray]) -> dict[str, float | None]:
    """Spearman's rho of each signal with the tiles' error rate (``means["error"]``): ``gate``,
    ``entropy`` (``means["entropy"]``) and ``boundary``, minus ``means["distance"]``; ``None``
    where a side is constant (rho undefined)."""
    signals = {"gate": gate, "entropy": means["entropy"], "boundary": -means["distance"]}

    def rho(x):
        if np.ptp(x) == 0 or np.ptp(means["error"]) == 0:
            return None
        return float(spearmanr(x, means["error"]).statistic)

    return {name: rho(signals[name]) for name in SIGNALS}


def gate_signal(checkpoint: Path, image: Path, label: Path) -> dict:
    """:func:`correlations` per gated stage (its layers' gates averaged; they share one tile grid)
    of one case, plus its tiles' count, error rate and share refined (``M > tau``); and the largest
    difference between these probabilities and ``infer``'s
    (:meth:`~hsmla_med.engine.segmentation.SegmentationModule.predict_probabilities`), a check that
    the windows are the ones ``infer`` runs."""
    from hsmla_med.engine.base import plain
    from hsmla_med.pipelines import get_task
    from hsmla_med.pipelines.btcv import preprocessing

    module, _ = get_task("btcv").load(checkpoint)
    config, inference = module.config, module.config["inference"]
    if config["spatial_dims"] != 2:
        raise ValueError(f"{checkpoint}: the gate analysis slides a 2D network over axial slices; this one is {config['spatial_dims']}D")
    pre = preprocessing(config["data"], config["in_channels"], len(module.label_names), keys=("image", "label"))
    case = {"image": str(image), "label": str(label)}
    for transform in pre:
        case = transform(case)
    volume, truth = plain(case["image"]).float(), plain(case["label"])[0].long().numpy()
    roi = tuple(inference["roi_size"])
    if any(n < r for n, r in zip(volume.shape[1:3], roi)):
        raise ValueError(f"{image}: slices of {tuple(volume.shape[1:3])} are smaller than the window {roi}; MONAI would pad them")

    layers = {name: m for name, m in module.network.named_modules() if isinstance(m, HSMLA)}
    seen: dict[str, tuple] = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, name=name: seen.__setitem__(name, (args[0].shape[2:], mod.last_gate)))
             for name, m in layers.items()]
    windows: dict[tuple[int, int], list] = {}  # (stride, block) -> [(z, rows, cols, gate per layer)]

    def predictor(x: torch.Tensor, coords) -> torch.Tensor:
        logits = module.network(x)
        for i, where in enumerate(coords):
            z, rows, cols = where[0].start, where[2], where[3]
            for name, (tokens, gate) in seen.items():
                stride = x.shape[2] // tokens[0]
                windows.setdefault((stride, layers[name].block), []).append((z, rows, cols, name, gate[i].double(), float(layers[name].tau)))
        return logits

    slices = volume[0].permute(2, 0, 1)[:, None]  # (D, 1, H, W): every axial slice a batch item, as SliceInferer
    try:
        with torch.no_grad():
            logits = sliding_window_inference(slices, roi, inference["sw_batch_size"] * inference["slab"], predictor,
                                              overlap=inference["overlap"], mode="gaussian", with_coord=True)
    finally:
        for hook in hooks:
            hook.remove()
    probs = torch.softmax(logits.float(), 1).permute(1, 2, 3, 0)  # (C, H, W, D)
    with torch.no_grad():
        reference = module.predict_probabilities(volume[None])[0]
    predicted = probs.argmax(0).numpy()
    maps = {"error": (predicted != truth).astype(np.float64), "entropy": predictive_entropy(probs[None].double())[0].numpy(),
            "distance": boundary_distance(predicted)}
    stages = {}
    for (stride, block), entries in sorted(windows.items()):
        by_window: dict[tuple, list] = {}
        for z, rows, cols, name, gate, tau in entries:
            by_window.setdefault((z, rows.start, cols.start), []).append((rows, cols, gate, tau))
        stage = [(z, parts[0][0], parts[0][1], torch.stack([g for _, _, g, _ in parts]).mean(0)) for (z, _, _), parts in by_window.items()]
        refined = [float((g > tau).double().mean()) for parts in by_window.values() for _, _, g, tau in parts]
        gate, means = tile_samples(stage, maps, block * stride)
        stages[f"stride{stride}"] = {"layers": len({e[3] for e in entries}), "tile_px": block * stride, "tiles": len(gate),
                                     "tile_error_rate": float(means["error"].mean()), "refined_share": statistics.fmean(refined),
                                     "spearman": correlations(gate, means)}
    return {"stages": stages, "voxel_error_rate": float(maps["error"].mean()),
            "probabilities_max_diff_vs_infer": float((probs - reference).abs().max())}


def _case_calibration(probabilities: Path, label: Path) -> dict:
    """:func:`calibration_metrics` of ``infer --save-probabilities``' ``<case>.npz`` against the
    label file (same grid), every voxel."""
    probs = torch.from_numpy(np.load(probabilities)["probabilities"].astype(np.float32))[None]
    truth = torch.from_numpy(np.asarray(nib.load(str(label)).dataobj).round().astype(np.int64))[None]
    return calibration_metrics(*flatten_maps(probs, truth))


def default_steps() -> int:
    """The training steps of ``hsmla-med train --task btcv`` without options (``trainer.max_steps``)."""
    from hsmla_med.config import task_config

    return int(task_config("btcv")["trainer"]["max_steps"])


def _review_queue(folder: Path) -> dict[str, float]:
    with (folder / "uncertainty.csv").open() as f:
        return {row["case"]: float(row["mean_foreground_uncertainty"]) for row in csv.DictReader(f)}


def run_seed(seed: int, folder: Path, data: Path, meta: dict, inputs: Path, steps: int, roi: int, crops: int) -> dict:
    """Train (unless ``folder/train/last.ckpt`` exists with the same overlay and steps), calibrate,
    infer and measure one seed; the row, also saved as ``folder/result.json``."""
    settings = {"overlay": overlay(NETWORKS[NETWORK], roi, crops), "steps": steps, "slices": meta["slices"]}
    train = folder / "train"
    result = folder / "result.json"
    wanted = {**settings, "runs": list(_runs(folder))}  # a result without one of today's runs is measured again
    if result.is_file() and (done := json.loads(result.read_text())).get("settings") == wanted:
        print(f"  seed {seed}: done before ({result}, commit {done['row']['commit']})", flush=True)
        return done["row"]
    saved = folder / "settings.json"
    if not ((train / "last.ckpt").is_file() and saved.is_file() and json.loads(saved.read_text()) == settings):
        write_yaml(folder / "overlay.yaml", settings["overlay"])
        _cli(["train", "--task", "btcv", "--data-dir", data, "--config", folder / "overlay.yaml", "--max-steps", steps, "--seed", seed,
              "--output", train, "--accelerator", "cpu"], folder / "train.log")
        write_json(saved, settings)
    for name, extra in TEMPERATURES.items():
        _cli(["calibrate", "--checkpoint", train / "last.ckpt", "--data-dir", data, "--output", folder / "calibrate" / name, "--accelerator",
              "cpu", *extra], folder / f"calibrate_{name}.log")
    for name, (checkpoint, extra) in _runs(folder).items():
        _cli(["infer", "--task", "btcv", "--checkpoint", checkpoint, "--input", inputs, "--output", folder / name, "--save-probabilities",
              *extra, "--device", "cpu", "--overwrite"], folder / f"infer_{name}.log")  # a seed measured again replaces its outputs
    row = measure(seed, steps, folder, data, meta)
    write_json(result, {"settings": wanted, "row": row})
    return row


def _runs(folder: Path) -> dict[str, tuple[Path, list[str]]]:
    """The infer runs of a seed: output folder name -> (checkpoint, infer options)."""
    return {
        "raw": (folder / "train" / "last.ckpt", ["--uncertainty", "entropy"]),
        "calibrated": (folder / "calibrate" / "single" / "last.ckpt", ["--uncertainty", "entropy"]),
        "calibrated_tta": (folder / "calibrate" / "single" / "last.ckpt", ["--tta", "--uncertainty", "mutual-information"]),
        "calibrated_per_class": (folder / "calibrate" / "per_class" / "last.ckpt", []),
    }


def measure(seed: int, steps: int, folder: Path, data: Path, meta: dict) -> dict:
    """A seed's row from the outputs of :func:`run_seed`'s commands in ``folder``."""
    runs = _runs(folder)
    row = {"seed": seed, "steps": steps, "commit": machine()["commit"], "cases": {}}
    for name in TEMPERATURES:
        fitted = json.loads((folder / "calibrate" / name / "calibration.json").read_text())
        row[f"temperature_{name}"] = fitted["temperature"]
        row[f"validation_{name}"] = {"before": fitted["before"], "after": fitted["after"]}  # calibrate's own sample
    queues = {name: _review_queue(folder / name) for name, (_, extra) in runs.items() if "--uncertainty" in extra}
    for prefix, split in SPLITS.items():
        entry = meta[split][0]
        case = Path(entry["image"]).name.removesuffix(".nii.gz")
        measured = {f"dice_{name}": scores(data, [entry], folder / name)["dice"] for name in runs}
        for name in runs:
            measured[f"calibration_{name}"] = _case_calibration(folder / name / f"{case}.npz", data / entry["label"])
        measured["uncertainty_entropy_raw"] = queues["raw"][case]
        measured["uncertainty_entropy"] = queues["calibrated"][case]
        measured["uncertainty_mutual_information"] = queues["calibrated_tta"][case]
        measured["gate"] = gate_signal(runs["calibrated"][0], data / entry["image"], data / entry["label"])
        row["cases"][prefix.rstrip("_") or "clean"] = {"case": case, **measured}
    return row


def summary(rows: list[dict]) -> list[dict]:
    """One line per case and measure: mean and sd over seeds, and the seeds' values."""
    def line(label: str, values: list[float | None]) -> dict:
        known = [v for v in values if v is not None]
        return {"measure": label, "mean": statistics.fmean(known) if known else None,
                "sd": statistics.stdev(known) if len(known) > 1 else 0.0,
                "seeds": ", ".join("n/a" if v is None else f"{v:.4g}" for v in values)}

    table = [line("temperature", [r["temperature_single"][0] for r in rows])]
    table += [line(f"temperature per class {c}", [r["temperature_per_class"][c] for r in rows]) for c in range(3)]
    for case in ("clean", "perturbed"):
        pick = [r["cases"][case] for r in rows]
        for metric in ("ece", "ece_foreground", "nll", "brier"):
            for name in ("raw", "calibrated", "calibrated_per_class"):
                table.append(line(f"{case} {metric} {name}", [p[f"calibration_{name}"][metric] for p in pick]))
        for name in ("calibrated", "calibrated_per_class"):
            table.append(line(f"{case} ece ratio raw/{name}", [p["calibration_raw"]["ece"] / p[f"calibration_{name}"]["ece"] for p in pick]))
        for name in ("raw", "calibrated", "calibrated_tta", "calibrated_per_class"):
            table.append(line(f"{case} dice {name}", [p[f"dice_{name}"] for p in pick]))
        for measure in ("uncertainty_entropy_raw", "uncertainty_entropy", "uncertainty_mutual_information"):
            table.append(line(f"{case} {measure}", [p[measure] for p in pick]))
        for stage in pick[0]["gate"]["stages"]:
            for signal in SIGNALS:
                table.append(line(f"{case} {stage} spearman {signal}", [p["gate"]["stages"][stage]["spearman"][signal] for p in pick]))
            table.append(line(f"{case} {stage} refined share", [p["gate"]["stages"][stage]["refined_share"] for p in pick]))
        table.append(line(f"{case} voxel error rate", [p["gate"]["voxel_error_rate"] for p in pick]))
    return table


def bench_trust(out: Path, seeds: int = 3, steps: int | None = None, data_dir: Path | None = None, slices: int = 24, roi: int = 96,
                crops: int = 8) -> list[dict]:
    """Every seed's row (:func:`run_seed`); ``trust.json`` (rows, summary, machine) and ``trust.md``
    (the summary table) written into ``out``; ``steps`` default :func:`default_steps`."""
    steps = default_steps() if steps is None else steps
    data = write_mni_dataset(data_dir, slices)
    meta = json.loads((data / "dataset.json").read_text())
    inputs = _eval_inputs(data, meta, out / "eval_inputs")
    rows = []
    for seed in range(seeds):
        rows.append(run_seed(seed, out / f"seed{seed}", data, meta, inputs, steps, roi, crops))
        table = summary(rows)
        write_json(out / "trust.json", {"machine": machine(), "steps": steps, "rows": rows, "summary": table})
        with atomic_path(out / "trust.md") as tmp:
            tmp.write_text(markdown(table) + "\n")
        print(f"seed {seed} done: {out / 'trust.md'}", flush=True)
    return rows


def main(argv: list[str]) -> int:
    parser = own_parser("trust", __doc__)
    parser.add_argument("--out", type=Path, required=True, help="working folder: runs, trust.json, trust.md")
    parser.add_argument("--seeds", type=positive_int, default=3, help="training seeds 0..N-1 (default 3)")
    parser.add_argument("--steps", type=positive_int, default=default_steps(),
                        help="training steps (default: the btcv task's trainer.max_steps, what `hsmla-med train` runs; 400 is the learning benchmark's)")
    parser.add_argument("--data-dir", type=Path, help="where the MNI dataset is written once (default ~/.cache/hsmla-med/mni-learning)")
    args = parser.parse_args(argv)
    bench_trust(args.out, args.seeds, args.steps, args.data_dir)
    return 0
