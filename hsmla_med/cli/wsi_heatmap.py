"""``hsmla-med wsi-heatmap``: tumour heatmaps of whole slides, and the slide options and run it
shares with ``wsi-features``. Both are the CAMELYON16 pipeline's own commands: its task, feature
extraction and file names."""

from __future__ import annotations

import argparse
from pathlib import Path

from hsmla_med.cli.invocation import Invocation, apart, report
from hsmla_med.cli.options import add_prediction_options, prediction_options


def add_slide_options(p: argparse.ArgumentParser, output: str) -> None:
    """The options of the whole-slide commands (wsi-heatmap, wsi-features)."""
    p.add_argument("--checkpoint", required=True, help="a checkpoint written by train --task camelyon16")
    p.add_argument("--slide", required=True, help="a slide file (any format OpenSlide opens) or a folder of slides")
    p.add_argument("--output", required=True, help=output)
    p.add_argument("--level", type=int, help="pyramid level of the patches (default: the checkpoint's training level)")
    p.add_argument("--batch-size", type=int, help="patches per forward pass (default: the checkpoint's, 64)")
    add_prediction_options(p)


def add_parser(sub) -> None:
    p = sub.add_parser("wsi-heatmap", help="tumour heatmaps of whole slides (CAMELYON16 checkpoint)", description="Streams the tissue patches of each slide through the classifier and writes <slide>_heatmap.tif (pyramidal, OpenSlide/QuPath), <slide>_overlay.png, <slide>_gates.png, the predicted tumour regions as <slide>.geojson (QuPath: drag onto the slide) and <slide>.xml (ASAP: Load in the Annotations panel; ASAP loads it by itself from beside the slide file) (inference.region_threshold and region_sigma of the training config), the CAMELYON16 submission lesions/<slide>.csv and slides.csv, and <slide>.json into OUTPUT. Slides this checkpoint already did with the same options are skipped, so an interrupted run resumes; OUTPUT holding heatmaps of another checkpoint or other options is refused unless --overwrite.")
    add_slide_options(p, "folder for the heatmaps")
    p.add_argument("--uncertainty", choices=["entropy"], help="also write <slide>_uncertainty.tif, each patch's binary entropy of the tumour "
                   "probability (0..255 for 0..1 bit), on the heatmap's pixels: it registers to the slide as the heatmap does")


def run(args, invocation: Invocation) -> list[Path]:
    return run_slides(args, invocation)


def run_slides(args, invocation: Invocation, features: bool = False) -> list[Path]:
    """wsi-heatmap, or wsi-features with ``features``: the same slides, options and checks."""
    from hsmla_med.data.patch_readers import requested_reader
    from hsmla_med.pipelines.camelyon16 import FEATURES_H5, FEATURES_PT, SLIDE_CSV, TASK, extract_features

    requested_reader()  # a bad HSMLA_MED_SLIDE_READER is refused before any work
    options = prediction_options(args, batch_size=args.batch_size, level=args.level, uncertainty=getattr(args, "uncertainty", None))
    apart(args.slide, args.output, "--slide")
    output = invocation.writable_folder(args.output, "--output")
    module, _ = TASK.load(args.checkpoint)
    if features:
        written = extract_features(module, args.slide, output, options)
        report(f"features of {len(written)} slide(s) in {output / FEATURES_H5} and {output / FEATURES_PT} (CLAM's layout)")
        return written
    written = TASK.predict(module, args.slide, output, options)
    slides = [p for p in written if p.name != SLIDE_CSV]  # (the run's slide CSV is no slide)
    report(f"heatmaps of {len(slides)} slide(s) in {output}; slide scores in {output / SLIDE_CSV}")
    return written
