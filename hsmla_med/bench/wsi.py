"""Whole-slide heatmap throughput: HSMLA-B0 / B1 patch classifiers against MONAI's ResNet-18 in
one run, on synthetic CAMELYON16-format slides of two sizes (the second 9x the area: 671
patches in tissue).

Each (model, slide, mode) runs in a fresh process that reports its wall time and peak
resident-set growth. Modes: ``forward`` (the network alone on the slide's patches, read into
memory beforehand: the ceiling), ``loop-0-R`` (``camelyon16.infer`` with patches read by reader
R, ``openslide`` or ``cucim``, in the main process between forward passes, as the loop before
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

import torch

from hsmla_med.bench.common import status_kib
from hsmla_med.data.patch_readers import READER_ENV

MODELS = ("HSMLA-B0", "HSMLA-B1", "ResNet-18 (MONAI)")
SIZES = ((8192, 6144), (24576, 18432))


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
        read = camelyon16.ReadPatchd(keep=1)
        grid = camelyon16.slide_patches({"slide": slide, "annotation": None, "label": 0}, module.config["data"])
        patches = torch.stack([
            read({"slide": slide, "x": x, "y": y, "level": int(grid["level"]), "size": patch})["image"] for x, y in grid["coords"]
        ])
    with tempfile.TemporaryDirectory() as out:
        base = status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # peak (VmHWM) := current resident set
        start = time.perf_counter()
        if mode == "forward":
            with torch.inference_mode():
                for i in range(0, len(patches), batch):
                    torch.softmax(module.network(patches[i : i + batch]), 1)
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
    readers = ("openslide", "cucim") if importlib.util.find_spec("cucim") else ("openslide",)
    return ("forward", *(f"loop-0-{r}" for r in readers), f"loop-1-{readers[-1]}")


def bench_wsi(patch: int = 256, batch: int = 32, rounds: int = 2, modes: tuple[str, ...] | None = None) -> list[dict]:
    """Rows ``model, slide, mode, patches, seconds, patches_per_s, peak_mib`` (best of
    ``rounds`` interleaved runs) and ``vs_forward``, the throughput over the same model's
    ``forward`` throughput on the same slide."""
    from hsmla_med.data.synthetic.wsi import generate_camelyon16
    from hsmla_med.pipelines import camelyon16

    modes = modes or default_modes()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        slides = []
        for w, h in SIZES:
            root = generate_camelyon16(tmp / f"{w}x{h}", num_normal=0, num_tumor=1, num_test=0, size=(w, h), seed=1)
            slide = next((root / "training" / "tumor").glob("*.tif"))
            # the patch grid (tissue mask) is computed once here, not inside the timed runs
            camelyon16.slide_patches({"slide": str(slide), "annotation": None, "label": 0}, _data_config(tmp / "cache", patch))
            slides.append((f"{w}x{h}", slide))
        best: dict[tuple[str, str, str], dict] = {}
        for _ in range(rounds):
            for name, slide in slides:
                for model in MODELS:
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
