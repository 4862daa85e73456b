"""The configs and README of a MONAI Bundle of ``hsmla-med export --format bundle``.

The bundle's network is the TorchScript file ``models/model.ts``, run by MONAI's own runner
(``python -m monai.bundle run``), as MONAI Deploy and the Model Zoo's runners expect.
``models/model.pt`` (the state dict) and the config item ``network_def_hsmla`` rebuild the
PyTorch network where ``hsmla_med`` is installed.

The transforms are those of ``hsmla-med infer``, each written once: for BTCV the config items of
:func:`hsmla_med.pipelines.btcv.preprocessing_items` (RAS orientation, resampling to the
checkpoint's spacing, foreground crop, intensity normalisation), which training and ``infer``
instantiate too, after loading; then the sliding window
(:func:`hsmla_med.inference.sliding.predict_volume`: ``SliceInferer`` for a 2D network, Gaussian
blending), softmax, ``Invertd`` of every class's probability and the argmax (what
:func:`hsmla_med.pipelines.btcv.labels_in_input_geometry` computes), saved as uint8 NIfTI in the
input's geometry. With ``ct_zscore``, ``ct_window`` or ``zscore`` intensities it needs MONAI alone; the Otsu
kinds (``zscore_foreground``, ``percentile``) have no MONAI equivalent and name ``hsmla_med``'s
transforms. EndoVis: the part of the frame that ``infer`` segments, by the function ``infer``
calls (:func:`hsmla_med.pipelines.endovis.inference_box`, so the bundle needs ``hsmla_med``),
resized to the network's size (area), the probabilities resized back (bilinear) and padded with
background outside it, saved as PNG.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import monai
import numpy
import torch

from hsmla_med.io import atomic_path
from hsmla_med.pipelines.btcv import UNCROPPED_BACKGROUND, preprocessing_items

__all__ = ["write_configs", "inference_config", "train_config", "recipe", "metadata", "LOGGING_CONF"]

BUNDLE_VERSION = "0.1.0"
SCHEMA = "https://github.com/Project-MONAI/MONAI-extra-test-data/releases/download/0.8.1/meta_schema_20240725.json"


def _network_def(config: dict, calibrated: bool = True) -> dict:
    """The network as ``hsmla_med`` builds it, as a config item; ``calibrated``: in hsmla-med
    calibrate's temperature wrapper where the checkpoint has one (which models/model.pt holds)."""
    network = {
        "_target_": "hsmla_med.config.build_network",
        "config": copy.deepcopy(config["network"]),
        "spatial_dims": config["spatial_dims"],
        "in_channels": config["in_channels"],
        "out_channels": len(config["label_names"]),
    }
    if calibrated and config.get("calibration"):
        network = {"_target_": "hsmla_med.engine.calibration.TemperatureScaled", "network": network,
                   "temperature": list(config["calibration"]["temperature"])}
    return network


def _common(config: dict, size, extra_imports: list[str] | None = None) -> dict:
    return {
        "imports": list(dict.fromkeys(["$import glob", "$import logging", "$import os", "$import numpy", "$import torch", *(extra_imports or [])])),
        "bundle_root": ".",
        "output_dir": "$@bundle_root + '/eval'",
        "dataset_dir": "$@bundle_root + '/data'",
        "save_execute_config": False,
        "device": "$torch.device('cuda:0' if torch.cuda.is_available() else 'cpu')",
        # the TorchScript network: windows of its exported size, batch dynamic
        "network_def": "$torch.jit.load(@bundle_root + '/models/model.ts', map_location='cpu')",
        "network": "$@network_def.to(@device).eval()",
        # one case: the window logits of the whole input, on the CPU (no ignite evaluator needed)
        "predict": "$lambda item: {**item, 'pred': @inferer(item['image'][None].to(@device), @network)[0].cpu()}",
        # the same network rebuilt by hsmla_med (installed) from the state dict models/model.pt
        "network_def_hsmla": _network_def(config),
        "network_hsmla": "$[@network_def_hsmla.load_state_dict(torch.load(@bundle_root + '/models/model.pt', map_location='cpu', weights_only=True)), @network_def_hsmla.eval().to(@device)][1]",
    }


def _btcv(config: dict, size) -> dict:
    """BTCV volumes as :func:`hsmla_med.pipelines.btcv.infer`: loading, then the items of
    :func:`~hsmla_med.pipelines.btcv.preprocessing_items` (the definition training and ``infer``
    instantiate), the sliding window, ``Invertd`` and the argmax."""
    data, inference = config["data"], config["inference"]
    imports, items = preprocessing_items(data)
    if config["spatial_dims"] == 2:
        inferer = {"_target_": "SliceInferer", "spatial_dim": 2, "roi_size": list(size), "sw_batch_size": int(inference["sw_batch_size"]) * int(inference["slab"]),
                   "overlap": float(inference["overlap"]), "mode": "gaussian"}
    else:
        inferer = {"_target_": "SlidingWindowInferer", "roi_size": list(size), "sw_batch_size": int(inference["sw_batch_size"]),
                   "overlap": float(inference["overlap"]), "mode": "gaussian"}
    return {
        **_common(config, size, imports),
        "datalist": "$list(sorted(glob.glob(@dataset_dir + '/*.nii.gz') + glob.glob(@dataset_dir + '/*.nii')))",
        "preprocessing": {
            "_target_": "Compose",
            "transforms": [
                {"_target_": "LoadImaged", "keys": "image", "ensure_channel_first": True, "image_only": True},
                *items,
            ],
        },
        "dataset": {"_target_": "Dataset", "data": "$[{'image': i} for i in @datalist]", "transform": "@preprocessing"},
        "inferer": inferer,
        "postprocessing": {
            "_target_": "Compose",
            "transforms": [
                {"_target_": "Activationsd", "keys": "pred", "softmax": True},
                # every class's probability back to the input's grid, then the argmax; the
                # background shifted around Invertd so that it is 1 outside the foreground crop
                {"_target_": "Lambdad", "keys": "pred", "func": f"$lambda p: torch.cat([p[:1] - {UNCROPPED_BACKGROUND!r}, p[1:]])"},
                {"_target_": "Invertd", "keys": "pred", "transform": "@preprocessing", "orig_keys": "image", "nearest_interp": False, "to_tensor": True},
                {"_target_": "Lambdad", "keys": "pred", "func": f"$lambda p: torch.cat([p[:1] + {UNCROPPED_BACKGROUND!r}, p[1:]])"},
                {"_target_": "AsDiscreted", "keys": "pred", "argmax": True},
                {"_target_": "SaveImaged", "keys": "pred", "output_dir": "@output_dir", "output_postfix": "", "output_ext": ".nii.gz",
                 "output_dtype": "$numpy.uint8", "resample": False, "separate_folder": False, "squeeze_end_dims": True, "print_log": False},
            ],
        },
        "initialize": ["$monai.utils.set_determinism(seed=0)", "$torch.set_grad_enabled(False)"],
        "run": _run("case(s) segmented; labels"),
    }


def _run(written: str) -> list[str]:
    """``run`` of an inference config: every item through the network and postprocessing, then
    one line (configs/logging.conf prints it) saying what was written where."""
    return ["$[@postprocessing(@predict(item)) for item in @dataset]",
            f"$logging.getLogger('bundle').info('%d {written} in %s', len(@datalist), os.path.abspath(@output_dir))"]


def _endovis(config: dict, size) -> dict:
    """EndoVis frames as :func:`hsmla_med.pipelines.endovis.infer` with ``--crop auto``: the
    training crop for frames large enough for it, frames of exactly the crop's size and of
    other sizes whole (:func:`hsmla_med.pipelines.endovis.inference_box`); area resize to the
    network's size; probabilities resized back bilinearly and placed in the frame with
    background outside the box; one PNG per frame, named as ``infer`` names them."""
    crop = None if config["data"]["crop"] is None else [int(v) for v in config["data"]["crop"]]
    h, w = (int(v) for v in size)
    return {
        **_common(config, size, ["$import functools", "$import re", "$from PIL import Image as PILImage", "$from hsmla_med.pipelines.endovis import inference_box"]),
        "datalist": "$sorted(p for p in glob.glob(@dataset_dir + '/**/*.png', recursive=True) if 'ground_truth' not in p and not os.path.basename(p).startswith('.'))",
        # (top, left, height, width) of the part of a frame of shape (H, W) that is segmented: the
        # function infer calls, so that the rule is written once
        "box": f"$functools.partial(inference_box, crop={crop!r}, mode='auto')",
        "read": "$lambda f: torch.from_numpy(numpy.asarray(PILImage.open(f).convert('RGB')).transpose(2, 0, 1).copy()).float().div_(255.0)",
        "cut": "$lambda d, x, b: {**d, 'shape': tuple(x.shape[1:]), 'box': b, 'image': x[:, b[0]:b[0] + b[2], b[1]:b[1] + b[3]]}",
        "load": "$lambda d: (lambda x: @cut(d, x, @box(x.shape[1:], path=d['image'])))(@read(d['image']))",
        "preprocessing": {
            "_target_": "Compose",
            "transforms": [
                "@load",
                {"_target_": "Resized", "keys": "image", "spatial_size": [h, w], "mode": "area"},
                {"_target_": "EnsureTyped", "keys": "image", "dtype": "$torch.float32", "track_meta": False},
            ],
        },
        "dataset": {"_target_": "Dataset", "data": "$[{'image': i, 'frame': i} for i in @datalist]", "transform": "@preprocessing"},
        # the window is the whole resized frame
        "inferer": {"_target_": "SimpleInferer"},
        "output_path": ("$lambda f: os.path.join(@output_dir, *([os.path.basename(os.path.dirname(os.path.dirname(f)))] "
                        "if os.path.basename(os.path.dirname(f)) == 'left_frames' and re.match(r'^instrument_dataset_(\\d+)$', "
                        "os.path.basename(os.path.dirname(os.path.dirname(f)))) else []), os.path.splitext(os.path.basename(f))[0] + '.png')"),
        "mask": ("$lambda d: torch.nn.functional.pad(torch.nn.functional.interpolate(d['pred'][None].float(), size=d['box'][2:], mode='bilinear', "
                 "align_corners=False).argmax(1)[0].to(torch.uint8), (d['box'][1], d['shape'][1] - d['box'][1] - d['box'][3], d['box'][0], "
                 "d['shape'][0] - d['box'][0] - d['box'][2]))"),
        "save": "$lambda d: (os.makedirs(os.path.dirname(@output_path(d['frame'])), exist_ok=True), PILImage.fromarray(@mask(d).numpy()).save(@output_path(d['frame'])))",
        "postprocessing": {
            "_target_": "Compose",
            "transforms": [{"_target_": "Activationsd", "keys": "pred", "softmax": True}, "@save"],
        },
        "initialize": ["$monai.utils.set_determinism(seed=0)", "$torch.set_grad_enabled(False)"],
        "run": _run("frame(s) segmented; masks"),
    }


def inference_config(task: str, config: dict, size) -> dict:
    """``configs/inference.json`` of a bundle of ``task``'s module ``config``."""
    return {"btcv": _btcv, "endovis": _endovis}[task](config, size)


def train_config(task: str, config: dict) -> dict:
    """``configs/train.json``: ``hsmla-med train`` of the checkpoint's recipe (:func:`recipe`) on
    ``dataset_dir`` into ``output_dir``, then one line naming that folder. A launcher of
    hsmla-med's training rather than MONAI's ignite ``SupervisedTrainer``, because the training
    is hsmla-med's (gate regularisers in the loss, tau calibrated at each validation, the
    cross-validation splits), which that trainer does not do. ``network_def`` is the network it
    trains, for the Model Zoo's tools (``verify_net_in_out``)."""
    return {
        "imports": ["$import logging", "$import os", "$import sys", "$import torch", "$from hsmla_med.cli import main as hsmla_med_main",
                    "$from hsmla_med.io import write_yaml"],
        "bundle_root": ".",
        "dataset_dir": "$@bundle_root + '/data'",
        "output_dir": "$@bundle_root + '/train'",
        "device": "$torch.device('cuda:0' if torch.cuda.is_available() else 'cpu')",
        "network_def": _network_def(config, calibrated=False),
        "network": "$@network_def.to(@device)",
        "recipe": recipe(task, config),
        "recipe_file": "$os.path.join(@output_dir, 'bundle_recipe.yaml')",
        "train_args": [],  # more options of hsmla-med train, e.g. ['--max-steps', '500']
        "run": [
            "$os.makedirs(@output_dir, exist_ok=True)",
            "$write_yaml(@recipe_file, @recipe)",
            ("$(lambda status: status == 0 or sys.exit(status))(hsmla_med_main(['train', '--task', @recipe['task'], '--data-dir', @dataset_dir, "
             "'--config', @recipe_file, '--output', @output_dir, *@train_args]))"),
            "$logging.getLogger('bundle').info('trained: best.ckpt and last.ckpt in %s', os.path.abspath(@output_dir))",
        ],
    }


def recipe(task: str, config: dict) -> dict:
    """The checkpoint's training recipe as a config of ``hsmla-med train --config``: its
    network, optimiser, loss and the data and inference settings it recorded (those the task's
    config has), for BTCV the mode and the window as the training crop. What a checkpoint does
    not record (steps, batch size, augmentation, seed) keeps the task's defaults."""
    from hsmla_med.config import task_config

    defaults = task_config(task)
    known = lambda section: {k: copy.deepcopy(v) for k, v in config[section].items() if k in defaults[section]}  # noqa: E731
    data = known("data")
    if task == "btcv":
        dims = config["spatial_dims"]
        data[f"roi_size_{dims}d"] = list(config["inference"]["roi_size"])
    out = {"task": task, "model": copy.deepcopy(config["network"]), "optim": known("optim"), "loss": known("loss"), "data": data,
           "inference": known("inference")}
    return {**out, "mode": f"{config['spatial_dims']}d"} if task == "btcv" else out


#: configs/logging.conf, the Model Zoo bundles' own: INFO and above to stdout, which
#: ``monai.bundle run`` applies by default (only standard handlers: MONAI refuses others)
LOGGING_CONF = """[loggers]
keys=root

[handlers]
keys=consoleHandler

[formatters]
keys=fullFormatter

[logger_root]
level=INFO
handlers=consoleHandler

[handler_consoleHandler]
class=StreamHandler
level=INFO
formatter=fullFormatter
args=(sys.stdout,)

[formatter_fullFormatter]
format=%(asctime)s - %(name)s - %(levelname)s - %(message)s
"""


def metadata(task: str, config: dict, size) -> dict:
    """``configs/metadata.json`` (MONAI's meta schema 20240725)."""
    labels = list(config["label_names"])
    channels = {str(i): name for i, name in enumerate(labels)}
    spatial_dims = config["spatial_dims"]
    if task == "btcv":
        description = ("HSMLA segmentation of CT/MRI volumes (NIfTI), trained with hsmla-med on task btcv; "
                       f"{'slice-wise 2D' if spatial_dims == 2 else '3D'} network, sliding-window inference, labels written in each input's geometry.")
        image = {"type": "image", "format": "hounsfield" if config["data"]["intensity"]["kind"] == "ct_window" else "magnitude", "modality": "CT" if config["data"]["intensity"]["kind"] == "ct_window" else "MR",
                 "num_channels": config["in_channels"], "channel_def": {"0": "image"}}
        out_type, out_format = "image", "segmentation"
    else:
        description = "HSMLA segmentation of surgical instrument frames (EndoVis 2017 PNG), trained with hsmla-med on task endovis."
        image = {"type": "image", "format": "RGB", "modality": "regular", "num_channels": config["in_channels"], "channel_def": {"0": "R", "1": "G", "2": "B"}}
        out_type, out_format = "image", "segmentation"
    image.update(spatial_shape=list(size), dtype="float32", value_range=[], is_patch_data=True)
    return {
        "schema": SCHEMA,
        "version": BUNDLE_VERSION,
        "changelog": {BUNDLE_VERSION: "exported by hsmla-med export --format bundle"},
        "monai_version": monai.__version__,
        "pytorch_version": torch.__version__.split("+")[0],
        "numpy_version": numpy.__version__,
        "required_packages_version": _required(task, config),
        "name": f"hsmla_{task}_segmentation",
        "task": f"{task} segmentation",
        "description": description,
        "authors": "hsmla-med",
        "copyright": "see the training data's licence",
        "network_data_format": {
            "inputs": {"image": image},
            "outputs": {"pred": {"type": out_type, "format": out_format, "num_channels": len(labels), "spatial_shape": list(size),
                                 "dtype": "float32", "value_range": [], "is_patch_data": True, "channel_def": channels}},
        },
        "hsmla_med": {"task": task, "label_names": labels, "spatial_dims": spatial_dims, "data": config["data"], "inference": config["inference"]},
    }


def _required(task: str, config: dict) -> dict:
    """Packages beyond MONAI and PyTorch that the bundle's inference needs."""
    import hsmla_med

    ours = {"hsmla-med": getattr(hsmla_med, "__version__", "")}
    if task == "endovis":  # the crop rule is hsmla_med's inference_box
        return {"pillow": _version("PIL"), **ours}
    packages = {"nibabel": _version("nibabel")}
    return {**packages, **ours} if _needs_hsmla(task, config) else packages


def _needs_hsmla(task: str, config: dict) -> bool:
    """Whether the bundle's inference imports ``hsmla_med``: EndoVis's crop rule and the Otsu
    intensity kinds do; BTCV with ``ct_window`` or ``zscore`` runs with MONAI alone."""
    return task == "endovis" or config["data"]["intensity"]["kind"] not in ("ct_window", "zscore")


def _version(module: str) -> str:
    from importlib import import_module

    return str(getattr(import_module(module), "__version__", ""))


def _readme(task: str, config: dict, size) -> str:
    labels = ", ".join(f"{i} {n}" for i, n in enumerate(config["label_names"]))
    inputs = "a folder of NIfTI volumes (`*.nii.gz`, `*.nii`)" if task == "btcv" else "a folder of PNG frames (searched recursively; label folders skipped)"
    outputs = ("`OUT/<case>.nii.gz`, uint8 labels in each input's shape and affine" if task == "btcv"
               else "`OUT/<path relative to IN>.png`, uint8 class index at each frame's size, background outside the crop")
    return f"""# HSMLA {task} segmentation (exported by `hsmla-med export --format bundle`)

Labels: {labels}.

## Run

From this folder, with MONAI and PyTorch installed{' and `hsmla_med` (its transforms are named in the config)' if _needs_hsmla(task, config) else ' (no `hsmla_med` needed)'}:

```bash
python -m monai.bundle run --config_file configs/inference.json --meta_file configs/metadata.json \\
    --dataset_dir IN --output_dir OUT
python -m monai.bundle verify_net_in_out network_def --meta_file configs/metadata.json --config_file configs/inference.json
```

Training anew on your data (`hsmla-med` needed: it runs `hsmla-med train` with this model's
recipe, `configs/train.json#recipe`; `--train_args "['--max-steps', '500']"` passes more options):

```bash
python -m monai.bundle run --config_file configs/train.json --meta_file configs/metadata.json --dataset_dir DATA --output_dir RUN
```

Inputs: {inputs}. Outputs: {outputs}. From another folder add `--bundle_root PATH/TO/BUNDLE`.
`--device "$torch.device('cpu')"` forces the CPU.

## Files

- `models/model.ts`: the network as TorchScript (logits of windows of {'x'.join(map(str, size))}, batch dynamic);
  its HSMLA layers run the dense form of the gated refinement, `O_lin + [M > tau] * M * R`, the same
  function as the PyTorch model (checked within 1e-4 at export).
- `models/model.pt`: the network's state dict for `hsmla_med` (config item `network_hsmla`).
- `configs/inference.json`: the transforms of `hsmla-med infer` as MONAI's own; `hsmla-med infer
  --checkpoint THIS_FOLDER` runs the same network through hsmla-med's own pipeline.
- `configs/train.json`: `hsmla-med train` of this model's recipe; `configs/logging.conf`: log
  lines to stdout (`monai.bundle run` applies it), the last one naming the output folder.

## Data

Trained on the data named by the checkpoint; see its licence. Not for clinical use.
"""


def write_configs(task: str, config: dict, size, output: str | Path) -> list[Path]:
    """Write ``configs/inference.json``, ``configs/train.json``, ``configs/logging.conf``,
    ``configs/metadata.json`` and ``docs/README.md`` into the bundle folder ``output``,
    atomically; returns their paths."""
    output = Path(output)
    files = {
        output / "configs" / "inference.json": json.dumps(inference_config(task, config, size), indent=2) + "\n",
        output / "configs" / "train.json": json.dumps(train_config(task, config), indent=2) + "\n",
        output / "configs" / "logging.conf": LOGGING_CONF,
        output / "configs" / "metadata.json": json.dumps(metadata(task, config, size), indent=2) + "\n",
        output / "docs" / "README.md": _readme(task, config, size),
    }
    for path, text in files.items():
        with atomic_path(path) as tmp:
            tmp.write_text(text)
    return list(files)
