"""Whole-slide heatmap throughput: HSMLA-B0 / B1 patch classifiers against MONAI's ResNet-18 in
one run, on synthetic CAMELYON16-format slides of two sizes (the second 9x the area: 671
patches in tissue) and, for the HSMLA models, on a dense slide of 6400 tissue patches
(:func:`dense_slide`), the scale of a real slide's tissue at level 0.

Each (model, slide, mode) runs in a fresh process that reports its wall time and peak
resident-set growth. Modes: ``forward`` (the network alone on the slide's patches, read into
memory beforehand: the ceiling), ``loop-0-R`` (``camelyon16.infer`` with patches read by reader
R, ``openslide``, ``tifffile`` or ``cucim``, in the main process between forward passes, as the loop before
Lightning's predict loop did) and ``loop-W-R`` (the same with W DataLoader workers reading
ahead); the cuCIM modes run where cuCIM is installed. The processes run with the allocator
settings of ``hsmla-med`` itself (:mod:`hsmla_med.runtime`), as a user's run would. Throughput is patches per second of the
whole heatmap: reading, classifying and writing the TIFF, overlays and JSON. Random weights;
HSMLA taus calibrated to alpha 0.3.

    hsmla-med bench --only wsi --out bench_out
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from hsmla_med.bench.common import status_kib
from hsmla_med.data.patch_readers import READER_ENV

MODELS = ("HSMLA-B0", "HSMLA-B1", "ResNet-18 (MONAI)")
SIZES = ((8192, 6144), (24576, 18432))
# A slide with the tissue patch count of a real CAMELYON16 slide at level 0 (tens of thousands:
# here 80 x 80 = 6400 tissue tiles), where the per-slide cost is amortised as it is on real data;
# HSMLA-B0, the subject, only: B1 (50 patches/s on two cores) would take 2 minutes a run
# there, ResNet-18 (5-15 patches/s) 7 to 20.
DENSE_TILES = 80
DENSE_MODELS = ("HSMLA-B0",)


def dense_slide(path: Path, tiles: int = DENSE_TILES, tile: int = 256, seed: int = 0, source: tuple[int, int] = (4096, 3072)) -> Path:
    """A synthetic slide of ``tiles`` x ``tiles`` tissue tiles (``tile`` px, each a whole tissue
    patch of a generated CAMELYON16-format tumour slide, drawn with random flips and transposes)
    framed by 4 tiles of glass on every side, so that the tissue mask (Otsu on saturation)
    finds tissue against glass as on a real slide; ``source`` is the generated slide's size. The generator itself renders a whole slide in
    memory in float32 (about 28 bytes a pixel): a slide of this much tissue would need tens of GiB."""
    from hsmla_med.data.slides import coverage, open_slide, tissue_mask
    from hsmla_med.data.synthetic.wsi import generate_camelyon16
    from hsmla_med.io.tiff import write_pyramidal_tiff

    source_root = generate_camelyon16(path.parent / "dense-source", num_normal=0, num_tumor=1, num_test=0, size=source, seed=seed)
    source = open_slide(next((source_root / "training" / "tumor").glob("*.tif")))
    width, height = source.dimensions
    level0 = np.asarray(source.read_region((0, 0), 0, (width, height)).convert("RGB"))
    mpp = float(source.properties["openslide.mpp-x"])
    mask, downsample = tissue_mask(source, min_area=_data_config(path, tile)["tissue_min_area_um2"] / mpp**2)
    source.close()
    step = tile // 8  # any crop, not only the tile grid's: small sources have few whole-tissue grid tiles
    corners = np.array([(x, y) for y in range(0, height - tile + 1, step) for x in range(0, width - tile + 1, step)])
    share = coverage(mask, downsample, corners, tile)
    tissue, glass = corners[share == 1.0], corners[share == 0.0]
    rng = np.random.default_rng(seed)
    side = (tiles + 8) * tile
    image = np.empty((side, side, 3), np.uint8)
    for row in range(tiles + 8):
        for col in range(tiles + 8):
            inside = 4 <= row < tiles + 4 and 4 <= col < tiles + 4
            x, y = (tissue if inside else glass)[rng.integers(len(tissue if inside else glass))]
            block = level0[y : y + tile, x : x + tile]
            block = block[:: rng.choice((1, -1)), :: rng.choice((1, -1))]
            image[row * tile : (row + 1) * tile, col * tile : (col + 1) * tile] = block.transpose(1, 0, 2) if rng.random() < 0.5 else block
    write_pyramidal_tiff(path, image, mpp, compression="jpeg")
    return path


def _data_config(cache: Path, patch: int) -> dict:
    return {"level": 0, "mpp": None, "patch_size": patch, "stride": patch, "min_tissue": 0.5, "tumour_coverage": 0.5,
            "tissue_min_area_um2": 15000, "cache_dir": str(cache)}


def _module(model: str, cache: Path, patch: int, batch: int):
    from monai.networks.nets import resnet18

    from hsmla_med.config import merge_config, task_config
    from hsmla_med.engine.classification import ClassificationModule
    from hsmla_med.nn import calibrate_tau
    from hsmla_med.pipelines import camelyon16

    config = merge_config(task_config("camelyon16"), {"model": model.split("-")[1].lower() if model.startswith("HSMLA") else "b0"})
    hp = camelyon16.module_config(config, {"variant": config["model"]}, camelyon16.LABELS)
    hp["data"] = _data_config(cache, patch)
    hp["inference"]["batch_size"] = batch
    network = None if model.startswith("HSMLA") else resnet18(spatial_dims=2, n_input_channels=3, num_classes=2)
    module = ClassificationModule(hp, network=network).eval()
    if model.startswith("HSMLA"):
        calibrate_tau(module.network, torch.rand(4, 3, patch, patch), 0.3)
    return module


def _child(model: str, slide: str, cache: str, patch: int, batch: int, mode: str) -> None:
    """In a fresh process: one heatmap (or the forward passes alone), its seconds and peak
    resident-set growth (MiB)."""
    from hsmla_med.pipelines import camelyon16
    from hsmla_med.pipelines.task import InferenceOptions

    module = _module(model, Path(cache), patch, batch)
    with torch.inference_mode():
        module.network(torch.rand(batch, 3, patch, patch))  # thread pools, oneDNN primitives
    if mode == "forward":
        # uint8 and channels-last, as the loop's patches travel (float32 would be 5 GB on the
        # dense slide), scaled per batch inside the timed part as the module scales them
        read = camelyon16.ReadPatchd(keep=1, uint8=True)
        grid = camelyon16.slide_patches({"slide": slide, "annotation": None, "label": 0}, module.config["data"])
        patches = camelyon16.patch_collate([
            read({"slide": slide, "x": x, "y": y, "level": int(grid["level"]), "size": patch}) for x, y in grid["coords"]
        ])["image"]
    with tempfile.TemporaryDirectory() as out:
        base = status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # peak (VmHWM) := current resident set
        start = time.perf_counter()
        if mode == "forward":
            with torch.inference_mode():
                for i in range(0, len(patches), batch):
                    torch.softmax(module.network(patches[i : i + batch].float().div_(255.0)), 1)
            count = len(patches)
        else:
            _, workers, reader = mode.split("-")
            os.environ[READER_ENV] = reader  # read when the loader opens the slide
            workers = int(workers)
            options = InferenceOptions(batch_size=batch, num_workers=workers, progress=lambda _: None)
            camelyon16.infer(module, slide, out, options)
            count = json.loads((Path(out) / f"{Path(slide).stem}.json").read_text())["patches"]
        seconds = time.perf_counter() - start
        peak = status_kib("VmHWM")
    print(json.dumps({"patches": count, "seconds": seconds, "peak_mib": (peak - base) / 1024}))


def default_modes() -> tuple[str, ...]:
    """The forward passes alone, the loop with each reader installed, and with one worker reading ahead."""
    readers = ("openslide", "tifffile", "cucim") if importlib.util.find_spec("cucim") else ("openslide", "tifffile")
    return ("forward", *(f"loop-0-{r}" for r in readers), f"loop-1-{readers[-1]}")


def bench_wsi(patch: int = 256, batch: int = 32, rounds: int = 2, modes: tuple[str, ...] | None = None,
              sizes: tuple[tuple[int, int], ...] = SIZES, dense_models: tuple[str, ...] = DENSE_MODELS) -> list[dict]:
    """Rows ``model, slide, mode, patches, seconds, patches_per_s, peak_mib`` (best of
    ``rounds`` interleaved runs) and ``vs_forward``, the throughput over the same model's
    ``forward`` throughput on the same slide. ``sizes``: the generated slides (every model);
    ``dense_models``: the models run on the dense slide (none: no dense slide)."""
    from hsmla_med.data.synthetic.wsi import generate_camelyon16
    from hsmla_med.pipelines import camelyon16

    modes = modes or default_modes()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        slides = []
        for w, h in sizes:
            root = generate_camelyon16(tmp / f"{w}x{h}", num_normal=0, num_tumor=1, num_test=0, size=(w, h), seed=1)
            slides.append((f"{w}x{h}", next((root / "training" / "tumor").glob("*.tif")), MODELS))
        if dense_models:
            side = (DENSE_TILES + 8) * 256
            slides.append((f"{side}x{side} dense", dense_slide(tmp / "dense" / "dense.tif"), dense_models))
        for _, slide, _ in slides:
            # the patch grid (tissue mask) is computed once here, not inside the timed runs
            camelyon16.slide_patches({"slide": str(slide), "annotation": None, "label": 0}, _data_config(tmp / "cache", patch))
        best: dict[tuple[str, str, str], dict] = {}
        for _ in range(rounds):
            for name, slide, models in slides:
                for model in models:
                    for mode in modes:
                        cmd = [sys.executable, "-m", "hsmla_med.bench.wsi", model, str(slide), str(tmp / "cache"), str(patch), str(batch), mode]
                        result = subprocess.run(cmd, capture_output=True, text=True, check=True)
                        run = json.loads(result.stdout.strip().splitlines()[-1])
                        key = (model, name, mode)
                        if key not in best or run["seconds"] < best[key]["seconds"]:
                            best[key] = run
                        print(f"  {model} on {name}, {mode}: {run['patches']} patches, {run['seconds']:.2f} s, {run['peak_mib']:.0f} MiB", flush=True)
    rows = [
        {"model": model, "slide": name, "mode": mode, "patches": r["patches"], "seconds": r["seconds"],
         "patches_per_s": r["patches"] / r["seconds"], "peak_mib": r["peak_mib"]}
        for (model, name, mode), r in best.items()
    ]
    forward = {(r["model"], r["slide"]): r["patches_per_s"] for r in rows if r["mode"] == "forward"}
    for r in rows:
        r["vs_forward"] = r["patches_per_s"] / forward[(r["model"], r["slide"])] if (r["model"], r["slide"]) in forward else ""
    return rows


if __name__ == "__main__":
    from hsmla_med.runtime import tune_cpu_allocator

    tune_cpu_allocator()
    torch.set_num_threads(os.cpu_count())
    _child(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
