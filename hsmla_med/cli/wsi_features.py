"""``hsmla-med wsi-features``: patch features of whole slides in CLAM's layout, for
multiple-instance learning."""

from __future__ import annotations

from pathlib import Path

from hsmla_med.cli.invocation import Invocation
from hsmla_med.cli.wsi_heatmap import add_slide_options, run_slides


def add_parser(sub) -> None:
    p = sub.add_parser("wsi-features", help="patch features of whole slides for multiple-instance learning (CLAM's layout)", description="Streams "
                       "the tissue patches of each slide through a patch encoder: --checkpoint, the classifier's penultimate activations "
                       "(the input of its final linear layer) on the heatmap's grid; or --encoder, a timm model with its weights from a local "
                       "file or a TorchScript file, on a grid of --patch-size at --level or --mpp, normalised by the encoder's mean and std at "
                       "its input size. Writes CLAM's layout: OUTPUT/h5_files/<slide>.h5 (datasets features N x D float32 and "
                       "coords N x 2 int64, level-0 x, y of each patch's top-left corner, with patch_level, patch_size and patch_size_level0 "
                       "on coords; encoder, mean, std, input_size, patch_size and mpp on features) and OUTPUT/pt_files/<slide>.pt (the "
                       "features tensor, what CLAM's training loads: give it --data_root_dir OUTPUT's parent). Slides this encoder already "
                       "did with the same options are skipped; --overwrite as for wsi-heatmap.")
    add_slide_options(p, "folder for h5_files/ and pt_files/", encoders=True)


def run(args, invocation: Invocation) -> list[Path]:
    return run_slides(args, invocation, features=True)
