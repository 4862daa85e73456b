"""The configs and README of a MONAI Bundle of ``hsmla-med export --format bundle``.

The bundle's network is the TorchScript file ``models/model.ts``, run by MONAI's own runner
(``python -m monai.bundle run``), as MONAI Deploy and the Model Zoo's runners expect.
``models/model.pt`` (the state dict) and the config item ``network_def_hsmla`` rebuild the
PyTorch network where ``hsmla_med`` is installed.

The transforms are those of ``hsmla-med infer``, each written once, by the task's pipeline
(:meth:`~hsmla_med.pipelines.task.Task.bundle`, for the tasks whose card declares ``bundle``):
the pipeline gives what is its own (the transforms as MONAI config items, the metadata's
description and input, the README's inputs and outputs, the packages its items import), this
module the rest around it (:class:`~hsmla_med.pipelines.task.BundleParts`).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import monai
import numpy
import torch

from hsmla_med.io import atomic_path
from hsmla_med.pipelines import get_task
from hsmla_med.pipelines.task import BundleParts

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


def _common(config: dict, extra_imports: list[str]) -> dict:
    return {
        "imports": list(dict.fromkeys(["$import glob", "$import logging", "$import os", "$import numpy", "$import torch", *extra_imports])),
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


def inference_config(task: str, config: dict, size) -> dict:
    """``configs/inference.json`` of a bundle of ``task``'s module ``config``: the task's items
    (:meth:`~hsmla_med.pipelines.task.Task.bundle`) between the common ones and the run, which
    sends every item through the network and postprocessing, then logs one line (configs/logging.conf
    prints it) saying what was written where."""
    parts = get_task(task).bundle(config)
    return {
        **_common(config, parts.imports),
        **parts.inference(size),
        "initialize": ["$monai.utils.set_determinism(seed=0)", "$torch.set_grad_enabled(False)"],
        "run": ["$[@postprocessing(@predict(item)) for item in @dataset]",
                f"$logging.getLogger('bundle').info('%d {parts.written} in %s', len(@datalist), os.path.abspath(@output_dir))"],
    }


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
    config has), and what the task's bundle adds (:attr:`~hsmla_med.pipelines.task.BundleParts.recipe`;
    BTCV: the mode and the window as the training crop). What a checkpoint does not record
    (steps, batch size, augmentation, seed) keeps the task's defaults."""
    from hsmla_med.config import task_config

    defaults = task_config(task)
    known = lambda section: {k: copy.deepcopy(v) for k, v in config[section].items() if k in defaults[section]}  # noqa: E731
    out = {"task": task, "model": copy.deepcopy(config["network"]), "optim": known("optim"), "loss": known("loss"), "data": known("data"),
           "inference": known("inference")}
    for key, value in get_task(task).bundle(config).recipe.items():
        out[key] = {**out[key], **value} if isinstance(out.get(key), dict) else value
    return out


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
    """``configs/metadata.json`` (MONAI's meta schema 20240725): the task's description and
    input (:meth:`~hsmla_med.pipelines.task.Task.bundle`), a segmentation of its labels out."""
    parts = get_task(task).bundle(config)
    labels = list(config["label_names"])
    channels = {str(i): name for i, name in enumerate(labels)}
    spatial_dims = config["spatial_dims"]
    image = {**parts.image, "spatial_shape": list(size), "dtype": "float32", "value_range": [], "is_patch_data": True}
    return {
        "schema": SCHEMA,
        "version": BUNDLE_VERSION,
        "changelog": {BUNDLE_VERSION: "exported by hsmla-med export --format bundle"},
        "monai_version": monai.__version__,
        "pytorch_version": torch.__version__.split("+")[0],
        "numpy_version": numpy.__version__,
        "required_packages_version": _required(parts),
        "name": f"hsmla_{task}_segmentation",
        "task": f"{task} segmentation",
        "description": parts.description,
        "authors": "hsmla-med",
        "copyright": "see the training data's licence",
        "network_data_format": {
            "inputs": {"image": image},
            "outputs": {"pred": {"type": "image", "format": "segmentation", "num_channels": len(labels), "spatial_shape": list(size),
                                 "dtype": "float32", "value_range": [], "is_patch_data": True, "channel_def": channels}},
        },
        "hsmla_med": {"task": task, "label_names": labels, "spatial_dims": spatial_dims, "data": config["data"], "inference": config["inference"]},
    }


def _required(parts: BundleParts) -> dict:
    """Packages beyond MONAI and PyTorch that the bundle's inference needs, with their versions."""
    from importlib import import_module

    import hsmla_med

    packages = {name: str(getattr(import_module(module), "__version__", "")) for name, module in parts.packages.items()}
    return {**packages, "hsmla-med": getattr(hsmla_med, "__version__", "")} if parts.needs_hsmla else packages


def _readme(task: str, config: dict, size) -> str:
    parts = get_task(task).bundle(config)
    labels = ", ".join(f"{i} {n}" for i, n in enumerate(config["label_names"]))
    return f"""# HSMLA {task} segmentation (exported by `hsmla-med export --format bundle`)

Labels: {labels}.

## Run

From this folder, with MONAI and PyTorch installed{' and `hsmla_med` (its transforms are named in the config)' if parts.needs_hsmla else ' (no `hsmla_med` needed)'}:

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

Inputs: {parts.inputs}. Outputs: {parts.outputs}. From another folder add `--bundle_root PATH/TO/BUNDLE`.
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
