"""``hsmla-med wsi-heatmap``: tumour heatmaps of whole slides, and the slide options and run it
shares with ``wsi-features``. Both are the CAMELYON16 pipeline's own commands: its task, feature
extraction and file names."""

from __future__ import annotations

import argparse
from pathlib import Path

from hsmla_med.cli.invocation import Invocation, apart, report
from hsmla_med.cli.options import add_prediction_options, prediction_options


#: the options of wsi-features that only an --encoder takes (a checkpoint's patches are its training's)
ENCODER_OPTIONS = {"encoder_weights": "--encoder-weights", "mean": "--mean", "std": "--std", "input_size": "--input-size",
                   "patch_size": "--patch-size", "mpp": "--mpp", "min_tissue": "--min-tissue"}


def add_slide_options(p: argparse.ArgumentParser, output: str, encoders: bool = False) -> None:
    """The options of the whole-slide commands (wsi-heatmap, wsi-features); with ``encoders``
    (wsi-features) a patch encoder may replace the checkpoint (:data:`ENCODER_OPTIONS`)."""
    p.add_argument("--checkpoint", required=not encoders, help="a checkpoint written by train --task camelyon16"
                   + (" (its classifier's penultimate activations); or --encoder" if encoders else ""))
    p.add_argument("--slide", required=True, help="a slide file (any format OpenSlide opens) or a folder of slides")
    p.add_argument("--output", required=True, help=output)
    p.add_argument("--level", type=int, help="pyramid level of the patches (default: the checkpoint's training level"
                   + ("; with --encoder, 0" if encoders else "") + ")")
    p.add_argument("--batch-size", type=int, help="patches per forward pass (default: the checkpoint's, 64)")
    if encoders:
        g = p.add_argument_group("any patch encoder instead of --checkpoint (nothing is downloaded)")
        g.add_argument("--encoder", metavar="timm:NAME|torchscript:PATH", help="timm:NAME, a timm model (e.g. vit_large_patch16_224, "
                       "resnet50) built without its classifier, with --encoder-weights; or torchscript:PATH, a traced or scripted "
                       "encoder taking float (B, 3, H, W) and giving (B, D) features")
        g.add_argument("--encoder-weights", metavar="PATH|random", help="the timm model's state dict: .safetensors, .pth, .pt or .bin "
                       "(a state_dict or model entry in it is taken); random: a smoke run from a fixed seed")
        g.add_argument("--mean", nargs=3, type=float, metavar=("R", "G", "B"), help="normalisation of the patches scaled to 0..1 "
                       "(default: the timm model's pretrained_cfg; ImageNet's for TorchScript)")
        g.add_argument("--std", nargs=3, type=float, metavar=("R", "G", "B"), help="(default: as --mean)")
        g.add_argument("--input-size", type=int, metavar="N", help="the patches are resized to N x N (bilinear, antialiased) "
                       "(default: the timm model's pretrained_cfg; the patch size for TorchScript)")
        g.add_argument("--patch-size", type=int, help="patches (and grid step) in pixels at their level (default 256)")
        g.add_argument("--mpp", type=float, help="instead of --level: µm per pixel, each slide's level nearest that resolution")
        g.add_argument("--min-tissue", type=float, help="share of a patch that must be tissue (default: the camelyon16 config's, 0.5)")
    add_prediction_options(p)


def add_parser(sub) -> None:
    p = sub.add_parser("wsi-heatmap", help="tumour heatmaps of whole slides (CAMELYON16 checkpoint)", description="Streams the tissue patches of each slide through the classifier and writes <slide>_heatmap.tif (pyramidal, OpenSlide/QuPath), <slide>_overlay.png, <slide>_gates.png, the predicted tumour regions as <slide>.geojson (QuPath: drag onto the slide) and <slide>.xml (ASAP: Load in the Annotations panel; ASAP loads it by itself from beside the slide file) (inference.region_threshold and region_sigma of the training config), the CAMELYON16 submission lesions/<slide>.csv and slides.csv, and <slide>.json into OUTPUT. Slides this checkpoint already did with the same options are skipped, so an interrupted run resumes; OUTPUT holding heatmaps of another checkpoint or other options is refused unless --overwrite.")
    add_slide_options(p, "folder for the heatmaps")
    p.add_argument("--uncertainty", choices=["entropy"], help="also write <slide>_uncertainty.tif, each patch's binary entropy of the tumour "
                   "probability (0..255 for 0..1 bit), on the heatmap's pixels: it registers to the slide as the heatmap does")


def run(args, invocation: Invocation) -> list[Path]:
    return run_slides(args, invocation)


def run_slides(args, invocation: Invocation, features: bool = False) -> list[Path]:
    """wsi-heatmap, or wsi-features with ``features``: the same slides, options and checks
    (wsi-features: ``--checkpoint`` or ``--encoder``, checked by :func:`_slide_encoder`)."""
    from hsmla_med.data.patch_readers import requested_reader
    from hsmla_med.pipelines.camelyon16 import FEATURES_H5, FEATURES_PT, SLIDE_CSV, TASK, extract_features

    requested_reader()  # a bad HSMLA_MED_SLIDE_READER is refused before any work
    encoder = features and _slide_encoder(args)
    # an encoder's level is its grid's (encode_slides), as --mpp is
    options = prediction_options(args, batch_size=args.batch_size, level=None if encoder else args.level,
                                 uncertainty=getattr(args, "uncertainty", None))
    apart(args.slide, args.output, "--slide")
    output = invocation.writable_folder(args.output, "--output")
    if encoder:
        from hsmla_med.pipelines.camelyon16.encoders import encode_slides, load_encoder

        loaded = load_encoder(args.encoder, args.encoder_weights, mean=args.mean, std=args.std, input_size=args.input_size)
        written = encode_slides(loaded, args.slide, output, patch_size=args.patch_size or 256, level=args.level, mpp=args.mpp,
                                min_tissue=args.min_tissue, options=options)
    else:
        module, _ = TASK.load(args.checkpoint)
        if not features:
            written = TASK.predict(module, args.slide, output, options)
            slides = [p for p in written if p.name != SLIDE_CSV]  # (the run's slide CSV is no slide)
            report(f"heatmaps of {len(slides)} slide(s) in {output}; slide scores in {output / SLIDE_CSV}")
            return written
        written = extract_features(module, args.slide, output, options)
    report(f"features of {len(written)} slide(s) in {output / FEATURES_H5} and {output / FEATURES_PT} (CLAM's layout)")
    return written


def _slide_encoder(args) -> bool:
    """Whether wsi-features runs an ``--encoder`` (else ``--checkpoint``): exactly one of them,
    and the encoder's options only with it."""
    from hsmla_med.errors import InputError

    if (args.checkpoint is None) == (args.encoder is None):
        raise InputError("wsi-features: give --checkpoint CKPT (a camelyon16 classifier) or --encoder timm:NAME|torchscript:PATH, "
                         + ("not both" if args.encoder else "one of them"))
    given = [flag for dest, flag in ENCODER_OPTIONS.items() if getattr(args, dest) is not None]
    if args.checkpoint is not None and given:
        raise InputError(f"{given[0]}: an option of --encoder; a checkpoint's patches are cut and normalised as in its training "
                         "(--level picks another pyramid level)")
    return args.encoder is not None
