"""EndoVis 2017: robotic surgical instrument segmentation on RGB video frames (PNG).

What is specific to the benchmark lives here: the dataset (the challenge's
``instrument_dataset_K`` folders, or the synthetic default), split into training and validation
by video (frames of one video are near-duplicates, so a frame-level split would leak), MONAI
transforms on the cropped frames resized to ``data.size``, writing PNG masks in each input
frame's own geometry, and scoring mask PNGs of any tool against a dataset's labels at each
frame's own size (:func:`score_predictions`, by the reference evaluation's per-frame rule).
Reading, the crop and the label conventions are :mod:`hsmla_med.data.endovis`'s; the loop,
checkpoints and the frame module (:class:`~hsmla_med.engine.segmentation.FrameSegmentationModule`,
Dice and IoU at each frame's original size) are the engine's.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Sequence
from functools import partial
from pathlib import Path

import numpy as np
import torch
from monai.transforms import Compose, RandFlipd, RandScaleIntensityd, RandShiftIntensityd, RandZoomd, Resized
from PIL import Image

from hsmla_med.data.datalist import Datalist
from hsmla_med.data.endovis import (EMPTY_TRUTH, PROBLEMS, VIDEO_FOLDER, LoadFramed, crop_box, empty_truth_videos, find_frames, find_videos,
                                    load_frame, merge_labels, read_label)
from hsmla_med.data.intensity import intensity_augmentations
from hsmla_med.data.splits import fold_cases, other_dataset
from hsmla_med.data.synthetic.endovis import generate_endovis
from hsmla_med.engine.base import hparams, plain
from hsmla_med.engine.datamodule import CaseDataModule
from hsmla_med.engine.segmentation import FrameSegmentationModule
from hsmla_med.errors import ConfigError, DataError, InputError
from hsmla_med.io import atomic_path, is_temporary, write_json
from hsmla_med.metrics import frame_confusion, frame_reference_scores, frame_scores, summarize_frames
from hsmla_med.metrics.summary import bootstrap_means
from hsmla_med.pipelines.task import BundleParts, InferenceOptions, Task, predict_cases, synthetic_root

VIDEO_PREFIX = "instrument_dataset_"  # the video folders, instrument_dataset_K: the case IDs of the splits

log = logging.getLogger("hsmla_med")

__all__ = ["TASK", "datalist", "transforms", "datamodule", "module_config", "held_out", "infer", "inference_box", "bundle", "score_predictions",
           "crossval_score"]


def _problem(config: dict) -> str:
    problem = config["data"]["problem"]
    if problem not in PROBLEMS:
        raise ConfigError(f"data.problem must be one of {', '.join(PROBLEMS)}, got {problem!r}")
    return problem


def datalist(config: dict) -> Datalist:
    """Frames of the user's folder or of the synthetic default (generated once into
    ``cache_dir``, logged as synthetic). Training and validation are labelled videos: those in
    whole videos of fold ``config["fold"]`` in ``splits_final.json`` (:func:`~hsmla_med.data.splits.fold_cases`;
    ``data.validation_videos`` make fold 0) are validation; the frames of unlabelled videos
    (the challenge's test set) are ``test``.

    A labelled video without an instrument in any ground-truth frame
    (:func:`~hsmla_med.data.endovis.empty_truth_videos`) is warned about by name; in
    validation its frames are not scored (the reason is :func:`score_predictions`'s), and a
    fold whose every validation video is such is refused. In training its frames stay, as all
    background, since they may be true negatives; the warning says so."""
    data = config["data"]
    problem = _problem(config)
    root, synthetic = data["data_dir"], False
    if not root:
        root = synthetic_root(data, "endovis", "EndoVis 2017-format frames", "drawn instruments, not surgery",
                              lambda root: generate_endovis(root, **data["synthetic"]))
        synthetic = True
    videos = find_videos(root)
    labelled = [v["video"] for v in videos if v["labelled"]]
    if len(labelled) < 2 and not other_dataset(config, [f"{VIDEO_PREFIX}{k}" for k in labelled]):
        raise DataError(f"{root}: need at least two videos with ground_truth to hold one out for validation, found {len(labelled)}")
    fixed = {}
    if data["validation_videos"]:
        held = {int(k) for k in data["validation_videos"]}
        if not held <= set(labelled) or held == set(labelled):
            raise ConfigError(f"data.validation_videos {sorted(held)} must be some, not all, of the labelled videos {labelled} in {root}")
        fixed = {f"{VIDEO_PREFIX}{k}": 0 for k in held}
    ids = [f"{VIDEO_PREFIX}{k}" for k in labelled]  # the video folders: their frames stay together
    record = fold_cases(config, Path(root), labelled, ids, synthetic, fixed=fixed)[2]
    held = {int(i[len(VIDEO_PREFIX):]) for i in record["val"]}
    empty = empty_truth_videos(videos, problem)
    for k, folder in empty.items():
        role = ("not scored in validation (each frame would count Dice 1 for predicting nothing)" if k in held
                else "its frames train as all background")
        log.warning("%s: %s for the %s task: %s; if its labels are missing, add them or move the video out of %s",
                    folder, EMPTY_TRUTH, problem, role, root)
    scored = held - set(empty)
    if held and not scored:
        raise DataError(f"{root}: validation video(s) {', '.join(f'{VIDEO_PREFIX}{k}' for k in sorted(held))}: {EMPTY_TRUTH}, "
                        f"nothing to validate on; name others in data.validation_videos or add their labels")
    pick = lambda keep: [c for v in videos for c in v["frames"] if keep(v)]  # noqa: E731
    return Datalist(
        PROBLEMS[problem],
        pick(lambda v: v["labelled"] and v["video"] not in held),
        pick(lambda v: v["video"] in scored),
        pick(lambda v: not v["labelled"]),
        Path(root),
        synthetic,
        record,
    )


def transforms(config: dict) -> tuple[Compose, Compose]:
    """Training and validation transforms: read, crop and merge the labels
    (:class:`~hsmla_med.data.endovis.LoadFramed`), resize to ``data.size`` (area for the frame,
    nearest for the training labels); training adds flips, zoom, per-channel colour scale and
    shift, and nnU-Net's intensity and resolution augmentations on the frame
    (:func:`~hsmla_med.data.intensity.intensity_augmentations`). Validation keeps each frame's
    original label and its crop ``box``: frames are scored at their own size, as ``infer``
    writes them (:meth:`~hsmla_med.engine.segmentation.FrameSegmentationModule.labels_in_frame`)."""
    data, keys = config["data"], ["image", "label"]
    aug = data["augment"]
    load = [LoadFramed(_problem(config), data["crop"]), Resized(keys, spatial_size=data["size"], mode=["area", "nearest-exact"])]
    validation = [LoadFramed(_problem(config), data["crop"], whole_label=True), Resized("image", spatial_size=data["size"], mode="area")]
    train = load + [
        RandFlipd(keys, prob=aug["flip_prob"], spatial_axis=0),
        RandFlipd(keys, prob=aug["flip_prob"], spatial_axis=1),
        RandZoomd(keys, prob=aug["zoom_prob"], min_zoom=aug["zoom_range"][0], max_zoom=aug["zoom_range"][1], mode=["bilinear", "nearest-exact"], keep_size=True),
        RandScaleIntensityd("image", factors=aug["colour_scale"], prob=aug["colour_prob"], channel_wise=True),
        RandShiftIntensityd("image", offsets=aug["colour_shift"], prob=aug["colour_prob"], channel_wise=True),
        *intensity_augmentations(aug, spatial_dims=2),
    ]
    return Compose(train), Compose(validation)


def datamodule(config: dict, cases: Datalist) -> CaseDataModule:
    train, val = transforms(config)
    data = config["data"]
    return CaseDataModule(cases.training, cases.validation, train, val, data["batch_size"], data["num_workers"], data["cache_rate"])


def module_config(config: dict, model: dict, label_names: list[str], in_channels: int = 3) -> dict:
    """The hyper-parameters of :class:`FrameSegmentationModule` for this task config; the
    inference window is the whole resized frame (``data.size``)."""
    data = config["data"]
    inference = {**config["inference"], "roi_size": list(data["size"]), "slab": 1}
    return hparams(config, model, label_names, 2, in_channels, inference, {"problem": _problem(config), "crop": data["crop"], "size": list(data["size"])})


def held_out(cases: Datalist) -> list[str]:
    """The inputs ``demo`` segments after training: the folders of the validation and test videos."""
    folders = {str(Path(c["image"]).parent.parent) for c in cases.validation + cases.test}
    return sorted(folders)


def output_path(frame: Path, output: Path) -> Path:
    """``output/instrument_dataset_K/frameNNN.png`` for a frame in the challenge layout (frame
    names repeat across videos), ``output/<name>.png`` otherwise."""
    video = frame.parent.parent.name
    if frame.parent.name == "left_frames" and VIDEO_FOLDER.match(video):
        return output / video / f"{frame.stem}.png"
    return output / f"{frame.stem}.png"


def inference_box(shape: tuple[int, int], crop, mode: str, path: Path) -> tuple[int, int, int, int]:
    """The part ``(top, left, h, w)`` of a frame of ``shape`` that inference segments: with
    ``mode="auto"`` the training ``crop`` for frames large enough for it (the challenge's raw
    1080 x 1920 frames) or of exactly its size, the whole frame for any other size (another
    endoscope's 1280 x 720, say); with ``"none"`` always the whole frame."""
    if mode == "none" or crop is None:
        return 0, 0, int(shape[0]), int(shape[1])
    top, left, height, width = (int(v) for v in crop)
    if shape[0] < top + height or shape[1] < left + width:
        if tuple(shape) != (height, width):
            return 0, 0, int(shape[0]), int(shape[1])
    return crop_box(shape, crop, path)


class FrameForInference:
    """Loader transform of an inference item: its frame's :func:`inference_box`, resized to the
    network's input (``data.size``), with the box and the frame's shape for the writer."""

    def __init__(self, crop, mode: str, size) -> None:
        self.crop, self.mode = crop, mode
        self.resize = Resized("image", spatial_size=size, mode="area")

    def __call__(self, item: dict) -> dict:
        whole, _, shape = load_frame(item["frame"], None)
        top, left, h, w = inference_box(shape, self.crop, self.mode, Path(item["frame"]))
        image = plain(self.resize({"image": whole[:, top : top + h, left : left + w]})["image"])
        return {**item, "image": image, "box": (top, left, h, w), "shape": tuple(int(v) for v in shape)}


def infer(
    module: FrameSegmentationModule, inputs: str | Path | Iterable[str | Path], output: str | Path, options: InferenceOptions = InferenceOptions()
) -> list[Path]:
    """Segment frames of any size and write one PNG mask per frame (uint8 class index,
    :data:`PROBLEMS` order) at the input frame's size, and report frames per second; in
    Lightning's predict loop (:func:`predict_cases`: frames split over processes and shards,
    frames with a mask skipped).

    ``inputs``: frame PNGs, folders of them, video folders or a dataset root
    (:func:`~hsmla_med.data.endovis.find_frames`). Each frame is cropped as :func:`inference_box`
    says (a raw 1080 x 1920 challenge frame to its 1024 x 1280 training window; ``options.crop``
    ``none`` never crops), resized to ``data.size``; the class probabilities are resized back
    to the crop (bilinear) before the argmax, and the crop is placed into the frame's geometry
    with background (0) outside it, so the mask overlays the input frame pixel for pixel.
    ``options.tta`` averages over mirrored frames.
    """
    cfg, output = module.config, Path(output)
    inference = options.apply(cfg["inference"])
    frames = [f for p in ([inputs] if isinstance(inputs, (str, Path)) else inputs) for f in find_frames(p)]
    items = []
    for frame in frames:
        path = output_path(frame, output)
        items.append({"name": str(path.relative_to(output)), "frame": str(frame), "output": path})

    # per video (instrument_dataset_K, or the folder of loose frames) and its output folder: the
    # frames this process segmented, and their seconds (each since the write before it)
    videos: dict[tuple[str, Path], tuple[int, float]] = {}
    clock = time.perf_counter()

    def write(case: dict) -> list[Path]:
        nonlocal clock
        mask = module.labels_in_frame(case["probs"], case["box"], case["shape"]).numpy()
        case["output"].parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(case["output"]) as tmp:
            Image.fromarray(mask).save(tmp, format="PNG")
        now = time.perf_counter()
        key = (Path(case["name"]).parent.name or Path(case["frame"]).parent.name, case["output"].parent)
        count, seconds = videos.get(key, (0, 0.0))
        videos[key], clock = (count + 1, seconds + now - clock), now
        return [case["output"]]

    transform = FrameForInference(cfg["data"]["crop"], options.crop, cfg["data"]["size"])
    written = predict_cases(module, items, transform, write, options, folder=output, settings=inference)
    for (video, folder), (count, seconds) in videos.items():
        options.progress(f"{video}: {count} frame(s) segmented by this process, {count / seconds:.2f} frames/s "
                         f"({options.device}, input {cfg['data']['size']}) -> {folder}")
    return written


def bundle(config: dict) -> BundleParts:
    """``export --format bundle``: EndoVis's parts of a MONAI Bundle of a module ``config``
    (:mod:`hsmla_med.export.bundle`): :func:`infer`'s steps as MONAI config items
    (:func:`_bundle_inference`), PNG frames in, PNG masks out. The crop is the function ``infer``
    calls (:func:`inference_box`), so the bundle needs ``hsmla_med``."""
    return BundleParts(
        imports=["$import functools", "$import re", "$from PIL import Image as PILImage", "$from hsmla_med.pipelines.endovis import inference_box"],
        inference=partial(_bundle_inference, config),
        written="frame(s) segmented; masks",
        description="HSMLA segmentation of surgical instrument frames (EndoVis 2017 PNG), trained with hsmla-med on task endovis.",
        image={"type": "image", "format": "RGB", "modality": "regular", "num_channels": config["in_channels"], "channel_def": {"0": "R", "1": "G", "2": "B"}},
        packages={"pillow": "PIL"},
        needs_hsmla=True,
        inputs="a folder of PNG frames (searched recursively; label folders skipped)",
        outputs="`OUT/<path relative to IN>.png`, uint8 class index at each frame's size, background outside the crop",
    )


def _bundle_inference(config: dict, size: Sequence[int]) -> dict:
    """The bundle's frames as :func:`infer` segments them with ``--crop auto``, the network's
    input of ``size``: the training crop for frames large enough for it, frames of exactly the
    crop's size and of other sizes whole (:func:`inference_box`); area resize to ``size``;
    probabilities resized back bilinearly and placed in the frame with background outside the
    box; one PNG per frame, named as ``infer`` names them (:func:`output_path`)."""
    crop = None if config["data"]["crop"] is None else [int(v) for v in config["data"]["crop"]]
    h, w = (int(v) for v in size)
    return {
        "datalist": "$sorted(p for p in glob.glob(@dataset_dir + '/**/*.png', recursive=True) if 'ground_truth' not in p and not os.path.basename(p).startswith('.'))",
        # (top, left, height, width) of the part of a frame of shape (H, W) that is segmented: the
        # function infer calls, so that the rule is written once
        "box": f"$functools.partial(inference_box, crop={crop!r}, mode='auto')",
        "read": "$lambda f: torch.from_numpy(numpy.asarray(PILImage.open(f).convert('RGB')).transpose(2, 0, 1).copy()).float().div_(255.0)",
        "cut": "$lambda d, x, b: {**d, 'shape': tuple(x.shape[1:]), 'box': b, 'image': x[:, b[0]:b[0] + b[2], b[1]:b[1] + b[3]]}",
        "load": "$lambda d: (lambda x: @cut(d, x, @box(x.shape[1:], path=d['image'])))(@read(d['image']))",
        "preprocessing": {
            "_target_": "Compose",
            "transforms": [
                "@load",
                {"_target_": "Resized", "keys": "image", "spatial_size": [h, w], "mode": "area"},
                {"_target_": "EnsureTyped", "keys": "image", "dtype": "$torch.float32", "track_meta": False},
            ],
        },
        "dataset": {"_target_": "Dataset", "data": "$[{'image': i, 'frame': i} for i in @datalist]", "transform": "@preprocessing"},
        # the window is the whole resized frame
        "inferer": {"_target_": "SimpleInferer"},
        "output_path": ("$lambda f: os.path.join(@output_dir, *([os.path.basename(os.path.dirname(os.path.dirname(f)))] "
                        "if os.path.basename(os.path.dirname(f)) == 'left_frames' and re.match(r'^instrument_dataset_(\\d+)$', "
                        "os.path.basename(os.path.dirname(os.path.dirname(f)))) else []), os.path.splitext(os.path.basename(f))[0] + '.png')"),
        "mask": ("$lambda d: torch.nn.functional.pad(torch.nn.functional.interpolate(d['pred'][None].float(), size=d['box'][2:], mode='bilinear', "
                 "align_corners=False).argmax(1)[0].to(torch.uint8), (d['box'][1], d['shape'][1] - d['box'][1] - d['box'][3], d['box'][0], "
                 "d['shape'][0] - d['box'][0] - d['box'][2]))"),
        "save": "$lambda d: (os.makedirs(os.path.dirname(@output_path(d['frame'])), exist_ok=True), PILImage.fromarray(@mask(d).numpy()).save(@output_path(d['frame'])))",
        "postprocessing": {
            "_target_": "Compose",
            "transforms": [{"_target_": "Activationsd", "keys": "pred", "softmax": True}, "@save"],
        },
    }


TERNAUSNET_FACTORS = {"binary": 255, "parts": 85, "type": 32}
"""The grey value per class of TernausNet's masks (``prepare_data.py``: ``binary_factor``,
``parts_factor``, ``instrument_factor``): its binary predictions are ``sigmoid * 255``, read as
instrument above ``255 * 0.5`` (``evaluate.py``)."""


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


def crossval_score(folds: list[tuple[Datalist, Path]], output: Path, config: dict) -> dict:
    """Every fold's validation masks (``instrument_dataset_K/frameNNN.png``, whole videos per
    fold) linked into ``output/predictions`` and scored at each frame's size against the dataset."""
    from hsmla_med.crossval import pool_file

    for _, folder in folds:
        for mask in folder.glob(f"{VIDEO_PREFIX}*/*.png"):
            if not is_temporary(mask):
                pool_file(mask, output / "predictions" / mask.parent.name / mask.name)
    return score_predictions(output / "predictions", folds[0][0].source, output, {"problem": config["data"]["problem"]})


def score_predictions(predictions: Path, labels: Path, output: Path, options: dict) -> dict:
    """``evaluate --task endovis --predictions DIR --labels DATA_DIR``: score mask PNGs against
    the ground truth of an EndoVis 2017 dataset folder (:func:`~hsmla_med.data.endovis.find_videos`),
    each at its frame's own size, and write ``summary.json`` into ``output`` (atomically).

    ``predictions`` holds ``instrument_dataset_K/frameNNN.png`` (the layout ``infer`` writes, and
    TernausNet's ``generate_masks.py`` writes for one problem); each mask is matched to frame
    ``frameNNN.png`` of video K, whose labels are merged for ``options["problem"]`` (``binary``
    by default, ``parts``, ``type``) as in training. Masks hold class indices (``infer``'s uint8
    masks), or, for the whole folder, TernausNet's grey values (:data:`TERNAUSNET_FACTORS`). A
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
    problem = options.get("problem") or "binary"
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


def _frames_summary(rows: list[dict], problem: str, draws: int = 1000, seed: int = 0) -> dict:
    """The ``summary.json`` document of :func:`score_predictions` from its per-frame rows."""
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


class EndoVis(Task):
    """EndoVis 2017 instrument segmentation: PNG frames, PNG masks."""

    name = "endovis"
    module_class = FrameSegmentationModule
    in_channels = 3

    def score_lines(self, summary: dict, output: Path) -> list[str]:
        fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
        rule, means = summary["reference_rule"], summary["foreground_mean"]
        return [f"{rule['frames']} frames ({summary['problem']}): Dice {fmt(rule['Dice'])}, IoU {fmt(rule['IoU'])} "
                f"(per-frame means, the reference evaluation's rule); mean of the class means: Dice {fmt(means['Dice'])}, IoU {fmt(means['IoU'])}",
                f"summary: {output / 'summary.json'}"]


TASK = EndoVis()
