"""CAMELYON16: whole-slide images through OpenSlide, ASAP XML lesion annotations, tumour/normal
patch classification, and whole-slide heatmaps.

What is specific to the benchmark lives here: finding slides and annotations (the CAMELYON16
folders, or a flat ``images/`` + ``annotations/`` layout, or the synthetic default), the patch
grid inside tissue labelled by tumour coverage (cached per slide), reading patches lazily, and
the heatmap export. The loop and checkpoints are the generic engine's; the metrics are
:mod:`hsmla_med.metrics.pathology`'s.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from monai.data import DataLoader, list_data_collate
from monai.transforms import Compose, MapTransform, RandFlipd, RandRotate90d, RandScaleIntensityd, RandShiftIntensityd
from torch.utils.data import WeightedRandomSampler

from hsmla_med.data.asap import rasterise, read_asap_xml
from hsmla_med.data.datalist import Datalist
from hsmla_med.data.splits import fold_cases
from hsmla_med.data.patch_readers import open_patches, requested_reader
from hsmla_med.data.slides import coverage, open_slide, patch_grid, select_level, slide_mpp, thumbnail, tissue_mask
from hsmla_med.data.synthetic.wsi import generate_camelyon16
from hsmla_med.io.tiff import write_pyramidal_tiff
from hsmla_med.engine.base import hparams
from hsmla_med.engine.classification import ClassificationModule
from hsmla_med.engine.datamodule import CaseDataModule
from hsmla_med.errors import DataError
from hsmla_med.io.overlays import gate_overlay, heatmap_overlay
from hsmla_med.io import atomic_path, write_json
from hsmla_med.metrics.pathology import lesion_labels, slide_score
from hsmla_med.pipelines.task import InferenceOptions, Task, predict_cases, synthetic_root

__all__ = ["TASK", "LABELS", "find_slides", "datalist", "slide_patches", "datamodule", "module_config", "SlideHeatmaps", "held_out", "infer"]

log = logging.getLogger("hsmla_med")
LABELS = ["normal", "tumour"]
# in the patch-grid cache key: version 2 takes the grid cells from patch_grid (version 1 cached
# cells computed back from rounded corners, which collide where a level's downsample is fractional)
_GRID_VERSION = 2
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
    ids = [Path(c["image"]).stem for c in labelled]  # the slide name, as the challenge's files name it
    training, validation, record = fold_cases(config, Path(root), labelled, ids, synthetic, classes=[c["label"] for c in labelled])
    return Datalist(LABELS, training, validation, test, Path(root), synthetic, record)


def _grid_params(data: dict) -> dict:
    return {k: data[k] for k in ("level", "mpp", "patch_size", "stride", "min_tissue", "tumour_coverage", "tissue_min_area_um2")}


_GRID_KEYS = {"coords", "rows", "cols", "labels", "lesions", "level", "tissue_downsample", "tissue_fraction"}  # slide_patches: its result


def _cached_grid(cache: Path) -> dict | None:
    """The patch grid cached in ``cache``, or ``None`` when there is none or it is damaged (a
    truncated or foreign file: then the grid is computed again and the file replaced, with a
    log line saying so)."""
    if not cache.is_file():
        return None
    try:
        with np.load(cache) as f:  # no pickles: a foreign file is refused, not run
            grid = {k: f[k] for k in f.files}
        if set(grid) == _GRID_KEYS:
            return grid
        problem = f"it holds {sorted(grid)}"
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as err:
        problem = str(err) or type(err).__name__
    log.warning("%s: damaged patch-grid cache (%s); computing the grid again", cache, problem)
    return None


def slide_patches(case: dict, data: dict) -> dict:
    """The patch grid of one slide: level-0 ``coords`` (n, 2) of patches inside tissue, their
    grid ``rows``/``cols``, tumour ``labels`` (annotation coverage >= ``tumour_coverage``), the
    ``lesions`` id under each patch centre (0 = none), the pyramid ``level`` and the
    tissue-mask downsample. Cached per slide file and parameters in ``cache_dir``. ``data``: the
    data section of a task config or a checkpoint."""
    params = _grid_params(data)
    slide_path = Path(case["slide"])
    stat = slide_path.stat()
    notes = Path(case["annotation"]).stat().st_mtime_ns if case["annotation"] else None
    key = json.dumps([_GRID_VERSION, str(slide_path.resolve()), stat.st_size, stat.st_mtime_ns, case["annotation"], notes, params], sort_keys=True)
    cache = Path(data["cache_dir"]).expanduser() / "camelyon16-patches" / f"{slide_path.stem}-{hashlib.sha1(key.encode()).hexdigest()[:12]}.npz"
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
    lesions = np.zeros(len(coords), dtype=np.int64)
    if case["annotation"]:
        tumour = rasterise(read_asap_xml(case["annotation"]), slide.dimensions, tissue_ds, slide_path.name)
        labels = (coverage(tumour, tissue_ds, coords, footprint) >= params["tumour_coverage"]).astype(np.int64)
        ids = lesion_labels(tumour)
        centre = ((coords + footprint / 2) / tissue_ds).astype(np.int64)
        cy = np.clip(centre[:, 1], 0, ids.shape[0] - 1)
        cx = np.clip(centre[:, 0], 0, ids.shape[1] - 1)
        lesions = np.where(labels > 0, ids[cy, cx], 0)
    result = {
        "coords": coords.astype(np.int64),
        "rows": cells[:, 0],  # each patch its own cell, whole downsample or not (patch_grid)
        "cols": cells[:, 1],
        "labels": labels,
        "lesions": lesions.astype(np.int64),
        "level": np.int64(level),
        "tissue_downsample": np.float64(tissue_ds),
        "tissue_fraction": np.float64(tissue.mean()),
    }
    slide.close()
    with atomic_path(cache) as tmp:
        np.savez(tmp, **result)
    return result


class ReadPatchd(MapTransform):
    """Read the patch ``(slide, x, y, level, size)`` of an item as ``image`` ``(3, size, size)``,
    float32 in 0..1 (for augmentation), or with ``uint8`` the bytes as read (0..255), which
    :class:`~hsmla_med.engine.classification.ClassificationModule` scales on its device: a
    quarter of the bytes through the loader workers' shared memory and the host-to-device copy.
    Slides are opened lazily, once per process (DataLoader workers included), and only the
    patch's region is read, by cuCIM where installed, else OpenSlide
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


def _items(cases: list[dict], config: dict) -> list[dict]:
    """One dict per patch of every slide (the DataModule adds the index ``case``)."""
    items = []
    for s, case in enumerate(cases):
        grid = slide_patches(case, config["data"])
        for (x, y), row, col, label, lesion in zip(grid["coords"], grid["rows"], grid["cols"], grid["labels"], grid["lesions"]):
            items.append({
                "slide": case["slide"], "x": int(x), "y": int(y), "level": int(grid["level"]), "size": config["data"]["patch_size"],
                "label": int(label), "lesion": int(lesion), "row": int(row), "col": int(col), "slide_index": s,
                "slide_label": case["label"],
            })
    return items


def transforms(config: dict) -> tuple[Compose, Compose]:
    """Patch reading plus stain-robust augmentation (per-channel intensity scale and shift,
    flips, 90-degree rotations) for training; patch reading alone, in bytes, for validation."""
    aug = config["data"]["augment"]
    train = Compose([
        ReadPatchd(),
        RandFlipd("image", prob=aug["flip_prob"], spatial_axis=0),
        RandFlipd("image", prob=aug["flip_prob"], spatial_axis=1),
        RandRotate90d("image", prob=aug["rot90_prob"], max_k=3),
        RandScaleIntensityd("image", factors=aug["colour_scale"], prob=aug["colour_prob"], channel_wise=True),
        RandShiftIntensityd("image", offsets=aug["colour_shift"], prob=aug["colour_prob"], channel_wise=True),
    ])
    return train, Compose([ReadPatchd(uint8=True)])


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
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)


def datamodule(config: dict, cases: Datalist) -> PatchDataModule:
    train, val = _items(cases.training, config), _items(cases.validation, config)
    log.info("camelyon16: %d training patches (%d tumour), %d validation patches", len(train), sum(i["label"] for i in train), len(val))
    return PatchDataModule(train, val, config)


def module_config(config: dict, model: dict, label_names: list[str], in_channels: int = 3) -> dict:
    """The hyper-parameters of :class:`ClassificationModule` for this task config."""
    data = _grid_params(config["data"]) | {"cache_dir": config["data"]["cache_dir"]}
    return hparams(config, model, label_names, 2, in_channels, dict(config["inference"]), data)


class SlideHeatmaps:
    """The whole-slide heatmaps of one process: each of its slides' patch grid (the tissue mask,
    computed once, in the main process), the probability and gate maps filled batch by batch as
    predictions arrive, and a slide's files written as soon as its last patch is in.

    Writes per slide ``<slide>_heatmap.tif`` (pyramidal, 0..255, the slide's physical resolution),
    ``<slide>_overlay.png``, ``<slide>_gates.png`` and, last, ``<slide>.json`` (slide score,
    patch count, tissue fraction, seconds since the previous slide of the process finished).
    A finished slide's files are written by a background thread while the network goes on with
    the next slide's patches; :meth:`flush` waits for them at the end of the run.
    """

    def __init__(self, module: ClassificationModule, output: Path, data: dict, progress: Callable[[str], None]) -> None:
        self.module, self.output, self.data, self.progress = module, output, data, progress
        self.slides: list[dict] = []
        self.clock = time.perf_counter()
        self._files = ThreadPoolExecutor(max_workers=1, thread_name_prefix="heatmap-files")
        self._pending: list[Future] = []

    def patches(self, slides: list[dict]) -> list[dict]:
        """The patches of ``slides`` in order, for the loader (``expand`` of the DataModule)."""
        patches = []
        self.slides, self.clock = [], time.perf_counter()
        for index, item in enumerate(slides):
            grid = slide_patches({"slide": item["slide"], "annotation": None, "label": 0}, self.data)
            level, size = int(grid["level"]), int(self.data["patch_size"])
            slide = open_slide(item["slide"])
            step = self.data["stride"] * float(slide.level_downsamples[level])  # a grid cell in level-0 pixels
            width, height = slide.dimensions
            slide.close()
            prob = np.full((int(np.ceil(height / step)), int(np.ceil(width / step))), np.nan)
            self.slides.append({**item, "grid": grid, "step": step, "prob": prob, "alpha": prob.copy(), "left": len(grid["coords"])})
            patches += [
                {"slide": item["slide"], "slide_index": index, "x": int(x), "y": int(y), "level": level, "size": size, "row": int(r), "col": int(c)}
                for (x, y), r, c in zip(grid["coords"], grid["rows"], grid["cols"])
            ]
            if not len(grid["coords"]):
                log.warning("%s: no %d-px patch at level %d holds enough tissue (min_tissue %s): the heatmap is empty and the slide scores 0",
                            item["slide"], size, level, self.data["min_tissue"])
                self._finish(self.slides[-1])
        return patches

    def write(self, prediction: dict) -> list[Path]:
        """Place a batch's probabilities and gate shares; finish the slides it completes."""
        written = []
        index = prediction["slide_index"].numpy()
        for s in np.unique(index):
            slide, mine = self.slides[s], index == s
            rows, cols = prediction["row"].numpy()[mine], prediction["col"].numpy()[mine]
            slide["prob"][rows, cols] = prediction["prob"].numpy()[mine]
            if prediction["alpha"] is not None:
                slide["alpha"][rows, cols] = prediction["alpha"].numpy()[mine]
            slide["left"] -= int(mine.sum())
            if slide["left"] == 0:
                self._pending.append(self._files.submit(self._finish, slide))
        return written + self._written()

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
        heat = np.nan_to_num(prob * 255, nan=0).round().astype(np.uint8).repeat(scale, 0).repeat(scale, 1)
        stem = Path(slide["slide"]).stem
        paths = [self.output / f"{stem}_heatmap.tif", self.output / f"{stem}_overlay.png", self.output / f"{stem}_gates.png"]
        write_pyramidal_tiff(paths[0], heat, mpp * step / scale if mpp else None)
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
            "score": slide_score(prob, self.module.config["inference"]["slide_sigma"]),
            "patches": len(grid["coords"]),
            "heatmap_pixels_per_cell": scale,
            "tissue_fraction": float(grid["tissue_fraction"]),
            "mean_alpha": float(np.nanmean(alpha)) if np.isfinite(alpha).any() else None,
            "seconds": now - self.clock,
        }
        self.clock = now
        write_json(slide["output"], record)  # last: it marks the slide done
        self.progress(f"{Path(slide['slide']).name}: score {record['score']:.3f}, {record['patches']} patches, {record['seconds']:.1f} s")
        slide.update(prob=None, alpha=None)
        return [*paths, slide["output"]]


def held_out(cases: Datalist) -> list[str]:
    """The slides ``demo`` writes heatmaps of after training: the test slides."""
    return [c["slide"] for c in cases.test]


def infer(module: ClassificationModule, inputs: str | Path, output: str | Path, options: InferenceOptions = InferenceOptions()) -> list[Path]:
    """Tumour-probability heatmaps (:class:`SlideHeatmaps`) of a slide or a folder of slides in
    Lightning's predict loop (:func:`predict_cases`): slides split over processes and shards;
    patches read by ``options.num_workers`` DataLoader workers (one OpenSlide handle each), in
    batches of ``options.batch_size`` (else the checkpoint's), at pyramid level
    ``options.level`` (else the checkpoint's level or mpp), mixed precision on CUDA. A slide
    whose ``<slide>.json`` exists is skipped, so an interrupted run resumes slide by slide (the
    JSON is written last)."""
    inputs, output = Path(inputs), Path(output)
    if not inputs.exists():
        raise DataError(f"{inputs}: slide or folder not found")
    slides = _slides(inputs) if inputs.is_dir() else [inputs]
    if not slides:
        raise DataError(f"{inputs}: no slides ({', '.join(SLIDE_SUFFIXES)}) found")
    if options.tta:
        log.warning("camelyon16: --tta is not used for heatmaps")
    data = module.config["data"] if options.level is None else {**module.config["data"], "level": options.level, "mpp": None}
    heatmaps = SlideHeatmaps(module, output, data, options.progress)
    items = [{"name": slide.stem, "slide": str(slide), "output": output / f"{slide.stem}.json"} for slide in slides]
    return predict_cases(
        module, items, ReadPatchd(keep=1, uint8=True), heatmaps.write, options, flush=heatmaps.flush,
        batch_size=options.batch_size or module.config["inference"]["batch_size"], collate=list_data_collate, expand=heatmaps.patches,
    )


class CAMELYON16(Task):
    """CAMELYON16 tumour/normal patch classification and whole-slide heatmaps."""

    name = "camelyon16"
    module_class = ClassificationModule
    in_channels = 3
    inputs = "whole slides (any format OpenSlide opens) or a folder of them"
    outputs = "OUTPUT/<slide>_heatmap.tif (pyramidal), _overlay.png, _gates.png and <slide>.json"


TASK = CAMELYON16()
