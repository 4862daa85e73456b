"""What whole-slide inference writes, slide by slide as its last patch arrives: heatmaps with
the challenge's submission files and the QuPath/ASAP tumour regions (:class:`SlideHeatmaps`),
or patch features in CLAM's layout (:class:`SlideFeatures`) (MONAI's ``apps/pathology``
``handlers``)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from hsmla_med.data.slides import open_slide, slide_mpp, thumbnail
from hsmla_med.engine.classification import ClassificationModule
from hsmla_med.inference.uncertainty import predictive_entropy
from hsmla_med.io import atomic_path, write_json
from hsmla_med.io.annotations import asap_outlines, tumour_regions, write_asap_xml, write_geojson
from hsmla_med.io.lesion_csv import LESIONS, write_lesion_csv
from hsmla_med.io.overlays import gate_overlay, heatmap_overlay
from hsmla_med.io.tiff import write_pyramidal_tiff
from hsmla_med.metrics.pathology import detect_lesions, slide_score
from hsmla_med.pipelines.camelyon16.data import grid_patches, patch_centres

log = logging.getLogger("hsmla_med")


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
    ``features`` carries ``name``, what ``encoder`` holds (``encoder``: what made the features;
    ``mean``, ``std``: the normalisation of the patches scaled to 0..1; ``input_size``: the side
    the encoder saw them at), ``patch_size`` (pixels at the grid's level) and ``mpp`` (the µm per
    pixel of the patches: the slide's level-0 mpp times the level's downsample; NaN where the
    slide records none).

    Args:
        output: the run's folder (``h5_files``, ``pt_files`` go under it).
        data: the data section the grid is cut by (:func:`grid_patches`).
        width: ``D``, the features per patch.
        encoder: the attributes of ``features`` that describe the encoder (``encoder``, ``mean``,
            ``std``, ``input_size``).
        progress: called with one line per slide done.
    """

    empty = "its feature files hold no patch"

    def __init__(self, output: Path, data: dict, width: int, encoder: dict, progress: Callable[[str], None]) -> None:
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
            "min_tissue": float(self.data["min_tissue"]),  # the grid's tissue threshold: a heatmap of the features cuts the same grid
        }
        handle = open_slide(slide["slide"])
        mpp = slide_mpp(handle)
        handle.close()
        described = {"name": stem, **self.encoder, "patch_size": int(self.data["patch_size"]), "mpp": mpp * downsample if mpp else math.nan}
        with atomic_path(slide["output"]) as tmp, h5py.File(tmp, "w") as f:  # closed before the rename
            f.create_dataset("features", data=features).attrs.update(described)
            f.create_dataset("coords", data=np.asarray(grid["coords"], np.int64).reshape(-1, 2)).attrs.update(coords)
        self.progress(f"{Path(slide['slide']).name}: {len(features)} patches x {self.width} features -> {pt}, {slide['output']}")
        slide["features"] = None
        return [pt, slide["output"]]
