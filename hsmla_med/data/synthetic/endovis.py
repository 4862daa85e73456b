"""Synthetic surgical video frames in the on-disk format of EndoVis 2017, the default data.

The challenge data needs a registration, so a user without it gets this stand-in with the same
layout (:mod:`hsmla_med.data.endovis`): ``instrument_dataset_K/left_frames/frameNNN.png`` RGB
frames of 1920 x 1080 with black borders outside the standard 1280 x 1024 crop, and per
instrument ``ground_truth/<folder>/frameNNN.png`` grey labels (10 shaft, 20 wrist, 30 claspers).

The distribution's quirks are drawn too, so that the readers meet them:

* label folders spelled as the challenge spells them, inconsistently: ``Left_Prograsp_Forceps_labels``
  (videos 1-3), ``Large_Needle_Driver_Left_labels`` (side after the name, video 4) and
  ``Prograsp_Forceps`` or ``Left_Bipolar_Forceps`` without ``_labels`` (videos 6 and 7); odd
  videos here use the first spelling, even videos all three;
* test videos (numbered after the labelled ones) have ``left_frames`` only, no ``ground_truth``;
* the last frame of the first test video has another, odd size: 1279 x 1023, the camera window
  less a row and a column, as a frame re-saved by another tool would be.

On request (``empty_videos``, never by default) labelled videos whose every ground-truth label
is all background while their frames show instruments, as labels lost in an export would be.

Each frame is textured tissue (reddish, two octaves of smooth noise, darker towards the edges of
the endoscope's light) with specular highlights, and one to three instruments entering from the
left, right or bottom edge: a dark shaft, a grey wrist and two bright jaws whose length, width,
opening and tint depend on the instrument type, so that the type task is learnable too. Each
video keeps its instruments (as a real video does) and moves them from frame to frame; where
instruments cross, the later one is on top and the earlier one's label keeps only its visible
pixels. Nothing here is real surgery.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from hsmla_med.data.datalist import read_json
from hsmla_med.data.endovis import CROP
from hsmla_med.io import atomic_path, write_json

__all__ = ["generate_endovis", "FRAME_SIZE", "INSTRUMENTS", "ODD_FRAME_SIZE"]

FRAME_SIZE = (1080, 1920)  # H, W of the challenge's frames
_GENERATOR_VERSION = 2  # 2: the distribution's folder spellings, an odd-sized test frame
ODD_FRAME_SIZE = (1023, 1279)  # H, W of the odd frame: see the module docstring
# folder name (the instrument) -> (shaft half-width, jaw length, jaw half-width, jaw opening in
# radians, jaw tint RGB), in pixels of the full frame
INSTRUMENTS = {
    "Maryland_Bipolar_Forceps": (34, 95, 11, 0.25, (205, 200, 190)),
    "Prograsp_Forceps": (38, 120, 16, 0.45, (190, 195, 205)),
    "Large_Needle_Driver": (36, 80, 14, 0.10, (215, 215, 215)),
    "Vessel_Sealer": (44, 130, 20, 0.15, (170, 165, 150)),
    "Grasping_Retractor": (30, 140, 9, 0.55, (200, 205, 210)),
    "Monopolar_Curved_Scissors": (34, 85, 8, 0.35, (225, 190, 140)),
}
_SHAFT_RGB, _WRIST_RGB = np.array([38.0, 38.0, 42.0]), np.array([120.0, 122.0, 128.0])


def _smooth_noise(rng: np.random.Generator, shape: tuple[int, int], cells: int) -> np.ndarray:
    """Smooth noise in -1..1 of ``shape``: ``cells`` random values per side, bicubic-upsampled."""
    small = rng.uniform(0, 255, (cells, max(2, cells * shape[1] // shape[0]))).astype(np.uint8)
    big = Image.fromarray(small).resize((shape[1], shape[0]), Image.BICUBIC)
    return np.asarray(big, np.float32) / 127.5 - 1.0


def _capsule(shape: tuple[int, int], p0: np.ndarray, p1: np.ndarray, radius: float) -> np.ndarray:
    """Boolean mask ``shape`` of the points within ``radius`` of the segment p0-p1 ((y, x) points),
    computed on the segment's bounding box only."""
    mask = np.zeros(shape, bool)
    lo = np.floor(np.minimum(p0, p1) - radius).astype(int).clip(0, np.array(shape) - 1)
    hi = np.ceil(np.maximum(p0, p1) + radius + 1).astype(int).clip(0, np.array(shape))
    if (hi <= lo).any():
        return mask
    yy, xx = np.mgrid[lo[0] : hi[0], lo[1] : hi[1]].astype(np.float32)
    d = p1 - p0
    t = np.clip(((yy - p0[0]) * d[0] + (xx - p0[1]) * d[1]) / max(float(d @ d), 1e-6), 0.0, 1.0)
    dist2 = (yy - p0[0] - t * d[0]) ** 2 + (xx - p0[1] - t * d[1]) ** 2
    mask[lo[0] : hi[0], lo[1] : hi[1]] = dist2 <= radius**2
    return mask


def _instrument(rng: np.random.Generator, name: str, side: str) -> list[tuple[np.ndarray, int, np.ndarray]]:
    """The parts of one instrument in a random pose: ``(mask, grey value, RGB)`` each, in full-frame
    pixels, entering the crop from ``side`` (``left``, ``right`` or ``bottom``)."""
    top, left, height, width = CROP
    shaft_r, jaw_len, jaw_r, opening, tint = INSTRUMENTS[name]
    # entry point on the crop's edge, tip somewhere in the middle of the view
    if side == "left":
        entry = np.array([top + rng.uniform(0.2, 0.9) * height, left - 40.0])
    elif side == "right":
        entry = np.array([top + rng.uniform(0.2, 0.9) * height, left + width + 40.0])
    else:
        entry = np.array([top + height + 40.0, left + rng.uniform(0.2, 0.8) * width])
    tip = np.array([top + rng.uniform(0.3, 0.7) * height, left + rng.uniform(0.3, 0.7) * width])
    direction = (tip - entry) / np.linalg.norm(tip - entry)
    wrist_len = 1.6 * shaft_r
    shaft_end = tip - direction * (wrist_len + jaw_len)
    wrist_end = tip - direction * jaw_len
    shape = FRAME_SIZE
    parts = [
        (_capsule(shape, entry, shaft_end, shaft_r), 10, _SHAFT_RGB),
        (_capsule(shape, shaft_end, wrist_end, 0.8 * shaft_r), 20, _WRIST_RGB),
    ]
    jaws = np.zeros(shape, bool)
    half = opening * rng.uniform(0.3, 1.0)
    for sign in (-1.0, 1.0):
        c, s = np.cos(sign * half), np.sin(sign * half)
        rotated = np.array([c * direction[0] - s * direction[1], s * direction[0] + c * direction[1]])
        jaws |= _capsule(shape, wrist_end, wrist_end + rotated * jaw_len, jaw_r)
    parts.append((jaws, 30, np.array(tint, float)))
    return parts


def _frame(rng: np.random.Generator, instruments: list[tuple[str, str]]) -> tuple[np.ndarray, list[np.ndarray]]:
    """One frame ``(1080, 1920, 3)`` uint8 and one grey label per instrument (visible pixels)."""
    h, w = FRAME_SIZE
    top, left, height, width = CROP
    # tissue: reddish base colour modulated by two octaves of smooth noise and a vignette
    base = (np.array([165.0, 62.0, 52.0]) + rng.uniform(-15, 15, 3)).astype(np.float32)
    tex = 0.65 * _smooth_noise(rng, (h, w), 8) + 0.35 * _smooth_noise(rng, (h, w), 40)
    yy, xx = np.ogrid[0:h, 0:w]
    yy, xx = yy.astype(np.float32), xx.astype(np.float32)
    r2 = ((yy - (top + height / 2)) / (0.75 * height)) ** 2 + ((xx - (left + width / 2)) / (0.75 * width)) ** 2
    light = np.clip(1.15 - 0.45 * r2, 0.35, 1.15)
    # per channel: the base colour, brighter and less saturated where the texture is high
    image = (base + (0.25 * base + np.float32([10.0, 25.0, 20.0])) * tex[..., None]) * light[..., None]

    labels = [np.zeros((h, w), np.uint8) for _ in instruments]
    for i, (name, side) in enumerate(instruments):
        if rng.uniform() < 0.1:  # out of view in this frame: an all-background label, as in real videos
            continue
        footprint = np.zeros((h, w), bool)
        for mask, grey, rgb in _instrument(rng, name, side):
            new = mask & ~footprint  # the shaft's capsule end is under the wrist, not over it
            shade = 0.85 + 0.3 * rng.uniform()
            image[new] = rgb * shade * (0.9 + 0.1 * light[new, None])
            labels[i][new] = grey
            footprint |= mask
        for earlier in labels[:i]:  # occluded by this instrument
            earlier[footprint] = 0
    # specular highlights: small bright ellipses on tissue and metal
    for _ in range(rng.integers(6, 14)):
        cy, cx = top + rng.uniform(0, height), left + rng.uniform(0, width)
        ry, rx = rng.uniform(3, 14), rng.uniform(3, 26)
        y0, y1, x0, x1 = int(max(cy - 3 * ry, 0)), int(min(cy + 3 * ry, h)), int(max(cx - 3 * rx, 0)), int(min(cx + 3 * rx, w))
        g = np.exp(-(((yy[y0:y1] - cy) / ry) ** 2 + ((xx[:, x0:x1] - cx) / rx) ** 2))
        image[y0:y1, x0:x1] += (255.0 - image[y0:y1, x0:x1]) * g[..., None] * 0.95
    # the da Vinci video's black borders, which the standard crop removes
    outside = np.ones((h, w), bool)
    outside[top : top + height, left : left + width] = False
    image[outside] = 3.0
    for label in labels:
        label[outside] = 0
    return np.clip(image, 0, 255).astype(np.uint8), labels


def _label_folder(name: str, side: str, k: int, i: int) -> str:
    """The ground-truth folder of instrument ``i`` of video ``k``, spelled as the challenge spells
    it: odd videos ``Left_<Name>_labels``; even videos, instrument by instrument, without
    ``_labels`` (``Left_Bipolar_Forceps``), side after the name (``<Name>_Left_labels``), then
    side first. An instrument entering from the bottom has no side word."""
    side = "" if side == "bottom" else side.capitalize()
    words = [[side, name], [name, side, "labels"], [side, name, "labels"]][2 if k % 2 else i % 3]
    return "_".join(word for word in words if word)


def _save_png(array: np.ndarray, path: Path) -> None:
    with atomic_path(path) as tmp:
        Image.fromarray(array).save(tmp, compress_level=1)


def generate_endovis(
    root: str | os.PathLike,
    num_videos: int = 4,
    num_test_videos: int = 1,
    frames_per_video: int = 8,
    seed: int = 0,
    empty_videos: Sequence[int] = (),
) -> Path:
    """Write synthetic EndoVis 2017-format videos under ``root`` and return ``root``.

    Args:
        root: dataset folder; created if missing.
        num_videos: labelled videos ``instrument_dataset_1..num_videos`` (with ``ground_truth``).
        num_test_videos: unlabelled videos numbered after them (``left_frames`` only); the
            first one's last frame has the odd size :data:`ODD_FRAME_SIZE`.
        frames_per_video: frames ``frame000.png``... per video.
        seed: frame ``j`` of video ``k`` depends only on ``seed``, ``k`` and ``j``.
        empty_videos: numbers ``K`` of labelled videos whose label PNGs are written all
            background (the instruments still drawn in the frames), to meet the readers'
            handling of a video with empty ground truth.

    Returns at once if ``root/synthetic.json`` records the same parameters. Every file is
    written under a temporary name and renamed, ``synthetic.json`` last, so a folder with it is
    complete. Raises :class:`FileExistsError` rather than write into a folder whose
    ``synthetic.json`` this generator did not write.
    """
    root = Path(root)
    if num_videos < 1 or num_test_videos < 0 or frames_per_video < 1:
        raise ValueError("need num_videos >= 1, num_test_videos >= 0 and frames_per_video >= 1")
    empty = sorted({int(k) for k in empty_videos})
    if any(not 1 <= k <= num_videos for k in empty):
        raise ValueError(f"empty_videos {empty} must be labelled videos, 1..{num_videos}")
    params = {
        "version": _GENERATOR_VERSION,
        "seed": int(seed),
        "num_videos": int(num_videos),
        "num_test_videos": int(num_test_videos),
        "frames_per_video": int(frames_per_video),
    }
    if empty:  # only when asked: the default dataset's record (and so its cache) stays as it was
        params["empty_videos"] = empty
    marker = root / "synthetic.json"
    if marker.is_file():
        meta = read_json(marker)
        if "generator" not in meta:
            raise FileExistsError(f"{marker}: not written by the synthetic EndoVis generator; refusing to overwrite")
        if meta["generator"] == params:
            return root
        marker.unlink()  # ours but stale: the folder is incomplete until the new one is written
        for video in root.glob("instrument_dataset_*"):  # an older version's folder names would stay beside the new ones
            shutil.rmtree(video)
    names = list(INSTRUMENTS)
    for k in range(1, num_videos + num_test_videos + 1):
        rng = np.random.default_rng((int(seed), k))
        chosen = rng.choice(len(names), size=int(rng.integers(1, 4)), replace=False)
        sides = rng.permutation(["left", "right", "bottom"])[: len(chosen)]
        instruments = [(names[c], side) for c, side in zip(chosen, sides)]
        folders = [_label_folder(name, side, k, i) for i, (name, side) in enumerate(instruments)]
        video = root / f"instrument_dataset_{k}"
        for j in range(frames_per_video):
            image, labels = _frame(np.random.default_rng((int(seed), k, j)), instruments)
            if k == num_videos + 1 and j == frames_per_video - 1:
                top, left = CROP[:2]
                image = image[top : top + ODD_FRAME_SIZE[0], left : left + ODD_FRAME_SIZE[1]]
            _save_png(image, video / "left_frames" / f"frame{j:03d}.png")
            if k <= num_videos:
                for folder, label in zip(folders, labels):
                    _save_png(np.zeros_like(label) if k in empty else label, video / "ground_truth" / folder / f"frame{j:03d}.png")
    write_json(marker, {
        "name": "EndoVis2017-synthetic",
        "description": "Synthetic surgical frames in the EndoVis 2017 layout (not real surgery), "
        "written by hsmla_med.data.synthetic.endovis as the default data.",
        "synthetic": True,
        "generator": params,
    })
    return root
