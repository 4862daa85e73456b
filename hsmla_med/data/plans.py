"""Plans from the data: the preprocessing and training shape of a dataset, derived from its
fingerprint (:mod:`hsmla_med.data.fingerprint`) as nnU-Net plans it, for every config value left
``auto``.

What is planned, and by which rule (each plan entry keeps its reason in words):

* ``data.spacing``: the median voxel spacing of the cases. Anisotropic data (the coarsest axis's
  median spacing more than 3x the finest other axis's, and its median size after resampling
  less than a third of the others') get that axis's 10th percentile instead, nnU-Net's rule
  (``determine_fullres_target_spacing``), so that thin-slice cases keep their detail.
* ``data.intensity``: from the modality that ``dataset.json`` names (nnU-Net v2's
  ``channel_names`` or the MSD's ``modality``). CT: clipped to the 0.5 and 99.5 percentiles of
  the dataset's foreground intensities, then z-scored with their mean and standard deviation
  (nnU-Net's ``CTNormalization``: the same numbers for every case, since HU are absolute).
  Anything else (MRI, or no modality named): z-scored per case over its foreground
  (``zscore_foreground``: mean and standard deviation of the case's Otsu foreground).
* ``norm``: the normalisation layers of an HSMLA network, from the modality and the mode. CT:
  batch norm, which folds into the convolutions at inference (HU are absolute: one scanner's CT
  looks like another's). Anything else, in 2D: instance norm, which normalises every image and
  channel by its own statistics, so that a new scanner's intensity scale and coil bias field do
  not shift the features; on the real MRI of the learning benchmark it held Dice on the
  other-scanner copy (0.889 against batch norm's 0.845), at 1.35-1.8x batch norm's inference time
  on the CPU. In 3D batch norm: there instance norm's statistics over the deep stages' few voxels
  (2 x 3 x 1 at stride 32 for a 64 x 96 x 32 patch) cost Dice (0.826 against 0.901-0.914, one
  seed; docs/benchmarks.md). nnU-Net uses instance norm throughout; its 3D patches are larger.
* ``mode``: ``2d`` for anisotropic data (slices much thicker than their pixels) or on a CPU
  (a 3D step costs several 2D steps there: docs/benchmarks.md), else ``3d``.
* ``data.roi_size_2d`` / ``roi_size_3d``: the median shape of the cases at the planned spacing
  (in-plane for 2D), rounded up to multiples of 32 voxels (the network's deepest stride, as
  nnU-Net makes its patch divisible by its poolings; MONAI's SwinUNETR requires it too), shrunk along its longest side while it exceeds the device's crop budget
  (see :data:`PATCH_BUDGET`).
* ``data.batch_size``: cases per step such that ``batch_size x samples_per_case`` crops hold
  about :data:`CROPS_PER_STEP` budget-sized crops (8 in 2D: batch statistics want several
  slices, as nnU-Net's 2D batches do; 2 in 3D, nnU-Net's minimum), between 1 and 8 and at most
  the number of training cases; on a GPU, one more multiple per 24 GiB.

The CPU budgets are a time budget: 8 crops of 96^2 (2D) or 2 of 64^3 (3D) are one step of about
0.3 s / 1.2 s for HSMLA-B0 on two cores (docs/benchmarks.md, "Plans from the data"). A median
slice that is larger is cropped, not the step made longer: on the real MRI of the learning
benchmark, 20 full slices per step (the GPU's 256^2 budget) trained 3.7x longer for less Dice.

A value set in the config (a number, a list, an intensity kind) is kept as set: the plan only
fills ``auto``, and says which it left.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hsmla_med.data.datalist import Datalist, read_json
from hsmla_med.data.fingerprint import FINGERPRINT_FILE, FINGERPRINT_VERSION, case_ids, compute_fingerprint
from hsmla_med.data.splits import beside_dataset
from hsmla_med.io import write_json

log = logging.getLogger("hsmla_med")

__all__ = ["PLANS_FILE", "PLANNED", "plan_dataset", "make_plan", "apply_plan", "plan_lines", "modality", "dataset_fingerprint"]

PLANS_FILE = "plans.json"
ANISOTROPY = 3.0  # nnU-Net's anisotropy_threshold
ROI_STEP = 32  # planned crops are whole multiples of the network's deepest stride
#: voxels of one training crop: on a CPU a time budget (module docstring); a GPU's are nnU-Net's
#: usual 3D patch (128^3) and the paper's 2D input (512^2)
PATCH_BUDGET = {("cpu", 2): 96 * 96, ("cpu", 3): 64**3, ("gpu", 2): 512 * 512, ("gpu", 3): 128**3}
#: budget-sized crops per step, by spatial dims (x 1 per 24 GiB of a GPU)
CROPS_PER_STEP = {2: 8, 3: 2}
MAX_BATCH = 8
GPU_MEMORY_UNIT = 24 * 2**30  # bytes of GPU memory per multiple of the step budget
#: the config keys a plan fills, where the config leaves them ``auto``
PLANNED = ("data.spacing", "data.intensity", "norm", "mode", "data.roi_size_2d", "data.roi_size_3d", "data.batch_size")


def modality(meta: dict) -> dict[str, str]:
    """``{channel: modality}`` from a dataset JSON (nnU-Net v2 ``channel_names``, else the
    MSD's ``modality``); empty when it names none."""
    names = meta.get("channel_names") or meta.get("modality") or {}
    return {str(k): str(v) for k, v in names.items()} if isinstance(names, dict) else {}


def _target_spacing(spacings: np.ndarray, shapes: np.ndarray) -> tuple[np.ndarray, str]:
    target = np.percentile(spacings, 50, axis=0)
    size = np.percentile(shapes, 50, axis=0)
    worst = int(np.argmax(target))
    others = [i for i in range(len(target)) if i != worst]
    aniso_spacing = target[worst] > ANISOTROPY * max(target[i] for i in others)
    aniso_voxels = size[worst] * ANISOTROPY < min(size[i] for i in others)
    reason = f"median spacing of {len(spacings)} cases"
    if aniso_spacing and aniso_voxels:
        tenth = float(np.percentile(spacings[:, worst], 10))
        largest_other = max(target[i] for i in others)
        target[worst] = max(largest_other, tenth) + 1e-5 if tenth < largest_other else tenth
        reason += f"; anisotropic ({'xyz'[worst]} {np.median(spacings[:, worst]):.3g} mm against {largest_other:.3g} mm): " \
                  f"{'xyz'[worst]} at its 10th percentile (nnU-Net's rule)"
    return target, reason


def _anisotropic(spacing: Sequence[float]) -> bool:
    spacing = sorted(spacing)
    return spacing[-1] > ANISOTROPY * spacing[-2]


def _intensity(fingerprint: dict, channels: dict[str, str]) -> tuple[dict, str]:
    kinds = {name.strip().upper() for name in channels.values()}
    if kinds == {"CT"} and len(channels) == 1:
        props = fingerprint["foreground_intensity_properties_per_channel"]["0"]
        if props["std"] is not None and props["std"] > 0:
            return ({"kind": "ct_zscore", "a_min": round(props["percentile_00_5"], 3), "a_max": round(props["percentile_99_5"], 3),
                     "mean": round(props["mean"], 4), "std": round(props["std"], 4)},
                    "dataset.json names the modality CT: nnU-Net's CT normalisation, clipped to the foreground's 0.5..99.5 "
                    "percentiles, z-scored with its mean and std")
    return {"kind": "zscore_foreground"}, f"{_named(channels)}: z-scored per case over its foreground"


def _named(channels: dict[str, str]) -> str:
    """What ``dataset.json`` says of the modality, as a plan's reason quotes it."""
    return f"dataset.json names {', '.join(sorted(set(channels.values())))}" if channels else \
        "dataset.json names no modality (channel_names / modality)"


def _norm(channels: dict[str, str], dims: int) -> tuple[str, str]:
    if channels and {name.strip().upper() for name in channels.values()} == {"CT"}:
        return "batch", "CT intensities are absolute (HU): batch norm, folded into the convolutions at inference"
    if dims == 3:
        return "batch", f"{_named(channels)}, but 3D patches: batch norm (instance norm over the deep stages' few voxels " \
                        "lost 3D Dice on MRI: 0.826 against 0.901-0.914)"
    return "instance", f"{_named(channels)}: instance norm, robust to another scanner's intensity scale and bias field (1.35-1.8x batch norm's " \
                       "inference time on a CPU)"


def _roi(median_shape: Sequence[float], budget: int) -> list[int]:
    """The median shape rounded up to whole multiples of :data:`ROI_STEP` (a median case fits one
    crop, as nnU-Net pads its patch to the network's divisor), shrunk along its longest side
    while it holds more than ``budget`` voxels."""
    roi = [max(ROI_STEP, ROI_STEP * math.ceil(float(s) / ROI_STEP - 1e-6)) for s in median_shape]
    while math.prod(roi) > budget and max(roi) > ROI_STEP:
        roi[int(np.argmax(roi))] -= ROI_STEP
    return roi


def make_plan(fingerprint: dict, channels: dict[str, str], samples_per_case: int, training_cases: int,
              device: str = "cpu", device_memory: int = 0, mode: str | None = None) -> dict:
    """The plan of a dataset (module docstring): every planned value and its reason.

    Args:
        fingerprint: :func:`~hsmla_med.data.fingerprint.compute_fingerprint`'s document.
        channels: :func:`modality` of the dataset JSON.
        samples_per_case: the config's crops per case and step (``data.samples_per_case``).
        training_cases: the training cases of the fold (a batch holds no more cases).
        device: ``cpu`` or ``gpu`` (the trainer's accelerator); ``device_memory`` its bytes.
        mode: ``2d`` or ``3d`` where the config sets it: the batch is planned for that mode's
            crops (``None``: for the planned mode).

    Returns ``{"values": {key: value}, "reasons": {key: str}, "median_shape": [x, y, z]}``,
    keys as in :data:`PLANNED`.
    """
    spacings = np.asarray(fingerprint["spacings"], dtype=np.float64)
    shapes = np.asarray(fingerprint["shapes_after_crop"], dtype=np.float64)
    spacing, spacing_reason = _target_spacing(spacings, shapes)
    median_shape = np.median(shapes * spacings / spacing, axis=0)
    intensity, intensity_reason = _intensity(fingerprint, channels)
    if _anisotropic(spacing):
        planned_mode, mode_reason = "2d", f"anisotropic ({max(spacing):.3g} mm slices, {min(spacing):.3g} mm pixels): 2D, as nnU-Net does"
    elif device == "cpu":
        planned_mode, mode_reason = "2d", "a CPU trains 2D several times faster per step than 3D; set mode: 3d for volumetric context"
    else:
        planned_mode, mode_reason = "3d", "near-isotropic data on a GPU: 3D patches"
    roi_2d = _roi(median_shape[:2], PATCH_BUDGET[device, 2])
    roi_3d = _roi(median_shape, PATCH_BUDGET[device, 3])
    dims = 2 if (mode or planned_mode) == "2d" else 3
    roi = roi_2d if dims == 2 else roi_3d
    norm, norm_reason = _norm(channels, dims)
    scale = max(1, device_memory // GPU_MEMORY_UNIT) if device == "gpu" else 1
    budget = CROPS_PER_STEP[dims] * PATCH_BUDGET[device, dims] * scale
    batch = int(min(MAX_BATCH, max(1, training_cases), max(1, budget // (samples_per_case * math.prod(roi)))))
    shape_text = " x ".join(f"{s:.0f}" for s in median_shape)
    roi_reason = f"the median shape after cropping at the planned spacing ({shape_text}), in multiples of {ROI_STEP}, " \
                 f"within {PATCH_BUDGET[device, 2]:,} (2D) / {PATCH_BUDGET[device, 3]:,} (3D) voxels on a {device.upper()}"
    return {
        "values": {"data.spacing": [round(float(s), 5) for s in spacing], "data.intensity": intensity, "norm": norm, "mode": planned_mode,
                   "data.roi_size_2d": roi_2d, "data.roi_size_3d": roi_3d, "data.batch_size": batch},
        "reasons": {"data.spacing": spacing_reason, "data.intensity": intensity_reason, "norm": norm_reason, "mode": mode_reason,
                    "data.roi_size_2d": roi_reason, "data.roi_size_3d": roi_reason,
                    "data.batch_size": f"{samples_per_case} crops per case, about {CROPS_PER_STEP[dims] * scale} budget-sized "
                                       f"{dims}D crops per step, at most {min(MAX_BATCH, training_cases)} cases"},
        "median_shape": [round(float(s), 1) for s in median_shape],
    }


def _parent(config: dict, key: str) -> tuple[dict, str]:
    """The mapping that holds a dotted ``key`` of ``config``, and the key's last name."""
    section, _, name = key.rpartition(".")
    return (config[section] if section else config), name


def _get(config: dict, key: str):
    target, name = _parent(config, key)
    return target[name]


def _is_auto(value) -> bool:
    return value == "auto" or isinstance(value, dict) and value.get("kind") == "auto"


def apply_plan(config: dict, plan: dict) -> list[str]:
    """Fill the ``auto`` values of ``config`` (in place) from ``plan``; returns the planned
    keys the config set itself (kept)."""
    kept = []
    for key, value in plan["values"].items():
        target, name = _parent(config, key)
        if not _is_auto(target[name]):
            kept.append(key)
        elif isinstance(value, dict):
            target[name] = {**target[name], **value}
        else:
            target[name] = value
    return kept


def _shown(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items())
    return str(value)


def plan_lines(plan: dict, kept: Sequence[str], config: dict, source: str) -> list[str]:
    """The plan as printed at the start of training: one line per key, its value and why (or
    the config's value, kept)."""
    lines = [f"plan ({source}):"]
    for key in plan["values"]:
        if key in kept:
            lines.append(f"  {key:<17} {_shown(_get(config, key))}   (set in the config; planned: {_shown(plan['values'][key])})")
        else:
            lines.append(f"  {key:<17} {_shown(plan['values'][key])}   ({plan['reasons'][key]})")
    return lines


def _device(trainer: dict) -> tuple[str, int]:
    """``cpu`` or ``gpu`` as the trainer's accelerator will run, and the GPU's memory in bytes."""
    import torch

    accelerator = str(trainer.get("accelerator", "auto")).lower()
    if accelerator in ("gpu", "cuda") or accelerator == "auto" and torch.cuda.is_available():
        if torch.cuda.is_available():
            return "gpu", int(torch.cuda.get_device_properties(0).total_memory)
    return "cpu", 0


def dataset_fingerprint(config: dict, cases: Datalist) -> tuple[dict, Path]:
    """The fingerprint of the dataset's labelled cases (training and validation lists, whatever
    the fold), from ``dataset_fingerprint.json`` beside the dataset when it was taken of the same
    cases and dataset JSON, else measured now and written there (the run folder for a
    read-only dataset). Returns it and its file."""
    root = cases.source.parent
    path = beside_dataset(config, root, FINGERPRINT_FILE)
    labelled = cases.training + cases.validation
    source = hashlib.sha256(cases.source.read_bytes()).hexdigest()
    if path.is_file():
        try:
            stored = read_json(path)
        except Exception:  # a damaged file is measured again, not an error
            stored = {}
        if stored.get("version") == FINGERPRINT_VERSION and stored.get("dataset_json_sha256") == source \
                and stored.get("cases") == case_ids(labelled, root):
            return stored, path
    log.info("fingerprint: measuring %d cases of %s", len(labelled), root)
    fingerprint = {**compute_fingerprint(cases, root, seed=0), "dataset_json_sha256": source}
    write_json(path, fingerprint)
    return fingerprint, path


def plan_dataset(config: dict, cases: Datalist, training_cases: int) -> dict | None:
    """Plan the ``auto`` values of ``config`` (in place) from the fingerprint of ``cases``, the
    full dataset (:func:`dataset_fingerprint`), with ``training_cases`` in the fold. Returns
    the plan (``values``, ``reasons``, ``median_shape``, ``kept``: the planned keys the config
    set itself, ``fingerprint``: its file), ``None`` when the config leaves nothing ``auto``."""
    if not any(_is_auto(_get(config, key)) for key in PLANNED):
        return None
    fingerprint, path = dataset_fingerprint(config, cases)
    device, memory = _device(config["trainer"])
    mode = None if _is_auto(config["mode"]) else config["mode"]
    plan = make_plan(fingerprint, modality(read_json(cases.source)), int(config["data"]["samples_per_case"]), training_cases, device,
                     memory, mode)
    plan["kept"] = apply_plan(config, plan)
    plan["fingerprint"] = str(path)
    return plan
