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
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from monai.data import DataLoader
from monai.transforms import Compose, MapTransform, RandFlipd, RandRotate90d, RandScaleIntensityd, RandShiftIntensityd
from torch.utils.data import WeightedRandomSampler

from hsmla_med.data.asap import rasterise, read_asap_xml
from hsmla_med.data.datalist import Datalist, split_cases
from hsmla_med.data.slides import coverage, open_slide, patch_grid, read_region, select_level, slide_mpp, tissue_mask
from hsmla_med.data.synthetic_wsi import generate_camelyon16
from hsmla_med.data.tiff import write_pyramidal_tiff
from hsmla_med.engine.base import hparams
from hsmla_med.engine.classification import ClassificationModule
from hsmla_med.engine.datamodule import CaseDataModule
from hsmla_med.errors import DataError
from hsmla_med.inference.overlays import gate_overlay, heatmap_overlay
from hsmla_med.io import atomic_path, write_json
from hsmla_med.metrics.pathology import lesion_labels, slide_score
from hsmla_med.nn import GatedNetwork
from hsmla_med.pipelines.task import InferenceOptions, Task, synthetic_root

__all__ = ["TASK", "LABELS", "find_slides", "datalist", "slide_patches", "datamodule", "module_config", "heatmap", "held_out", "infer"]

log = logging.getLogger("hsmla_med")
LABELS = ["normal", "tumour"]
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
    the training slides."""
    data = config["data"]
    root, synthetic = data["data_dir"], False
    if not root:
        synth = data["synthetic"]
        root = synthetic_root(data, "camelyon16", "CAMELYON16-format slides", "textures, not tissue")
        generate_camelyon16(root, synth["num_normal"], synth["num_tumor"], synth["num_test"], tuple(synth["size"]), seed=synth["seed"])
        synthetic = True
    training, test = find_slides(root)
    training, validation = split_cases(training, data["validation_fraction"], config["seed"], classes=[c["label"] for c in training])
    if not validation:
        raise DataError(f"{root}: need at least two slides of a class to hold one out for validation")
    return Datalist(LABELS, training, validation, test, Path(root), synthetic)


def _grid_params(data: dict) -> dict:
    return {k: data[k] for k in ("level", "mpp", "patch_size", "stride", "min_tissue", "tumour_coverage", "tissue_min_area_um2")}


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
    key = json.dumps([str(slide_path.resolve()), stat.st_size, stat.st_mtime_ns, case["annotation"], notes, params], sort_keys=True)
    cache = Path(data["cache_dir"]).expanduser() / "camelyon16-patches" / f"{slide_path.stem}-{hashlib.sha1(key.encode()).hexdigest()[:12]}.npz"
    if cache.is_file():
        with np.load(cache) as f:
            return {k: f[k] for k in f.files}
    slide = open_slide(slide_path)
    level = select_level(slide, None if params["mpp"] else params["level"], params["mpp"])  # mpp wins when set
    level_ds = float(slide.level_downsamples[level])
    # debris and holes below a physical area: the same tissue at any scanner resolution
    mpp = slide_mpp(slide)
    min_area = data["tissue_min_area_um2"] / mpp**2 if mpp else 2.0**18
    tissue, tissue_ds = tissue_mask(slide, min_area=min_area)
    footprint = params["patch_size"] * level_ds
    coords = patch_grid(tissue, tissue_ds, slide.dimensions, params["patch_size"], params["stride"], level_ds, params["min_tissue"])
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
    step = params["stride"] * level_ds
    result = {
        "coords": coords.astype(np.int64),
        "rows": (coords[:, 1] // step).astype(np.int64),
        "cols": (coords[:, 0] // step).astype(np.int64),
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
    """Read the patch ``(slide, x, y, level, size)`` of an item as ``image`` ``(3, size, size)``
    float32 in 0..1. Slides are opened lazily, once per process (DataLoader workers included),
    and only the patch's region is read."""

    def __init__(self) -> None:
        super().__init__(["slide"])
        self._open: dict[str, object] = {}

    def __call__(self, item: dict) -> dict:
        path = item["slide"]
        if path not in self._open:
            self._open[path] = open_slide(path)
        rgb = read_region(self._open[path], int(item["x"]), int(item["y"]), int(item["level"]), int(item["size"]))
        return {**item, "image": torch.from_numpy(np.ascontiguousarray(rgb.transpose(2, 0, 1))).float() / 255.0}


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
    flips, 90-degree rotations) for training; patch reading alone for validation."""
    aug = config["data"]["augment"]
    train = Compose([
        ReadPatchd(),
        RandFlipd("image", prob=aug["flip_prob"], spatial_axis=0),
        RandFlipd("image", prob=aug["flip_prob"], spatial_axis=1),
        RandRotate90d("image", prob=aug["rot90_prob"], max_k=3),
        RandScaleIntensityd("image", factors=aug["colour_scale"], prob=aug["colour_prob"], channel_wise=True),
        RandShiftIntensityd("image", offsets=aug["colour_shift"], prob=aug["colour_prob"], channel_wise=True),
    ])
    return train, Compose([ReadPatchd()])


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


def _patch_alpha(network: torch.nn.Module) -> torch.Tensor | None:
    """Per sample of the last forward: the share of gate tiles above tau, over all HSMLA layers."""
    if not isinstance(network, GatedNetwork):
        return None
    shares = [
        (layer.last_gate > layer.tau).flatten(1).float().mean(1)
        for layer in network.hsmla_layers().values()
        if layer.last_gate is not None
    ]
    return torch.stack(shares).mean(0) if shares else None


def heatmap(
    module: ClassificationModule, slide_path: str | Path, output: str | Path, batch_size: int | None = None, device: str = "cpu",
    progress: Callable[[int, int], None] | None = None, level: int | None = None,
) -> dict:
    """Tumour-probability heatmap of one slide: patches in tissue are streamed in batches
    through the network; writes ``<slide>_heatmap.tif`` (pyramidal, 0..255, the slide's
    physical resolution), ``<slide>_overlay.png``, ``<slide>_gates.png`` and, last,
    ``<slide>.json`` (slide score, patch count, tissue fraction, seconds). Returns the JSON.
    ``level``: the pyramid level of the patches instead of the checkpoint's (level or mpp)."""
    started = time.perf_counter()
    slide_path, output = Path(slide_path), Path(output)
    data = module.config["data"] if level is None else {**module.config["data"], "level": level, "mpp": None}
    grid = slide_patches({"slide": str(slide_path), "annotation": None, "label": 0}, data)
    slide = open_slide(slide_path)
    level, size = int(grid["level"]), int(data["patch_size"])
    tissue_ds = float(grid["tissue_downsample"])
    n = len(grid["coords"])
    if n == 0:
        log.warning("%s: no %d-px patch at level %d holds enough tissue (min_tissue %s): the heatmap is empty and the slide scores 0",
                    slide_path, size, level, data["min_tissue"])
    # the grid covers the whole slide from its origin, so map cells line up with slide pixels
    step_level0 = data["stride"] * float(slide.level_downsamples[level])
    width, height = slide.dimensions
    prob = np.full((int(np.ceil(height / step_level0)), int(np.ceil(width / step_level0))), np.nan)
    alpha = prob.copy()
    network = module.network.to(device).eval()
    batch_size = batch_size or module.config["inference"]["batch_size"]
    with torch.inference_mode():
        for start in range(0, n, batch_size):
            coords = grid["coords"][start : start + batch_size]
            patches = np.stack([read_region(slide, int(x), int(y), level, size) for x, y in coords])
            x = torch.from_numpy(patches.transpose(0, 3, 1, 2).copy()).float().div_(255.0).to(device)
            p = torch.softmax(network(x).float(), 1)[:, 1].cpu().numpy()
            rows, cols = grid["rows"][start : start + batch_size], grid["cols"][start : start + batch_size]
            prob[rows, cols] = p
            a = _patch_alpha(network)
            if a is not None:
                alpha[rows, cols] = a.cpu().numpy()
            if progress:
                progress(min(start + batch_size, n), n)
    streamed = time.perf_counter() - started
    # k x k heatmap pixels per grid cell, k a power of two taking the long side to >= 1024 px, so
    # that viewers get a pyramid even for small slides; the pixel size stays physical
    scale = 2 ** max(0, int(np.ceil(np.log2(1024 / max(prob.shape + (1,))))))
    mpp = slide_mpp(slide)
    heat = np.nan_to_num(prob * 255, nan=0).round().astype(np.uint8).repeat(scale, 0).repeat(scale, 1)
    stem = slide_path.stem
    write_pyramidal_tiff(output / f"{stem}_heatmap.tif", heat, mpp * step_level0 / scale if mpp else None)
    # thumbnail padded with glass to the grid's extent (a part of a cell beyond the slide edge)
    thumb = np.asarray(slide.get_thumbnail((width / tissue_ds, height / tissue_ds)).convert("RGB"))
    extent = np.round(np.array(prob.shape) * step_level0 / height * thumb.shape[0]).astype(int)
    thumb = np.pad(thumb, ((0, max(0, extent[0] - thumb.shape[0])), (0, max(0, extent[1] - thumb.shape[1])), (0, 0)), constant_values=255)
    heatmap_overlay(output / f"{stem}_overlay.png", thumb, prob, title=f"{stem}: tumour probability")
    gate_overlay(output / f"{stem}_gates.png", thumb, alpha, title=f"{stem}: HSMLA tiles refined")
    slide.close()
    record = {
        "slide": str(slide_path),
        "score": slide_score(prob, module.config["inference"]["slide_sigma"]),
        "patches": n,
        "heatmap_pixels_per_cell": scale,
        "tissue_fraction": float(grid["tissue_fraction"]),
        "mean_alpha": float(np.nanmean(alpha)) if np.isfinite(alpha).any() else None,
        "seconds": time.perf_counter() - started,
        "seconds_patches": streamed,  # grid, reading and classifying the patches; the rest is writing
    }
    write_json(output / f"{stem}.json", record)
    return record


def held_out(cases: Datalist) -> list[str]:
    """The slides ``demo`` writes heatmaps of after training: the test slides."""
    return [c["slide"] for c in cases.test]


def infer(module: ClassificationModule, inputs: str | Path, output: str | Path, options: InferenceOptions = InferenceOptions()) -> list[Path]:
    """Heatmaps for a slide or a folder of slides (``options``: ``device``, ``batch_size``,
    ``level``). A slide whose ``<slide>.json`` exists is skipped, so an interrupted run resumes
    slide by slide (the JSON is written last)."""
    from tqdm import tqdm

    inputs = Path(inputs)
    if not inputs.exists():
        raise DataError(f"{inputs}: slide or folder not found")
    slides = _slides(inputs) if inputs.is_dir() else [inputs]
    if not slides:
        raise DataError(f"{inputs}: no slides ({', '.join(SLIDE_SUFFIXES)}) found")
    if options.tta:
        log.warning("camelyon16: --tta is not used for heatmaps")
    written = []
    for i, slide in enumerate(slides, 1):
        record = Path(output) / f"{slide.stem}.json"
        if record.is_file():
            options.progress(f"[{i}/{len(slides)}] {slide.name}: done before ({record}), skipped")
        else:
            with tqdm(desc=f"[{i}/{len(slides)}] {slide.name}", unit="patch") as bar:
                def advance(done: int, total: int) -> None:
                    bar.total = total
                    bar.update(done - bar.n)

                summary = heatmap(module, slide, output, options.batch_size, options.device, advance, options.level)
            options.progress(f"[{i}/{len(slides)}] {slide.name}: score {summary['score']:.3f}, {summary['patches']} patches, {summary['seconds']:.1f} s")
        written.append(record)
    return written


class CAMELYON16(Task):
    """CAMELYON16 tumour/normal patch classification and whole-slide heatmaps."""

    name = "camelyon16"
    module_class = ClassificationModule
    in_channels = 3
    inputs = "whole slides (any format OpenSlide opens) or a folder of them"
    outputs = "OUTPUT/<slide>_heatmap.tif (pyramidal), _overlay.png, _gates.png and <slide>.json"


TASK = CAMELYON16()
