"""EndoVis 2017: robotic surgical instrument segmentation on RGB video frames (PNG).

What is specific to the benchmark lives here: the dataset (the challenge's
``instrument_dataset_K`` folders, or the synthetic default), split into training and validation
by video (frames of one video are near-duplicates, so a frame-level split would leak), MONAI
transforms on the cropped frames resized to ``data.size``, writing PNG masks in each input
frame's own geometry, and :func:`score_predictions`, which reads ``evaluate``'s options and
scores mask PNGs of any tool with :func:`~hsmla_med.evaluation.frames.score_frames` (at each
frame's own size, by the reference evaluation's per-frame rule). Reading, the crop and the label conventions are :mod:`hsmla_med.data.endovis`'s; the loop,
checkpoints and the frame module (:class:`~hsmla_med.engine.segmentation.FrameSegmentationModule`,
Dice and IoU at each frame's original size) are the engine's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from functools import partial
from pathlib import Path

from monai.transforms import Compose, RandFlipd, RandScaleIntensityd, RandShiftIntensityd, RandZoomd, Resized
from PIL import Image

from hsmla_med.data.datalist import Datalist
from hsmla_med.data.endovis import (EMPTY_TRUTH, PROBLEMS, VIDEO_FOLDER, VIDEO_PREFIX, LoadFramed, crop_box, empty_truth_videos, find_frames,
                                    find_videos, load_frame)
from hsmla_med.data.intensity import intensity_augmentations
from hsmla_med.data.splits import fold_cases, other_dataset
from hsmla_med.data.synthetic.endovis import generate_endovis
from hsmla_med.engine.base import hparams, plain
from hsmla_med.engine.datamodule import CaseDataModule
from hsmla_med.engine.segmentation import FrameSegmentationModule
from hsmla_med.errors import ConfigError, DataError
from hsmla_med.evaluation.frames import score_frames
from hsmla_med.io import atomic_path, is_temporary
from hsmla_med.pipelines.task import BundleParts, InferenceOptions, Task, predict_cases, synthetic_root

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
    validation its frames are not scored (the reason is :func:`~hsmla_med.evaluation.frames.score_frames`'s), and a
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
    record = fold_cases(config, Path(root), labelled, ids, synthetic, fixed=fixed, fixed_option="data.validation_videos")[2]
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
    """``evaluate --task endovis --predictions DIR --labels DATA_DIR``: the mask PNGs of
    ``DIR/instrument_dataset_K/`` scored against the dataset folder's ground truth, each at its
    frame's own size, for ``options["problem"]`` (``binary`` by default, ``parts``, ``type``),
    into ``output/summary.json`` (:func:`~hsmla_med.evaluation.frames.score_frames`)."""
    return score_frames(predictions, labels, output, options.get("problem") or "binary")


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
