"""The ``hsmla-med`` command line: train, infer, evaluate, bench, demo.

Configuration flows one way: the task's packaged YAML (``configs/<task>.yaml``), then a user YAML
(``--config``, merged over it; unknown keys are refused), then the command-line options. Errors
about the user's input print one line naming the file and the problem (``--debug`` shows the
traceback); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import signal
import shlex
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hsmla_med.config import load_yaml, task_config
from hsmla_med.defaults import CALIBRATION_SAMPLES, UNCERTAINTY_KINDS, UNCERTAINTY_THRESHOLD
from hsmla_med.pipelines import ALIASES, CARDS, get_task, task_name, tasks_with

__all__ = ["main", "build_parser"]

log = logging.getLogger("hsmla_med")

#: the pipeline of ``evaluate --predictions`` without ``--task``: label maps of any segmentation tool
PREDICTIONS_TASK = "segmentation"

_EPILOG = """examples:
  hsmla-med demo                                   # all four tasks on synthetic data, minutes on CPU
  hsmla-med train --task btcv --data-dir /data/BTCV --model b1 --max-steps 20000 --output runs/b1
  hsmla-med train --task btcv --output runs/b1 --resume --max-steps 40000
  hsmla-med train --task btcv --devices 4 --strategy ddp              # multi-GPU (Lightning DDP)
  hsmla-med infer --task btcv --checkpoint runs/b1/best.ckpt --input /data/BTCV/imagesTs --output preds
  hsmla-med evaluate --task btcv --checkpoint runs/b1/best.ckpt --data-dir /data/BTCV
  hsmla-med train --task camelyon16 --data-dir /data/CAMELYON16 --output runs/c16
  hsmla-med wsi-heatmap --checkpoint runs/c16/best.ckpt --slide /data/CAMELYON16/testing/images --output heatmaps
  hsmla-med wsi-features --checkpoint runs/c16/best.ckpt --slide /data/CAMELYON16/testing/images --output features/c16   # CLAM's h5_files/, pt_files/
  hsmla-med train --task luna16 --data-dir /data/LUNA16 --output runs/luna
  hsmla-med infer --task luna16 --checkpoint runs/luna/best.ckpt --input /data/LUNA16/subset9 --output luna_preds
  hsmla-med export --checkpoint runs/b1/best.ckpt --format onnx --output export/b1    # also torchscript | bundle
  hsmla-med calibrate --checkpoint runs/b1/best.ckpt --data-dir /data/BTCV --output runs/b1/calibrated   # temperature scaling
  hsmla-med bench --only models
"""


def _add_task_options(p: argparse.ArgumentParser, data: bool = True, required: bool = True, help: str = "") -> None:
    generic = "; ".join(f"{alias}: your own data through the {task} pipeline (needs --data-dir)" for alias, task in ALIASES.items())
    p.add_argument("--task", required=required, help=f"task pipeline: {' | '.join(CARDS)} ({generic}){help}")
    if data:
        p.add_argument("--data-dir", help="dataset folder (MSD/nnU-Net layout with dataset.json); default: the synthetic dataset")
        p.add_argument("--config", help="YAML merged over the task's default config (configs/<task>.yaml)")


def _add_trainer_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Lightning trainer (passed through)")
    g.add_argument("--accelerator", help="cpu | gpu | auto (config: trainer.accelerator)")
    g.add_argument("--devices", help="number of devices, a list like 0,1, or auto")
    g.add_argument("--num-nodes", type=int, help="nodes for multi-node DDP")
    g.add_argument("--strategy", help="auto | ddp: Lightning's DDP over --devices x --num-nodes processes (also under torchrun or SLURM)")
    g.add_argument("--precision", help="auto | 32-true | 16-mixed | bf16-mixed")


def _add_training_options(p: argparse.ArgumentParser, output: str) -> None:
    _add_task_options(p)
    p.add_argument("--model", help="b0 | b1 | b2 | a model YAML (config: model)")
    p.add_argument("--mode", choices=["2d", "3d"], help="2d: axial slices; 3d: patches (config: mode)")
    steps = p.add_mutually_exclusive_group()
    steps.add_argument("--max-steps", type=int, help="optimizer steps to train (total, also when resuming)")
    steps.add_argument("--max-epochs", type=int, help="epochs to train instead of steps")
    p.add_argument("--output", help=output)
    p.add_argument("--seed", type=int, help="random seed (config: seed; the splits file, once made, keeps its folds)")
    p.add_argument("--logger", choices=["csv", "tensorboard", "mlflow"], help="Lightning's loggers: csv (OUTPUT/logs, always), also tensorboard "
                   "(OUTPUT/tensorboard; pip install tensorboard) or mlflow (MLFLOW_TRACKING_URI, else OUTPUT/mlruns; pip install mlflow) "
                   "(config: trainer.logger)")
    _add_trainer_options(p)


def _add_graph_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="on CUDA, run the network eagerly instead of replaying a CUDA graph captured once per window or patch-batch shape "
                   "(the default: the host launches one graph instead of hundreds of kernels per forward)")


def _add_prediction_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto")
    _add_graph_option(p)
    g = p.add_argument_group("many cases: Lightning's predict loop, each output written once by the process that owns its case")
    g.add_argument("--devices", type=int, help="processes per node, one per device (with --strategy ddp)")
    g.add_argument("--strategy", choices=["auto", "ddp"], default="auto", help="ddp: split the cases over --devices x --num-nodes processes (also under torchrun or SLURM)")
    g.add_argument("--num-nodes", type=int, default=1, help="nodes of a multi-node run")
    g.add_argument("--precision", choices=["auto", "32-true", "16-mixed", "bf16-mixed"], default="auto", help="auto: mixed precision on CUDA, float32 on the CPU")
    g.add_argument("--shard", help="I/N: only shard I (from 0) of N of the sorted cases, for array jobs; outputs this checkpoint wrote with the same options are skipped (provenance.json)")
    g.add_argument("--num-workers", type=int, default=0, help="DataLoader workers reading and preprocessing inputs (default 0: in the main process)")
    g.add_argument("--overwrite", action="store_true", help="predict every case again, also into a folder that holds outputs of another checkpoint or other options (refused without it; OUTPUT/provenance.json says whose they are)")


def _add_slide_options(p: argparse.ArgumentParser, output: str) -> None:
    """The options of the whole-slide commands (wsi-heatmap, wsi-features)."""
    p.add_argument("--checkpoint", required=True, help="a checkpoint written by train --task camelyon16")
    p.add_argument("--slide", required=True, help="a slide file (any format OpenSlide opens) or a folder of slides")
    p.add_argument("--output", required=True, help=output)
    p.add_argument("--level", type=int, help="pyramid level of the patches (default: the checkpoint's training level)")
    p.add_argument("--batch-size", type=int, help="patches per forward pass (default: the checkpoint's, 64)")
    _add_prediction_options(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hsmla-med",
        description="HSMLA attention networks and medical imaging pipelines on MONAI and Lightning.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks for input errors too")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    monitors = ", ".join(f"{n} {card.monitor}" for n, card in CARDS.items())
    p = sub.add_parser("train", help="train a network on a task", description="Train with Lightning; writes last.ckpt, best.ckpt (highest "
                       f"validation score: {monitors}), metrics.json, metrics.csv, logs/ and training_curve.png into --output.")
    _add_training_options(p, "run folder (config: output, default runs/<task>)")
    p.add_argument("--resume", action="store_true", help="continue from OUTPUT/last.ckpt (weights, optimizer, schedule, step)")
    p.add_argument("--fold", type=int, help="cross-validation fold of splits_final.json to train (config: fold, default 0)")

    p = sub.add_parser("cross-validate", help="train every fold of splits_final.json and score the pooled validation",
                       description="nnU-Net's workflow: trains each fold of splits_final.json into OUTPUT/fold_K (a started fold resumes, a "
                       "finished one is skipped), predicts fold K's validation cases with its last.ckpt into OUTPUT/fold_K/validation "
                       "(volumes: label maps and <case>.npz probabilities in the input geometry), scores them pooled (OUTPUT/crossval/"
                       "summary.json; btcv and other per-case tasks; otherwise the mean of the folds' validation summaries), chooses "
                       "OUTPUT/postprocessing.json on them (btcv), and writes OUTPUT/crossval.json. infer --checkpoint "
                       "OUTPUT/fold_*/last.ckpt then averages the folds' probabilities.")
    _add_training_options(p, "cross-validation folder (default runs/<task>-cv)")
    p.add_argument("--folds", help="only these folds, e.g. 0,2 (default: all); the pooled summary needs all of them")

    p = sub.add_parser("infer", help="run a checkpoint on new inputs", description="Run a checkpoint on new inputs. " + "; ".join(f"{n}: {card.outputs}" for n, card in CARDS.items()) + ".")
    _add_task_options(p, data=False, required=False, help="; default: the task the checkpoint was trained for")
    p.add_argument("--checkpoint", required=True, nargs="+", metavar="CKPT", help="a checkpoint written by train (best.ckpt or last.ckpt), or a "
                   "network of hsmla-med export: model.ts or a bundle folder; several (the folds of cross-validate): their ensemble, the "
                   "mean of their class probabilities (float32) before the argmax (checkpoints of one task, label set, spatial dims and "
                   "data preparation)")
    p.add_argument("--input", required=True, help="a file or a folder: " + "; ".join(f"{card.inputs} ({n})" for n, card in CARDS.items()))
    p.add_argument("--output", required=True, help="folder for the predictions")
    p.add_argument("--series-uid", metavar="UID", help="btcv, luna16: the DICOM series (SeriesInstanceUID) to read in an --input folder "
                   "that holds files of several series (refused without it, listing them)")
    p.add_argument("--series-rules", metavar="F", help="btcv, luna16: a YAML or JSON file of rules that pick the DICOM series to read by their "
                   "attributes, in MONAI Deploy's format ({selections: [{name, conditions: {Modality: '(?i)CT', SeriesDescription: "
                   "REGEX, ImageType: [ORIGINAL, PRIMARY]}}]}); default (btcv): the checkpoint's inference.series_selection")
    p.add_argument("--tta", action="store_true", help="mirroring test-time augmentation")
    overlaps = ", ".join(f"{n} {c['inference']['overlap']}" for n in CARDS if "overlap" in (c := task_config(n))["inference"])
    p.add_argument("--overlap", type=float, help=f"sliding-window overlap in [0, 1) (default: the checkpoint's; as trained by default: {overlaps})")
    p.add_argument("--crop", choices=["auto", "none"], default="auto", help="endovis: auto crops frames of the challenge's raw size as in training and uses other sizes whole; none never crops")
    p.add_argument("--save-probabilities", action="store_true", help="btcv: also write OUTPUT/<case>.npz, the class probabilities (float16) in the input's grid (an ensemble's: their mean)")
    p.add_argument("--output-format", action="append", metavar="F", help=f"{', '.join(tasks_with('output_formats'))}: nifti (default: OUTPUT/<case>.nii.gz; "
                   "a MetaImage / NRRD input's as <case>.mha / .nrrd) and/or dicom-seg "
                   "(OUTPUT/<case>.seg.dcm, a DICOM SEG referencing the input series; DICOM inputs only); repeat it or give a comma list for both")
    p.add_argument("--postprocessing", metavar="F", help="btcv: the postprocessing.json to apply to the label maps (largest connected "
                   "components, chosen on validation by cross-validate); default: the postprocessing.json in the folder that holds "
                   "the checkpoints, or above a cross-validate fold_K folder, if there is one; none: no post-processing")
    p.add_argument("--uncertainty", choices=UNCERTAINTY_KINDS, help=f"{', '.join(tasks_with('uncertainty'))}: also write "
                   "OUTPUT/uncertainty/<case>_uncertainty.nii.gz, "
                   "the voxel-wise uncertainty on the label map's grid, normalised to [0, 1] (entropy: of the class probabilities; "
                   "mutual-information: the disagreement of the mirrored copies of --tta and/or of several --checkpoint, which it needs), "
                   "and OUTPUT/uncertainty.csv, a review queue: per case the mean uncertainty over the predicted foreground, the volume "
                   "(mL) above --uncertainty-threshold and the foreground's volume, most uncertain first")
    p.add_argument("--uncertainty-threshold", type=float, default=UNCERTAINTY_THRESHOLD, metavar="U", help="with --uncertainty: voxels above U "
                   f"count as uncertain in uncertainty.csv (default {UNCERTAINTY_THRESHOLD}: half the largest possible entropy)")
    _add_prediction_options(p)

    p = sub.add_parser("evaluate", help="metrics of a checkpoint on a dataset's validation cases, or of any folder of predicted label maps",
                       description="The task's validation metrics of a checkpoint (--task, --checkpoint) on the validation cases ("
                       + "; ".join(f"{n}: {card.metrics}" for n, card in CARDS.items()) + "); writes OUTPUT/metrics.json. "
                       "Or, with --predictions DIR --labels DIR, scores label maps from any tool (ours, nnU-Net's, MONAI's) against the "
                       "reference label maps of the same file names (with --dataset-json also by the image its lists name beside each "
                       "label: imgNNNN with labelNNNN), the pairs there are, as nnU-Net's compute_metrics_on_folder does, plus HD95 and "
                       "NSD in mm and bootstrap 95% intervals; writes summary.json and metrics_per_case.csv into --output (default: DIR).")
    _add_task_options(p, required=False, help=f"; default with --checkpoint: the task it was trained for; with --predictions: {task_name(PREDICTIONS_TASK)}")
    p.add_argument("--checkpoint", nargs="+", metavar="CKPT", help="a checkpoint written by train; several: their ensemble (probabilities "
                   "averaged as infer does), which has trained on every member's training cases")
    p.add_argument("--output", help="folder for metrics.json (default runs/evaluate), or for summary.json with --predictions (default: that folder)")
    p.add_argument("--predictions", metavar="P", help="predictions of any tool, scored without a checkpoint: btcv (default) a folder of NIfTI / MetaImage / NRRD "
                   "label maps; luna16 a submission CSV (or the folder infer wrote it in); camelyon16 a folder of lesion CSVs and the slide CSV; endovis a folder of mask PNGs")
    p.add_argument("--labels", metavar="L", help="with --predictions, the reference: btcv a folder of label maps (same file names, same shape "
                   "and affine); luna16 annotations.csv (or a LUNA16 folder, whose CSVs are found there); camelyon16 the folder of annotation XMLs; endovis the dataset folder")
    p.add_argument("--dataset-json", metavar="F", help="btcv, with --predictions: dataset.json naming the classes ('labels'; default: the label "
                   "values found) and pairing each label with the image its lists name beside it (a prediction is named after its image: "
                   "imgNNNN.nii.gz scores against labelNNNN.nii.gz)")
    p.add_argument("--dicom", metavar="DIR", help="btcv, with --predictions: the folder under which the image series that DICOM SEG files "
                   "(.dcm, among the predictions or labels) reference are found, by Series Instance UID, at any depth (default: the --labels folder); "
                   "a SEG's segments take the label values of their names in --dataset-json")
    p.add_argument("--nsd-tolerance", type=float, metavar="MM", help="btcv: NSD tolerance in mm (default: the checkpoint's inference.nsd_tolerance; "
                   "with --predictions 2)")
    p.add_argument("--save-probabilities", action="store_true", help="btcv, with --checkpoint: also write OUTPUT/validation/<case>.npz, the class "
                   "probabilities (float16, classes first) in the original geometry beside the label maps")
    p.add_argument("--excluded", metavar="F", help="luna16, with --predictions: annotations_excluded.csv (findings there count neither way)")
    p.add_argument("--seriesuids", metavar="F", help="luna16, with --predictions: seriesuids.csv, the scans scored (default: those of --labels)")
    p.add_argument("--problem", choices=["binary", "parts", "type"], help="endovis, with --predictions: the task the masks answer (default binary)")
    p.add_argument("--masks", metavar="DIR", help="camelyon16, with --predictions: the ground-truth mask TIFFs <slide>_Mask.tif that "
                   "Evaluation_FROC.py reads (default: Masks or Ground_Truth/Masks beside --labels, if there; else each slide's XML, "
                   "rasterised as ASAP makes those masks)")
    p.add_argument("--tta", action="store_true", help="mirroring test-time augmentation")
    p.add_argument("--allow-training-cases", action="store_true", help="score validation cases the checkpoint trained on (refused by default: "
                   "the checkpoint records its fold's case IDs)")
    p.add_argument("--routing", choices=["gate", "off", "all"], help="override HSMLA routing: off = linear attention only, all = refine every tile")
    _add_graph_option(p)
    _add_trainer_options(p)

    p = sub.add_parser("calibrate", help="fit a temperature to a checkpoint's probabilities on its validation cases",
                       description=f"Temperature scaling: runs the checkpoint ({', '.join(tasks_with('calibration'))}) on the validation cases of the split it "
                       "recorded, as evaluate does, fits one temperature T (or one per class) by L-BFGS minimising the NLL of softmax(logits / T) "
                       "on a uniform sample of the validation voxels or patches, and writes OUTPUT/<checkpoint name> (the calibrated checkpoint: "
                       "the network divides its logits by T, so infer, --save-probabilities, wsi-heatmap, evaluate and export apply it), "
                       "OUTPUT/calibration.json (T; ECE over 15 equal-mass bins, over all samples and over the foreground, Brier score and "
                       "NLL, each before and after) and OUTPUT/reliability.png.")
    p.add_argument("--checkpoint", required=True, metavar="CKPT", help="a checkpoint written by train")
    p.add_argument("--data-dir", help="the dataset the checkpoint trained on (default: the synthetic dataset)")
    p.add_argument("--config", help="YAML merged over the task's default config (configs/<task>.yaml)")
    p.add_argument("--output", required=True, help="folder for the calibrated checkpoint, calibration.json and reliability.png")
    p.add_argument("--per-class", action="store_true", help="one temperature per class (can change the argmax, hence the label maps); "
                   "default: one temperature, which keeps every argmax")
    p.add_argument("--samples", type=int, default=CALIBRATION_SAMPLES, metavar="N", help="fit and score on a uniform sample of at most N "
                   f"validation voxels or patches (default {CALIBRATION_SAMPLES})")
    p.add_argument("--allow-training-cases", action="store_true", help="calibrate on validation cases the checkpoint trained on (refused by default)")
    _add_trainer_options(p)

    p = sub.add_parser("report", help="a self-contained HTML page of a run, evaluation or calibration folder",
                       description="Writes one HTML file (images inlined, no network needed) of a folder that train, evaluate, calibrate, "
                       "cross-validate, infer or wsi-heatmap wrote: scores, training curves, the per-case table (sortable, worst mean Dice "
                       "first) with box plots per class, the worst cases as pictures (volumes through their largest error, frames with both "
                       "outlines, missed nodules), slide overlays, FROC, calibration, the uncertainty review queue, the share of tiles each "
                       "gated layer refined, the configuration and plan, and provenance. train, evaluate, calibrate and cross-validate write it by themselves.")
    p.add_argument("folder", metavar="RUN_OR_EVAL_DIR", help="the folder to report on")
    p.add_argument("--output", metavar="FILE", help="the HTML file (default: RUN_OR_EVAL_DIR/report.html)")

    p = sub.add_parser("wsi-heatmap", help="tumour heatmaps of whole slides (CAMELYON16 checkpoint)", description="Streams the tissue patches of each slide through the classifier and writes <slide>_heatmap.tif (pyramidal, OpenSlide/QuPath), <slide>_overlay.png, <slide>_gates.png, the predicted tumour regions as <slide>.geojson (QuPath: drag onto the slide) and <slide>.xml (ASAP: Load in the Annotations panel; ASAP loads it by itself from beside the slide file) (inference.region_threshold and region_sigma of the training config), the CAMELYON16 submission lesions/<slide>.csv and slides.csv, and <slide>.json into OUTPUT. Slides this checkpoint already did with the same options are skipped, so an interrupted run resumes; OUTPUT holding heatmaps of another checkpoint or other options is refused unless --overwrite.")
    _add_slide_options(p, "folder for the heatmaps")
    p.add_argument("--uncertainty", choices=["entropy"], help="also write <slide>_uncertainty.tif, each patch's binary entropy of the tumour "
                   "probability (0..255 for 0..1 bit), on the heatmap's pixels: it registers to the slide as the heatmap does")

    p = sub.add_parser("wsi-features", help="patch features of whole slides for multiple-instance learning (CLAM's layout)", description="Streams "
                       "the tissue patches of each slide (the heatmap's grid) through the classifier and writes its penultimate activations "
                       "(the input of its final linear layer) in CLAM's layout: OUTPUT/h5_files/<slide>.h5 (datasets features N x D float32 and "
                       "coords N x 2 int64, level-0 x, y of each patch's top-left corner, with patch_level, patch_size and patch_size_level0 "
                       "on coords) and OUTPUT/pt_files/<slide>.pt (the features tensor, what CLAM's training loads: give it --data_root_dir "
                       "OUTPUT's parent). Slides this checkpoint already did with the same options are skipped; --overwrite as for wsi-heatmap.")
    _add_slide_options(p, "folder for h5_files/ and pt_files/")

    p = sub.add_parser("export", help="export a checkpoint's network: ONNX, TorchScript or a MONAI Bundle",
                       description="Export the network of a checkpoint for deployment (docs/deployment.md): --format onnx writes OUTPUT/model.onnx "
                       "(opset 18), torchscript OUTPUT/model.ts (traced; hsmla-med infer --checkpoint takes it), bundle a MONAI "
                       f"Bundle in OUTPUT (configs/, models/model.ts, models/model.pt, docs/README.md; tasks {' and '.join(tasks_with('bundle'))}). The batch axis is "
                       "dynamic, and so are ONNX's spatial axes (traced at the checkpoint's sliding-window size or --input-size; export.json "
                       "records the range proven); TorchScript keeps the size it was traced at. Each graph is checked against the PyTorch network "
                       "(max |logit difference| <= 1e-4) before it is written; OUTPUT/export.json records the figures.")
    p.add_argument("--checkpoint", required=True, help="a checkpoint written by train (best.ckpt or last.ckpt)")
    p.add_argument("--format", required=True, choices=["onnx", "torchscript", "bundle"], help="onnx | torchscript | bundle")
    p.add_argument("--output", required=True, help="folder for the exported files")
    p.add_argument("--input-size", type=int, nargs="+", metavar="N", help="spatial size the graph is traced at (TorchScript's fixed size), H W (2D) or H W D (3D); default: the checkpoint's sliding-window size")

    # its options are the benchmark's own (hsmla-med bench --help), passed through unparsed
    sub.add_parser("bench", help="benchmarks of HSMLA networks vs SegFormer, SwinUNETR and UNet (CPU; --only gpu on a CUDA GPU)", add_help=False)

    p = sub.add_parser("demo", help="train on synthetic data for a few minutes, infer, print metrics", description="Generates synthetic data in each benchmark's format ("
                       + ", ".join(card.synthetic for card in CARDS.values() if card.synthetic) + "), trains a small HSMLA model on each (configs/<task>_demo.yaml), "
                       "runs inference on the held-out data (label volumes, slide heatmaps, frame masks, a nodule submission CSV) and prints the metrics and output paths.")
    p.add_argument("--task", choices=[*tasks_with("synthetic"), "all"], default="all", help="which demo (default: all)")
    p.add_argument("--output", default="runs/demo", help="run folder; one subfolder per task (default runs/demo)")
    p.add_argument("--max-steps", type=int, help="override the demo's training steps")
    p.add_argument("--config", help="YAML merged over the demo's config (configs/<task>_demo.yaml), e.g. a smaller synthetic dataset")
    return parser


def _config(args) -> dict:
    from hsmla_med.config import merge_user_config, validate_config
    from hsmla_med.engine.run import check_trainer_config

    config = task_config(args.task)
    if getattr(args, "config", None):
        config = merge_user_config(config, args.config, f"--task {args.task_alias or args.task}")
    if getattr(args, "data_dir", None):
        config["data"]["data_dir"] = args.data_dir
    for key in ("model", "mode", "seed", "output", "fold"):
        if getattr(args, key, None) is not None:
            config[key] = getattr(args, key)
    trainer = config["trainer"]
    if getattr(args, "max_steps", None) is not None:
        trainer["max_steps"], trainer["max_epochs"] = args.max_steps, None
    if getattr(args, "max_epochs", None) is not None:
        trainer["max_epochs"], trainer["max_steps"] = args.max_epochs, None
    for key in ("accelerator", "devices", "num_nodes", "strategy", "precision", "logger"):
        value = getattr(args, key, None)
        if value is not None:
            trainer[key] = int(value) if key == "devices" and str(value).isdigit() else value
    config = validate_config(config, source="command-line options")
    check_trainer_config(config["trainer"])  # before any data is read
    alias = getattr(args, "task_alias", None)
    if alias is not None and not config["data"].get("data_dir"):
        from hsmla_med.errors import InputError

        raise InputError(f"--task {alias}: give your dataset with --data-dir (an MSD or nnU-Net folder with dataset.json); "
                         f"--task {args.task} without it trains on the synthetic {args.task} stand-in")
    if alias is not None and getattr(args, "output", None) is None:
        config["output"] = f"runs/{alias}"
    return config


def _train(config: dict, resume: bool = False) -> dict:
    import lightning as L

    from hsmla_med.config import model_config
    from hsmla_med.engine.run import fit
    from hsmla_med.io import write_json, write_yaml

    task = get_task(config["task"])
    output = _writable_folder(config["output"], "--output")
    L.seed_everything(config["seed"], workers=True, verbose=False)
    cases = task.datalist(config)
    split = f" (fold {cases.split['fold']} of {cases.split['file']})" if cases.split else ""
    log.info("%s: %d training / %d validation cases%s, %d labels", task.name, len(cases.training), len(cases.validation), split, cases.num_classes)
    module = task.build_module(config, model_config(config["model"]), cases)
    if _first_process():
        write_yaml(output / "config.yaml", config)
        if cases.plan is not None:  # what the data decided, before the first step
            from hsmla_med.data.plans import PLANS_FILE, plan_lines

            write_json(output / PLANS_FILE, cases.plan)
            log.info("\n".join(plan_lines(cases.plan, cases.plan["kept"], config, f"{cases.plan['fingerprint']}; {output / PLANS_FILE}")))
    summary = fit(module, task.datamodule(config, cases), output, config["trainer"], resume=resume)
    _print_summary(task, summary, output)
    _write_html_report(output)
    return summary


_COUNTS = ("TP", "FP", "FN", "TN", "n_pred", "n_ref")  # voxel counts: not printed as scores


def _cross_validate(args) -> dict:
    from hsmla_med.crossval import cross_validate
    from hsmla_med.errors import InputError
    from hsmla_med.pipelines.task import InferenceOptions

    if args.output is None:
        args.output = f"runs/{args.task_alias or args.task}-cv"
    config = _config(args)
    folds = None
    if args.folds is not None:
        try:
            folds = [int(k) for k in args.folds.split(",")]
        except ValueError:
            raise InputError(f"--folds {args.folds!r}: give fold numbers separated by commas, e.g. 0,2") from None
    task = get_task(config["task"])
    _writable_folder(config["output"], "--output")
    options = InferenceOptions(device=_device("auto"), save_probabilities=True, overwrite=True, progress=_report)
    report = cross_validate(task, config, _train, options, folds, progress=_report)
    if _first_process():
        pooled = report.get("pooled") or {}
        means = pooled.get("foreground_mean") or pooled.get("mean_of_folds") or {}
        print(f"\ncross-validation of {len(report['folds'])} fold(s) in {report['seconds']:.0f} s; pooled validation: "
              + ", ".join(f"{k} {v:.4f}" for k, v in means.items() if isinstance(v, (int, float)) and k not in _COUNTS)
              + f"\n  report: {Path(config['output']) / 'crossval.json'}")
        _write_html_report(Path(config["output"]))
    return report


def _print_summary(task, summary: dict | None, output: Path) -> None:
    if summary is None or not _first_process():
        return
    print("\n" + "\n".join(task.summary_lines(summary)))
    print(f"metrics: {output / 'metrics.json'}")


_COMMAND_LINE: list[str] = []  # the arguments of the running command (main's), for command.json


def _html_report(args) -> Path:
    from hsmla_med.report import write_report

    path = write_report(Path(args.folder), Path(args.output) if args.output else None)
    print(f"report: {path}")
    return path


def _write_html_report(folder: Path) -> None:
    """``folder/command.json`` (the command line and the versions that ran it: the report's
    provenance) and ``folder/report.html`` at the end of a command, by the first process; a report
    that cannot be written is a warning, not a failure: the command's results are already on disk."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from hsmla_med.errors import InputError
    from hsmla_med.io import write_json
    from hsmla_med.report import write_report

    if not _first_process():
        return
    versions = {"python": platform.python_version()}
    for package in ("hsmla-med", "torch", "monai", "lightning", "numpy"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    write_json(folder / "command.json", {"command": shlex.join(["hsmla-med", *_COMMAND_LINE]), "versions": versions})
    try:
        print(f"report: {write_report(folder)}")
    except InputError as err:
        log.warning("warning: no report.html: %s", err)


def _device(name: str) -> str:
    """The torch device of ``--device``: ``auto`` is CUDA when there is one."""
    import torch

    from hsmla_med.errors import InputError

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise InputError(f"--device {name!r}: not a device; use cpu, cuda, cuda:N or auto") from None
    if device.type not in ("cpu", "cuda"):
        raise InputError(f"--device {name!r}: use cpu, cuda, cuda:N or auto")
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise InputError(f"--device {name}: no such CUDA device on this machine ({torch.cuda.device_count()} found); use --device cpu")
    return name


_CREATED: list[Path] = []  # output folders this command created (removed again if it fails and they stayed empty)
#: folder levels below an output folder where commands write (cross-validate's deepest:
#: fold_K/validation/.provenance/lesions), swept of killed runs' temporaries
_OUTPUT_DEPTH = 4


def _writable_folder(path: str | Path, option: str) -> Path:
    """``path`` as a folder that exists and can be written, checked before any work is done,
    and rid of the temporaries that killed runs left in it (``kill -9`` ends a write before its
    rename: :func:`~hsmla_med.io.remove_stale_temporaries`, only those of processes that no
    longer run). The outermost folder this creates is remembered: a command that then fails
    leaves no empty folders behind (:func:`_remove_empty_created`)."""
    import os

    from hsmla_med.errors import InputError
    from hsmla_med.io import remove_stale_temporaries

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError(f"{option} {path}: exists and is not a folder")
    missing = [folder for folder in (path, *path.parents) if not folder.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
        if missing:
            _CREATED.append(missing[-1])
    except OSError as err:
        raise InputError(f"{option} {path}: cannot create the folder ({err.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise InputError(f"{option} {path}: folder is not writable")
    removed = remove_stale_temporaries(path, below=_OUTPUT_DEPTH)
    if removed:
        log.info("%s: removed %d temporary file(s) that killed runs left (%s)", path, len(removed),
                 ", ".join(str(p.relative_to(path)) for p in removed[:3]) + (", ..." if len(removed) > 3 else ""))
    return path


def _remove_empty_created() -> None:
    """Remove the folders :func:`_writable_folder` created in this command that hold no file
    (after a failure: an export or a run that stopped before writing anything), or only the
    provenance records of a prediction that wrote no output."""
    import os
    import shutil

    from hsmla_med.engine.prediction import PROVENANCE, RECORDS

    def record(folder: str, name: str) -> bool:
        return name == PROVENANCE or RECORDS in Path(folder).relative_to(top).parts

    for top in reversed(_CREATED):
        if top.is_dir() and all(record(folder, name) for folder, _, files in os.walk(top) for name in files):
            shutil.rmtree(top)
    _CREATED.clear()


def _apart(inputs: str, output: str, option: str) -> None:
    """Refuse an ``--output`` that is the input folder itself: predictions would mix with the
    inputs (and be read as inputs by the next run); an output file that would be its own input
    is refused case by case (:func:`hsmla_med.pipelines.task.predict_cases`)."""
    from hsmla_med.errors import InputError

    if Path(inputs).resolve() == Path(output).resolve():
        raise InputError(f"--output {output}: is the {option} itself; give a folder apart from the inputs")


def _options(args, **extra):
    from hsmla_med.engine.prediction import Shard
    from hsmla_med.pipelines.task import InferenceOptions

    return InferenceOptions(
        device=_device(args.device), tta=getattr(args, "tta", False), overlap=getattr(args, "overlap", None), devices=args.devices,
        strategy=args.strategy, num_nodes=args.num_nodes, precision=args.precision, shard=Shard.parse(args.shard),
        num_workers=args.num_workers, overwrite=args.overwrite, cuda_graphs=args.cuda_graphs, **extra,
    )


def _output_formats(given: list[str] | None, task) -> tuple[str, ...]:
    """``--output-format`` values (repeated or comma lists) in order, once each; dicom-seg only for
    a task whose card declares it."""
    from hsmla_med.errors import InputError

    formats = tuple(dict.fromkeys(f.strip() for value in given or ["nifti"] for f in value.split(",") if f.strip()))
    if "dicom-seg" in formats and "dicom-seg" not in task.card.output_formats:
        writers = ", ".join(tasks_with("output_formats", "dicom-seg"))
        raise InputError(f"--output-format dicom-seg: only --task {writers} writes label volumes as DICOM SEG, not {task.name}")
    return formats


def _infer(args) -> list[Path]:
    from hsmla_med.errors import InputError

    args.task = _checkpoint_task(args)
    task = get_task(args.task)
    formats = _output_formats(args.output_format, task)
    if args.uncertainty is not None and args.uncertainty not in task.card.uncertainty:
        raise InputError(f"--uncertainty: only --task {', '.join(tasks_with('uncertainty', args.uncertainty))} writes uncertainty maps, not {task.name}")
    options = _options(args, crop=args.crop, save_probabilities=args.save_probabilities, output_formats=formats, series_uid=args.series_uid,
                       uncertainty=args.uncertainty, uncertainty_threshold=args.uncertainty_threshold,
                       series_rules=load_yaml(args.series_rules) if args.series_rules else None,
                       postprocessing=_postprocessing(task, args.postprocessing, args.checkpoint))
    _apart(args.input, args.output, "--input")
    output = _writable_folder(args.output, "--output")
    module, _ = task.load(args.checkpoint)
    started = time.perf_counter()
    written = task.predict(module, args.input, output, options)
    _report(f"{len(written)} output file(s) in {output} ({time.perf_counter() - started:.1f} s): "
            + ", ".join(p.name for p in written[:3]) + (", ..." if len(written) > 3 else ""))
    return written


def _resolve_task(args) -> None:
    """``args.task`` as its pipeline's name (a clear error for an unknown one), the generic name
    given, if any, in ``args.task_alias``."""
    given = getattr(args, "task", None)
    args.task_alias = given if given in ALIASES else None
    if given is not None and args.command != "demo":  # demo's choices include 'all'
        args.task = task_name(given)


def _checkpoint_task(args) -> str:
    """The task of ``infer`` / ``evaluate``: ``--task``, or where it is left out the one the first
    ``--checkpoint`` was trained for (a checkpoint of train or a network of hsmla-med export
    records it); one line when it records none. A ``--task`` that differs from the checkpoint's
    is refused when the checkpoint is loaded, after the options are checked against it."""
    from hsmla_med.engine.checkpoint import written_task
    from hsmla_med.errors import InputError

    if args.task is not None:
        return args.task
    first = args.checkpoint[0]
    written = written_task(first)
    if written is None:
        raise InputError(f"--checkpoint {first}: does not record its task; pass --task ({' | '.join(CARDS)})")
    return task_name(written)


def _postprocessing(task, given: str | None, checkpoints: list[str]) -> list[dict] | None:
    """The kept steps of ``--postprocessing F``, or of the ``postprocessing.json`` beside the
    checkpoints, for a task that post-processes its label maps (``none``: no post-processing)."""
    from hsmla_med.errors import InputError
    from hsmla_med.inference.postprocessing import beside_checkpoints, read_postprocessing

    if given == "none":
        return None
    if not task.postprocesses:
        if given is not None:
            raise InputError(f"--postprocessing {given}: task {task.name} writes no label maps that it post-processes (btcv does)")
        return None
    path = Path(given) if given is not None else beside_checkpoints(checkpoints)
    if path is None:
        return None
    steps = read_postprocessing(path)
    _report(f"post-processing ({path}): " + ("; ".join(f"largest connected component of classes {s['labels']}" for s in steps) or "none kept"))
    return steps or None


def _export(args) -> list[Path]:
    from hsmla_med.export import export, format_report

    output = _writable_folder(args.output, "--output")
    written, report = export(args.checkpoint, args.format, output, args.input_size)
    print(format_report(report))
    print(f"{len(written)} file(s) in {output}: " + ", ".join(str(p.relative_to(output)) for p in written))
    return written


def _first_process() -> bool:
    """Whether this is the first process (global rank 0) of the run, the one that reports and
    writes summaries; the rank is set by Lightning's DDP set-up, or by torchrun/SLURM."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return rank_zero_only.rank == 0


def _report(line: str) -> None:
    """Printed by the first process only (the others of a DDP prediction have their own lines)."""
    if _first_process():
        print(line)


def _wsi(args, features: bool = False) -> list[Path]:
    """wsi-heatmap, or wsi-features with ``features``: the same slides, options and checks. Both
    are the CAMELYON16 pipeline's own commands: its task, feature extraction and file names."""
    from hsmla_med.data.patch_readers import requested_reader
    from hsmla_med.pipelines.camelyon16 import FEATURES_H5, FEATURES_PT, SLIDE_CSV, TASK, extract_features

    requested_reader()  # a bad HSMLA_MED_SLIDE_READER is refused before any work
    options = _options(args, batch_size=args.batch_size, level=args.level, uncertainty=getattr(args, "uncertainty", None))
    _apart(args.slide, args.output, "--slide")
    output = _writable_folder(args.output, "--output")
    module, _ = TASK.load(args.checkpoint)
    if features:
        written = extract_features(module, args.slide, output, options)
        _report(f"features of {len(written)} slide(s) in {output / FEATURES_H5} and {output / FEATURES_PT} (CLAM's layout)")
        return written
    written = TASK.predict(module, args.slide, output, options)
    slides = [p for p in written if p.name != SLIDE_CSV]  # (the run's slide CSV is no slide)
    _report(f"heatmaps of {len(slides)} slide(s) in {output}; slide scores in {output / SLIDE_CSV}")
    return written


def _evaluate_predictions(args) -> dict:
    from hsmla_med.errors import InputError

    if args.labels is None:
        raise InputError("--predictions needs --labels, the reference files")
    if args.checkpoint is not None:
        raise InputError("--checkpoint with --predictions: the predictions are scored as they are; give one or the other")
    task = get_task(args.task or PREDICTIONS_TASK)
    predictions, labels = Path(args.predictions), Path(args.labels)
    for option, path in (("--predictions", predictions), ("--labels", labels)):
        if not path.exists():  # before the default --output would create a folder there
            raise InputError(f"{option} {path}: not found")
    default = predictions if predictions.is_dir() else predictions.parent
    output = _writable_folder(args.output if args.output is not None else default, "--output")
    options = {k: getattr(args, k) for k in ("dataset_json", "nsd_tolerance", "excluded", "seriesuids", "data_dir", "problem", "dicom", "masks")}
    summary = task.score_predictions(predictions, labels, output, options)
    print("\n".join(task.score_lines(summary, output)))
    _write_html_report(output)
    return summary


def _scored_cases(task, module, args, checkpoints: list[str]):
    """The config and the validation cases of the split the checkpoint recorded, which
    ``evaluate`` and ``calibrate`` run it on; refused (one line) when it trained on them (unless
    ``--allow-training-cases``) or predicts other classes than the dataset has."""
    from hsmla_med.errors import InputError

    config = task.evaluation_config(_config(args), module)
    cases = task.datalist(config)
    named = " ".join(checkpoints)
    trained = set((module.config.get("split") or {}).get("train") or [])
    seen = sorted(trained & set((cases.split or {}).get("val") or []))
    if not trained:
        log.warning("%s records no split (written before splits_final.json): cannot check that its validation cases are unseen", named)
    elif seen and not args.allow_training_cases:
        where = (f"fold {cases.split['fold']} of {cases.split['file']}" if cases.split.get("file")
                 else f"case IDs of its training split, found in {cases.split['dataset']}")
        raise InputError(f"--checkpoint {named} trained on {len(seen)} of the {len(cases.validation)} cases to score "
                         f"({where}: {', '.join(seen[:5])}{' ...' if len(seen) > 5 else ''}); "
                         "their scores would not be held-out scores; pass --allow-training-cases to score them anyway")
    if cases.label_names != module.label_names:
        raise InputError(f"--checkpoint {named} predicts {len(module.label_names)} classes {module.label_names}, "
                         f"the dataset has {len(cases.label_names)} {cases.label_names}")
    return config, cases


def _evaluate(args) -> dict:
    from hsmla_med.engine.calibration import CalibrationSample
    from hsmla_med.engine.callbacks import write_gate_example
    from hsmla_med.engine.run import evaluate
    from hsmla_med.errors import InputError
    from hsmla_med.io import write_json

    if args.predictions is not None:
        return _evaluate_predictions(args)
    if args.checkpoint is None:
        raise InputError("evaluate needs --checkpoint, or --predictions DIR --labels DIR")
    args.task = _checkpoint_task(args)  # the config of the cases to score is this task's
    task = get_task(args.task)
    if args.output is None:  # the default of this mode (predictions mode writes beside the predictions)
        args.output = "runs/evaluate"
    output = _writable_folder(args.output, "--output")
    module, meta = task.load(args.checkpoint, tta=args.tta)
    module.use_cuda_graphs(args.cuda_graphs)
    if args.routing:
        if not hasattr(module.network, "set_routing") or not module.network.hsmla_layers():
            raise InputError(f"--routing: {' '.join(args.checkpoint)} holds a {type(module.network).__name__}, which has no HSMLA layers")
        module.network.set_routing(args.routing)
    config, cases = _scored_cases(task, module, args, [str(c) for c in args.checkpoint])
    task.evaluation_outputs(module, output, {"nsd_tolerance": args.nsd_tolerance, "save_probabilities": args.save_probabilities})
    module.calibration_sample = CalibrationSample()  # ECE, Brier, NLL where the task draws one (its card declares calibration)
    summary = evaluate(module, task.datamodule(config, cases), config["trainer"], output)
    if not _first_process():  # every process holds the gathered summary; one writes and prints it
        return summary
    checkpoints = [str(c) for c in args.checkpoint]
    write_json(output / "metrics.json", {**summary, **meta, "checkpoint": checkpoints[0] if len(checkpoints) == 1 else checkpoints,
                                         "routing": args.routing or "gate"})
    reports = task.evaluation_reports(module, output)
    write_gate_example(module, output)
    _print_summary(task, summary, output)
    if reports:
        print(f"per case: {', '.join(map(str, reports))}")
    _write_html_report(output)
    return summary


def _calibrate(args) -> dict | None:
    from hsmla_med.engine.calibration import calibrate, check_calibratable
    from hsmla_med.engine.checkpoint import read_hparams
    from hsmla_med.errors import InputError

    hparams = read_hparams(args.checkpoint)  # a missing or foreign file: one line, before any work
    check_calibratable(hparams, args.checkpoint)
    args.task = hparams["task"]
    task = get_task(args.task)
    output = _writable_folder(args.output, "--output")
    module, _ = task.load(args.checkpoint)
    config, cases = _scored_cases(task, module, args, [args.checkpoint])
    if not cases.validation:
        raise InputError(f"--checkpoint {args.checkpoint}: the split it recorded leaves no validation cases in {config['data']['data_dir'] or 'the synthetic dataset'}")
    record = calibrate(task, module, task.datamodule(config, cases), config["trainer"], args.checkpoint, output, args.per_class, args.samples,
                       cases.split)
    if record is not None:
        before, after = record["before"], record["after"]
        fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
        print(f"temperature {', '.join(f'{t:.4g}' for t in record['temperature'])} from {record['samples']} validation samples; "
              + "; ".join(f"{k} {fmt(before[k])} -> {fmt(after[k])}" for k in ("ece", "ece_foreground", "brier", "nll")))
        print(f"calibrated checkpoint: {output / Path(args.checkpoint).name}; {output / 'calibration.json'}, {output / 'reliability.png'}")
        _write_html_report(output)
    return record


def _demo(args) -> int:
    from importlib import resources

    from hsmla_med.config import merge_config, merge_user_config, validate_config
    from hsmla_med.pipelines.task import InferenceOptions

    tasks = tasks_with("synthetic") if args.task == "all" else [args.task]
    report = []
    for name in tasks:
        started = time.perf_counter()
        overlay = resources.files("hsmla_med.configs") / f"{name}_demo.yaml"
        config = merge_config(task_config(name), load_yaml(overlay), f"{name}_demo.yaml")
        if args.config:
            config = merge_user_config(config, args.config, f"the {name} demo")
        output = Path(args.output) / name
        config["output"] = str(output)
        if args.max_steps is not None:
            config["trainer"]["max_steps"] = args.max_steps
        summary = _train(validate_config(config, args.config or f"{name}_demo.yaml"))
        task = get_task(name)
        cases = task.datalist(config)
        module, _ = task.load(output / "best.ckpt")
        predictions = output / "predictions"
        for item in task.held_out(cases):
            task.predict(module, item, predictions, InferenceOptions(overwrite=True))
        # every file written, not only what marks a case done (a slide's heatmap, overlay and regions too)
        written = sorted(str(p.relative_to(predictions)) for p in predictions.rglob("*") if p.is_file() and not p.relative_to(predictions).parts[0].startswith("."))
        metric = module.monitor
        # a score over slides says so: its items (patches) are not what it averages
        held = f"{summary['slides']} held-out synthetic slides" if "slides" in summary else f"{summary['cases']} held-out synthetic items"
        report.append(
            f"{name}: {metric} {summary[metric]:.4f} on {held}, "
            f"{time.perf_counter() - started:.0f} s\n  checkpoints: {output / 'best.ckpt'}, {output / 'last.ckpt'}\n"
            f"  metrics: {output / 'metrics.json'}, curve: {output / 'training_curve.png'}\n"
            f"  outputs in {predictions}: {', '.join(written)}"
        )
    print("\n" + "\n".join(report))
    return 0


def _bench(args) -> int:
    from hsmla_med.bench.main import main as bench_main

    return bench_main(args.args)


def _warnings_shown(debug: bool):
    """``warnings.showwarning`` for a command: a warning that hsmla-med's own code gives about the
    user's data (a slide without tissue, a volume without foreground) is one line like its other
    messages, ``hsmla-med: warning: ...``, not Python's two lines of file, line number and source
    line; other libraries' warnings, and every warning under ``--debug``, keep Python's format."""
    import os
    from importlib.util import find_spec

    import hsmla_med

    folders = list(hsmla_med.__path__)
    for sub in ("pipelines", "kernels"):  # (installed from folders of their own: pyproject.toml)
        folders += find_spec(f"hsmla_med.{sub}").submodule_search_locations or []
    ours = tuple(os.path.join(os.path.realpath(folder), "") for folder in folders)
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if not debug and os.path.realpath(filename).startswith(ours):
            log.warning("warning: %s", message)
        else:
            shown(message, category, filename, lineno, file, line)

    return show


@contextmanager
def _interruptible() -> Iterator[list[int]]:
    """SIGINT and SIGTERM as ``KeyboardInterrupt`` in the main thread, for the duration of a
    command; yields the list that records the first signal's number.

    SIGTERM's default would end the process where it stands, with no ``finally`` run: temporaries
    left, no message. As a ``KeyboardInterrupt`` both unwind through the code's clean-up, and the
    libraries shut down as they do for Ctrl-C (DataLoader workers, which inherit the handler, end
    quietly). Lightning's loops catch it, tear down and end with ``sys.exit(1)``
    (``_call_and_handle_interrupt``), so :func:`main` recognises an interruption by the recorded
    signal, not by the exception that reaches it. A second signal during the clean-up is ignored,
    as Lightning ignores a second Ctrl-C. Outside the main thread (a notebook's worker thread)
    nothing is installed: Python allows handlers in the main thread only."""
    import threading

    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def interrupt(signum, frame):
        if not received:
            received.append(signum)
            raise KeyboardInterrupt

    previous = {signum: signal.signal(signum, interrupt) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for signum, handler in previous.items():  # also undoes Lightning's SIG_IGN for SIGINT
            if handler is not None:  # (None: a handler not set from Python, which cannot be set back)
                signal.signal(signum, handler)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.args = extra
    _COMMAND_LINE[:] = sys.argv[1:] if argv is None else argv  # as command.json records it
    # a line at a time into a pipe (| tee) as into a terminal: block-buffered, stdout would hold
    # the per-case lines back until exit, behind the log lines on stderr that followed them
    if callable(getattr(sys.stdout, "reconfigure", None)):  # (a notebook's stream has no buffering to set)
        sys.stdout.reconfigure(line_buffering=True)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("hsmla-med: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    # Lightning's tips (loggers to install, GPU/TPU availability, num_workers advice) and a
    # deprecation inside Lightning itself are noise to our users; real warnings stay visible.
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    # its "Received SIGTERM" in every loop: the command's own line says it was interrupted
    logging.getLogger("lightning.pytorch.trainer.connectors.signal_connector").setLevel(logging.WARNING)
    # (the run folder holds config.yaml before Lightning's checkpoint callback looks at it)
    for message in (".*does not have many workers.*", ".*treespec, LeafSpec.*", ".*smaller than the logging interval.*",
                    "Checkpoint directory .* exists and is not empty"):
        warnings.filterwarnings("ignore", message=message)
    from hsmla_med.errors import find_input_error
    from hsmla_med.runtime import configure_cpu_threads, tune_cpu_allocator

    if "torch" not in sys.modules:  # (main() called again in one process, by tests or a notebook: too late)
        configure_cpu_threads()  # OpenMP's waiting and thread count, which it reads once, when torch loads

    commands = {
        "train": lambda: _train(_config(args), args.resume),
        "cross-validate": lambda: _cross_validate(args),
        "infer": lambda: _infer(args),
        "evaluate": lambda: _evaluate(args),
        "wsi-heatmap": lambda: _wsi(args),
        "wsi-features": lambda: _wsi(args, features=True),
        "export": lambda: _export(args),
        "calibrate": lambda: _calibrate(args),
        "report": lambda: _html_report(args),
        "bench": lambda: _bench(args),
        "demo": lambda: _demo(args),
    }
    shown, warnings.showwarning = warnings.showwarning, _warnings_shown(args.debug)
    try:
        with _interruptible() as received:
            try:
                tune_cpu_allocator()  # a bad HSMLA_MED_MALLOC_TOP_PAD is an input error like any other
                _resolve_task(args)
                result = commands[args.command]()
            except BaseException as err:
                # after a signal, whatever ends the command is the interruption: Lightning's
                # sys.exit(1), or an error of a library that saw its work cut short
                if not received and not isinstance(err, KeyboardInterrupt):
                    raise
                _remove_empty_created()
                if "lightning" not in sys.modules or _first_process():  # one line for all the processes of a run (Ctrl-C reaches each)
                    print("hsmla-med: interrupted", file=sys.stderr)
                return 128 + (received[0] if received else signal.SIGINT)  # the shell's status of a process the signal ended
    except Exception as err:
        _remove_empty_created()
        problem = find_input_error(err)
        if problem is None or args.debug:
            raise
        print(f"hsmla-med: error: {problem}", file=sys.stderr)
        return 2
    finally:
        _CREATED.clear()
        log.removeHandler(handler)  # main() may run again in this process (tests, notebooks)
        warnings.showwarning = shown
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
