"""BTCV: abdominal CT, 13 organs, NIfTI in MSD / nnU-Net folders or MONAI's list JSON.

What is specific to the benchmark lives here: the dataset (real folder or the synthetic
default), MONAI transforms for 2D (axial slices) and 3D (patches) training, and writing
predictions back as NIfTI in each input's own geometry. The loop, metrics and checkpoints are
the generic engine's (:mod:`hsmla_med.engine`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from operator import lt, ne
from pathlib import Path

import nibabel as nib
import numpy as np
import torch
from monai.transforms import (
    Compose,
    CropForegroundd,
    EnsureTyped,
    Invertd,
    NormalizeIntensityd,
    Orientationd,
    ScaleIntensityRanged,
    Spacingd,
)

from hsmla_med.data.checks import CheckCased, LoadCased
from hsmla_med.data.datalist import Datalist, case_name, load_datalist, read_header
from hsmla_med.data.intensity import ForegroundPercentiled, ForegroundZScored, otsu_foreground
from hsmla_med.data.synthetic_btcv import generate_btcv
from hsmla_med.data.volume_crops import crop_and_augment, roi_size, spatial_dims
from hsmla_med.engine.base import hparams
from hsmla_med.engine.datamodule import CaseDataModule
from hsmla_med.engine.segmentation import SegmentationModule
from hsmla_med.errors import ConfigError, DataError
from hsmla_med.inference.sliding import predict_volume
from hsmla_med.io import atomic_path, is_temporary
from hsmla_med.pipelines.task import InferenceOptions, Task, synthetic_root

__all__ = ["TASK", "datalist", "preprocessing", "transforms", "datamodule", "module_config", "held_out", "infer"]

OTSU_MARGIN = 2  # voxels around the Otsu foreground that the crop keeps


def datalist(config: dict) -> Datalist:
    """The dataset of ``config["data"]``: the user's folder, or the synthetic default (generated
    once into ``cache_dir`` in BTCV's on-disk format, and logged as synthetic)."""
    data = config["data"]
    if data["data_dir"]:
        return load_datalist(data["data_dir"], data["dataset_json"], data["validation_fraction"], config["seed"])
    synth = data["synthetic"]
    root = synthetic_root(data, "btcv", "BTCV-format volumes", "phantoms, not patients")
    generate_btcv(root, synth["num_train"], synth["num_validation"], synth["num_test"], tuple(synth["shape"]), synth["seed"])
    return load_datalist(root, seed=config["seed"])


def _intensity(data: dict, keys: list[str]) -> tuple[CropForegroundd, Callable]:
    """The foreground crop, on the raw (resampled) intensities, and the normalisation of
    ``data.intensity``. The crop comes first because a normalised image has no fixed background
    value: after a z-score, MONAI's default ``x > 0`` would keep only the above-mean voxels."""
    spec = data["intensity"]
    kind = spec["kind"]
    crop = partial(CropForegroundd, keys, source_key="image", allow_smaller=True)
    if kind == "ct_window":
        # a_min < HU is exactly "windowed > 0": the CT crop is the one it always was
        return crop(select_fn=partial(lt, spec["a_min"])), ScaleIntensityRanged("image", a_min=spec["a_min"], a_max=spec["a_max"], b_min=0.0, b_max=1.0, clip=True)
    if kind == "zscore":
        return crop(select_fn=partial(ne, 0)), NormalizeIntensityd("image", nonzero=True, channel_wise=True)
    # Otsu kinds: a margin keeps the partial-volume rim, darker than the threshold, in the crop
    if kind == "zscore_foreground":
        return crop(select_fn=otsu_foreground, margin=OTSU_MARGIN), ForegroundZScored("image")
    if kind == "percentile":
        lower, upper = spec["lower"], spec["upper"]
        if not 0 <= lower < upper <= 100:
            raise ConfigError(f"data.intensity.lower and upper must be percentiles with 0 <= lower < upper <= 100, got {lower!r} and {upper!r}")
        return crop(select_fn=otsu_foreground, margin=OTSU_MARGIN), ForegroundPercentiled("image", lower, upper)
    raise ConfigError(f"data.intensity.kind must be one of ct_window, zscore, zscore_foreground, percentile, got {kind!r}")


def preprocessing(data: dict, in_channels: int, num_classes: int, keys: Sequence[str] = ("image", "label")) -> list:
    """Load, check, RAS orientation, resampling, foreground crop, intensity normalisation, as
    the ``data`` section (of a task config or a checkpoint: ``spacing``, ``intensity``) says."""
    keys = list(keys)
    interp = ["bilinear" if k == "image" else "nearest" for k in keys]
    crop, normalise = _intensity(data, keys)
    return [
        LoadCased(keys, ensure_channel_first=True, image_only=True),
        CheckCased(in_channels, num_classes),
        Orientationd(keys, axcodes="RAS", labels=(("L", "R"), ("P", "A"), ("I", "S"))),  # NIfTI world: RAS+
        Spacingd(keys, pixdim=data["spacing"], mode=interp),
        crop,
        normalise,
        EnsureTyped(keys, dtype=[torch.float32 if k == "image" else torch.int64 for k in keys], track_meta=True),
    ]


def transforms(config: dict, in_channels: int, num_classes: int) -> tuple[Compose, Compose]:
    """Training and validation transforms: :func:`preprocessing`, then for training
    :func:`crop_and_augment`."""
    pre = preprocessing(config["data"], in_channels, num_classes)
    return Compose(pre + crop_and_augment(config)), Compose(pre)


def module_config(config: dict, model: dict, label_names: Sequence[str], in_channels: int = 1) -> dict:
    """The hyper-parameters of :class:`SegmentationModule` for this task config."""
    inference = {**config["inference"], "roi_size": roi_size(config)}
    data = {"spacing": list(config["data"]["spacing"]), "intensity": dict(config["data"]["intensity"])}
    return hparams(config, model, label_names, spatial_dims(config), in_channels, inference, data)


def datamodule(config: dict, cases: Datalist, in_channels: int = 1) -> CaseDataModule:
    train, val = transforms(config, in_channels, cases.num_classes)
    data = config["data"]
    return CaseDataModule(cases.training, cases.validation, train, val, data["batch_size"], data["num_workers"], data["cache_rate"])


def held_out(cases: Datalist) -> list[str]:
    """The volumes ``demo`` segments after training: validation and test images."""
    return [c["image"] for c in cases.validation + cases.test]


def _inputs(path: str | Path) -> list[Path]:
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.name.endswith((".nii", ".nii.gz")) and not is_temporary(p))
        if not files:
            raise DataError(f"{path}: no NIfTI files (.nii, .nii.gz) in the input folder")
        return files
    if not path.exists():
        raise DataError(f"{path}: input not found")
    return [path]


def infer(
    module: SegmentationModule, inputs: str | Path | Iterable[str | Path], output: str | Path, options: InferenceOptions = InferenceOptions()
) -> list[Path]:
    """Segment NIfTI volumes and write ``output/<case>.nii.gz`` label maps (uint8) with exactly
    each input's shape and affine.

    The volume goes through the training preprocessing (RAS, resampling, intensity, foreground
    crop); class probabilities are mapped back through the inverse transforms (``Invertd``:
    un-crop, resample to the original grid, original orientation) and only then turned into
    labels, so boundaries are interpolated as probabilities rather than as label values.
    """
    cfg, device = module.config, options.device
    inf = options.apply(cfg["inference"])
    pre = Compose(preprocessing(cfg["data"], cfg["in_channels"], len(module.label_names), keys=("image",)))
    invert = Invertd("pred", transform=pre, orig_keys="image", nearest_interp=False, to_tensor=True)
    files = [Path(p) for p in ([inputs] if isinstance(inputs, (str, Path)) else inputs)]
    files = [f for p in files for f in _inputs(p)]
    module = module.to(device).eval()
    written = []
    for i, file in enumerate(files, 1):
        shape, affine = read_header(file)
        options.progress(f"[{i}/{len(files)}] {file.name} {shape}")
        data = pre({"image": str(file)})
        with torch.inference_mode():
            image = data["image"].unsqueeze(0).to(device)
            probs = predict_volume(module.network, image, inf["roi_size"], cfg["spatial_dims"], inf["overlap"], inf["sw_batch_size"], inf["tta"], inf["slab"])
        data["pred"] = probs[0].cpu()
        labels = invert(data)["pred"].argmax(0).numpy().astype(np.uint8)
        if labels.shape != tuple(shape[:3]):
            raise RuntimeError(f"{file}: inverted prediction has shape {labels.shape}, expected {shape[:3]}")
        written.append(write_labels(Path(output) / f"{case_name(file)}.nii.gz", labels, file))
    return written


def write_labels(path: Path, labels: np.ndarray, reference: Path) -> Path:
    """Write a uint8 label volume with the reference image's affine and q/s-form codes, atomically."""
    ref = nib.load(str(reference))
    img = nib.Nifti1Image(labels, ref.affine)
    img.set_qform(ref.header.get_qform(), code=int(ref.header["qform_code"]) or 1)
    img.set_sform(ref.header.get_sform(), code=int(ref.header["sform_code"]) or 1)
    img.header.set_xyzt_units(*ref.header.get_xyzt_units())
    with atomic_path(path) as tmp:
        nib.save(img, str(tmp))
    return path


class BTCV(Task):
    """BTCV and any NIfTI segmentation dataset in MSD / nnU-Net layout (CT or MRI)."""

    name = "btcv"
    module_class = SegmentationModule
    in_channels = 1
    inputs = "NIfTI volumes (.nii, .nii.gz)"
    outputs = "OUTPUT/<case>.nii.gz label maps with each input's shape and affine"


TASK = BTCV()
