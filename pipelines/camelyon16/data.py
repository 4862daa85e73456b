"""CAMELYON16's data: the slides and annotations of a dataset folder (the challenge's layout, a
flat ``images/`` + ``annotations/`` one, or the synthetic default), the patch grid of each slide
inside its tissue, labelled by tumour coverage and by the official evaluation mask (cached per
slide), and the patches as a DataModule (MONAI's ``apps/pathology`` keeps the same in its
``data``)."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import torch
from monai.data import DataLoader
from torch.utils.data import WeightedRandomSampler

from hsmla_med.data.asap import read_asap_xml, rasterise
from hsmla_med.data.datalist import Datalist
from hsmla_med.data.slides import SLIDE_SUFFIXES, coverage, open_slide, patch_grid, select_level, slide_mpp, tissue_mask
from hsmla_med.data.splits import fold_cases
from hsmla_med.data.synthetic.wsi import generate_camelyon16
from hsmla_med.engine.datamodule import CaseDataModule
from hsmla_med.errors import DataError
from hsmla_med.evaluation.pathology import hit_labels, slide_truth
from hsmla_med.io import atomic_path, read_npz_cache
from hsmla_med.pipelines.camelyon16.patch_transforms import _stain, patch_collate, transforms
from hsmla_med.pipelines.task import synthetic_root

log = logging.getLogger("hsmla_med")


LABELS = ["normal", "tumour"]


# in the patch-grid cache key: version 2 takes the grid cells from patch_grid (version 1 cached
# cells computed back from rounded corners, which collide where a level's downsample is fractional);
# version 3: "lesions" is the official evaluation-mask label at each patch centre, with the slide's counts
_GRID_VERSION = 4  # 4: evaluation masks made as ASAP makes them (asap_mask)


def _slides(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*") if p.suffix.lower() in SLIDE_SUFFIXES) if folder.is_dir() else []


def _cases(slides: list[Path], annotations: Path, tumour_folder: bool | None = None) -> list[dict]:
    """Slide dicts ``{"slide", "annotation", "label"}``; a slide is tumour when it has an
    annotation file (or, in CAMELYON16's ``training/tumor`` folder, always)."""
    cases = []
    for slide in slides:
        xml = annotations / f"{slide.stem}.xml"
        is_tumour = xml.is_file() if tumour_folder is None else tumour_folder
        if is_tumour and not xml.is_file():
            log.warning("%s: tumour slide without annotation %s: skipped (its patches cannot be labelled)", slide, xml)
            continue
        cases.append({"slide": str(slide), "annotation": str(xml) if xml.is_file() else None, "label": int(is_tumour)})
    return cases


def find_slides(data_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """Labelled training slides and test slides of ``data_dir``: CAMELYON16's layout
    (``training/normal``, ``training/tumor``, ``training/lesion_annotations``,
    ``testing/images``, ``testing/lesion_annotations``) or ``images/*.tif`` with
    ``annotations/<slide>.xml`` (a slide without annotation is normal)."""
    root = Path(data_dir)
    if not root.is_dir():
        raise DataError(f"{root}: data directory not found")
    if (root / "training").is_dir():
        notes = root / "training" / "lesion_annotations"
        training = _cases(_slides(root / "training" / "normal"), notes, False)
        training += _cases(_slides(root / "training" / "tumor"), notes, True)
        test = _cases(_slides(root / "testing" / "images"), root / "testing" / "lesion_annotations")
    else:
        training, test = _cases(_slides(root / "images"), root / "annotations"), []
    if not training:
        raise DataError(f"{root}: no slides ({', '.join(SLIDE_SUFFIXES)}) in images/ or training/normal, training/tumor")
    return training, test


def datalist(config: dict) -> Datalist:
    """Training/validation/test slides: the user's folder or the synthetic default (generated
    once into ``cache_dir``, logged as synthetic). Validation is a seeded, stratified share of
    the training slides in ``splits_final.json`` (:func:`~hsmla_med.data.splits.fold_cases`),
    stratified tumour/normal."""
    data = config["data"]
    root, synthetic = data["data_dir"], False
    if not root:
        synth = data["synthetic"]
        root = synthetic_root(data, "camelyon16", "CAMELYON16-format slides", "textures, not tissue", lambda root: generate_camelyon16(
            root, synth["num_normal"], synth["num_tumor"], synth["num_test"], tuple(synth["size"]), seed=synth["seed"]))
        synthetic = True
    labelled, test = find_slides(root)
    ids = [Path(c["slide"]).stem for c in labelled]  # the slide name, as the challenge's files name it
    training, validation, record = fold_cases(config, Path(root), labelled, ids, synthetic, classes=[c["label"] for c in labelled])
    if record["file"] is None and test:  # a checkpoint scored on another CAMELYON16-layout dataset: its testing slides are the held-out ones
        validation, record = test, {**record, "val": sorted(Path(c["slide"]).stem for c in test)}
    return Datalist(LABELS, training, validation, test, Path(root), synthetic, record)


def _grid_params(data: dict) -> dict:
    return {k: data[k] for k in ("level", "mpp", "patch_size", "stride", "min_tissue", "tumour_coverage", "tissue_min_area_um2")}


_GRID_KEYS = {"coords", "rows", "cols", "labels", "lesions", "num_lesions", "num_labels", "level", "tissue_downsample", "tissue_fraction"}  # slide_patches: its result


def _cached_grid(cache: Path) -> dict | None:
    """The patch grid cached in ``cache``, or ``None`` when there is none or it is damaged (a
    truncated or foreign file: then the grid is computed again and the file replaced, with a
    log line saying so)."""
    return read_npz_cache(cache, _GRID_KEYS, "patch-grid")


def slide_patches(case: dict, data: dict) -> dict:
    """The patch grid of one slide: level-0 ``coords`` (n, 2) of patches inside tissue, their
    grid ``rows``/``cols``, tumour ``labels`` (annotation coverage >= ``tumour_coverage``), the
    official evaluation-mask label at each patch centre (``lesions``, 0 = none; the point a
    detection on that patch is scored at), the slide's ``num_lesions`` (lesions to detect) and
    ``num_labels`` (its largest label; ITC clusters above ``num_lesions``) from
    :func:`slide_truth`, the pyramid ``level`` and the tissue-mask downsample. Cached per slide file and parameters in ``cache_dir``. ``data``: the
    data section of a task config or a checkpoint. With ``data.stain_normalization``, the slide's
    stain matrix is estimated here too (:func:`~hsmla_med.data.stain.slide_stain`, cached beside the grid)."""
    params = _grid_params(data)
    slide_path = Path(case["slide"])
    stat = slide_path.stat()
    notes = Path(case["annotation"]).stat().st_mtime_ns if case["annotation"] else None
    key = json.dumps([_GRID_VERSION, str(slide_path.resolve()), stat.st_size, stat.st_mtime_ns, case["annotation"], notes, params], sort_keys=True)
    cache = Path(data["cache_dir"]).expanduser() / "camelyon16-patches" / f"{slide_path.stem}-{hashlib.sha1(key.encode()).hexdigest()[:12]}.npz"
    for normalise in _stain(data):  # the slide's stain matrix, estimated here in the main process, cached beside the grid
        normalise.stain(slide_path)
    cached = _cached_grid(cache)
    if cached is not None:
        return cached
    slide = open_slide(slide_path)
    level = select_level(slide, None if params["mpp"] else params["level"], params["mpp"])  # mpp wins when set
    level_ds = float(slide.level_downsamples[level])
    # debris and holes below a physical area: the same tissue at any scanner resolution
    mpp = slide_mpp(slide)
    min_area = data["tissue_min_area_um2"] / mpp**2 if mpp else 2.0**18
    tissue, tissue_ds = tissue_mask(slide, min_area=min_area)
    footprint = params["patch_size"] * level_ds
    coords, cells = patch_grid(tissue, tissue_ds, slide.dimensions, params["patch_size"], params["stride"], level_ds, params["min_tissue"])
    labels = np.zeros(len(coords), dtype=np.int64)
    lesions, num_lesions, num_labels = np.zeros(len(coords), dtype=np.int64), 0, 0
    if case["annotation"]:
        polygons = read_asap_xml(case["annotation"])
        tumour = rasterise(polygons, slide.dimensions, tissue_ds, slide_path.name)
        labels = (coverage(tumour, tissue_ds, coords, footprint) >= params["tumour_coverage"]).astype(np.int64)
        truth, num_lesions, downsample = slide_truth(polygons, slide.dimensions, mpp)
        lesions = hit_labels(truth, downsample, patch_centres(cells, params["stride"] * level_ds, footprint))
        num_labels = int(truth.max())
    result = {
        "coords": coords.astype(np.int64),
        "rows": cells[:, 0],  # each patch its own cell, whole downsample or not (patch_grid)
        "cols": cells[:, 1],
        "labels": labels,
        "lesions": lesions.astype(np.int64),
        "num_lesions": np.int64(num_lesions),
        "num_labels": np.int64(num_labels),
        "level": np.int64(level),
        "tissue_downsample": np.float64(tissue_ds),
        "tissue_fraction": np.float64(tissue.mean()),
    }
    slide.close()
    with atomic_path(cache) as tmp:
        np.savez(tmp, **result)
    return result


def patch_centres(cells: np.ndarray, step: float, footprint: float) -> np.ndarray:
    """Level-0 pixel ``(x, y)`` (int64 ``(n, 2)``) at the centre of the patches of grid ``cells``
    (``(n, 2)`` row, col): the patch of cell (r, c) has its corner at ``round(c * step),
    round(r * step)`` (:func:`~hsmla_med.data.slides.patch_grid`) and covers ``footprint``
    level-0 pixels, however fractional the level's downsample. The point where a detection on
    that patch is scored, in validation and in the lesion CSV alike."""
    corners = np.round(np.asarray(cells, np.int64).reshape(-1, 2)[:, ::-1] * step)
    return np.floor(corners + footprint / 2).astype(np.int64)


def _items(cases: list[dict], config: dict) -> list[dict]:
    """One dict per patch of every slide (the DataModule adds the index ``case``)."""
    items = []
    for s, case in enumerate(cases):
        grid = slide_patches(case, config["data"])
        counts = {"num_lesions": int(grid["num_lesions"]), "num_labels": int(grid["num_labels"])}
        for (x, y), row, col, label, lesion in zip(grid["coords"], grid["rows"], grid["cols"], grid["labels"], grid["lesions"]):
            items.append({
                "slide": case["slide"], "x": int(x), "y": int(y), "level": int(grid["level"]), "size": config["data"]["patch_size"],
                "label": int(label), "lesion": int(lesion), "row": int(row), "col": int(col), "slide_index": s,
                "slide_label": case["label"], **counts,
            })
    return items


class PatchDataModule(CaseDataModule):
    """Patches read lazily (never cached whole), training drawn balanced between tumour and
    normal: ``samples_per_epoch`` draws with replacement, each class half of them."""

    def __init__(self, training: list[dict], validation: list[dict], config: dict) -> None:
        train, val = transforms(config)
        data = config["data"]
        super().__init__(training, validation, train, val, data["batch_size"], data["num_workers"], cache_rate=0.0)
        self.samples_per_epoch = data["samples_per_epoch"]

    def train_dataloader(self) -> DataLoader:
        labels = np.array([item["label"] for item in self.training])
        counts = np.bincount(labels, minlength=2)
        weights = np.where(labels == 1, 0.5 / max(counts[1], 1), 0.5 / max(counts[0], 1))
        if counts.min() == 0:
            log.warning("training patches of one class only (%d normal, %d tumour): sampling without balance", *counts)
            weights = np.ones(len(labels))
        sampler = WeightedRandomSampler(torch.as_tensor(weights, dtype=torch.double), self.samples_per_epoch, replacement=True)
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0, collate_fn=patch_collate)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers, collate_fn=patch_collate)


def datamodule(config: dict, cases: Datalist) -> PatchDataModule:
    train, val = _items(cases.training, config), _items(cases.validation, config)
    log.info("camelyon16: %d training patches (%d tumour), %d validation patches", len(train), sum(i["label"] for i in train), len(val))
    return PatchDataModule(train, val, config)


def grid_patches(index: int, slide: str, data: dict) -> tuple[dict, list[dict]]:
    """The patch grid of the slide at ``slide`` (:func:`slide_patches`, no annotation) and its
    patches as the loader reads them, in grid order: what heatmaps and features are computed on.

    Args:
        index: the slide's place in the run (``slide_index`` of its patches).
        slide: the slide file.
        data: the data section the grid is cut by (a checkpoint's, with the run's level).

    Returns:
        The grid with the slide's geometry added: ``downsample`` (OpenSlide's, of the grid's
        level), ``dimensions`` (level-0 width, height) and ``level_dimensions`` (at the grid's
        level); and one dict per patch: ``slide``, ``slide_index``, level-0 ``x``/``y`` of its
        top-left corner, ``level``, ``size`` and its grid ``row``/``col``.
    """
    grid = slide_patches({"slide": slide, "annotation": None, "label": 0}, data)
    level, size = int(grid["level"]), int(data["patch_size"])
    handle = open_slide(slide)
    grid = {**grid, "downsample": float(handle.level_downsamples[level]), "dimensions": handle.dimensions,
            "level_dimensions": handle.level_dimensions[level]}
    handle.close()
    patches = [{"slide": slide, "slide_index": index, "x": int(x), "y": int(y), "level": level, "size": size, "row": int(r), "col": int(c)}
               for (x, y), r, c in zip(grid["coords"], grid["rows"], grid["cols"])]
    return grid, patches
