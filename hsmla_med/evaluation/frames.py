"""EndoVis 2017 instrument masks scored per frame: mask PNGs of any tool (``infer``'s class
indices, or TernausNet's grey values) against a dataset's labels merged for the problem, each
at its frame's own size; per class Dice, IoU and nnU-Net's counts (TP, FP, FN, TN, n_pred,
n_ref), and the per-frame rule of the reference evaluation (``general_dice`` /
``general_jaccard`` of TernausNet's ``evaluate.py``,
:func:`~hsmla_med.metrics.frame_reference_scores`) averaged over the frames, with bootstrap
intervals.

Reading frames, labels and videos is :mod:`hsmla_med.data.endovis`'s; validation scores frames
by the same rule, and ``evaluate --predictions`` reaches :func:`score_frames` through the
pipeline's ``score_predictions``.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import torch

from hsmla_med.data.endovis import EMPTY_TRUTH, PROBLEMS, VIDEO_FOLDER, VIDEO_PREFIX, empty_truth_videos, find_videos, merge_labels, read_label
from hsmla_med.errors import DataError, InputError
from hsmla_med.io import write_json
from hsmla_med.metrics import frame_confusion, frame_reference_scores, frame_scores, summarize_frames
from hsmla_med.metrics.summary import bootstrap_means

__all__ = ["TERNAUSNET_FACTORS", "score_frames"]

log = logging.getLogger("hsmla_med")


TERNAUSNET_FACTORS = {"binary": 255, "parts": 85, "type": 32}
"""The grey value per class of TernausNet's masks (``prepare_data.py``: ``binary_factor``,
``parts_factor``, ``instrument_factor``): its binary predictions are ``sigmoid * 255``, read as
instrument above ``255 * 0.5`` (``evaluate.py``)."""


def score_frames(predictions: Path, labels: Path, output: Path, problem: str = "binary") -> dict:
    """Score mask PNGs against the ground truth of an EndoVis 2017 dataset folder
    (:func:`~hsmla_med.data.endovis.find_videos`), each at its frame's own size, and write
    ``summary.json`` into ``output`` (atomically).

    ``predictions`` holds ``instrument_dataset_K/frameNNN.png`` (the layout ``infer`` writes, and
    TernausNet's ``generate_masks.py`` writes for one problem); each mask is matched to frame
    ``frameNNN.png`` of video K, whose labels are merged for ``problem`` (``binary``, ``parts``,
    ``type``) as in training. Masks hold class indices (``infer``'s uint8 masks), or, for the
    whole folder, TernausNet's grey values (:data:`TERNAUSNET_FACTORS`). A
    mask of another size than its frame's labels, a mask of no labelled frame, or other values
    are a :class:`~hsmla_med.errors.DataError` naming the file. Frames without a mask are not
    scored, nor are the frames of a video without an instrument in any ground-truth frame
    (:func:`~hsmla_med.data.endovis.empty_truth_videos`), which is warned about by name and
    listed in ``excluded_videos``; if no other frame has a mask, there is nothing to score.

    ``summary.json``: ``metric_per_case`` (per frame: the files, ``video``, per class Dice, IoU,
    TP, FP, FN, TN, n_pred, n_ref as nnU-Net counts them, NaN written as null where the class
    is in neither, and ``frame_score``, the frame's Dice and IoU by the reference rule of
    :func:`~hsmla_med.metrics.frame_reference_scores`); ``mean`` (per class, over the frames
    that count it) and ``foreground_mean`` (mean of the class means); ``reference_rule`` (the
    mean over all frames of ``frame_score``: the number to compare with TernausNet's
    ``evaluate.py`` and the papers quoting it, and the ``dice``/``iou`` of validation);
    ``ci95`` (seeded percentile bootstrap of the frames, :func:`~hsmla_med.metrics.summary.bootstrap_means`);
    ``excluded_videos`` (the videos left out for their empty ground truth, above).
    """
    if problem not in PROBLEMS:
        raise InputError(f"--problem must be one of {', '.join(PROBLEMS)}, got {problem!r}")
    names = PROBLEMS[problem]
    videos = [v for v in find_videos(labels) if v["labelled"]]
    frames = {(v["video"], Path(c["image"]).name): c for v in videos for c in v["frames"]}
    masks = _prediction_masks(predictions)
    # A frame whose truth is empty keeps the reference rule: 1 if nothing is predicted, else 0,
    # counted in the mean over frames. The challenge scored IoU per frame and averaged it over
    # the frames (Allan et al., 2019), and evaluate.py of TernausNet (the winning team's public
    # code, the reference followed here) returns 1 for a frame whose truth and prediction are
    # both empty: an instrument may leave the view for a while. A labelled video with no
    # instrument in any frame is another matter: its labels are missing or were lost (the
    # challenge labelled videos of instruments at work), and by that rule each of its frames
    # would add 1.0 for predicting nothing and 0 for finding the instruments it shows. Neither
    # rule speaks of such a video, so it is left out of the means and named in a warning and in
    # the summary.
    empty = empty_truth_videos([v for v in videos if v["video"] in {k for k, _ in masks}], problem)
    for folder in empty.values():
        log.warning("%s: %s for the %s task: its frames are left out of the Dice/IoU means", folder, EMPTY_TRUTH, problem)
    if all(k in empty for k, _ in masks):
        raise DataError(f"--predictions {predictions}: nothing to score: its masks are all of {', '.join(f'{VIDEO_PREFIX}{k}' for k in sorted(empty))}, "
                        f"where {EMPTY_TRUTH} in --labels {labels}")
    scaled = _ternausnet_scale([m for _, m in masks], problem)
    rows = []
    for video, mask_path in masks:
        case = frames.get((video, mask_path.name))
        if case is None:
            raise DataError(f"{mask_path}: no labelled frame instrument_dataset_{video}/left_frames/{mask_path.name} in --labels {labels}")
        if video in empty:
            continue
        truth = merge_labels(case["labels"], problem, frame=case["image"])
        mask = _mask_classes(read_label(mask_path), problem, scaled, mask_path)
        if mask.shape != truth.shape:
            raise DataError(f"{mask_path}: mask is {mask.shape[1]} x {mask.shape[0]} (W x H), the labels of {case['image']} "
                            f"{truth.shape[1]} x {truth.shape[0]}; masks are scored at the frame's own size")
        metrics, frame_score = _score_frame(mask, truth, len(names))
        rows.append({"reference_file": case["image"], "prediction_file": str(mask_path), "video": video, "label_files": case["labels"],
                     "metrics": metrics, "frame_score": frame_score})
    summary = {**_frames_summary(rows, problem), "excluded_videos": [f"{VIDEO_PREFIX}{k}" for k in sorted(empty)]}
    output.mkdir(parents=True, exist_ok=True)
    write_json(output / "summary.json", summary)
    return summary


def _prediction_masks(predictions: Path) -> list[tuple[int, Path]]:
    """``(K, mask)`` for every ``instrument_dataset_K/*.png`` in ``predictions``, in order of K and name."""
    if not predictions.is_dir():
        raise DataError(f"--predictions {predictions}: not a folder; give the folder of instrument_dataset_K/ mask folders that infer writes")
    masks = sorted((int(m.group(1)), p) for d in predictions.iterdir() if d.is_dir() and (m := VIDEO_FOLDER.match(d.name))
                   for p in d.iterdir() if p.suffix.lower() == ".png" and not p.name.startswith("."))
    if not masks:
        raise DataError(f"--predictions {predictions}: no instrument_dataset_K/*.png masks")
    return masks


def _ternausnet_scale(masks: list[Path], problem: str) -> bool:
    """Whether the masks are TernausNet's grey values (:data:`TERNAUSNET_FACTORS`) rather than
    class indices: some mask has a value that is no class index. Decided for the whole folder,
    since a mask of TernausNet's whose values are all low (a binary map below 2/255) would read
    as class indices too."""
    classes = len(PROBLEMS[problem])
    return any(int(read_label(mask).max()) >= classes for mask in masks)


def _mask_classes(mask: np.ndarray, problem: str, scaled: bool, path: Path) -> np.ndarray:
    """A prediction mask's class indices: as they are, or from TernausNet's grey values."""
    if not scaled:
        return mask
    factor = TERNAUSNET_FACTORS[problem]
    if problem == "binary":
        return (mask > 255 * 0.5).astype(np.uint8)
    if (mask % factor).any() or mask.max() >= len(PROBLEMS[problem]) * factor:
        raise DataError(f"{path}: grey values {sorted(set(np.unique(mask).tolist()))[:8]} are neither {problem} class indices "
                        f"0..{len(PROBLEMS[problem]) - 1} nor TernausNet's class x {factor} (as other masks in the folder are)")
    return mask // factor


def _score_frame(prediction: np.ndarray, truth: np.ndarray, classes: int) -> tuple[dict, dict]:
    """Per foreground class Dice, IoU and nnU-Net's counts, and the reference rule's frame score."""
    pred, ref = (torch.from_numpy(np.array(a, dtype=np.uint8))[None, None] for a in (prediction, truth))  # (a copy: PIL arrays are read-only)
    confusion = frame_confusion(pred, ref, classes)[0]
    dice, iou = (v[0].tolist() for v in frame_scores(pred, ref, classes))
    frame_dice, frame_iou = frame_reference_scores(pred, ref, classes)
    metrics = {}
    for c in range(1, classes):
        tp, n_ref, n_pred = int(confusion[c, c]), int(confusion[c].sum()), int(confusion[:, c].sum())
        metrics[str(c)] = {"Dice": _number(dice[c - 1]), "IoU": _number(iou[c - 1]), "TP": tp, "FP": n_pred - tp, "FN": n_ref - tp,
                           "TN": truth.size - n_ref - n_pred + tp, "n_pred": n_pred, "n_ref": n_ref}
    return metrics, {"Dice": float(frame_dice[0]), "IoU": float(frame_iou[0])}


def _number(value: float) -> float | None:
    return None if value is None or math.isnan(value) else float(value)


def _frames_summary(rows: list[dict], problem: str, draws: int = 1000, seed: int = 0) -> dict:
    """The ``summary.json`` document of :func:`score_frames` from its per-frame rows."""
    names = PROBLEMS[problem][1:]
    keys = [str(c) for c in range(1, len(names) + 1)]
    table = {m: np.array([[np.nan if r["metrics"][k][m] is None else r["metrics"][k][m] for k in keys] for r in rows]) for m in ("Dice", "IoU")}
    reference = {m: np.array([r["frame_score"][m] for r in rows]) for m in ("Dice", "IoU")}
    frames = summarize_frames(*(torch.from_numpy(t) for t in (table["Dice"], table["IoU"], reference["Dice"], reference["IoU"])), names)
    class_means = {m: [frames[f"{m.lower()}_per_class"][n] for n in names] for m in ("Dice", "IoU")}
    intervals = {m: bootstrap_means(table[m], draws, seed) for m in table}
    reference_intervals = {m: bootstrap_means(reference[m][:, None], draws, seed)[0][0] for m in reference}
    bounds = lambda pair: [_number(v) for v in pair]  # noqa: E731
    present = {m: [v for v in class_means[m] if v is not None] for m in class_means}
    return {
        "problem": problem,
        "labels": dict(zip(keys, names, strict=True)),
        "metric_per_case": rows,
        "mean": {k: {m: class_means[m][i] for m in class_means} for i, k in enumerate(keys)},
        "foreground_mean": {m: (math.fsum(v) / len(v) if v else None) for m, v in present.items()},
        "reference_rule": {"Dice": frames["dice"], "IoU": frames["iou"], "frames": frames["cases"],
                           "rule": "per frame: mean over the classes in the truth (1 if truth and prediction are empty, 0 if only the "
                                   "truth is); then the mean over frames (general_dice/general_jaccard of TernausNet's evaluate.py)"},
        "ci95": {
            "mean": {k: {m: bounds(intervals[m][0][i]) for m in intervals} for i, k in enumerate(keys)},
            "foreground_mean": {m: bounds(intervals[m][1]) for m in intervals},
            "reference_rule": {m: bounds(reference_intervals[m]) for m in reference_intervals},
        },
        "bootstrap": {"draws": draws, "seed": seed, "confidence": 0.95, "method": "percentile, frames resampled with replacement"},
    }
