"""CAMELYON16 lesion detections scored as the challenge's ``Evaluation_FROC.py`` scores them:
each slide's evaluation mask (the ground-truth mask TIFF, else the mask ASAP makes of the XML
outlines), grown and labelled by the official rules (:func:`~hsmla_med.metrics.pathology.evaluation_mask`),
each detection looked up in it, and the lesion-level FROC over the slides
(:func:`~hsmla_med.metrics.pathology.lesion_froc`); the slide-level AUC of a slide CSV.

The submission's files are :mod:`hsmla_med.io.lesion_csv`'s; validation looks patches up in the
same masks (:func:`slide_truth`, :func:`hit_labels`), so a submission scores as validation did.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np

from hsmla_med.data.asap import TUMOUR_GROUPS, Polygon, asap_mask, read_asap_xml
from hsmla_med.data.slides import SLIDE_SUFFIXES, open_slide, read_mask_level, slide_mpp
from hsmla_med.errors import DataError, InputError
from hsmla_med.io.lesion_csv import read_lesion_csv, read_slide_csv
from hsmla_med.metrics.pathology import GROW_UM, auc, evaluation_geometry, evaluation_mask, lesion_froc, slide_fp_tp

__all__ = ["slide_truth", "mask_folder", "score_slides", "slide_auc"]

log = logging.getLogger("hsmla_med")


def slide_truth(polygons: list[Polygon], level0_size: tuple[int, int], mpp: float | None, mask: Path | None = None) -> tuple[np.ndarray, int, int]:
    """The official evaluation mask of a slide (:func:`evaluation_mask`): its tumour mask at
    downsample ``2**level`` of :func:`evaluation_geometry` (level 5 of a 0.243 µm slide, as
    ``Evaluation_FROC.py``), grown by the official 75 µm, ITC clusters numbered last. Returns
    ``(labels, num_lesions, downsample)``.

    The tumour mask is the ground-truth mask TIFF ``mask`` where given (CAMELYON16's
    ``Ground_Truth/Masks``, read as the official script reads it:
    :func:`~hsmla_med.data.slides.read_mask_level`), else the one ASAP makes of the outlines
    (:func:`~hsmla_med.data.asap.asap_mask`), which is how the challenge made those TIFFs."""
    slide_mpp_used, level = evaluation_geometry(mpp)
    downsample = 2**level
    tumour = read_mask_level(mask, downsample) if mask is not None else asap_mask(polygons, level0_size, downsample)
    labels, num_lesions = evaluation_mask(tumour, slide_mpp_used * downsample)
    return labels, num_lesions, downsample


def hit_labels(labels: np.ndarray, downsample: int, points: np.ndarray) -> np.ndarray:
    """The evaluation-mask label at each level-0 point ``(x, y)`` (``(n, 2)`` non-negative
    integers), as the official script looks it up: ``labels[int(y / 2**level), int(x /
    2**level)]``; 0 beyond the mask (no lesion reaches there)."""
    points = np.asarray(points, np.int64).reshape(-1, 2)
    rows, cols = points[:, 1] // downsample, points[:, 0] // downsample
    inside = (rows < labels.shape[0]) & (cols < labels.shape[1])
    hits = np.zeros(len(points), np.int64)
    hits[inside] = labels[rows[inside], cols[inside]]
    return hits


def _slide_geometry(stem: str, labels: Path, data_dir: Path | None) -> tuple[tuple[int, int] | None, float | None, str | None]:
    """Level-0 size and mpp of the slide ``stem``, found under ``data_dir`` or beside the
    annotation folder (its parent, searched recursively: CAMELYON16's ``testing/images`` beside
    ``testing/lesion_annotations``); ``(None, None, None)`` when there is none."""
    for path in sorted((data_dir or labels.parent).rglob(f"{stem}.*")):
        if path.suffix.lower() in SLIDE_SUFFIXES and path.is_file():
            slide = open_slide(path)
            try:
                return tuple(slide.dimensions), slide_mpp(slide), str(path)
            finally:
                slide.close()
    return None, None, None


MASK_FOLDERS = ("Masks", "Ground_Truth/Masks")  # beside the annotation folder: CAMELYON16's ground-truth mask TIFFs


def mask_folder(labels: Path, given: str | Path | None) -> Path | None:
    """The folder of ground-truth mask TIFFs: ``--masks``, else ``Masks`` or
    ``Ground_Truth/Masks`` beside the annotation folder, else ``None`` (masks made from the XML)."""
    if given is not None:
        folder = Path(given)
        if not folder.is_dir():
            raise InputError(f"--masks {folder}: not a folder (the ground-truth mask TIFFs, <slide>_Mask.tif)")
        return folder
    return next((labels.parent / name for name in MASK_FOLDERS if (labels.parent / name).is_dir()), None)


def _mask_file(stem: str, folder: Path | None) -> Path | None:
    """``<slide>_Mask.tif``, the name ``Evaluation_FROC.py`` opens (any case of ``_mask``)."""
    if folder is None:
        return None
    return next((p for p in sorted(folder.glob("*")) if p.stem.lower() == f"{stem.lower()}_mask" and p.suffix.lower() in (".tif", ".tiff")), None)


def _score_slide(csv_path: Path, labels: Path, data_dir: Path | None, masks: Path | None) -> tuple[tuple, dict]:
    """One slide of a submission: its :func:`slide_fp_tp` counts (with its lesion count) and its
    row of the summary."""
    found = read_lesion_csv(csv_path)
    xml, mask = labels / f"{csv_path.stem}.xml", _mask_file(csv_path.stem, masks)
    polygons = read_asap_xml(xml) if xml.is_file() and mask is None else []
    size, mpp, slide_path = _slide_geometry(csv_path.stem, labels, data_dir)
    if mask is not None:  # the mask is the slide's geometry, as the official script reads it
        reader = open_slide(mask)
        size, mpp = tuple(reader.dimensions), slide_mpp(reader) or mpp
        reader.close()
    points = found[:, 1:].astype(np.int64)
    if size is not None and len(points) and ((points[:, 0] >= size[0]) | (points[:, 1] >= size[1])).any():
        x, y = points[(points[:, 0] >= size[0]) | (points[:, 1] >= size[1])][0]
        raise DataError(f"{csv_path}: detection at ({x}, {y}) lies outside the {size[0]}x{size[1]} slide {mask or slide_path}")
    known = size is not None
    if not known:  # the outlines' extent, with room for the growth: no lesion reaches beyond it
        official_mpp, level = evaluation_geometry(None)
        extent = np.max([p.points.max(axis=0) for p in polygons], axis=0) if polygons else np.zeros(2)
        size = tuple(int(math.ceil(v + GROW_UM / official_mpp + 2**level)) + 1 for v in extent)
    truth, num_lesions, downsample = slide_truth(polygons, size, mpp, mask)
    beyond = (points[:, 1] // downsample >= truth.shape[0]) | (points[:, 0] // downsample >= truth.shape[1])
    if known and beyond.any():
        x, y = points[beyond][0]
        raise DataError(f"{csv_path}: detection at ({x}, {y}) lies in the last partial row or column of the slide's evaluation mask "
                        f"({truth.shape[1]}x{truth.shape[0]} pixels of {downsample} level-0 pixels), which Evaluation_FROC.py cannot look up "
                        "(IndexError); place it at most "
                        f"({truth.shape[1] * downsample - 1}, {truth.shape[0] * downsample - 1})")
    fp, tp = slide_fp_tp(found[:, 0], hit_labels(truth, downsample, points), num_lesions, int(truth.max()))
    reference = mask or (xml if xml.is_file() else None)
    row = {
        "slide": csv_path.stem, "prediction_file": str(csv_path), "reference_file": str(reference) if reference else None,
        "slide_file": slide_path, "tumour": bool(truth.max() > 0), "lesions": num_lesions, "itc": int(truth.max()) - num_lesions,
        "detected": int((tp[:num_lesions] > 0).sum()), "detections": len(found), "false_positives": len(fp),
        "evaluation_level": int(math.log2(downsample)), "mpp": evaluation_geometry(mpp)[0],
    }
    return (fp, tp, num_lesions), row


def _has_tumour(xml: Path) -> int:
    return int(xml.is_file() and any(p.group in TUMOUR_GROUPS for p in read_asap_xml(xml)))


def score_slides(csvs: list[Path], labels: Path, data_dir: Path | None, masks: Path | None) -> tuple[dict, list[dict]]:
    """The lesion-level FROC of the lesion CSVs ``csvs`` (:func:`lesion_froc`'s dict) and a
    summary row per slide. ``labels``: the folder of ``<slide>.xml`` outlines (a slide without
    one is normal); ``data_dir``: where the slide files are looked for (their size and mpp);
    ``masks``: the folder of ground-truth mask TIFFs (:func:`mask_folder`), or ``None``."""
    counts, rows = zip(*(_score_slide(path, labels, data_dir, masks) for path in csvs))
    return lesion_froc(list(counts)), list(rows)


def slide_auc(path: Path, labels: Path, masks: Path | None) -> tuple[float | None, int]:
    """The slide-level AUC of the slide CSV ``path`` (a slide file's extension dropped from its
    names; tumour: a ground-truth mask or tumour outlines in ``labels``) and the number of slides
    it lists; ``None`` with slides of one class only."""
    scores = {Path(name).stem if Path(name).suffix.lower() in SLIDE_SUFFIXES else name: value for name, value in read_slide_csv(path).items()}
    tumour = [int(_mask_file(name, masks) is not None) or _has_tumour(labels / f"{name}.xml") for name in scores]
    value = auc(list(scores.values()), tumour) if scores else math.nan
    return None if math.isnan(value) else value, len(scores)
