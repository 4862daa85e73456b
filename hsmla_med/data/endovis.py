"""EndoVis 2017 robotic instrument segmentation: the challenge's folders, PNG frames and labels,
the standard crop, and the per-instrument labels merged into the three tasks.

The challenge ships each video as::

    instrument_dataset_K/left_frames/frameNNN.png                    RGB, 1920 x 1080 (W x H)
    instrument_dataset_K/ground_truth/<Name>_labels/frameNNN.png     8-bit grey, one folder per instrument

(test videos come without ``ground_truth``). The label folders are spelled inconsistently in the
distribution: ``Left_Prograsp_Forceps_labels``, ``Large_Needle_Driver_Left_labels`` (video 4),
``Prograsp_Forceps`` and ``Left_Bipolar_Forceps`` without ``_labels`` (videos 6 and 7); every
folder in ``ground_truth`` is an instrument, its type read from its name (an unknown name is an
error rather than a silently dropped instrument). Conventions, as the challenge data is prepared by
the public code of its winning team (``prepare_data.py`` of ternaus/robot-surgery-segmentation,
Shvets et al., "Automatic Instrument Segmentation in Robot-Assisted Surgery using Deep
Learning", ICMLA 2018):

* **crop**: rows 28..1051 and columns 320..1599, a 1024 x 1280 (H x W) window without the black
  borders of the da Vinci video (:data:`CROP`);
* **parts**: grey value 10 = shaft, 20 = wrist, 30 = claspers; every non-zero value is
  instrument (binary), also values that are no part;
* **type**: from the folder name (``Left_Prograsp_Forceps_labels``, ``Maryland_Bipolar_Forceps_labels``
  ...): Bipolar_Forceps 1, Prograsp_Forceps 2, Large_Needle_Driver 3, Vessel_Sealer 4,
  Grasping_Retractor 5, Monopolar_Curved_Scissors 6, Other 7 (:data:`INSTRUMENT_TYPES`);
* ``Other`` (the ultrasound probe and similar non-robotic tools) counts for the type task only,
  not as instrument in the binary and parts tasks;
* where instruments overlap, the label folders are applied in sorted name order and a later one
  overwrites an earlier one (the reference code's rule, with its folder order made explicit).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from monai.transforms import MapTransform
from PIL import Image

from hsmla_med.errors import ConfigError, DataError

__all__ = [
    "CROP",
    "EMPTY_TRUTH",
    "PROBLEMS",
    "INSTRUMENT_TYPES",
    "PART_VALUES",
    "VIDEO_FOLDER",
    "VIDEO_PREFIX",
    "LoadFramed",
    "crop_box",
    "empty_truth_videos",
    "find_frames",
    "find_videos",
    "instrument_type",
    "load_frame",
    "merge_labels",
    "read_frame",
    "read_label",
]

log = logging.getLogger("hsmla_med")

CROP = (28, 320, 1024, 1280)  # top, left, height, width of the standard crop of 1080 x 1920 frames
PART_VALUES = {10: 1, 20: 2, 30: 3}  # grey value -> shaft, wrist, claspers
INSTRUMENT_TYPES = {  # folder-name substring -> type index
    "Bipolar_Forceps": 1,
    "Prograsp_Forceps": 2,
    "Large_Needle_Driver": 3,
    "Vessel_Sealer": 4,
    "Grasping_Retractor": 5,
    "Monopolar_Curved_Scissors": 6,
    "Other": 7,
}
PROBLEMS = {  # class names per task, index = label value
    "binary": ["background", "instrument"],
    "parts": ["background", "shaft", "wrist", "claspers"],
    "type": ["background"] + [name.lower() for name in INSTRUMENT_TYPES],
}
_FRAMES, _LABELS = "left_frames", "ground_truth"
EMPTY_TRUTH = "every ground-truth frame is empty (or ground_truth/ holds no labels)"  # the warning about such a video
VIDEO_FOLDER = re.compile(r"^instrument_dataset_(\d+)$")  # one video of the challenge
VIDEO_PREFIX = "instrument_dataset_"  # the video folders, instrument_dataset_K: the case IDs of the splits


def _open(path: Path) -> Image.Image:
    try:
        image = Image.open(path)
        image.deep = _is_16bit(image)  # read before load(), which empties the tile list it looks at
        image.load()
        return image
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except Exception as err:  # truncated or foreign files raise several types
        raise DataError(f"{path}: cannot read as an image ({type(err).__name__}: {err})") from None


def _is_16bit(image: Image.Image) -> bool:
    # Pillow opens 48-bit RGB PNGs as "RGB" (raw mode "RGB;16B", in the tile list of an image not
    # loaded yet) and 16-bit grey ones as "I;16"
    raw = " ".join(str(tile.args) for tile in image.tile) if image.tile else ""
    return getattr(image, "deep", False) or image.mode in ("I", "I;16", "I;16B", "I;16L", "F") or ";16" in raw


def read_frame(path: str | Path) -> np.ndarray:
    """An 8-bit RGB frame ``(H, W, 3)`` uint8.

    RGBA (and palette) frames are converted to RGB, dropping the alpha channel (frames are
    opaque video; some tools save them with an all-opaque alpha). 16-bit, greyscale and other
    modes are refused with a :class:`DataError` naming the file.
    """
    path = Path(path)
    image = _open(path)
    if _is_16bit(image):
        raise DataError(f"{path}: 16-bit image; frames must be 8-bit RGB PNGs")
    if image.mode in ("RGBA", "P", "PA"):
        image = image.convert("RGB")
    if image.mode != "RGB":
        raise DataError(f"{path}: image mode {image.mode!r}; frames must be 8-bit RGB")
    return np.asarray(image)


def read_label(path: str | Path) -> np.ndarray:
    """An 8-bit grey label ``(H, W)`` uint8 (grey values as in :data:`PART_VALUES`).

    RGB(A) labels whose colour channels are equal (grey saved as colour) give their first
    channel; anything else — colour, 16-bit, bilevel, palette — is a :class:`DataError`.
    """
    path = Path(path)
    image = _open(path)
    if _is_16bit(image):
        raise DataError(f"{path}: 16-bit label; EndoVis labels are 8-bit grey PNGs")
    if image.mode == "L":
        return np.asarray(image)
    if image.mode in ("RGB", "RGBA"):
        rgb = np.asarray(image)[..., :3]
        if (rgb == rgb[..., :1]).all():
            return np.ascontiguousarray(rgb[..., 0])
        raise DataError(f"{path}: colour label image; EndoVis labels are grey (values 10, 20, 30)")
    raise DataError(f"{path}: label image mode {image.mode!r}; EndoVis labels are 8-bit grey")


def instrument_type(folder: str | Path) -> int:
    """Type index (1..7) of a ground-truth folder, from its name (``Left_Prograsp_Forceps_labels``: 2)."""
    name = Path(folder).name
    for key, index in INSTRUMENT_TYPES.items():
        if key in name:
            return index
    raise DataError(f"{folder}: unknown instrument folder; names must contain one of {', '.join(INSTRUMENT_TYPES)}")


_WARNED_VALUES: set[int] = set()


def _warn_no_part(file: Path, values: np.ndarray) -> None:
    """Grey values that are no part become background in the parts task, as in the reference
    code; say so once per value rather than silently."""
    new = sorted(set(values.tolist()) - _WARNED_VALUES)
    if new:
        _WARNED_VALUES.update(new)
        names = ", ".join(f"{v} {PROBLEMS['parts'][p]}" for v, p in PART_VALUES.items())
        log.warning("%s: grey value(s) %s are no part label (%s): background in the parts task", file, ", ".join(map(str, new)), names)


def merge_labels(
    files: Sequence[str | Path], problem: str, shape: tuple[int, int] | None = None, frame: str | Path | None = None
) -> np.ndarray:
    """Merge one frame's per-instrument label PNGs into the label map ``(H, W)`` uint8 of a task.

    Args:
        files: one label PNG per instrument, each in its ``<Name>_labels`` folder (the folder
            names the instrument type); applied in sorted folder order, later overwriting.
        problem: ``binary`` (1 = instrument), ``parts`` (1 shaft, 2 wrist, 3 claspers) or
            ``type`` (1..7, :data:`INSTRUMENT_TYPES`); see the module docstring for the rules.
        shape: ``(H, W)`` every label must have (the frame's); default: the first label's.
        frame: the frame the labels belong to, named in the error for a label of another size.
    """
    if problem not in PROBLEMS:
        raise ConfigError(f"data.problem must be one of {', '.join(PROBLEMS)}, got {problem!r}")
    merged = None
    for file in sorted((Path(f) for f in files), key=lambda f: f.parent.name):
        grey = read_label(file)
        if shape is None:
            shape = grey.shape
        if grey.shape != tuple(shape):
            raise DataError(f"{frame or file}: label {file} is {grey.shape[1]} x {grey.shape[0]} (W x H), the frame {shape[1]} x {shape[0]}")
        if merged is None:
            merged = np.zeros(shape, np.uint8)
        kind = instrument_type(file.parent)
        if problem == "type":
            merged[grey > 0] = kind
        elif kind != INSTRUMENT_TYPES["Other"]:
            if problem == "binary":
                merged[grey > 0] = 1
            else:
                _warn_no_part(file, np.setdiff1d(np.unique(grey), [0, *PART_VALUES]))
                for value, part in PART_VALUES.items():
                    merged[grey == value] = part
    if merged is None:
        if shape is None:
            raise ValueError("merge_labels needs label files or a shape")
        merged = np.zeros(shape, np.uint8)
    return merged


def crop_box(shape: tuple[int, int], crop: Sequence[int] | None, path: str | Path = "?") -> tuple[int, int, int, int]:
    """``(top, left, height, width)`` of the part of a frame of ``shape`` (H, W) that the model sees.

    ``crop`` is ``(top, left, height, width)`` (:data:`CROP`) or None (the whole frame). A frame
    of exactly ``height x width`` is taken as cropped already (as the reference code stores its
    prepared frames) and used whole; a frame too small for the crop is a :class:`DataError`
    naming it. The crop says where the camera image lies in the da Vinci's 1920 x 1080 video
    frame; in a frame of another size that place is unknown, and cropping or padding it anyway
    would train on borders or shifted labels. (Inference uses such a frame whole instead, as the
    challenge scores every test frame whole at its own size: ``pipelines.endovis.inference_box``.)
    """
    h, w = int(shape[0]), int(shape[1])
    if crop is None:
        return 0, 0, h, w
    top, left, height, width = (int(v) for v in crop)
    if (h, w) == (height, width):
        return 0, 0, h, w
    if h < top + height or w < left + width:
        raise DataError(
            f"{path}: frame is {w} x {h} (W x H); the crop needs at least {left + width} x {top + height} "
            f"(or exactly {width} x {height}, cropped already); set data.crop to null to use whole frames"
        )
    return top, left, height, width


class LoadFramed(MapTransform):
    """Read a frame dict ``{"image": frame.png, "labels": [label.png, ...]}`` into
    ``image`` ``(3, h, w)`` float32 in 0..1 and ``label`` ``(1, h, w)`` int64 (the task's label
    map), both cropped to :func:`crop_box`. Without ``labels`` (inference) only the image is
    read. ``labels`` is replaced by ``label``; other keys pass through.

    Args:
        problem: ``binary``, ``parts`` or ``type``.
        crop: ``(top, left, height, width)`` or None, see :func:`crop_box`.
        whole_label: keep ``label`` at the frame's original size, uncropped (uint8), and add ``box``,
            the crop ``(top, left, h, w)`` as an int64 tensor: validation puts the prediction
            back into the frame (as ``infer`` does) and scores it against the original label.
    """

    def __init__(self, problem: str, crop: Sequence[int] | None = CROP, whole_label: bool = False) -> None:
        super().__init__(["image"])
        if problem not in PROBLEMS:
            raise ConfigError(f"data.problem must be one of {', '.join(PROBLEMS)}, got {problem!r}")
        self.problem, self.crop, self.whole_label = problem, None if crop is None else tuple(crop), whole_label

    def __call__(self, data: dict) -> dict:
        out = {k: v for k, v in data.items() if k != "labels"}
        out["image"], (top, left, h, w), shape = load_frame(data["image"], self.crop)
        if "labels" in data:
            label = merge_labels(data["labels"], self.problem, shape, data["image"])
            if self.whole_label:  # uint8: 2 MB a 1920 x 1080 frame in the validation cache, not 16
                out["label"], out["box"] = torch.from_numpy(label)[None], torch.tensor([top, left, h, w])
            else:
                out["label"] = torch.from_numpy(np.ascontiguousarray(label[top : top + h, left : left + w]))[None].long()
        return out


def load_frame(path: str | Path, crop: Sequence[int] | None = CROP) -> tuple[torch.Tensor, tuple[int, int, int, int], tuple[int, int]]:
    """A frame for the network: ``(image, box, shape)`` with ``image`` ``(3, h, w)`` float32 in
    0..1 cropped to ``box`` = :func:`crop_box` ``(top, left, h, w)`` of the frame's ``shape`` (H, W)."""
    rgb = read_frame(path)
    top, left, h, w = crop_box(rgb.shape[:2], crop, path)
    image = torch.from_numpy(np.ascontiguousarray(rgb[top : top + h, left : left + w].transpose(2, 0, 1))).float().div_(255.0)
    return image, (top, left, h, w), rgb.shape[:2]


def _frames(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix.lower() == ".png" and not p.name.startswith("."))


def find_videos(root: str | Path) -> list[dict]:
    """The videos ``instrument_dataset_K`` under ``root``, in order of K: dicts ``{"video": K,
    "frames": [case dicts]}``, a case being ``{"image": frame, "labels": [one label PNG per
    instrument folder in ``ground_truth``], "video": K}`` (``labels`` only when the video has
    ``ground_truth``).

    A labelled video must have every frame in every instrument folder: a missing label is a
    :class:`DataError` naming the frame and the file.
    """
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: data directory not found")
    videos = sorted(
        ((int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := VIDEO_FOLDER.match(p.name))), key=lambda kv: kv[0]
    )
    if not videos:
        raise DataError(f"{root}: no instrument_dataset_K folders (EndoVis 2017 layout)")
    found = []
    for k, folder in videos:
        if not (folder / _FRAMES).is_dir():
            raise DataError(f"{folder}: no {_FRAMES} folder")
        frames = _frames(folder / _FRAMES)
        if not frames:
            raise DataError(f"{folder / _FRAMES}: no PNG frames")
        truth = folder / _LABELS
        # every folder, with or without the _labels the distribution mostly (not always) appends
        label_dirs = sorted(p for p in truth.iterdir() if p.is_dir() and not p.name.startswith(".")) if truth.is_dir() else []
        for d in label_dirs:
            instrument_type(d)  # an unknown instrument folder: an error now, not mid-training
        cases = []
        for frame in frames:
            case = {"image": str(frame), "video": k}
            if truth.is_dir():
                missing = [d / frame.name for d in label_dirs if not (d / frame.name).is_file()]
                if missing:
                    raise DataError(f"{frame}: no label {missing[0]} for this frame")
                case["labels"] = [str(d / frame.name) for d in label_dirs]
            cases.append(case)
        found.append({"video": k, "frames": cases, "labelled": truth.is_dir()})
    return found


def empty_truth_videos(videos: Sequence[dict], problem: str) -> dict[int, Path]:
    """``{K: video folder}`` of the labelled videos of :func:`find_videos` without an instrument
    of ``problem`` in any ground-truth frame: every label all background (or only ``Other`` in
    the binary and parts tasks), or a ``ground_truth/`` without label folders.

    Labels are read frame by frame up to the first frame with an instrument, which in a
    labelled video is nearly always its first. Callers warn about each video
    (:data:`EMPTY_TRUTH`) and leave it out of their Dice/IoU means: see
    :func:`~hsmla_med.evaluation.frames.score_frames` for why.
    """
    empty = {}
    for video in videos:
        if video["labelled"] and not any(c["labels"] and merge_labels(c["labels"], problem, frame=c["image"]).any() for c in video["frames"]):
            empty[video["video"]] = Path(video["frames"][0]["image"]).parent.parent
    return empty


def find_frames(path: str | Path) -> list[Path]:
    """The PNG frames of an input: a frame file, a folder of frames, a video folder
    (``instrument_dataset_K`` with ``left_frames``) or a dataset root holding video folders."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(f"{path}: input not found")
    if (path / _FRAMES).is_dir():
        path = path / _FRAMES
    frames = _frames(path)
    if not frames and any(VIDEO_FOLDER.match(p.name) for p in path.iterdir()):
        frames = [Path(c["image"]) for v in find_videos(path) for c in v["frames"]]
    if not frames:
        raise DataError(f"{path}: no PNG frames in the input folder")
    return frames
