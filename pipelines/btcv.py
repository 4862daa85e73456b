"""BTCV: abdominal CT, 13 organs, NIfTI in MSD / nnU-Net folders or MONAI's list JSON.

What is specific to the benchmark lives here: the dataset (real folder or the synthetic
default), MONAI transforms for 2D (axial slices) and 3D (patches) training, and writing
predictions back as NIfTI in each input's own geometry. The loop, metrics and checkpoints are
the generic engine's (:mod:`hsmla_med.engine`).
"""

from __future__ import annotations

import logging
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
    RandCropByPosNegLabeld,
    RandFlipd,
    RandRotate90d,
    RandShiftIntensityd,
    ScaleIntensityRanged,
    Spacingd,
    SpatialPadd,
    SqueezeDimd,
)

from hsmla_med.data.checks import CheckCased, LoadCased
from hsmla_med.data.datalist import Datalist, case_name, load_datalist, read_header
from hsmla_med.data.intensity import ForegroundPercentiled, ForegroundZScored, intensity_augmentations, otsu_foreground
from hsmla_med.data.synthetic_btcv import generate_btcv
from hsmla_med.engine.base import hparams
from hsmla_med.engine.datamodule import CaseDataModule
from hsmla_med.engine.segmentation import SegmentationModule
from hsmla_med.errors import ConfigError, DataError
from hsmla_med.inference.sliding import predict_volume
from hsmla_med.io import atomic_path

__all__ = ["datalist", "preprocessing", "crop_and_augment", "transforms", "datamodule", "module_config", "held_out", "infer", "MODULE"]

log = logging.getLogger("hsmla_med")
MODULE = SegmentationModule
MODES = {"2d": 2, "3d": 3}
MRI_KINDS = ("zscore", "zscore_foreground")  # data.intensity kinds that give tissue negative values
OTSU_MARGIN = 2  # voxels around the Otsu foreground that the crop keeps


def spatial_dims(config: dict) -> int:
    if config["mode"] not in MODES:
        raise ConfigError(f"mode must be one of {sorted(MODES)}, got {config['mode']!r}")
    return MODES[config["mode"]]


def datalist(config: dict) -> Datalist:
    """The dataset of ``config["data"]``: the user's folder, or the synthetic default (generated
    once into ``cache_dir`` in BTCV's on-disk format, and logged as synthetic)."""
    data = config["data"]
    if data["data_dir"]:
        return load_datalist(data["data_dir"], data["dataset_json"], data["validation_fraction"], config["seed"])
    synth = data["synthetic"]
    root = Path(data["cache_dir"]).expanduser() / "btcv-synthetic"
    log.warning("No --data-dir given: using the SYNTHETIC BTCV-format dataset in %s (phantoms, not patients)", root)
    generate_btcv(root, synth["num_train"], synth["num_validation"], synth["num_test"], tuple(synth["shape"]), synth["seed"])
    return load_datalist(root, seed=config["seed"])


def _intensity(config: dict, keys: list[str]) -> tuple[CropForegroundd, Callable]:
    """The foreground crop, on the raw (resampled) intensities, and the normalisation of
    ``data.intensity``. The crop comes first because a normalised image has no fixed background
    value: after a z-score, MONAI's default ``x > 0`` would keep only the above-mean voxels."""
    spec = config["data"]["intensity"]
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


def preprocessing(config: dict, in_channels: int, num_classes: int, keys: Sequence[str] = ("image", "label")) -> list:
    """Load, check, RAS orientation, resampling, foreground crop, intensity normalisation."""
    keys = list(keys)
    interp = ["bilinear" if k == "image" else "nearest" for k in keys]
    crop, normalise = _intensity(config, keys)
    return [
        LoadCased(keys, ensure_channel_first=True, image_only=True),
        CheckCased(in_channels, num_classes),
        Orientationd(keys, axcodes="RAS", labels=(("L", "R"), ("P", "A"), ("I", "S"))),  # NIfTI world: RAS+
        Spacingd(keys, pixdim=config["data"]["spacing"], mode=interp),
        crop,
        normalise,
        EnsureTyped(keys, dtype=[torch.float32 if k == "image" else torch.int64 for k in keys], track_meta=True),
    ]


def roi_size(config: dict) -> list[int]:
    return list(config["data"]["roi_size_2d" if spatial_dims(config) == 2 else "roi_size_3d"])


def crop_and_augment(config: dict) -> list:
    """Random training crops of a preprocessed ``image``/``label`` volume, centred on foreground
    or background in the ratio ``data.pos_neg``, and augmentation: flips, 90-degree rotations, an
    intensity shift and nnU-Net's intensity and resolution augmentations
    (:func:`~hsmla_med.data.intensity.intensity_augmentations`). 2D mode crops single axial
    slices (``(h, w, 1)`` crops, the slice axis squeezed); 3D crops patches."""
    keys = ["image", "label"]
    dims = spatial_dims(config)
    roi = roi_size(config)
    crop = roi + [1] if dims == 2 else roi
    aug = config["data"]["augment"]
    pos, neg = config["data"]["pos_neg"]
    train = [
        SpatialPadd(keys, spatial_size=crop),
        RandCropByPosNegLabeld(
            keys, "label", spatial_size=crop, pos=pos, neg=neg, num_samples=config["data"]["samples_per_case"],
            # a CT window maps air to 0: background crops centre on body voxels. A z-scored MRI
            # has negative tissue voxels, so there any background voxel may be a centre.
            image_key=None if config["data"].get("intensity", {}).get("kind") in MRI_KINDS else "image", image_threshold=0
        ),
    ]
    if dims == 2:
        train.append(SqueezeDimd(keys, dim=-1))
    train += [RandFlipd(keys, prob=aug["flip_prob"], spatial_axis=axis) for axis in range(dims)]
    train += [
        RandRotate90d(keys, prob=aug["rot90_prob"], max_k=3, spatial_axes=(0, 1)),
        RandShiftIntensityd("image", offsets=aug["shift_offset"], prob=aug["shift_prob"]),
    ]
    return train + intensity_augmentations(aug, dims)


def transforms(config: dict, in_channels: int, num_classes: int) -> tuple[Compose, Compose]:
    """Training and validation transforms: :func:`preprocessing`, then for training
    :func:`crop_and_augment`."""
    pre = preprocessing(config, in_channels, num_classes)
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
        files = sorted(p for p in path.iterdir() if p.name.endswith((".nii", ".nii.gz")))
        if not files:
            raise DataError(f"{path}: no NIfTI files (.nii, .nii.gz) in the input folder")
        return files
    if not path.exists():
        raise DataError(f"{path}: input not found")
    return [path]


def infer(
    module: SegmentationModule,
    inputs: str | Path | Iterable[str | Path],
    output: str | Path,
    tta: bool = False,
    device: str = "cpu",
    progress: Callable[[str], None] = print,
) -> list[Path]:
    """Segment NIfTI volumes and write ``output/<case>.nii.gz`` label maps (uint8) with exactly
    each input's shape and affine.

    The volume goes through the training preprocessing (RAS, resampling, intensity, foreground
    crop); class probabilities are mapped back through the inverse transforms (``Invertd``:
    un-crop, resample to the original grid, original orientation) and only then turned into
    labels, so boundaries are interpolated as probabilities rather than as label values.
    """
    cfg = module.config
    config = {"data": {**cfg["data"]}, "mode": {2: "2d", 3: "3d"}[cfg["spatial_dims"]]}
    pre = Compose(preprocessing(config, cfg["in_channels"], len(module.label_names), keys=("image",)))
    invert = Invertd("pred", transform=pre, orig_keys="image", nearest_interp=False, to_tensor=True)
    files = [Path(p) for p in ([inputs] if isinstance(inputs, (str, Path)) else inputs)]
    files = [f for p in files for f in _inputs(p)]
    module = module.to(device).eval()
    written = []
    for i, file in enumerate(files, 1):
        shape, affine = read_header(file)
        progress(f"[{i}/{len(files)}] {file.name} {shape}")
        data = pre({"image": str(file)})
        with torch.inference_mode():
            image = data["image"].unsqueeze(0).to(device)
            inf = cfg["inference"]
            probs = predict_volume(module.network, image, inf["roi_size"], cfg["spatial_dims"], inf["overlap"], inf["sw_batch_size"], tta, inf["slab"])
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
