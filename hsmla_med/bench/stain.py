"""Slide-level stain normalisation (``data.stain_normalization: macenko``) on two differently
stained copies of the same synthetic CAMELYON16 slides, against the targets below.

(a) Mean colour distance (RGB, grey levels) of the tissue pixels between the two copies of each
    slide, as written and after each copy is normalised with its own slide's stain matrix
    (target: at least 3 times smaller), the matrix estimated as the pipeline does (from the tissue
    mask's picture, and from all of level 0), the pipeline's tiles at the patch level beside them; the same on one slide for other second stains (hue only,
    strength only, stains nearly collinear); the time to estimate a slide's matrix and to
    normalise a 256 x 256 patch (MONAI's per-patch ``NormalizeHEStains`` beside it).
(b) A patch classifier (HSMLA-B0, ``hsmla-med train --task camelyon16``) trained on the first
    stain, normalisation off and on; patch AUC on the test slides of the same stain, of the
    other, and with a stain of its own per slide (:func:`mixed_stains`) (target: the drop on the
    other stain with normalisation at most half the drop without).

    hsmla-med bench --only stain [--work /tmp/bench-stain] [--steps 200] [--seeds 0] [--size 4096 3072] [--skip-training | --skip-colour]
                                 [--no-colour-augment] [--tumour clear|subtle] [--mixed-seed 0]
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from monai.apps.pathology.transforms.stain.array import NormalizeHEStains

from hsmla_med.bench.common import non_negative_int, own_parser, positive_int
from hsmla_med.config import merge_config, task_config
from hsmla_med.data.slides import open_slide, read_region, tissue_mask
from hsmla_med.data.stain import normalize_stain, slide_stain
from hsmla_med.data.synthetic.wsi import DEFAULT_STAIN, OTHER_STAIN, TUMOURS, generate_camelyon16
from hsmla_med.engine.classification import ClassificationModule, patch_images
from hsmla_med.engine.run import load_module
from hsmla_med.io import write_json, write_yaml
from hsmla_med.metrics.pathology import auc
from hsmla_med.pipelines import camelyon16

COUNTS = {"num_normal": 4, "num_tumor": 4, "num_test": 4, "size": (4096, 3072), "seed": 0}
DATA = {"level": 0, "patch_size": 128, "stride": 128, "num_workers": 1}
MIN_AREA_UM2 = 15000.0  # the task default; the synthetic slides are 0.972 µm per pixel


def _unit(v) -> np.ndarray:
    return np.asarray(v, np.float64) / np.linalg.norm(v)


# other second stains, (haematoxylin, eosin) optical densities: how the reduction depends on what differs
VARIANTS = {
    "hue only (OTHER_STAIN's directions, strengths 1)": tuple(_unit(v) for v in OTHER_STAIN),
    "strength only (Ruifrok's directions, x1.25 / x0.8)": (1.25 * _unit(DEFAULT_STAIN[0]), 0.8 * _unit(DEFAULT_STAIN[1])),
    "nearly collinear (12 degrees apart, x1.25 / x0.8)": ((0.576, 0.977, 0.526), (0.208, 0.671, 0.383)),
}


def colour_distances(first: Path, second: Path, cache: Path, slides: list[Path] | None = None, **how) -> dict:
    """Per slide of the two dataset copies (``slides``, relative paths: all of them by default):
    mean RGB distance of the first copy's tissue pixels (its tissue mask at level 0) between the
    copies, as written and normalised (stain matrices by :func:`slide_stain` with ``how``'s
    ``picture`` / ``tiles``; its defaults, the pipeline's, without)."""
    rows = []
    for path in [first / s for s in slides] if slides else sorted(first.rglob("*.tif")):
        other = second / path.relative_to(first)
        slide = open_slide(path)
        tissue, downsample = tissue_mask(slide, min_area=MIN_AREA_UM2 / 0.972**2)
        width, height = slide.dimensions
        rows_, cols_ = (np.minimum((np.arange(n) / downsample).astype(int), m - 1) for n, m in ((height, tissue.shape[0]), (width, tissue.shape[1])))
        mask = tissue[rows_[:, None], cols_[None, :]]  # the mask at level 0
        images = [read_region(open_slide(p), 0, 0, 0, (width, height)) for p in (path, other)]
        normalised = []
        for image, p in zip(images, (path, other)):
            started = time.perf_counter()
            stain = slide_stain(p, cache, MIN_AREA_UM2, **how)
            estimate = time.perf_counter() - started
            normalised.append(normalize_stain(torch.from_numpy(image).permute(2, 0, 1), stain).permute(1, 2, 0).numpy())
        before = float(np.linalg.norm(images[0][mask].astype(np.float64) - images[1][mask], axis=1).mean())
        after = float(np.linalg.norm(normalised[0][mask].astype(np.float64) - normalised[1][mask], axis=1).mean())
        rows.append({"slide": path.stem, "tissue_pixels": int(mask.sum()), "before": before, "after": after, "estimate_s": estimate})
        print(f"  {path.stem:<11} tissue {mask.sum():>8} px   before {before:6.2f}   after {after:6.2f}   x{before / after:5.2f}")
    return {"slides": rows, "before": statistics.mean(r["before"] for r in rows), "after": statistics.mean(r["after"] for r in rows)}


def variants(first: Path, work: Path, cache: Path, counts: dict) -> list[dict]:
    """:func:`colour_distances` of the first tumour slide (of ``counts``' size and tumour) against copies in :data:`VARIANTS`' stains."""
    rows = []
    for name, stain in VARIANTS.items():
        root = generate_camelyon16(work / f"variant-{len(rows)}", **{**counts, "num_normal": 0, "num_tumor": 1, "num_test": 0}, stain=stain)
        h, e = (_unit(v) for v in stain)
        print(f"  {name}: stains {np.degrees(np.arccos(h @ e)):.0f} degrees apart")
        row = colour_distances(first, root, cache, [Path("training/tumor/tumor_001.tif")])["slides"][0]
        rows.append({"variant": name, "stain": [list(map(float, v)) for v in stain], **row})
    return rows


def mixed_stains(work: Path, first: Path, counts: dict, seed: int = 0) -> tuple[Path, list[dict]]:
    """The test slides again, each in a stain of its own, as the slides of a laboratory vary among
    themselves: each stain's direction a random point between Ruifrok's and :data:`OTHER_STAIN`'s,
    haematoxylin 0.75-1.35 and eosin 0.75-1.25 times as strong (uniform, ``seed``). A shift shared
    by every test slide moves all scores alike and leaves the AUC as it was; one per slide does
    not. Returns the dataset's root (training: ``first``'s, unused) and each slide's draw."""
    rng = np.random.default_rng(seed)
    root, draws = work / "mixed-stain", []
    (root / "testing" / "images").mkdir(parents=True, exist_ok=True)
    (root / "testing" / "lesion_annotations").mkdir(exist_ok=True)
    if not (root / "training").exists():
        (root / "training").symlink_to(first / "training", target_is_directory=True)
    for i in range(1, counts["num_test"] + 1):
        mix, strength = rng.uniform(0, 1, 2), (rng.uniform(0.75, 1.35), rng.uniform(0.75, 1.25))
        stain = tuple(s * _unit((1 - t) * _unit(a) + t * _unit(b)) for s, t, a, b in zip(strength, mix, DEFAULT_STAIN, OTHER_STAIN))
        copy = generate_camelyon16(work / f"mixed-{i}", **{**counts, "num_normal": 1, "num_tumor": 0}, stain=stain)
        for rel in (f"testing/images/test_{i:03d}.tif", f"testing/lesion_annotations/test_{i:03d}.xml"):
            link = root / rel
            if (copy / rel).exists() and not link.is_symlink():
                link.symlink_to(copy / rel)
        draws.append({"slide": f"test_{i:03d}", "haematoxylin": float(strength[0]), "eosin": float(strength[1]),
                      "towards_other": [float(t) for t in mix]})
        print(f"  test_{i:03d}: haematoxylin x{strength[0]:.2f}, eosin x{strength[1]:.2f}, hues {mix[0]:.2f} / {mix[1]:.2f} of the way to OTHER_STAIN's")
    return root, draws


def patch_timing(path: Path, cache: Path, repeats: int = 50) -> dict:
    """Median milliseconds to normalise one 256 x 256 uint8 patch of tissue: with the slide's
    parameters (this module) and with MONAI's NormalizeHEStains (estimation per patch)."""
    slide = open_slide(path)
    tissue, downsample = tissue_mask(slide, min_area=MIN_AREA_UM2 / 0.972**2)
    rows, cols = np.nonzero(tissue)
    x, y = int(np.median(cols) * downsample) - 128, int(np.median(rows) * downsample) - 128
    patch = read_region(slide, x, y, 0, 256)
    stain, monai = slide_stain(path, cache, MIN_AREA_UM2), NormalizeHEStains()
    tensor = torch.from_numpy(patch).permute(2, 0, 1)
    times = {"slide_matrix_ms": [], "monai_per_patch_ms": []}
    for _ in range(repeats):
        for name, run in (("slide_matrix_ms", lambda: normalize_stain(tensor, stain)), ("monai_per_patch_ms", lambda: monai(patch))):
            started = time.perf_counter()
            run()
            times[name].append(1000 * (time.perf_counter() - started))
    return {name: statistics.median(values) for name, values in times.items()}


def patch_auc(module: ClassificationModule, config: dict, root: Path) -> tuple[float, int, int]:
    """Patch AUC (tumour by annotation coverage) over the test slides of ``root``, the patches
    read and normalised by the task's validation chain."""
    read = camelyon16.transforms(config)[1]
    _, test = camelyon16.find_slides(root)
    scores, labels = [], []
    for case in test:
        grid = camelyon16.slide_patches(case, config["data"])
        items = [{"slide": case["slide"], "x": int(x), "y": int(y), "level": int(grid["level"]), "size": config["data"]["patch_size"]}
                 for x, y in grid["coords"]]
        for start in range(0, len(items), 64):
            batch = torch.stack([read(item)["image"] for item in items[start : start + 64]])
            with torch.no_grad():
                logits = module.network(patch_images({"image": batch}))
            scores += torch.softmax(logits.float(), dim=1)[:, 1].tolist()
        labels += grid["labels"].tolist()
    return auc(scores, labels), int(sum(labels)), len(labels)


def colour_part(roots: dict, cache: Path, counts: dict) -> tuple[dict, dict]:
    """(a): the colour distances (the pipeline's estimate, the picture's, level 0's, other second
    stains) and the per-patch timing."""
    print(f"(a) two copies of {sum(COUNTS[k] for k in ('num_normal', 'num_tumor', 'num_test'))} synthetic slides "
          f"{counts['size'][0]} x {counts['size'][1]}, second stain {OTHER_STAIN}")
    distances = colour_distances(roots["first"], roots["other"], cache / "camelyon16-patches")
    print(f"  mean: before {distances['before']:.2f}, after {distances['after']:.2f}: x{distances['before'] / distances['after']:.2f}")
    for name, label, estimate in (("picture", "the tissue mask's picture (level 1 here)", {"tiles": 0}),
                                  ("level0", "all of level 0 (a picture of at least 8192 px)", {"picture": (8192, 16384), "tiles": 0})):
        print(f"  the same, each slide's matrix estimated from the tissue pixels of {label}:")
        row = distances[name] = colour_distances(roots["first"], roots["other"], cache / "camelyon16-patches", **estimate)
        print(f"  mean: before {row['before']:.2f}, after {row['after']:.2f}: x{row['before'] / row['after']:.2f}")
    print("  tumor_001 against other second stains:")
    distances["variants"] = variants(roots["first"], roots["first"].parent, cache / "camelyon16-patches", counts)
    timing = patch_timing(roots["first"] / "training" / "tumor" / "tumor_001.tif", cache / "camelyon16-patches")
    estimate = statistics.median(r["estimate_s"] for r in distances["slides"])
    print(f"  a slide's matrix (cached after): {estimate:.2f} s; a 256 x 256 patch: {timing['slide_matrix_ms']:.2f} ms with the slide's "
          f"matrix, {timing['monai_per_patch_ms']:.2f} ms MONAI NormalizeHEStains (per patch)")
    return distances, timing


def main(argv: list[str]) -> int:
    parser = own_parser("stain", __doc__)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-stain"), help="working folder (default /tmp/bench-stain)")
    parser.add_argument("--steps", type=positive_int, default=200, help="(b) training steps (default 200)")
    parser.add_argument("--seeds", type=non_negative_int, nargs="+", default=[0], help="(b) training seeds (default 0)")
    parser.add_argument("--size", type=positive_int, nargs=2, default=COUNTS["size"], help="slide width and height at level 0")
    parser.add_argument("--skip-training", action="store_true", help="(a) only")
    parser.add_argument("--skip-colour", action="store_true", help="(b) only")
    parser.add_argument("--tumour", choices=sorted(TUMOURS), default="clear",
                        help="the slides' metastases: clear (the default data, found by their shapes) or subtle (darker nuclei of "
                        "nearly normal size and density, found by the haematoxylin's strength, which the second stain moves)")
    parser.add_argument("--mixed-seed", type=non_negative_int, default=0, help="(b) the seed of the test slides' own stains")
    parser.add_argument("--no-colour-augment", action="store_true",
                        help="(b) without the per-channel colour jitter (data.augment.colour_prob 0): a classifier that has seen one stain's colours only")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    started = time.perf_counter()
    roots = {"first": args.work / "first-stain", "other": args.work / "other-stain"}
    counts = {**COUNTS, "size": tuple(args.size), "tumour": args.tumour}
    generate_camelyon16(roots["first"], **counts)
    generate_camelyon16(roots["other"], stain=OTHER_STAIN, **counts)
    cache = args.work / "cache"
    distances, timing = (None, None) if args.skip_colour else colour_part(roots, cache, counts)
    arms, seeds = [], [] if args.skip_training else args.seeds
    if seeds:
        print("(b) the test slides each in a stain of its own:")
        roots["mixed"], draws = mixed_stains(args.work, roots["first"], counts, args.mixed_seed)
        print(f"    HSMLA-B0 trained {args.steps} steps on the first stain, patch AUC on the test slides")
    for seed in seeds:
        for method in (None, "macenko"):
            name = f"{method or 'off'}-seed{seed}"
            data = {**DATA, "cache_dir": str(cache), "stain_normalization": method}
            if args.no_colour_augment:
                data["augment"] = {"colour_prob": 0.0}
            overrides = {"data": data, "trainer": {"accelerator": "cpu", "progress_bar": False}}
            write_yaml(args.work / f"{name}.yaml", overrides)
            run = args.work / name
            clock = time.perf_counter()
            # hsmla-med train in a process of its own: the command line sits above the benchmarks
            code = subprocess.run([sys.executable, "-m", "hsmla_med.cli", "train", "--task", "camelyon16", "--data-dir", str(roots["first"]),
                                   "--config", str(args.work / f"{name}.yaml"), "--max-steps", str(args.steps), "--seed", str(seed),
                                   "--output", str(run)]).returncode
            if code != 0:
                raise SystemExit(f"training {name} failed ({code})")
            seconds = time.perf_counter() - clock
            module, _ = load_module(run / "last.ckpt", ClassificationModule)
            config = merge_config(task_config("camelyon16"), overrides)
            same, tumour, patches = patch_auc(module, config, roots["first"])
            other, _, _ = patch_auc(module, config, roots["other"])
            mixed, _, _ = patch_auc(module, config, roots["mixed"])
            arms.append({"arm": name, "same": same, "other": other, "drop": same - other, "mixed": mixed, "drop_mixed": same - mixed,
                         "train_s": seconds, "patches": patches, "tumour": tumour})
            print(f"  normalisation {method or 'off':<8} seed {seed}: AUC same stain {same:.4f}, other stain {other:.4f} "
                  f"(drop {same - other:+.4f}), a stain per slide {mixed:.4f} (drop {same - mixed:+.4f}) "
                  f"({patches} test patches, {tumour} tumour; training {seconds:.0f} s)")
    for seed in seeds:
        off, on = (next(a for a in arms if a["arm"] == f"{m}-seed{seed}") for m in ("off", "macenko"))
        print(f"  seed {seed}: drop with normalisation {on['drop']:+.4f} against {off['drop']:+.4f} without; "
              f"a stain per slide {on['drop_mixed']:+.4f} against {off['drop_mixed']:+.4f}")
    result = {"colour_distance": distances, "patch_timing_ms": timing, "classifier": arms, "mixed_stains": draws if seeds else None,
              "wall_s": time.perf_counter() - started}
    write_json(args.work / ("colour.json" if args.skip_training else "result.json"), result)
    print(f"wall time {time.perf_counter() - started:.0f} s")
    return 0
