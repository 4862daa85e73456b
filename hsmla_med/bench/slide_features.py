"""Patch encoders on the CPU, for learning from slide labels: features per second of our HSMLA-B0
patch classifier (``wsi-features --checkpoint``: the input of its final layer), a timm
ViT-S/16 and a timm ResNet-50 (``--encoder timm:NAME``; random weights, whose time is a released
model's: UNI and Virchow are larger ViTs) on the same synthetic slides and 256-pixel patches at
level 0 (CLAM's grid), each through the whole-slide predict loop as the command runs it.

    hsmla-med bench --only slide-features [--slides 4] [--rounds 2] [--out DIR]

A first pass over one slide per encoder warms the patch grids' cache and the networks; then each
round runs every encoder over every slide (interleaved, so that load from elsewhere hits them
alike), each into a fresh folder. Reports the patches, the seconds (median of the rounds) and
patches per second, and each encoder's time relative to the HSMLA classifier's.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import h5py

from hsmla_med.bench.common import markdown, out_folder, own_parser, positive_int, write_csv

PATCH, LEVEL = 256, 0
TIMM = {"timm ViT-S/16 (vit_small_patch16_224)": "timm:vit_small_patch16_224", "timm ResNet-50 (resnet50)": "timm:resnet50"}


def _hsmla_classifier(cache: Path):
    """HSMLA-B0's CAMELYON16 classifier (random weights), its grid ``PATCH`` px at level ``LEVEL``."""
    import torch

    from hsmla_med.config import model_config, task_config
    from hsmla_med.engine.classification import ClassificationModule
    from hsmla_med.pipelines import camelyon16

    torch.manual_seed(0)
    config = task_config("camelyon16")
    config["data"].update(level=LEVEL, mpp=None, patch_size=PATCH, stride=PATCH, cache_dir=str(cache))
    return ClassificationModule(camelyon16.module_config(config, model_config("b0"), camelyon16.LABELS)).eval()


def _runners(cache: Path) -> dict:
    """Name -> ``run(slides, output)`` writing that encoder's features of ``slides``."""
    from hsmla_med.pipelines.camelyon16 import extract_features
    from hsmla_med.pipelines.camelyon16.encoders import encode_slides, load_encoder
    from hsmla_med.pipelines.task import InferenceOptions

    options = InferenceOptions(device="cpu", progress=lambda _: None)
    module = _hsmla_classifier(cache)
    runners = {"HSMLA-B0 classifier (--checkpoint)": lambda slides, out: extract_features(module, slides, out, options)}
    for name, spec in TIMM.items():
        encoder = load_encoder(spec, "random")
        runners[name] = (lambda e: lambda slides, out: encode_slides(e, slides, out, patch_size=PATCH, level=LEVEL, options=options,
                                                                       cache_dir=cache))(encoder)
    return runners


def _patches(folder: Path) -> tuple[int, int]:
    """The patches of the h5 files under ``folder`` and their features' width."""
    counts, width = 0, 0
    for path in sorted(folder.glob("h5_files/*.h5")):
        with h5py.File(path, "r") as f:
            counts += f["features"].shape[0]
            width = f["features"].shape[1]
    return counts, width


def main(argv: list[str]) -> int:
    parser = own_parser("slide-features", __doc__)
    parser.add_argument("--slides", type=positive_int, default=4, help="synthetic slides (4096 x 3072, half with metastases; default 4)")
    parser.add_argument("--rounds", type=positive_int, default=2, help="timed rounds (default 2)")
    parser.add_argument("--out", type=out_folder, default=Path("."), help="folder for slide_features.csv (default: here)")
    args = parser.parse_args(argv)
    from hsmla_med.data.synthetic.wsi import generate_camelyon16
    from hsmla_med.runtime import tune_cpu_allocator

    tune_cpu_allocator()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = generate_camelyon16(root / "data", num_normal=args.slides - args.slides // 2, num_tumor=args.slides // 2, num_test=0)
        slides = sorted((data / "training").glob("*/*.tif"))
        runners = _runners(root / "cache")
        for name, run in runners.items():  # warm-up: grids cached, first forward passes made
            run(slides[:1], root / "warm" / name)
        seconds = {name: [] for name in runners}
        counts = {}
        for r in range(args.rounds):
            for name, run in runners.items():
                out = root / f"round{r}" / name
                started = time.perf_counter()
                run(slides, out)
                seconds[name].append(time.perf_counter() - started)
                counts[name] = _patches(out)
                print(f"  round {r + 1}, {name}: {seconds[name][-1]:.1f} s", flush=True)
    reference = statistics.median(seconds[next(iter(runners))])
    rows = [{"encoder": name, "features": counts[name][1], "patches": counts[name][0], "seconds": round(statistics.median(t), 1),
             "rounds_s": ", ".join(f"{s:.1f}" for s in t), "patches_per_s": round(counts[name][0] / statistics.median(t), 1),
             "time_vs_hsmla": round(statistics.median(t) / reference, 2)} for name, t in seconds.items()]
    write_csv(args.out / "slide_features.csv", rows)
    print(f"\n{len(slides)} slides, {PATCH}-px patches at level {LEVEL}, {args.rounds} round(s)\n\n{markdown(rows)}")
    return 0
