"""Post-processing chosen on validation, as nnU-Net's ``determine_postprocessing``
(``nnunetv2/postprocessing/remove_connected_components.py``) chooses it.

On the pooled validation label maps of a cross-validation and their references,
:func:`choose_postprocessing` tries, in nnU-Net's order:

1. keeping the largest connected component of all foreground classes together (the voxels of
   every other component become background);
2. then, when there is more than one foreground class, keeping the largest connected component
   of each class alone, class by class, on the result of step 1 where step 1 was kept.

A step is kept when the foreground mean Dice rises (strictly) and no class's mean Dice falls.
For a per-class step only that class changes (the voxels it removes become background, which no
other class's Dice counts), so this is nnU-Net's rule there too: that class's mean Dice rises.
For the same reason the per-class decisions do not depend on each other, and each is taken on
the result of step 1 alone.

Dice per case and class is nnU-Net's (``2 TP / (2 TP + FP + FN)``, undefined when the class is in
neither map); its means follow :mod:`hsmla_med.metrics.summary` (cases without a value skipped;
the foreground mean over the classes with one). The component operation is MONAI's
``KeepLargestConnectedComponent`` (full connectivity: 26 neighbours in 3D, as nnU-Net's
``skimage.measure.label`` default; of two largest components of equal size, MONAI keeps one
and nnU-Net both).

The choice goes into ``postprocessing.json`` (what was tried, the Dice before and after, what was
kept); :func:`apply_postprocessing` applies its kept steps to a label map (``infer`` does it for
every BTCV output, :func:`read_postprocessing`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from monai.transforms import KeepLargestConnectedComponent

# (private helpers of the folder evaluator, reused so pairing, geometry checks, label values and
# the dataset JSON's classes are read exactly as evaluate --predictions reads them)
from hsmla_med.evaluation.segmentation import _dataset_labels, _foreground, check_geometry, pair_files, read_labels
from hsmla_med.errors import DataError
from hsmla_med.io import write_json
from hsmla_med.metrics.summary import _nanmean

__all__ = ["FORMAT", "NAME", "apply_postprocessing", "beside_checkpoints", "choose_postprocessing", "read_postprocessing"]

log = logging.getLogger("hsmla_med")

FORMAT = 1  # version of postprocessing.json's layout
NAME = "postprocessing.json"
_FOLD = re.compile(r"fold_\d+")  # cross-validate's folder of one fold: OUTPUT/fold_K
RULE = ("nnU-Net's determine_postprocessing: keep the largest connected component (MONAI KeepLargestConnectedComponent, full "
        "connectivity) of all foreground classes together, then of each class; a step is kept when the foreground mean Dice "
        "rises and no class's mean Dice falls")


def _keep_largest(label_map: np.ndarray, labels: Sequence[int]) -> np.ndarray:
    """``label_map`` with the voxels of ``labels`` outside their (joint) largest connected
    component set to background (0); a new array, the input is left as it is."""
    transform = KeepLargestConnectedComponent(applied_labels=[int(c) for c in labels], is_onehot=False, independent=False)
    # MONAI changes the tensor it is given in place (and numpy input shares its memory): a copy,
    # as int64 where torch lacks the operations on the map's type (uint16, uint32, uint64)
    unsupported = label_map.dtype.kind == "u" and label_map.dtype != np.uint8
    work = label_map.astype(np.int64) if unsupported else label_map.copy()
    return np.asarray(transform(torch.from_numpy(work)[None]))[0].astype(label_map.dtype, copy=False)


def apply_postprocessing(label_map: np.ndarray, spec: dict | Sequence[dict] | None) -> np.ndarray:
    """``label_map`` (integer classes, any number of dims) after the kept steps of ``spec``: a
    ``postprocessing.json`` document or its ``kept`` list, each step ``{"labels": [...]}``
    keeping the largest connected component of those classes together. ``None`` or no step:
    the map as it is."""
    steps = spec.get("kept", []) if isinstance(spec, dict) else spec or []
    for step in steps:
        label_map = _keep_largest(label_map, step["labels"])
    return label_map


def _counts(reference: np.ndarray, prediction: np.ndarray, classes: Sequence[int]) -> dict[int, tuple[int, int, int]]:
    """``(TP, FP, FN)`` of each class, from one joint histogram of the two maps."""
    size = int(max(reference.max(initial=0), prediction.max(initial=0), *classes)) + 1
    joint = np.bincount(reference.ravel().astype(np.int64) * size + prediction.ravel(), minlength=size * size).reshape(size, size)
    return {c: (int(joint[c, c]), int(joint[:, c].sum() - joint[c, c]), int(joint[c, :].sum() - joint[c, c])) for c in classes}


def _dice_means(counts: list[dict[int, tuple[int, int, int]]], classes: Sequence[int]) -> dict:
    """Mean Dice per class over the cases (a class missing from a case's counts is in neither of
    its maps), and their foreground mean; NaN as ``None``."""
    table = np.array([[_dice(*case.get(c, (0, 0, 0))) for c in classes] for case in counts], dtype=np.float64)
    means = _nanmean(table, axis=0)
    foreground = _nanmean(means, axis=0)
    plain = lambda v: None if np.isnan(v) else float(v)  # noqa: E731
    return {"mean": {str(c): plain(m) for c, m in zip(classes, means, strict=True)}, "foreground_mean": plain(foreground)}


def _dice(tp: int, fp: int, fn: int) -> float:
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else float("nan")


def _improves(before: dict, after: dict) -> bool:
    """nnU-Net's test: the foreground mean rises and no class's mean falls (an undefined mean
    neither rises nor falls)."""
    if before["foreground_mean"] is None or after["foreground_mean"] is None or not after["foreground_mean"] > before["foreground_mean"]:
        return False
    return not any(a is not None and b is not None and a < b for a, b in ((after["mean"][k], before["mean"][k]) for k in before["mean"]))


def choose_postprocessing(predictions_dir: str | Path, labels_dir: str | Path, output_json: str | Path,
                          dataset_json: str | Path | None = None) -> dict:
    """Choose the post-processing of a model on its pooled validation predictions (see the module
    docstring) and write it to ``output_json`` atomically.

    Args:
        predictions_dir: NIfTI label maps (the validation predictions of every fold).
        labels_dir: the reference label maps, paired by file name (or through ``dataset_json``'s
            image names, as ``evaluate --predictions``).
        output_json: where ``postprocessing.json`` goes (beside the checkpoints, for ``infer``).
        dataset_json: its ``labels`` are the foreground classes (default: the values found).

    Returns:
        The document written: ``tried`` (each step: ``labels``, ``scope``, ``dice_before``,
        ``dice_after`` with the per-class and foreground means, ``kept``), ``kept`` (the steps
        :func:`apply_postprocessing` applies), ``dice`` (``before``: the predictions as given,
        ``after``: with the kept steps) and the inputs.
    """
    predictions, labels = Path(predictions_dir), Path(labels_dir)
    spec, aliases = _dataset_labels(Path(dataset_json)) if dataset_json is not None else (None, {})
    names, allowed = (spec.names, spec.allowed) if spec is not None else (None, None)
    pairs = pair_files(predictions, labels, aliases)
    check_geometry(pairs)

    # pass 1: the predictions as given, and with the largest component of all their foreground
    # (without a dataset JSON the classes are those found; a case's own values are all that its
    # joint component can hold)
    found, given, joint = set(names or ()), [], []
    for reference, prediction in pairs:
        ref, pred = read_labels(reference), read_labels(prediction)
        mine = sorted(set(names or ()) | _foreground(reference, ref, allowed, dataset_json) | _foreground(prediction, pred, allowed, dataset_json))
        found |= set(mine)
        given.append(_counts(ref, pred, mine))
        joint.append(_counts(ref, _keep_largest(pred, mine), mine))
    classes = sorted(found)
    if not classes:
        raise DataError(f"--labels {labels}: no foreground label in any label map or prediction")
    before, after = _dice_means(given, classes), _dice_means(joint, classes)
    first = {"labels": classes, "scope": "foreground", "dice_before": before, "dice_after": after, "kept": _improves(before, after)}
    log.info("post-processing: largest foreground component %s (foreground Dice %s -> %s)",
             "kept" if first["kept"] else "rejected", before["foreground_mean"], after["foreground_mean"])
    source = joint if first["kept"] else given
    tried, final = [first], [dict(case) for case in source]

    # pass 2: each class's largest component on the result of step 1 (the decisions are independent)
    if len(classes) > 1:
        alone = {c: [] for c in classes}  # a class's counts after its own step, case by case
        for reference, prediction in pairs:
            ref, pred = read_labels(reference), read_labels(prediction)
            pred = _keep_largest(pred, classes) if first["kept"] else pred
            for c in classes:
                alone[c].append(_counts(ref, _keep_largest(pred, [c]), [c])[c])
        base = _dice_means(source, classes)
        for c in classes:
            candidate = _dice_means([{**case, c: counts} for case, counts in zip(source, alone[c], strict=True)], classes)
            tried.append({"labels": [c], "scope": "class", "dice_before": base, "dice_after": candidate, "kept": _improves(base, candidate)})
            if tried[-1]["kept"]:
                for case, counts in zip(final, alone[c], strict=True):
                    case[c] = counts
    document = {
        "format": FORMAT,
        "rule": RULE,
        "predictions": str(predictions),
        "labels": str(labels),
        "dataset_json": None if dataset_json is None else str(dataset_json),
        "cases": len(pairs),
        "classes": {str(c): (names or {}).get(c, str(c)) for c in classes},
        "tried": tried,
        "kept": [{"labels": step["labels"]} for step in tried if step["kept"]],
        "dice": {"before": before, "after": _dice_means(final, classes)},
    }
    write_json(Path(output_json), document)
    return document


def read_postprocessing(path: str | Path) -> list[dict]:
    """The kept steps of a ``postprocessing.json``; a file that is not one (unreadable, another
    layout, steps without integer ``labels``) is one :class:`~hsmla_med.errors.DataError`."""
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"--postprocessing {path}: file not found") from None
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: not a readable postprocessing.json ({err})") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT or not isinstance(document.get("kept"), list):
        raise DataError(f"{path}: not a postprocessing.json of hsmla-med (format {FORMAT}, with a 'kept' list)")
    for step in document["kept"]:
        values = step.get("labels") if isinstance(step, dict) else None
        if not isinstance(values, list) or not values or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
            raise DataError(f"{path}: a kept step {step!r} must have 'labels', a list of foreground classes (integers > 0)")
    return [{"labels": list(step["labels"])} for step in document["kept"]]


def beside_checkpoints(checkpoints: Sequence[str | Path]) -> Path | None:
    """The ``postprocessing.json`` that belongs to ``checkpoints``: in the folder that holds them
    all (``OUTPUT`` for cross-validate's ``OUTPUT/fold_*/last.ckpt``), else, when that is one
    fold's folder ``fold_K``, in the folder above it (a single fold of a cross-validation);
    ``None`` when there is none."""
    folder = Path(os.path.commonpath([Path(c).absolute().parent for c in checkpoints]))
    for candidate in [folder, *([folder.parent] if _FOLD.fullmatch(folder.name) else [])]:
        if (candidate / NAME).is_file():
            return candidate / NAME
    return None
