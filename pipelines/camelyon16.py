"""CAMELYON16: whole-slide images through OpenSlide, ASAP XML lesion annotations, tumour/normal
patch classification, and whole-slide heatmaps.

What is specific to the benchmark lives here: finding slides and annotations (the CAMELYON16
folders, or a flat ``images/`` + ``annotations/`` layout, or the synthetic default), the patch
grid inside tissue labelled by tumour coverage (cached per slide), reading patches lazily, the
heatmap export with the challenge's submission files, and scoring a submission
(:func:`score_predictions`). The loop and checkpoints are the generic engine's; the metrics are
:mod:`hsmla_med.metrics.pathology`'s (the official CAMELYON16 rules).
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from monai.data import DataLoader, list_data_collate
from monai.transforms import Compose, MapTransform, RandFlipd, RandRotate90d, RandScaleIntensityd, RandShiftIntensityd
from torch.utils.data import WeightedRandomSampler

from hsmla_med.data.asap import TUMOUR_GROUPS, Polygon, asap_mask, rasterise, read_asap_xml
from hsmla_med.data.datalist import Datalist
from hsmla_med.data.splits import fold_cases
from hsmla_med.data.patch_readers import open_patches, requested_reader
from hsmla_med.data.slides import coverage, open_slide, patch_grid, read_mask_level, select_level, slide_mpp, thumbnail, tissue_mask
from hsmla_med.data.stain import hed_jitter, stain_normalization
from hsmla_med.data.synthetic.wsi import generate_camelyon16
from hsmla_med.io.tiff import write_pyramidal_tiff
from hsmla_med.engine.base import hparams
from hsmla_med.engine.classification import ClassificationModule, final_linear
from hsmla_med.engine.datamodule import CaseDataModule
from hsmla_med.errors import DataError, InputError
from hsmla_med.inference.uncertainty import predictive_entropy
from hsmla_med.io.overlays import gate_overlay, heatmap_overlay
from hsmla_med.io.annotations import asap_outlines, tumour_regions, write_asap_xml, write_geojson
from hsmla_med.io import atomic_path, read_npz_cache, write_json
from hsmla_med.metrics.pathology import (GROW_UM, ITC_UM, auc, detect_lesions, evaluation_geometry, evaluation_mask, lesion_froc, slide_fp_tp,
                                         slide_score)
from hsmla_med.pipelines.task import InferenceOptions, Task, input_files, predict_cases, synthetic_root

__all__ = ["TASK", "LABELS", "find_slides", "datalist", "slide_patches", "datamodule", "module_config", "grid_patches", "SlideHeatmaps",
           "SlideFeatures", "held_out", "infer", "extract_features", "slide_truth", "read_lesion_csv", "read_slide_csv", "score_predictions",
           "crossval_score"]

log = logging.getLogger("hsmla_med")
LABELS = ["normal", "tumour"]
# in the patch-grid cache key: version 2 takes the grid cells from patch_grid (version 1 cached
# cells computed back from rounded corners, which collide where a level's downsample is fractional);
# version 3: "lesions" is the official evaluation-mask label at each patch centre, with the slide's counts
_GRID_VERSION = 4  # 4: evaluation masks made as ASAP makes them (asap_mask)
SLIDE_SUFFIXES = (".tif", ".tiff", ".svs", ".ndpi", ".mrxs", ".scn", ".bif")


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


class ReadPatchd(MapTransform):
    """Read the patch ``(slide, x, y, level, size)`` of an item as ``image`` ``(3, size, size)``,
    float32 in 0..1 (for augmentation), or with ``uint8`` the bytes as read (0..255), which
    :class:`~hsmla_med.engine.classification.ClassificationModule` scales on its device: a
    quarter of the bytes through the loader workers' shared memory and the host-to-device copy.
    Slides are opened lazily, once per process (DataLoader workers included), and only the
    patch's region is read, by tifffile or cuCIM where they agree with OpenSlide, else OpenSlide
    (:func:`~hsmla_med.data.patch_readers.open_patches`; ``HSMLA_MED_SLIDE_READER``); ``keep``
    bounds the handles held open (the least recently used closes first; inference reads slide
    after slide and keeps one)."""

    def __init__(self, keep: int | None = None, uint8: bool = False) -> None:
        super().__init__(["slide"])
        requested_reader()  # a bad HSMLA_MED_SLIDE_READER is refused before training or inference starts
        self.keep, self.uint8 = keep, uint8
        self._open: OrderedDict[str, object] = OrderedDict()

    def __call__(self, item: dict) -> dict:
        path = item["slide"]
        if path not in self._open:
            if self.keep is not None and len(self._open) >= self.keep:
                self._open.popitem(last=False)[1].close()
            self._open[path] = open_patches(path)
        self._open.move_to_end(path)
        rgb = self._open[path].read(int(item["x"]), int(item["y"]), int(item["level"]), int(item["size"]))
        image = torch.from_numpy(rgb).permute(2, 0, 1)  # a channels-last view: the networks run channels-last
        return {**item, "image": image if self.uint8 else image.float().div_(255.0)}


def patch_collate(items: list[dict]) -> dict:
    """MONAI's ``list_data_collate`` with the patches' ``image`` stacked channels-last, as the
    networks run: :class:`ReadPatchd`'s images are channels-last views of the bytes read, which
    ``torch.stack`` (``default_collate``) copies into a contiguous NCHW batch by a strided copy
    that the network then undoes (25-40 ms per 32 patches of 256 px against 1.3 ms for stacking
    the pixel rows as read, on this project's 2-vCPU host: docs/benchmarks.md). Hand-written:
    neither MONAI's nor PyTorch's collate takes a memory format."""
    rest = list_data_collate([{k: v for k, v in item.items() if k != "image"} for item in items])
    rest["image"] = torch.stack([torch.as_tensor(item["image"]).permute(1, 2, 0) for item in items]).permute(0, 3, 1, 2)
    return rest


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


def _stain(data: dict) -> list:
    """The stain normalisation ``data.stain_normalization`` asks for (a transform right after
    :class:`ReadPatchd`; none by default), the slides' estimates cached beside their patch grids."""
    return stain_normalization(data, Path(data["cache_dir"]).expanduser() / "camelyon16-patches")


def transforms(config: dict) -> tuple[Compose, Compose]:
    """Patch reading (and stain normalisation, when configured) plus stain-robust augmentation
    (HED stain jitter, per-channel intensity scale and shift, flips, 90-degree rotations) for
    training; patch reading (and normalisation) alone, in bytes, for validation."""
    aug, stain = config["data"]["augment"], _stain(config["data"])
    train = Compose([
        ReadPatchd(),
        *stain,
        RandFlipd("image", prob=aug["flip_prob"], spatial_axis=0),
        RandFlipd("image", prob=aug["flip_prob"], spatial_axis=1),
        RandRotate90d("image", prob=aug["rot90_prob"], max_k=3),
        hed_jitter(aug),
        RandScaleIntensityd("image", factors=aug["colour_scale"], prob=aug["colour_prob"], channel_wise=True),
        RandShiftIntensityd("image", offsets=aug["colour_shift"], prob=aug["colour_prob"], channel_wise=True),
    ])
    return train, Compose([ReadPatchd(uint8=True), *stain])


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


def module_config(config: dict, model: dict, label_names: list[str], in_channels: int = 3) -> dict:
    """The hyper-parameters of :class:`ClassificationModule` for this task config."""
    # stain_normalization: wsi-heatmap and wsi-features normalise as training did
    data = _grid_params(config["data"]) | {"cache_dir": config["data"]["cache_dir"], "stain_normalization": config["data"].get("stain_normalization")}
    return hparams(config, model, label_names, 2, in_channels, dict(config["inference"]), data)


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


class _SlideSink:
    """What heatmaps and features share: the patches of a process's slides for the loader (each
    slide's grid from :func:`grid_patches`), a batch's predictions placed slide by slide, and a
    slide finished when its last patch is in. Subclasses say what a slide holds (:meth:`_start`),
    how a batch is placed (:meth:`_place`), what finishing writes (:meth:`_finish`) and when
    (:meth:`_done`)."""

    empty = ""  # what the warning for a slide without a tissue patch adds

    def patches(self, slides: list[dict]) -> list[dict]:
        """The patches of ``slides`` in order, for the loader (``expand`` of the DataModule)."""
        patches = []
        self.slides = []
        for index, item in enumerate(slides):
            grid, mine = grid_patches(index, item["slide"], self.data)
            self.slides.append({**item, "grid": grid, "left": len(mine), **self._start(grid, mine)})
            patches += mine
            if not mine:
                log.warning("%s: no %d-px patch at level %d holds enough tissue (min_tissue %s): %s",
                            item["slide"], self.data["patch_size"], int(grid["level"]), self.data["min_tissue"], self.empty)
                self._finish(self.slides[-1])
        return patches

    def write(self, prediction: dict) -> list[Path]:
        """Place a batch's predictions; finish the slides it completes."""
        written = []
        index = prediction["slide_index"].numpy()
        for s in np.unique(index):
            slide, mine = self.slides[s], index == s
            self._place(slide, prediction, mine)
            slide["left"] -= int(mine.sum())
            if slide["left"] == 0:
                written += self._done(slide)
        return written

    def _done(self, slide: dict) -> list[Path]:
        return self._finish(slide)


class SlideHeatmaps(_SlideSink):
    """The whole-slide heatmaps of one process: each of its slides' patch grid (the tissue mask,
    computed once, in the main process), the probability and gate maps filled batch by batch as
    predictions arrive, and a slide's files written as soon as its last patch is in.

    Writes per slide ``<slide>_heatmap.tif`` (pyramidal, 0..255, the slide's physical resolution),
    ``<slide>_overlay.png``, ``<slide>_gates.png``, the challenge's lesion CSV
    ``lesions/<slide>.csv`` (:func:`write_lesion_csv`), the tumour regions
    (:func:`~hsmla_med.io.annotations.tumour_regions`) as ``<slide>.geojson`` for QuPath and
    ``<slide>.xml`` for ASAP and, last, ``<slide>.json`` (slide score,
    detections, patch count, tissue fraction, seconds since the previous slide of the process
    finished).
    With ``uncertainty`` (``entropy``) also ``<slide>_uncertainty.tif``: each patch's binary
    entropy (:func:`~hsmla_med.inference.uncertainty.predictive_entropy` of (1 - p, p), 0..255
    for 0..1 bit; 0 where no patch was read) on the heatmap's pixels, pixel size and extent.
    A finished slide's files are written by a background thread while the network goes on with
    the next slide's patches; :meth:`flush` waits for them at the end of the run.
    """

    empty = "the heatmap is empty and the slide scores 0"

    def __init__(self, module: ClassificationModule, output: Path, data: dict, progress: Callable[[str], None],
                 uncertainty: str | None = None) -> None:
        self.module, self.output, self.data, self.progress, self.uncertainty = module, output, data, progress, uncertainty
        self.slides: list[dict] = []
        self.clock = time.perf_counter()
        self._files = ThreadPoolExecutor(max_workers=1, thread_name_prefix="heatmap-files")
        self._pending: list[Future] = []

    def patches(self, slides: list[dict]) -> list[dict]:
        self.clock = time.perf_counter()
        return super().patches(slides)

    def _start(self, grid: dict, patches: list[dict]) -> dict:
        step = self.data["stride"] * grid["downsample"]  # a grid cell in level-0 pixels
        width, height = grid["dimensions"]
        prob = np.full((int(np.ceil(height / step)), int(np.ceil(width / step))), np.nan)
        return {"step": step, "footprint": self.data["patch_size"] * grid["downsample"], "prob": prob, "alpha": prob.copy()}

    def _place(self, slide: dict, prediction: dict, mine: np.ndarray) -> None:
        rows, cols = prediction["row"].numpy()[mine], prediction["col"].numpy()[mine]
        slide["prob"][rows, cols] = prediction["prob"].numpy()[mine]
        if prediction["alpha"] is not None:
            slide["alpha"][rows, cols] = prediction["alpha"].numpy()[mine]

    def _done(self, slide: dict) -> list[Path]:
        self._pending.append(self._files.submit(self._finish, slide))
        return []

    def write(self, prediction: dict) -> list[Path]:
        """Place a batch's probabilities and gate shares; finish the slides it completes (their
        files written in the background: the paths of those done so far)."""
        return super().write(prediction) + self._written()

    def flush(self) -> list[Path]:
        """Wait for every slide's files; the paths written since the last call."""
        return self._written(wait=True)

    def _written(self, wait: bool = False) -> list[Path]:
        """The paths of the background writes that are done (all of them with ``wait``); a
        failed write raises here."""
        done = [f for f in self._pending if wait or f.done()]
        self._pending = [f for f in self._pending if f not in done]
        return [path for f in done for path in f.result()]

    def _finish(self, slide: dict) -> list[Path]:
        prob, alpha, step, grid = slide["prob"], slide["alpha"], slide["step"], slide["grid"]
        handle = open_slide(slide["slide"])
        # k x k heatmap pixels per grid cell, k a power of two taking the long side to >= 1024 px, so
        # that viewers get a pyramid even for small slides; the pixel size stays physical
        scale = 2 ** max(0, int(np.ceil(np.log2(1024 / max(prob.shape + (1,))))))
        mpp = slide_mpp(handle)
        # cut to the slide: the last cell reaches past the slide's edge, and ASAP, which places an
        # overlay by the ratio of the two images' widths (not by pixel size), would squeeze the
        # map by that much; so the heatmap spans the slide within one of its pixels
        width, height = handle.dimensions

        def pixels(cells: np.ndarray) -> np.ndarray:  # 0..1 per grid cell -> the heatmap's 0..255 pixels
            return (np.nan_to_num(cells * 255, nan=0).round().astype(np.uint8).repeat(scale, 0).repeat(scale, 1)
                    [: math.ceil(height * scale / step), : math.ceil(width * scale / step)])

        heat = pixels(prob)
        stem = Path(slide["slide"]).stem
        paths = [self.output / f"{stem}_heatmap.tif", self.output / f"{stem}_overlay.png", self.output / f"{stem}_gates.png",
                 self.output / LESIONS / f"{stem}.csv", self.output / f"{stem}.geojson", self.output / f"{stem}.xml"]
        inference = self.module.config["inference"]
        found = detect_lesions(prob, inference["lesion_threshold"], inference["lesion_radius"])
        points = patch_centres(found[:, 1:], step, slide["footprint"])
        write_lesion_csv(paths[3], found[:, 0], points)
        # a checkpoint older than the region settings: its lesion threshold and slide-score smoothing;
        # the CSV's detections are the polygons' too (one definition of a lesion for the three files)
        regions = tumour_regions(prob, step, handle.dimensions, inference.get("region_threshold", inference["lesion_threshold"]),
                                 inference.get("region_sigma", inference["slide_sigma"]), detections=(found[:, 0], points))
        write_geojson(paths[4], regions, mpp)
        write_asap_xml(paths[5], asap_outlines(regions))
        write_pyramidal_tiff(paths[0], heat, mpp * step / scale if mpp else None)
        if self.uncertainty is not None:  # the heatmap's pixels, so it registers to the slide as the heatmap does
            entropy = predictive_entropy(torch.from_numpy(np.stack([1 - prob, prob])), dim=0).numpy()
            paths.append(write_pyramidal_tiff(self.output / f"{stem}_uncertainty.tif", pixels(entropy), mpp * step / scale if mpp else None))
        # thumbnail cut or padded with glass to the grid's extent (a part of a cell beyond the slide edge)
        thumb, thumb_ds = thumbnail(handle)
        handle.close()
        rows, cols = np.maximum(np.round(np.array(prob.shape) * step / thumb_ds).astype(int), 1)
        thumb = np.pad(thumb[:rows, :cols], ((0, max(0, rows - thumb.shape[0])), (0, max(0, cols - thumb.shape[1])), (0, 0)), constant_values=255)
        heatmap_overlay(paths[1], thumb, prob, title=f"{stem}: tumour probability")
        gate_overlay(paths[2], thumb, alpha, title=f"{stem}: HSMLA tiles refined")
        now = time.perf_counter()
        record = {
            "slide": slide["slide"],
            "score": slide_score(prob, inference["slide_sigma"]),
            "detections": len(found),
            "patches": len(grid["coords"]),
            "heatmap_pixels_per_cell": scale,
            "tissue_fraction": float(grid["tissue_fraction"]),
            "mean_alpha": float(np.nanmean(alpha)) if np.isfinite(alpha).any() else None,
            "seconds": now - self.clock,
        }
        self.clock = now
        write_json(slide["output"], record)  # last: it marks the slide done
        self.progress(f"{Path(slide['slide']).name}: slide score {record['score']:.3f}, {record['patches']} patches, {record['seconds']:.1f} s "
                      f"-> {paths[0]}, {slide['output']}")
        slide.update(prob=None, alpha=None)
        return [*paths, slide["output"]]


FEATURES_H5, FEATURES_PT = "h5_files", "pt_files"  # CLAM's folders (extract_features_fp.py), which its training reads


class SlideFeatures(_SlideSink):
    """The patch features of one process's slides in CLAM's layout, filled batch by batch as
    predictions arrive (``features`` of :meth:`ClassificationModule.predict_step
    <hsmla_med.engine.classification.ClassificationModule.predict_step>`), a slide's files written
    as soon as its last patch is in.

    Writes per slide ``pt_files/<slide>.pt``, the features as one float32 tensor ``(N, D)``
    (what CLAM's training loads), then, last (it marks the slide done),
    ``h5_files/<slide>.h5`` with the datasets ``features`` (float32 ``(N, D)``) and ``coords``
    (int64 ``(N, 2)``, level-0 x, y of each patch's top-left corner: the heatmap's grid, in its
    order), each written to a temporary name and renamed. ``coords`` carries the attributes that
    CLAM's and Trident's loaders read: ``patch_level``, ``patch_size`` (pixels at that level),
    ``patch_size_level0`` (``patch_size`` times the level's downsample, rounded: the patch's
    level-0 footprint), ``downsample`` (x, y), ``level_dim`` and ``downsampled_level_dim`` (the
    level's width, height), ``level0_width``, ``level0_height`` and ``name`` (the slide's stem);
    ``features`` carries ``name`` and ``encoder`` (the checkpoint and the layer whose input the
    features are).

    Args:
        output: the run's folder (``h5_files``, ``pt_files`` go under it).
        data: the data section the grid is cut by (:func:`grid_patches`).
        width: ``D``, the features per patch (the final linear layer's ``in_features``).
        encoder: what made the features, for the ``encoder`` attribute.
        progress: called with one line per slide done.
    """

    empty = "its feature files hold no patch"

    def __init__(self, output: Path, data: dict, width: int, encoder: str, progress: Callable[[str], None]) -> None:
        self.output, self.data, self.width, self.encoder, self.progress = output, data, width, encoder, progress
        self.slides: list[dict] = []

    def _start(self, grid: dict, patches: list[dict]) -> dict:
        # a patch's row in the files, from its grid cell (every patch has its own: patch_grid)
        order = np.zeros((int(grid["rows"].max(initial=-1)) + 1, int(grid["cols"].max(initial=-1)) + 1), np.int64)
        order[grid["rows"], grid["cols"]] = np.arange(len(patches))
        return {"order": order, "features": np.zeros((len(patches), self.width), np.float32)}

    def _place(self, slide: dict, prediction: dict, mine: np.ndarray) -> None:
        rows = slide["order"][prediction["row"].numpy()[mine], prediction["col"].numpy()[mine]]
        slide["features"][rows] = prediction["features"].numpy()[mine]

    def _finish(self, slide: dict) -> list[Path]:
        import h5py  # here: every command imports this module, only wsi-features writes HDF5

        grid, stem, features = slide["grid"], Path(slide["slide"]).stem, slide["features"]
        pt = self.output / FEATURES_PT / f"{stem}.pt"
        with atomic_path(pt) as tmp:
            torch.save(torch.from_numpy(features), tmp)
        downsample = grid["downsample"]
        coords = {
            "patch_level": int(grid["level"]), "patch_size": int(self.data["patch_size"]),
            "patch_size_level0": int(round(self.data["patch_size"] * downsample)),
            "downsample": (downsample, downsample), "level_dim": grid["level_dimensions"], "downsampled_level_dim": grid["level_dimensions"],
            "level0_width": grid["dimensions"][0], "level0_height": grid["dimensions"][1], "name": stem,
        }
        with atomic_path(slide["output"]) as tmp, h5py.File(tmp, "w") as f:  # closed before the rename
            f.create_dataset("features", data=features).attrs.update({"name": stem, "encoder": self.encoder})
            f.create_dataset("coords", data=np.asarray(grid["coords"], np.int64).reshape(-1, 2)).attrs.update(coords)
        self.progress(f"{Path(slide['slide']).name}: {len(features)} patches x {self.width} features -> {pt}, {slide['output']}")
        slide["features"] = None
        return [pt, slide["output"]]


def held_out(cases: Datalist) -> list[str]:
    """The slides ``demo`` writes heatmaps of after training: the test slides."""
    return [c["slide"] for c in cases.test]


def infer(module: ClassificationModule, inputs: str | Path | Iterable[str | Path], output: str | Path,
          options: InferenceOptions = InferenceOptions()) -> list[Path]:
    """Tumour-probability heatmaps (:class:`SlideHeatmaps`) of a slide, a folder of slides or a list of them in
    Lightning's predict loop (:func:`predict_cases`): slides split over processes and shards;
    patches read by ``options.num_workers`` DataLoader workers (one OpenSlide handle each), in
    batches of ``options.batch_size`` (else the checkpoint's), at pyramid level
    ``options.level`` (else the checkpoint's level or mpp), mixed precision on CUDA. A slide
    whose ``<slide>.json`` exists is skipped, so an interrupted run resumes slide by slide (the
    JSON is written last)."""
    output = Path(output)
    slides, data = _run_slides(module, inputs, options, "heatmaps")
    if options.uncertainty not in (None, "entropy"):
        raise InputError(f"--uncertainty {options.uncertainty}: a slide's patches are predicted once; wsi-heatmap writes --uncertainty entropy")
    heatmaps = SlideHeatmaps(module, output, data, options.progress, options.uncertainty)
    items = [{"name": slide.stem, "slide": str(slide), "output": output / f"{slide.stem}.json"} for slide in slides]

    def slide_csv() -> list[Path]:
        """The run's slide-level CSV from the scores of its slides done so far (resumed ones too)."""
        done = [item for item in items if item["output"].is_file()]
        if len(done) < len(items):
            options.progress(f"{SLIDE_CSV}: {len(done)} of {len(items)} slide(s) so far (the others are other shards')")
        scores = {item["name"]: json.loads(item["output"].read_text())["score"] for item in done}
        write_slide_csv(output / SLIDE_CSV, scores)
        return [output / SLIDE_CSV]

    return _predict_patches(module, items, heatmaps, options, finish=slide_csv, flush=heatmaps.flush)


def extract_features(module: ClassificationModule, inputs: str | Path | Iterable[str | Path], output: str | Path,
                     options: InferenceOptions = InferenceOptions()) -> list[Path]:
    """Patch features for multiple-instance learning (CLAM, Trident) of a slide, a folder of
    slides or a list of them, in CLAM's layout (:class:`SlideFeatures`): ``h5_files/<slide>.h5``
    and ``pt_files/<slide>.pt`` under ``output``. A patch's features are the classifier's
    penultimate activations, the input of its final linear layer
    (:func:`~hsmla_med.engine.classification.penultimate`); the patches are the heatmap's (the
    same grid, reading, loop, processes and shards as :func:`infer`). A slide whose h5 this
    checkpoint wrote with the same options is skipped (the h5 is written last).

    Returns (first process) every slide's h5; on other processes, the files they wrote.

    Raises:
        ConfigError: the network has no final linear layer (before any slide is read).
        DataError: naming a slide OpenSlide cannot read.
    """
    output = Path(output)
    name, layer = final_linear(module.network, getattr(module, "checkpoint_path", None) or "the network")
    slides, data = _run_slides(module, inputs, options, "features")
    encoder = f"{getattr(module, 'checkpoint_path', None) or type(module.network).__name__}: input of {name}"
    features = SlideFeatures(output, data, layer.in_features, encoder, options.progress)
    items = [{"name": slide.stem, "slide": str(slide), "output": output / FEATURES_H5 / f"{slide.stem}.h5"} for slide in slides]
    module.predict_features = True
    try:
        return _predict_patches(module, items, features, options, folder=output)
    finally:
        module.predict_features = False


def _run_slides(module: ClassificationModule, inputs: str | Path | Iterable[str | Path], options: InferenceOptions,
                what: str) -> tuple[list[Path], dict]:
    """The slides of ``inputs`` and the data section their patch grid is cut by: the
    checkpoint's, at ``options.level`` when given (else its level or mpp)."""
    slides = input_files(inputs, _slides)
    if not slides:
        raise DataError(f"{inputs}: no slides ({', '.join(SLIDE_SUFFIXES)}) found")
    if options.tta:
        log.warning("camelyon16: --tta is not used for %s", what)
    return slides, module.config["data"] if options.level is None else {**module.config["data"], "level": options.level, "mpp": None}


def _predict_patches(module: ClassificationModule, items: list[dict], sink: SlideHeatmaps | SlideFeatures, options: InferenceOptions,
                     **extra) -> list[Path]:
    """The patches of the slide ``items`` (``sink.patches``) in Lightning's predict loop
    (:func:`predict_cases`, ``extra`` its ``finish``/``flush``), read as bytes (one
    :class:`ReadPatchd` per loader worker) in batches of ``options.batch_size`` (else the
    checkpoint's), each batch's predictions handed to ``sink.write``."""
    read = Compose([ReadPatchd(keep=1, uint8=True), *_stain(sink.data)])  # normalised bytes, rounded, as validation saw them
    return predict_cases(module, items, read, sink.write, options, collate=patch_collate, expand=sink.patches,
                         batch_size=options.batch_size or module.config["inference"]["batch_size"], **extra)


# The challenge's submission (camelyon16.grand-challenge.org/Evaluation): one CSV per slide, named
# as the slide, a row "Confidence,X,Y" (level-0 pixels, no header) per detected lesion, which
# Evaluation_FROC.py reads from a folder of nothing else (every *.csv there is a slide's); and one
# CSV of "image name, probability of metastasis" for the slide-level ROC.
LESIONS = "lesions"
SLIDE_CSV = "slides.csv"
SLIDE_CSV_HEADER = ("Image", "Confidence")


def write_lesion_csv(path: Path, confidences: np.ndarray, points: np.ndarray) -> None:
    """A slide's lesion CSV: ``Confidence,X,Y`` rows, most confident first, no header. X and Y are
    integers (the official reader takes them with ``int()``); confidences are written to round
    trip exactly (``repr``), so a submission scores as the maps it came from."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text("".join(f"{float(p)!r},{int(x)},{int(y)}\n" for p, (x, y) in zip(confidences, np.asarray(points).reshape(-1, 2))))


def write_slide_csv(path: Path, scores: dict[str, float]) -> None:
    """The slide-level CSV: header ``Image,Confidence``, then ``<slide name>,<score>`` per slide."""
    with atomic_path(path) as tmp, tmp.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(SLIDE_CSV_HEADER)
        writer.writerows([name, repr(float(score))] for name, score in sorted(scores.items()))


def _number(text: str, path: Path, line: int, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise DataError(f"{path}: line {line}: {what} {text.strip()!r} is not a finite number")
    return value


def _coordinate(text: str, path: Path, line: int, axis: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise DataError(f"{path}: line {line}: {axis} {text.strip()!r} is not an integer (level-0 pixels; "
                        "Evaluation_FROC.py reads coordinates with int(), which refuses decimals)") from None


def read_lesion_csv(path: Path) -> np.ndarray:
    """A lesion CSV as ``(n, 3)`` float64 ``(confidence, x, y)``; blank lines skipped.

    Where the official ``readCSVContent`` would stop with a traceback (a header, a word, a
    missing column, a coordinate with decimals, which its ``int()`` refuses), this raises one
    :class:`DataError` naming the file and line. Coordinates must be non-negative integers."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split(",")
        if len(fields) != 3:
            raise DataError(f"{path}: line {number}: {line.strip()!r} is not 'Confidence,X,Y' (three numbers, no header)")
        rows.append([_number(fields[0], path, number, "confidence"), *(_coordinate(t, path, number, a) for t, a in zip(fields[1:], "XY"))])
        if min(rows[-1][1:]) < 0:
            raise DataError(f"{path}: line {number}: negative coordinate in {line.strip()!r} (level-0 pixels start at 0)")
    return np.array(rows, np.float64).reshape(-1, 3)


def read_slide_csv(path: Path) -> dict[str, float]:
    """The slide-level CSV: ``{slide name: confidence}`` from ``name,confidence`` rows (a slide
    file's extension is dropped); a first line whose second field is not a number is a header."""
    scores = {}
    with path.open(newline="") as f:
        for number, fields in enumerate(csv.reader(f), 1):
            if not fields or not "".join(fields).strip():
                continue
            if len(fields) != 2:
                raise DataError(f"{path}: line {number}: {','.join(fields)!r} is not 'Image,Confidence'")
            if number == 1 and _is_header(fields[1]):
                continue
            name = fields[0].strip()
            scores[Path(name).stem if Path(name).suffix.lower() in SLIDE_SUFFIXES else name] = _number(fields[1], path, number, "confidence")
    return scores


def _is_header(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return True
    return False


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


def crossval_score(folds: list[tuple[Datalist, Path]], output: Path, config: dict) -> dict:
    """Every fold's validation lesion CSVs linked into ``output/predictions/lesions``, their
    slide scores merged into one ``slides.csv``, their annotations linked into
    ``output/labels``, scored by the official rules (the slides' sizes from the dataset)."""
    from hsmla_med.crossval import pool_file

    scores: dict[str, float] = {}
    for cases, folder in folds:
        scores.update(read_slide_csv(folder / SLIDE_CSV))
        for case in cases.validation:
            name = Path(case["slide"]).stem
            pool_file(folder / LESIONS / f"{name}.csv", output / "predictions" / LESIONS / f"{name}.csv")
            if case["annotation"]:
                pool_file(Path(case["annotation"]), output / "labels" / f"{name}.xml")
    (output / "labels").mkdir(parents=True, exist_ok=True)  # all normal: no annotation at all
    write_slide_csv(output / "predictions" / SLIDE_CSV, scores)
    return score_predictions(output / "predictions", output / "labels", output, {"data_dir": folds[0][0].source})


def score_predictions(predictions: Path, labels: Path, output: Path, options: dict) -> dict:
    """Score a CAMELYON16 submission (``evaluate --task camelyon16 --predictions DIR --labels XML_DIR``).

    ``DIR`` holds the lesion CSVs (``DIR/lesions/<slide>.csv``, as ``wsi-heatmap`` writes them,
    or ``DIR/<slide>.csv``, the challenge's layout) and, optionally, the slide-level
    ``DIR/slides.csv``. The slides scored are those with a lesion CSV; ``XML_DIR/<slide>.xml``
    is a slide's ASAP annotation, and a slide without one (or with one without tumour outlines)
    is normal. Lesion-level FROC by the official rules (:func:`slide_truth`, :func:`slide_fp_tp`,
    :func:`lesion_froc`); slide AUC of ``slides.csv`` over its slides when it has both classes.

    A slide's tumour mask is its ground-truth mask TIFF ``<slide>_Mask.tif`` where there is one
    (``options["masks"]``, ``evaluate --masks DIR``; else a ``Masks`` or ``Ground_Truth/Masks``
    folder beside the annotation folder, :func:`mask_folder`), read as the official script reads
    it; else the mask ASAP makes of its XML (:func:`~hsmla_med.data.asap.asap_mask`). The
    XML's mask needs the slide's level-0 size and resolution: the slide file of the same name is
    looked for under ``--data-dir`` (else under the annotation folder's parent, e.g.
    CAMELYON16's ``testing/images``); without one, the mask covers the outlines' extent (plus
    the growth) at the official 0.243 µm and level 5, which gives the official result on
    CAMELYON16's slides, and a detection beyond it counts as a false positive. Where the slide's
    size is known, a detection outside the slide, or in the last partial row or column of its
    evaluation mask (which the official lookup cannot index), is refused in one line.

    Writes ``OUTPUT/summary.json`` (atomically): ``froc``, ``sensitivity`` at the six rates,
    ``lesions``, ``slides``, ``auc`` (null without a slide CSV or with one class),
    ``metric_per_case`` (a row per slide) and the ``rules``.
    """
    if not predictions.is_dir():
        raise DataError(f"{predictions}: --predictions for camelyon16 is a folder of lesion CSVs (and {SLIDE_CSV})")
    if not labels.is_dir():
        raise DataError(f"{labels}: --labels for camelyon16 is the folder of ASAP XML annotations")
    folder = predictions / LESIONS if (predictions / LESIONS).is_dir() else predictions
    csvs = sorted(p for p in folder.glob("*.csv") if not (folder == predictions and p.name == SLIDE_CSV))
    if not csvs:
        raise DataError(f"{folder}: no lesion CSVs (<slide>.csv)")
    data_dir = Path(options["data_dir"]) if options.get("data_dir") else None
    masks = mask_folder(labels, options.get("masks"))
    if masks is not None:
        log.info("ground-truth masks: %s (<slide>_Mask.tif; a slide without one: its XML, rasterised as ASAP does)", masks)
    counts, rows = zip(*(_score_slide(path, labels, data_dir, masks) for path in csvs))
    froc = lesion_froc(list(counts))
    summary = {"task": "camelyon16", **froc, "auc": None, "auc_slides": 0}
    if (predictions / SLIDE_CSV).is_file():
        scores = read_slide_csv(predictions / SLIDE_CSV)
        tumour = [int(_mask_file(name, masks) is not None) or _has_tumour(labels / f"{name}.xml") for name in scores]
        value = auc(list(scores.values()), tumour) if scores else math.nan
        summary.update(auc=None if math.isnan(value) else value, auc_slides=len(scores))
    summary["rules"] = {"grow_um": GROW_UM, "itc_major_axis_um": ITC_UM, "evaluation": "Evaluation_FROC.py (CAMELYON16)"}
    summary["metric_per_case"] = list(rows)
    write_json(output / "summary.json", summary)
    return summary


def _has_tumour(xml: Path) -> int:
    return int(xml.is_file() and any(p.group in TUMOUR_GROUPS for p in read_asap_xml(xml)))


class CAMELYON16(Task):
    """CAMELYON16 tumour/normal patch classification and whole-slide heatmaps."""

    name = "camelyon16"
    module_class = ClassificationModule
    in_channels = 3
    input_key = "slide"

    def score_lines(self, summary: dict, output: Path) -> list[str]:
        fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
        sens = ", ".join(f"{rate} FP: {fmt(v)}" for rate, v in summary["sensitivity"].items())
        return [f"{summary['slides']} slides, {summary['lesions']} lesions: FROC {fmt(summary['froc'])} ({sens}); "
                f"slide AUC {fmt(summary['auc'])}", f"summary: {output / 'summary.json'}"]


TASK = CAMELYON16()
