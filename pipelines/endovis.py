"""EndoVis 2017: robotic surgical instrument segmentation on RGB video frames (PNG).

What is specific to the benchmark lives here: the dataset (the challenge's
``instrument_dataset_K`` folders, or the synthetic default), split into training and validation
by video (frames of one video are near-duplicates, so a frame-level split would leak), MONAI
transforms on the cropped frames resized to ``data.size``, and writing PNG masks in each input
frame's own geometry. Reading, the crop and the label conventions are
:mod:`hsmla_med.data.endovis`'s; the loop, checkpoints and the frame module
(:class:`~hsmla_med.engine.segmentation.FrameSegmentationModule`, Dice and IoU) are the
engine's.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from monai.transforms import Compose, RandFlipd, RandScaleIntensityd, RandShiftIntensityd, RandZoomd, Resized
from PIL import Image

from hsmla_med.data.datalist import Datalist
from hsmla_med.data.endovis import PROBLEMS, VIDEO_FOLDER, LoadFramed, crop_box, find_frames, find_videos, load_frame
from hsmla_med.data.intensity import intensity_augmentations
from hsmla_med.data.splits import fold_cases
from hsmla_med.data.synthetic.endovis import generate_endovis
from hsmla_med.engine.base import hparams, plain
from hsmla_med.engine.datamodule import CaseDataModule
from hsmla_med.engine.segmentation import FrameSegmentationModule
from hsmla_med.errors import ConfigError, DataError
from hsmla_med.io import atomic_path
from hsmla_med.pipelines.task import InferenceOptions, Task, predict_cases, synthetic_root

VIDEO_PREFIX = "instrument_dataset_"  # the video folders, instrument_dataset_K: the case IDs of the splits

__all__ = ["TASK", "datalist", "transforms", "datamodule", "module_config", "held_out", "infer", "inference_box"]


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
    (the challenge's test set) are ``test``."""
    data = config["data"]
    problem = _problem(config)
    root, synthetic = data["data_dir"], False
    if not root:
        root = synthetic_root(data, "endovis", "EndoVis 2017-format frames", "drawn instruments, not surgery",
                              lambda root: generate_endovis(root, **data["synthetic"]))
        synthetic = True
    videos = find_videos(root)
    labelled = [v["video"] for v in videos if v["labelled"]]
    if len(labelled) < 2:
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
    pick = lambda keep: [c for v in videos for c in v["frames"] if keep(v)]  # noqa: E731
    return Datalist(
        PROBLEMS[problem],
        pick(lambda v: v["labelled"] and v["video"] not in held),
        pick(lambda v: v["video"] in held),
        pick(lambda v: not v["labelled"]),
        Path(root),
        synthetic,
        record,
    )


def transforms(config: dict) -> tuple[Compose, Compose]:
    """Training and validation transforms: read, crop and merge the labels
    (:class:`~hsmla_med.data.endovis.LoadFramed`), resize to ``data.size`` (area for the frame,
    nearest for the labels); training adds flips, zoom, per-channel colour scale and shift, and
    nnU-Net's intensity and resolution augmentations on the frame
    (:func:`~hsmla_med.data.intensity.intensity_augmentations`)."""
    data, keys = config["data"], ["image", "label"]
    aug = data["augment"]
    load = [LoadFramed(_problem(config), data["crop"]), Resized(keys, spatial_size=data["size"], mode=["area", "nearest-exact"])]
    train = load + [
        RandFlipd(keys, prob=aug["flip_prob"], spatial_axis=0),
        RandFlipd(keys, prob=aug["flip_prob"], spatial_axis=1),
        RandZoomd(keys, prob=aug["zoom_prob"], min_zoom=aug["zoom_range"][0], max_zoom=aug["zoom_range"][1], mode=["bilinear", "nearest-exact"], keep_size=True),
        RandScaleIntensityd("image", factors=aug["colour_scale"], prob=aug["colour_prob"], channel_wise=True),
        RandShiftIntensityd("image", offsets=aug["colour_shift"], prob=aug["colour_prob"], channel_wise=True),
        *intensity_augmentations(aug, spatial_dims=2),
    ]
    return Compose(train), Compose(load)


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
        items.append({"name": str(path.relative_to(output)), "frame": str(frame), "output": path, "inference": inference})

    predicted = []

    def write(case: dict) -> list[Path]:
        predicted.append(case["name"])
        top, left, h, w = case["box"]
        labels = F.interpolate(case["probs"][None], size=(h, w), mode="bilinear", align_corners=False).argmax(1)[0]
        mask = np.zeros(case["shape"], np.uint8)
        mask[top : top + h, left : left + w] = labels.to(torch.uint8).numpy()
        case["output"].parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(case["output"]) as tmp:
            Image.fromarray(mask).save(tmp, format="PNG")
        return [case["output"]]

    started = time.perf_counter()
    transform = FrameForInference(cfg["data"]["crop"], options.crop, cfg["data"]["size"])
    written = predict_cases(module, items, transform, write, options, folder=output)
    seconds = time.perf_counter() - started
    options.progress(f"endovis: {len(predicted)} frame(s) segmented by this process, {len(predicted) / seconds:.2f} frames/s "
                     f"({options.device}, input {cfg['data']['size']})")
    return written


class EndoVis(Task):
    """EndoVis 2017 instrument segmentation: PNG frames, PNG masks."""

    name = "endovis"
    module_class = FrameSegmentationModule
    in_channels = 3
    inputs = "PNG frames, video folders or an EndoVis 2017 root"
    outputs = "one PNG mask per frame at the frame's size"


TASK = EndoVis()
