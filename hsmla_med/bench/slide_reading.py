"""Slide reading on the CPU: per-patch reads with OpenSlide, tifffile and cuCIM (where installed), and
the overlays' thumbnail, ``slides.thumbnail`` against OpenSlide's ``get_thumbnail`` at the
tissue mask's size (what ``wsi-heatmap`` used before).

Then one heatmap overlay PNG over each thumbnail (after a first figure, which pays matplotlib's
set-up). One synthetic CAMELYON16-format slide (JPEG tiles) is written to a temporary folder; its tissue
patch grid (256 px at level 0) is read in grid order by each reader, interleaved, ``--rounds``
times; the median ms per patch is reported, and whether both readers gave the same bytes.

    hsmla-med bench --only slide-reading [--size 24576 18432] [--rounds 5]
"""

from __future__ import annotations

import importlib.util
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from hsmla_med.bench.common import own_parser, positive_int
from hsmla_med.data.patch_readers import CuCIMPatches, OpenSlidePatches, TiffPatches
from hsmla_med.data.slides import open_slide, thumbnail
from hsmla_med.data.synthetic.wsi import generate_camelyon16
from hsmla_med.io.overlays import heatmap_overlay
from hsmla_med.pipelines import camelyon16

PATCH = 256


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str]) -> int:
    p = own_parser("slide-reading", __doc__)
    p.add_argument("--size", type=positive_int, nargs=2, default=[24576, 18432], metavar=("W", "H"),
                   help="slide size at level 0 (default 24576 18432)")
    p.add_argument("--rounds", type=positive_int, default=5, help="interleaved rounds (default 5)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = generate_camelyon16(Path(tmp) / "slides", num_normal=0, num_tumor=1, num_test=0, size=tuple(args.size), seed=1)
        path = str(next((root / "training" / "tumor").glob("*.tif")))
        data = {"level": 0, "mpp": None, "patch_size": PATCH, "stride": PATCH, "min_tissue": 0.5, "tumour_coverage": 0.5,
                "tissue_min_area_um2": 15000, "cache_dir": str(Path(tmp) / "cache")}
        grid = camelyon16.slide_patches({"slide": path, "annotation": None, "label": 0}, data)
        coords = [(int(x), int(y)) for x, y in grid["coords"]]
        readers = {"openslide": OpenSlidePatches(path), "tifffile": TiffPatches(path)}
        if importlib.util.find_spec("cucim"):
            readers["cucim"] = CuCIMPatches(path)
        times = {name: [] for name in readers}
        for _ in range(args.rounds):
            for name, reader in readers.items():
                times[name].append(_seconds(lambda r=reader: [r.read(x, y, 0, PATCH) for x, y in coords]) / len(coords))
        print(f"slide {args.size[0]} x {args.size[1]}, {len(coords)} patches of {PATCH} px at level 0, median of {args.rounds} rounds")
        for name in readers:
            print(f"  {name}: {1e3 * statistics.median(times[name]):.2f} ms per patch (rounds: "
                  + ", ".join(f"{1e3 * t:.2f}" for t in times[name]) + ")")
        for name in readers.keys() - {"openslide"}:
            same = all(np.array_equal(readers[name].read(x, y, 0, PATCH), readers["openslide"].read(x, y, 0, PATCH)) for x, y in coords)
            print(f"  {name} bytes equal OpenSlide's on every patch: {same}")
        with open_slide(path) as slide:
            width, height = slide.dimensions
            ds = float(grid["tissue_downsample"])
            before = [_seconds(lambda: slide.get_thumbnail((width / ds, height / ds))) for _ in range(args.rounds)]
            after = [_seconds(lambda: thumbnail(slide)) for _ in range(args.rounds)]
            pictures = {"get_thumbnail": np.asarray(slide.get_thumbnail((width / ds, height / ds)).convert("RGB")),
                        "slides.thumbnail": thumbnail(slide)[0]}
        for name, seconds in (("get_thumbnail", before), ("slides.thumbnail", after)):
            shape = pictures[name].shape
            print(f"  {name}: {shape[1]} x {shape[0]} px, {statistics.median(seconds):.3f} s")
        prob = np.random.default_rng(0).random((-(-height // PATCH), -(-width // PATCH)))
        heatmap_overlay(Path(tmp) / "first.png", pictures["slides.thumbnail"], prob)  # matplotlib's set-up
        for name, picture in pictures.items():
            seconds = [_seconds(lambda: heatmap_overlay(Path(tmp) / "o.png", picture, prob)) for _ in range(args.rounds)]
            print(f"  heatmap overlay over {name}'s picture: {statistics.median(seconds):.3f} s")
    return 0
