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

On a CUDA device (``device``; ``hsmla-med bench --only wsi --device cuda``) the processes run
the network there as ``hsmla-med wsi-heatmap`` does by default: the loop is ``camelyon16.infer``
with that device (Lightning's predict loop, ``precision="auto"``: bf16 autocast where the GPU
supports it, else float16; the network replayed from CUDA graphs, ``module.graphed()``), and
``forward`` times the same per-batch work without the reading: each batch of the loop's size
moved to the device as Lightning moves it, ``predict_step`` (the graphed network, softmax, the
gate share, the results copied back) under the same autocast, the clock read after
``torch.cuda.synchronize()``. Both warm up (the graph of the batch shape captured, Triton's
kernels compiled) before the clock starts, as on the CPU they warm up the thread pools. The
default there is the issue's case alone: HSMLA-B0 on the dense slide, one round, the forward
and the loop with 8 and with 4 tifffile workers (a GPU host has cores to spare for readers):
about 45 s on a 16-core H100/H200 host, estimated (the dense slide about 12 s, then about 10 s a
process, the first one's Triton compiles on top). Without that device, one line says so and
nothing is measured.

    hsmla-med bench --only wsi --out bench_out
    hsmla-med bench --only wsi --device cuda --out bench_out/gpu/wsi
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from hsmla_med.bench.common import status_kib
from hsmla_med.data.patch_readers import READER_ENV, READERS
from hsmla_med.errors import ConfigError

MODELS = ("HSMLA-B0", "HSMLA-B1", "ResNet-18 (MONAI)")
SIZES = ((8192, 6144), (24576, 18432))
# A slide with the tissue patch count of a real CAMELYON16 slide at level 0 (tens of thousands:
# here 80 x 80 = 6400 tissue tiles), where the per-slide cost is amortised as it is on real data;
# HSMLA-B0, the subject, only: B1 (50 patches/s on two cores) would take 2 minutes a run
# there, ResNet-18 (5-15 patches/s) 7 to 20.
DENSE_TILES = 80
DENSE_MODELS = ("HSMLA-B0",)
SLIDE_READERS = ("openslide", "tifffile", "cucim")
# on CUDA: DataLoader workers of the loop modes (a GPU host's cores read while the GPU classifies)
# and of the forward mode's untimed read of the patches into memory (6400 reads in one process
# would take longer than the timed part)
CUDA_WORKERS = (8, 4)
PRELOAD_WORKERS = 8


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
    rows = []  # the blocks of each row of tiles, drawn in order (the same slide for a seed)
    for row in range(tiles + 8):
        rows.append([])
        for col in range(tiles + 8):
            inside = 4 <= row < tiles + 4 and 4 <= col < tiles + 4
            x, y = (tissue if inside else glass)[rng.integers(len(tissue if inside else glass))]
            block = level0[y : y + tile, x : x + tile]
            block = block[:: rng.choice((1, -1)), :: rng.choice((1, -1))]
            rows[-1].append(block.transpose(1, 0, 2) if rng.random() < 0.5 else block)

    def place(row: int) -> None:
        for col, block in enumerate(rows[row]):
            image[row * tile : (row + 1) * tile, col * tile : (col + 1) * tile] = block

    # copied by threads (NumPy's copies release the GIL): one thread took 9 s of the dense slide's 21 on two cores
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(place, range(tiles + 8)))
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


def _precision(device: str) -> tuple[str, object]:
    """The precision ``camelyon16.infer`` runs at on ``device`` with its default ``precision="auto"``
    (the choice of :func:`hsmla_med.engine.prediction.run_prediction`: bf16-mixed where the GPU
    supports it, else 16-mixed; 32-true on the CPU), and a factory of the context Lightning's
    predict loop runs ``predict_step`` in at that precision (its ``MixedPrecision`` plugin:
    autocast without the weight cache)."""
    from hsmla_med.engine.run import _precision as choose

    name = choose({"precision": "auto", "accelerator": "gpu" if torch.device(device).type == "cuda" else "cpu"})
    if name in ("16-mixed", "bf16-mixed"):
        from lightning.pytorch.plugins.precision import MixedPrecision

        return name, MixedPrecision(name, device=torch.device(device).type).predict_step_context
    return name, nullcontext


def _patch_batches(slide: str, module, patch: int, batch: int, workers: int) -> list[dict]:
    """The slide's tissue patches as the loop's batches (uint8, channels-last, with their places),
    read by ``workers`` DataLoader workers (0: in this process), kept in this process's memory."""
    from monai.data import Dataset
    from torch.utils.data import DataLoader

    from hsmla_med.pipelines import camelyon16

    grid = camelyon16.slide_patches({"slide": slide, "annotation": None, "label": 0}, module.config["data"])
    items = [{"slide": slide, "x": int(x), "y": int(y), "level": int(grid["level"]), "size": patch, "row": int(r), "col": int(c), "slide_index": 0}
             for (x, y), r, c in zip(grid["coords"], grid["rows"], grid["cols"])]
    loader = DataLoader(Dataset(items, camelyon16.ReadPatchd(keep=1, uint8=True)), batch_size=batch, num_workers=workers,
                        collate_fn=camelyon16.patch_collate)
    # copies out of the workers' shared memory, which would otherwise hold every batch
    return [{k: v.clone() if isinstance(v, torch.Tensor) and workers else v for k, v in b.items()} for b in loader]


def _child(model: str, slide: str, cache: str, patch: int, batch: int, mode: str, device: str = "cpu") -> dict:
    """In a fresh process: one heatmap (or the forward passes alone) on ``device``: its patches,
    seconds and peak resident-set growth (MiB)."""
    from lightning.fabric.utilities.apply_func import move_data_to_device

    from hsmla_med.pipelines import camelyon16
    from hsmla_med.pipelines.task import InferenceOptions

    on = torch.device(device)
    cuda = on.type == "cuda"
    if cuda and on.index is not None:
        torch.cuda.set_device(on)  # (cuda:N: the current device of the graphs' streams, as Lightning sets it)
    module = _module(model, Path(cache), patch, batch).to(on)
    _, precision = _precision(device)
    # the network's first calls outside the clock, for both modes: thread pools and oneDNN
    # primitives on the CPU; on CUDA Triton's kernels and the graph of the batch shape, captured
    # under the loop's autocast (the loop then replays it: graphs are kept on the module)
    warm = torch.randint(0, 256, (batch, patch, patch, 3), dtype=torch.uint8).permute(0, 3, 1, 2)
    place = {k: torch.zeros(batch, dtype=torch.long) for k in ("slide_index", "row", "col")}
    with torch.inference_mode(), precision():
        for _ in range(2 if cuda else 1):
            module.predict_step(move_data_to_device({"image": warm, **place}, on))
    if cuda:
        torch.cuda.synchronize(on)
    if mode == "forward":
        # uint8 and channels-last in the loop's batches, as the loop's patches travel (float32
        # would be 5 GB on the dense slide), moved and scaled per batch inside the timed part
        batches = _patch_batches(slide, module, patch, batch, PRELOAD_WORKERS if cuda else 0)
    with tempfile.TemporaryDirectory() as out:
        base = status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # peak (VmHWM) := current resident set
        start = time.perf_counter()
        if mode == "forward":
            with torch.inference_mode(), precision():
                for b in batches:  # what Lightning's predict loop does with a batch (the batch hooks, a no-op here, aside)
                    module.predict_step(move_data_to_device(b, on))
            if cuda:
                torch.cuda.synchronize(on)
            count = sum(len(b["image"]) for b in batches)
        else:
            _, workers, reader = mode.split("-")
            os.environ[READER_ENV] = reader  # read when the loader opens the slide
            options = InferenceOptions(device=device, batch_size=batch, num_workers=int(workers), progress=lambda _: None)
            camelyon16.infer(module, slide, out, options)
            if cuda:
                torch.cuda.synchronize(on)
            count = json.loads((Path(out) / f"{Path(slide).stem}.json").read_text())["patches"]
        seconds = time.perf_counter() - start
        peak = status_kib("VmHWM")
    return {"patches": count, "seconds": seconds, "peak_mib": (peak - base) / 1024}


def default_modes(device: str = "cpu") -> tuple[str, ...]:
    """On the CPU: the forward passes alone, the loop with each reader installed, and with one
    worker reading ahead. On CUDA: the forward passes and the loop with 8 and with 4 tifffile
    workers (the reader ``auto`` takes for these slides; is half the readers enough?) and, where
    installed, 8 cuCIM workers, most important first (the OpenSlide reader, ``loop-8-openslide``,
    on request: a process more would take the default past a minute)."""
    readers = SLIDE_READERS if importlib.util.find_spec("cucim") else SLIDE_READERS[:2]
    if torch.device(device).type == "cuda":
        many, few = CUDA_WORKERS
        return ("forward", f"loop-{many}-tifffile", f"loop-{few}-tifffile", *((f"loop-{many}-cucim",) if "cucim" in readers else ()))
    return ("forward", *(f"loop-0-{r}" for r in readers), f"loop-1-{readers[-1]}")


def _check_modes(modes: tuple[str, ...]) -> None:
    for mode in modes:
        parts = mode.split("-")
        if mode != "forward" and not (len(parts) == 3 and parts[0] == "loop" and parts[1].isdigit() and parts[2] in READERS):
            raise ConfigError(f"wsi benchmark mode {mode!r}: use forward or loop-W-R (W DataLoader workers, R one of {', '.join(READERS)})")


def device_problem(device: str) -> str | None:
    """Why ``device`` cannot run the heatmaps on this machine (a CUDA device it lacks), or ``None``
    (the test of :func:`hsmla_med.bench.gpu.device_problem`, said for this table)."""
    on = torch.device(device)
    if on.type == "cuda" and (on.index or 0) >= torch.cuda.device_count():
        return f"no such CUDA device on this machine ({torch.cuda.device_count()} found); nothing measured (without --device the heatmaps run on the CPU)"
    return None


def _run(cmd: list[str]) -> dict | str:
    """One child process: its JSON line, or (it failed) the end of what it wrote to stderr."""
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        tail = [line for line in result.stderr.strip().splitlines() if line.strip()][-5:]
        return f"exit status {result.returncode}" + "".join(f"\n      {line}" for line in tail)
    return json.loads(result.stdout.strip().splitlines()[-1])


def bench_wsi(patch: int = 256, batch: int = 32, rounds: int | None = None, modes: tuple[str, ...] | None = None,
              sizes: tuple[tuple[int, int], ...] | None = None, dense_models: tuple[str, ...] = DENSE_MODELS,
              device: str = "cpu") -> list[dict]:
    """Rows ``model, slide, mode, patches, seconds, patches_per_s, peak_mib`` (best of
    ``rounds`` interleaved runs) and ``vs_forward``, the throughput over the same model's
    ``forward`` throughput on the same slide. ``sizes``: the generated slides (every model);
    ``dense_models``: the models run on the dense slide (none: no dense slide).

    ``device``: where the children run the network (``cpu``, ``cuda``, ``cuda:N``). Defaults by device: ``rounds`` 2 on the CPU, 1
    on CUDA; ``sizes`` :data:`SIZES` on the CPU, none on CUDA (the dense slide alone, where the
    per-slide costs are amortised); ``modes`` :func:`default_modes`. A child that fails is a line
    with the end of its error, and no row.

    Raises:
        ConfigError: ``device`` names a CUDA device this machine lacks, or a mode is not
            ``forward`` or ``loop-W-R``.
        RuntimeError: every child failed.
    """
    from hsmla_med.data.synthetic.wsi import generate_camelyon16
    from hsmla_med.pipelines import camelyon16

    problem = device_problem(device)
    if problem:
        raise ConfigError(f"wsi benchmark on {device}: {problem}")
    cuda = torch.device(device).type == "cuda"
    rounds = rounds or (1 if cuda else 2)
    sizes = (() if cuda else SIZES) if sizes is None else sizes
    modes = tuple(modes or default_modes(device))
    _check_modes(modes)
    if cuda:
        precision, _ = _precision(device)
        print(f"  on {torch.cuda.get_device_name(torch.device(device))} ({device}), {os.cpu_count()} CPUs, precision {precision}, "
              f"CUDA graphs; {rounds} round(s) of {', '.join(modes)}", flush=True)
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
                        cmd = [sys.executable, "-m", "hsmla_med.bench.wsi", model, str(slide), str(tmp / "cache"), str(patch), str(batch), mode, device]
                        run = _run(cmd)
                        if isinstance(run, str):
                            print(f"  {model} on {name}, {mode}: failed, {run}", flush=True)
                            continue
                        key = (model, name, mode)
                        if key not in best or run["seconds"] < best[key]["seconds"]:
                            best[key] = run
                        forward = best.get((model, name, "forward"))
                        ratio = f", {run['patches'] / run['seconds'] / (forward['patches'] / forward['seconds']):.2f}x the forward" if forward and mode != "forward" else ""
                        print(f"  {model} on {name}, {mode}: {run['patches']} patches, {run['seconds']:.2f} s, "
                              f"{run['patches'] / run['seconds']:.0f} patches/s{ratio}, {run['peak_mib']:.0f} MiB", flush=True)
    if not best:
        raise RuntimeError(f"wsi benchmark on {device}: every run failed (see the lines above)")
    rows = [
        {"model": model, "slide": name, "mode": mode, "patches": r["patches"], "seconds": r["seconds"],
         "patches_per_s": r["patches"] / r["seconds"], "peak_mib": r["peak_mib"]}
        for (model, name, mode), r in best.items()
    ]
    forward = {(r["model"], r["slide"]): r["patches_per_s"] for r in rows if r["mode"] == "forward"}
    for r in rows:
        r["vs_forward"] = r["patches_per_s"] / forward[(r["model"], r["slide"])] if (r["model"], r["slide"]) in forward else ""
    return rows


def _child_main(argv: list[str]) -> None:
    """The child's command line: model, slide, cache, patch, batch, mode and (default cpu) device;
    prints its result as one JSON line."""
    model, slide, cache, patch, batch, mode, *device = argv
    print(json.dumps(_child(model, slide, cache, int(patch), int(batch), mode, *device)))


if __name__ == "__main__":
    from hsmla_med.runtime import tune_cpu_allocator

    tune_cpu_allocator()
    torch.set_num_threads(os.cpu_count())
    _child_main(sys.argv[1:])
