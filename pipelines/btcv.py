"""BTCV: abdominal CT, 13 organs, NIfTI in MSD / nnU-Net folders or MONAI's list JSON.

What is specific to the benchmark lives here: the dataset (real folder or the synthetic
default), MONAI transforms for 2D (axial slices) and 3D (patches) training, and writing
predictions back as NIfTI in each input's own geometry. The loop, metrics and checkpoints are
the generic engine's (:mod:`hsmla_med.engine`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
from monai.bundle import ConfigParser
from monai.transforms import Compose

from hsmla_med.data.checks import CheckCased, LoadCased
from hsmla_med.data.datalist import VOLUME_FILE, VOLUME_FORMATS, Datalist, case_name, channel_groups, channels_grid, load_datalist, read_header, read_json
from hsmla_med.data.plans import plan_dataset
from hsmla_med.data.splits import fold_datalist
from hsmla_med.data.synthetic.btcv import generate_btcv
from hsmla_med.data.volume_crops import crop_and_augment, roi_size, spatial_dims
from hsmla_med.engine.base import hparams
from hsmla_med.engine.datamodule import CaseDataModule
from hsmla_med.engine.prediction import model_record
from hsmla_med.engine.segmentation import SegmentationModule
from hsmla_med.errors import ConfigError, DataError, InputError
from hsmla_med.evaluation import DEFAULT_NSD_TOLERANCE, check_nsd_tolerance
from hsmla_med.inference import geometry
from hsmla_med.inference.ensemble import is_ensemble
from hsmla_med.inference.geometry import UNCROPPED_BACKGROUND, write_probabilities
from hsmla_med.defaults import REVIEW_QUEUE, UNCERTAINTY_MAPS, uncertainty_map_path
from hsmla_med.inference.uncertainty import case_row, uncertainty_map, write_review_queue
from hsmla_med.metrics.summary import write_reports
from hsmla_med.inference.postprocessing import apply_postprocessing
from hsmla_med.io import is_temporary, write_json
from hsmla_med.io.dicom import DicomSeries, SeriesRules, find_series, is_dicom_file, select_series, series_of
from hsmla_med.io.dicom_seg import SEG_SUFFIX, is_seg_file
from hsmla_med.io.itk import data_file
from hsmla_med.io.volumes import NIFTI, PredictedVolume, output_format, prediction_path, volume_format
from hsmla_med.pipelines.task import BundleParts, InferenceOptions, Task, input_files, predict_cases, synthetic_root

__all__ = ["TASK", "datalist", "check_config", "preprocessing_items", "UNCROPPED_BACKGROUND", "preprocessing", "transforms", "datamodule", "module_config", "held_out", "infer", "bundle", "score_predictions", "crossval_score"]

OTSU_MARGIN = 2  # voxels around the Otsu foreground that the crop keeps


def datalist(config: dict) -> Datalist:
    """The dataset of ``config["data"]``: the user's folder, or the synthetic default (generated
    once into ``cache_dir`` in BTCV's on-disk format, and logged as synthetic)."""
    check_config(config)  # the first step of train and evaluate: bad values end here, before any data work
    data = config["data"]
    if data["data_dir"]:
        cases = load_datalist(data["data_dir"], data["dataset_json"])
    else:
        synth = data["synthetic"]
        root = synthetic_root(data, "btcv", "BTCV-format volumes", "phantoms, not patients", lambda root: generate_btcv(
            root, synth["num_train"], synth["num_validation"], synth["num_test"], tuple(synth["shape"]), synth["seed"]))
        cases = load_datalist(root, "dataset_0.json")  # MONAI's BTCV datalist name
    fold = fold_datalist(config, cases)  # fold config["fold"] of splits_final.json
    plan = plan_dataset(config, cases, len(fold.training))  # the config's auto values, from the whole dataset
    if plan is not None:
        check_config(config)  # the planned values, as a user's would be
    return replace(fold, plan=plan)


def check_config(config: dict) -> None:
    """Refuse preprocessing and window values that cannot train (a reversed CT window, windows
    too small: :func:`preprocessing_items`, :func:`~hsmla_med.data.volume_crops.roi_size`) with
    a :class:`ConfigError` naming the option, before any data is read or generated; likewise an
    ``inference.nsd_tolerance`` that is no distance. Values left ``auto`` are planned from the
    data (:func:`~hsmla_med.data.plans.plan_dataset`) and checked then."""
    data = config["data"]
    if data["spacing"] != "auto" and data["intensity"]["kind"] != "auto":
        preprocessing_items(data)
    if config["mode"] != "auto" and data["roi_size_2d" if spatial_dims(config) == 2 else "roi_size_3d"] != "auto":
        roi_size(config)
    check_nsd_tolerance(config["inference"].get("nsd_tolerance", DEFAULT_NSD_TOLERANCE), "inference.nsd_tolerance", ConfigError)


def _intensity_items(data: dict, keys: list[str]) -> tuple[dict, dict]:
    """The foreground crop, on the raw (resampled) intensities, and the normalisation of
    ``data.intensity``, as config items. The crop comes first because a normalised image has no
    fixed background value: after a z-score, MONAI's default ``x > 0`` would keep only the
    above-mean voxels. The crop's ``select_fn`` is a ``functools.partial`` or a module function,
    not a lambda, so that the transforms pickle into DataLoader workers and DDP processes."""
    spec = data["intensity"]
    kind = spec["kind"]
    crop = {"_target_": "CropForegroundd", "keys": keys, "source_key": "image", "allow_smaller": True}
    if kind == "ct_window":
        a_min, a_max = spec["a_min"], spec["a_max"]
        if not a_min < a_max:  # ScaleIntensityRange would invert the image without a word
            raise ConfigError(f"data.intensity.a_min and a_max must be a CT window with a_min < a_max (HU), got {a_min!r} and {a_max!r}")
        # a_min < HU is exactly "windowed > 0": the CT crop is the one it always was
        crop["select_fn"] = f"$functools.partial(operator.lt, {float(a_min)!r})"
        return crop, {"_target_": "ScaleIntensityRanged", "keys": "image", "a_min": float(a_min), "a_max": float(a_max), "b_min": 0.0, "b_max": 1.0, "clip": True}
    if kind == "ct_zscore":  # nnU-Net's CTNormalization: clip, then z-score with the dataset's foreground statistics
        a_min, a_max, mean, std = (spec.get(k) for k in ("a_min", "a_max", "mean", "std"))
        if not (all(isinstance(v, (int, float)) for v in (a_min, a_max, mean, std)) and a_min < a_max and std > 0):
            raise ConfigError(f"data.intensity kind ct_zscore needs a_min < a_max (HU) and mean, std > 0, got {a_min!r}, {a_max!r}, {mean!r}, {std!r}")
        crop["select_fn"] = f"$functools.partial(operator.lt, {float(a_min)!r})"
        # one linear map with clipping: clip to [a_min, a_max], then (x - mean) / std
        return crop, {"_target_": "ScaleIntensityRanged", "keys": "image", "a_min": float(a_min), "a_max": float(a_max),
                      "b_min": (float(a_min) - mean) / std, "b_max": (float(a_max) - mean) / std, "clip": True}
    if kind == "zscore":
        crop["select_fn"] = "$functools.partial(operator.ne, 0)"
        return crop, {"_target_": "NormalizeIntensityd", "keys": "image", "nonzero": True, "channel_wise": True}
    # Otsu kinds: a margin keeps the partial-volume rim, darker than the threshold, in the crop
    crop.update(select_fn="$otsu_foreground", margin=OTSU_MARGIN)  # imported by preprocessing_items
    if kind == "zscore_foreground":
        return crop, {"_target_": "hsmla_med.data.intensity.ForegroundZScored", "keys": "image"}
    if kind == "percentile":
        lower, upper = spec["lower"], spec["upper"]
        if not 0 <= lower < upper <= 100:
            raise ConfigError(f"data.intensity.lower and upper must be percentiles with 0 <= lower < upper <= 100, got {lower!r} and {upper!r}")
        return crop, {"_target_": "hsmla_med.data.intensity.ForegroundPercentiled", "keys": "image", "lower": lower, "upper": upper}
    raise ConfigError(f"data.intensity.kind must be one of ct_window, ct_zscore, zscore, zscore_foreground, percentile (or auto), got {kind!r}")


def preprocessing_items(data: dict, keys: Sequence[str] = ("image",)) -> tuple[list[str], list[dict]]:
    """The one definition of BTCV's preprocessing after loading: RAS orientation, resampling,
    foreground crop, intensity normalisation, as the ``data`` section (of a task config or a
    checkpoint: ``spacing``, ``intensity``) says, written as MONAI bundle config items. Training
    and ``infer`` instantiate them (:func:`preprocessing`), ``export --format bundle`` writes
    them into the bundle's ``configs/inference.json``. Returns the imports their expressions need
    and the items."""
    keys = list(keys)
    crop, normalise = _intensity_items(data, keys)
    imports = ["$import functools", "$import operator", "$import torch"]
    if crop["select_fn"] == "$otsu_foreground":
        # "$import a.b.c" would bind the name "a.b.c" in MONAI's ConfigParser, which no expression can use
        imports.append("$from hsmla_med.data.intensity import otsu_foreground")
    return imports, [
        {"_target_": "Orientationd", "keys": keys, "axcodes": "RAS", "labels": [["L", "R"], ["P", "A"], ["I", "S"]]},  # NIfTI world: RAS+
        {"_target_": "Spacingd", "keys": keys, "pixdim": list(data["spacing"]), "mode": ["bilinear" if k == "image" else "nearest" for k in keys],
         "dtype": "$torch.float32"},
        crop,
        normalise,
        {"_target_": "EnsureTyped", "keys": keys, "dtype": ["$torch.float32" if k == "image" else "$torch.int64" for k in keys], "track_meta": True},
    ]


def preprocessing(data: dict, in_channels: int, num_classes: int, keys: Sequence[str] = ("image", "label"),
                  label_names: Sequence[str] | None = None, label_values: Sequence[int] | None = None) -> list:
    """Load, check, then :func:`preprocessing_items` instantiated by MONAI's ``ConfigParser``
    (the parser the bundle runs under). ``label_names`` (the dataset's) value the segments of
    DICOM SEG labels (:class:`~hsmla_med.data.checks.LoadCased`); ``label_values``: those a
    label may hold where they are not ``0..num_classes - 1`` (ignore label, regions)."""
    imports, items = preprocessing_items(data, keys)
    parser = ConfigParser({"imports": imports, "preprocessing": items})
    parser.get_parsed_content("imports")  # the modules the items' expressions name
    return [
        LoadCased(list(keys), ensure_channel_first=True, image_only=True, label_names=label_names),
        CheckCased(in_channels, num_classes, label_values=label_values),
        *parser.get_parsed_content("preprocessing"),
    ]


def transforms(config: dict, in_channels: int, num_classes: int, label_names: Sequence[str] | None = None,
               label_values: Sequence[int] | None = None, ignore_label: int | None = None) -> tuple[Compose, Compose]:
    """Training and validation transforms: :func:`preprocessing`, then for training
    :func:`crop_and_augment` (whose crops centre on no voxel of ``ignore_label``)."""
    pre = preprocessing(config["data"], in_channels, num_classes, label_names=label_names, label_values=label_values)
    return Compose(pre + crop_and_augment(config, ignore_label)), Compose(pre)


def module_config(config: dict, model: dict, label_names: Sequence[str], in_channels: int = 1) -> dict:
    """The hyper-parameters of :class:`SegmentationModule` for this task config."""
    inference = {**config["inference"], "roi_size": roi_size(config)}
    data = {"spacing": list(config["data"]["spacing"]), "intensity": dict(config["data"]["intensity"])}
    return hparams(config, _with_norm(model, config.get("norm")), label_names, spatial_dims(config), in_channels, inference, data)


def _with_norm(model: dict, norm: str | None) -> dict:
    """``model`` with the config's ``norm`` (``batch`` or ``instance``, planned from the modality
    where ``auto``: :mod:`hsmla_med.data.plans`) where it is an HSMLA network that names none; so
    the checkpoint records the norm it was built with. A MONAI network, a model that names its
    own, or a norm left ``auto`` (a module built without a dataset to plan from: the network's
    default, batch norm) is kept as it is."""
    if norm in (None, "auto") or "monai" in model or "norm" in model:
        return model
    return {**model, "norm": norm}


def datamodule(config: dict, cases: Datalist, in_channels: int | None = None) -> CaseDataModule:
    """The cases' data, with the dataset's input channels unless ``in_channels`` is given."""
    train, val = transforms(config, cases.channels if in_channels is None else in_channels, cases.num_classes, cases.label_names,
                            cases.label_values(), cases.ignore_label)
    data = config["data"]
    return CaseDataModule(cases.training, cases.validation, train, val, data["batch_size"], data["num_workers"], data["cache_rate"])


def held_out(cases: Datalist) -> list[str]:
    """The volumes ``demo`` segments after training: validation and test images, and the
    synthetic dataset's DICOM series (``test_dicom``: a test case again, as a PACS exports it)."""
    dicom = read_json(cases.source).get("test_dicom", []) if cases.synthetic and cases.source else []
    images = [c["image"] for c in cases.validation + cases.test]  # (several channels: a list of files, infer groups them again)
    return [f for image in images for f in (image if isinstance(image, list) else [image])] + [str(cases.source.parent / d) for d in dicom]


def _volume_inputs(folder: Path, series_uid: str | None = None, rules: SeriesRules | None = None) -> list[Path | DicomSeries]:
    """The volume files of an input folder (NIfTI, a NIfTI pair by its ``.hdr``, MetaImage,
    NRRD), else its DICOM image series (one case per series: :func:`~hsmla_med.io.dicom.select_series`)."""
    files = sorted(p for p in folder.iterdir() if VOLUME_FILE.search(p.name) and not is_temporary(p))
    if files:
        return files
    series = find_series(folder)
    if not series:
        raise DataError(f"{folder}: no volume files ({VOLUME_FORMATS}) and no DICOM image series in the input folder")
    return select_series(series, folder, series_uid, rules)


def _series_rules(options: InferenceOptions, inference: dict) -> SeriesRules | None:
    """The series selection rules of this run (``--series-rules``) or of the checkpoint
    (``inference.series_selection``), ``None`` for none."""
    if options.series_rules is not None:
        return SeriesRules(options.series_rules, "--series-rules", InputError)
    rules = inference.get("series_selection")
    return None if rules is None else SeriesRules(rules, "the checkpoint's inference.series_selection")


def _case(source: Path | DicomSeries, output: Path) -> dict:
    """The ``infer`` item of a NIfTI file or a DICOM series (a DICOM file given alone: its
    series). A series is loaded from its sorted files (``image``; kept as ``dicom_files`` for
    writers that reference the source instances) and named by :attr:`DicomSeries.name`."""
    if isinstance(source, list):  # a case's channel files (CASE_0000.nii.gz, ...): one grid
        channels_grid(source)
        name = case_name(source)
        return {"name": name, "image": [str(f) for f in source], "source": str(source[0]), "output": prediction_path(output, source, name)}
    if isinstance(source, Path) and source.suffix == ".img" and source.with_suffix(".hdr").is_file():
        source = source.with_suffix(".hdr")  # the voxels of a NIfTI pair: the pair, by its header (not a DICOM file so named)
    elif isinstance(source, Path) and source.suffix == ".raw":  # the voxels of a detached MetaImage / NRRD header beside them
        source = next((h for h in map(source.with_suffix, (".mhd", ".nhdr")) if h.is_file() and data_file(h) == source), source)
    if isinstance(source, Path) and is_dicom_file(source):
        source = series_of(source)
    if isinstance(source, DicomSeries):
        files = [str(f) for f in source.files]
        return {"name": source.name, "image": files, "dicom_files": files, "source": str(source.folder),
                "output": prediction_path(output, source.folder, source.name)}
    read_header(source)  # an unreadable header or an affine that places no voxel: one line, before any work
    name = case_name(source)
    return {"name": name, "image": str(source), "source": str(source), "output": prediction_path(output, source, name)}


def _channel_cases(sources: list, channels: int) -> list:
    """The inputs of a model of several input channels: NIfTI files grouped into cases
    (:func:`~hsmla_med.data.datalist.channel_groups`), a case of one file (4D) as that file."""
    series = next((s for s in sources if not (isinstance(s, Path) and VOLUME_FILE.search(s.name))), None)
    if series is not None:
        raise DataError(f"{getattr(series, 'folder', series)}: the model takes {channels} input channels, one volume file each "
                        "(CASE_0000.nii.gz, CASE_0001.nii.gz, ...); a DICOM series is one channel")
    return [group if len(group) > 1 else group[0] for group in channel_groups(sources, channels)]


def _output_formats(items: list[dict], output: Path, names: Sequence[str]) -> None:
    """Each case's label map formats (``item["formats"]``): ``--output-format``'s, or its input's
    own (:meth:`~hsmla_med.io.volumes.VolumeFormat.predicted_as`), those that reference a series
    last; the last one's file marks the case done (``item["output"]``). A format that needs a
    series (a DICOM SEG references its instances) refuses an input file, which has none."""
    given = sorted((output_format(name) for name in names), key=lambda f: f.needs_series)
    for item in items:
        formats = given or [volume_format(item["source"]).predicted_as()]
        needs = next((f for f in formats if f.needs_series and "dicom_files" not in item), None)
        if needs is not None:
            raise DataError(f"{item['source']}: --output-format {needs.name} needs a DICOM series input ({needs.title} references the "
                            f"series' instances); a {volume_format(item['source']).title} file has none: use --output-format nifti")
        item["formats"] = formats
        item["output"] = prediction_path(output, item["source"], item["name"], formats[-1])


def infer(
    module: SegmentationModule, inputs: str | Path | Iterable[str | Path], output: str | Path, options: InferenceOptions = InferenceOptions()
) -> list[Path]:
    """Segment NIfTI volumes or DICOM series (folders: :func:`_volume_inputs`; a folder of
    several series needs ``options.series_uid``) and write ``output/<case>.nii.gz`` label maps
    (uint8) with exactly each input's shape and affine (a MetaImage or NRRD input: ``<case>.mha``
    or ``<case>.nrrd`` on its grid, as nnU-Net writes a dataset's ``file_ending``; a series: ``<series name>.nii.gz`` on the
    grid SimpleITK reads it on, :func:`~hsmla_med.io.dicom.read_series`), with ``dicom-seg`` among
    ``options.output_formats`` a series' ``<case>.seg.dcm`` (:func:`~hsmla_med.io.dicom_seg.write_seg`:
    the same labels as a DICOM SEG referencing the series; instead of the NIfTI without ``nifti``),
    and ``<case>.npz`` probabilities with ``options.save_probabilities``, in Lightning's predict loop (:func:`predict_cases`: cases
    split over processes and shards; cases with a label map are skipped).

    With ``options.uncertainty`` also ``output/uncertainty/<case>_uncertainty.nii.gz``, the
    voxel-wise uncertainty (:mod:`hsmla_med.inference.uncertainty`) on the label map's grid
    (:func:`uncertainty_in_input_geometry`), each case's review-queue row beside it
    (``<case>.json``), and at the end ``output/uncertainty.csv``, the rows of this run's cases
    done so far, most uncertain first (:func:`~hsmla_med.inference.uncertainty.write_review_queue`).

    Each volume goes through the training preprocessing (RAS, resampling, intensity, foreground
    crop) in the loader; the class probabilities are mapped back through the inverse transforms
    (un-crop, resample to the original grid, original orientation: MONAI's inverses, with the
    resampling axis by axis, :func:`~hsmla_med.inference.geometry.invert`) before the argmax,
    so boundaries are interpolated as probabilities rather than as label values
    (:func:`labels_in_input_geometry`).
    """
    cfg = module.config
    inference = options.apply(cfg["inference"])
    pre = Compose(preprocessing(cfg["data"], cfg["in_channels"], len(module.label_names), keys=("image",)))
    output = Path(output)
    rules = _series_rules(options, inference)
    sources = input_files(inputs, lambda folder: _volume_inputs(folder, options.series_uid, rules))
    if cfg["in_channels"] > 1:
        sources = _channel_cases(sources, cfg["in_channels"])
    items = [_case(f, output) for f in sources]
    if options.uncertainty is not None:
        _check_uncertainty(module, options)
    _output_formats(items, output, options.output_formats)
    # once: the weights' sha256 in every SEG's algorithm identification
    algorithm = model_record(module) if any(f.needs_series for item in items for f in item["formats"]) else None
    seg_uids = _seg_uids(items, options.seg_uids) if options.seg_uids else {}

    def write(case: dict) -> list[Path]:
        source = Path(case["source"])
        # a series' grid is the one its reader gave (MONAI keeps it as original_affine / spatial_shape)
        if "dicom_files" in case:
            shape = tuple(int(n) for n in case["image"].meta["spatial_shape"])
            reference = affine = np.asarray(case["image"].meta["original_affine"], dtype=np.float64)
        else:
            (shape, affine), reference = read_header(source), source
        # before the labels: they may reuse the probabilities' memory
        uncertainty = uncertainty_in_input_geometry(case, pre, options.uncertainty) if options.uncertainty is not None else None
        labels, probabilities = labels_in_input_geometry(case, pre, options.save_probabilities, cfg.get("regions_class_order"))
        labels = apply_postprocessing(labels, options.postprocessing)  # the probabilities stay as predicted
        if labels.shape != tuple(shape[:3]):
            raise RuntimeError(f"{source}: inverted prediction has shape {labels.shape}, expected {shape[:3]}")
        written = []
        if probabilities is not None:
            written.append(write_probabilities(output / f"{case['name']}.npz", probabilities))
        if uncertainty is not None:
            written.append(NIFTI.write_map(uncertainty_map_path(output, case["name"]), uncertainty, reference))
            write_json(_row_path(output, case["name"]), case_row(case["name"], uncertainty, labels, affine, options.uncertainty_threshold))
        named = f"DICOM series {case['name']} ({source})" if "dicom_files" in case else source.name  # a series' folder is no case name
        predicted = PredictedVolume(source, case["name"], reference, case.get("dicom_files"), module.label_names, algorithm,
                                    seg_uids.get(case["name"]))
        for fmt in case["formats"]:  # the last marks the case done
            path = fmt.write_prediction(output, labels, predicted)
            if path is None:
                options.progress(f"{named}: no foreground class predicted, no {fmt.title} written (it holds at least one segment)")
            else:
                written.append(path)
        options.progress(f"{named}: {'x'.join(map(str, shape[:3]))} voxels -> {', '.join(map(str, written))}")
        return written

    def review_queue() -> list[Path]:
        """The run's review queue from the rows of its cases done so far (resumed ones too)."""
        rows = [json.loads(path.read_text()) for item in items if (path := _row_path(output, item["name"])).is_file()]
        if len(rows) < len(items):
            options.progress(f"{REVIEW_QUEUE}: {len(rows)} of {len(items)} case(s) so far (the others are other shards')")
        return [write_review_queue(output / REVIEW_QUEUE, rows)]

    return predict_cases(module, items, pre, write, options, finish=review_queue if options.uncertainty is not None else None, settings=inference)


def _seg_uids(items: list[dict], given: dict[str, str]) -> dict[str, str]:
    """The SEG UIDs of ``options.seg_uids`` (by Series Instance UID) by case name; a series of
    a given UID found in several cases (copies in two folders) is refused: their SEGs would be
    one object of that UID."""
    import pydicom

    found: dict[str, str] = {}
    for item in items:
        if "dicom_files" not in item:
            continue
        series = str(pydicom.dcmread(item["dicom_files"][0], stop_before_pixels=True).SeriesInstanceUID)
        if series not in given:
            continue
        if given[series] in found.values():
            raise InputError(f"series {series}: found in several cases; its one SEG UID would name several SEGs (give one folder of the series)")
        found[item["name"]] = given[series]
    return found


def _row_path(output: Path, name: str) -> Path:
    return output / UNCERTAINTY_MAPS / f"{name}.json"


def _check_uncertainty(module: SegmentationModule, options: InferenceOptions) -> None:
    """Refuse an ``--uncertainty`` the run cannot measure: mutual information without several
    predictions to compare, any uncertainty of a region-based (sigmoid) model, whose outputs
    are not one distribution over classes."""
    if options.uncertainty == "mutual-information" and not options.tta and not is_ensemble(module):
        raise InputError("--uncertainty mutual-information: measures how much several predictions of a voxel disagree, and this run makes "
                         "one; add --tta (mirrored copies) or give several --checkpoint (an ensemble), or use --uncertainty entropy")
    if module.config.get("regions_class_order"):
        raise InputError(f"--uncertainty {options.uncertainty}: the checkpoint predicts overlapping regions (one sigmoid each), "
                         "not one probability per class; the entropy of a class distribution does not apply")


def uncertainty_in_input_geometry(case: dict, transform: Compose, kind: str) -> np.ndarray:
    """The ``kind`` uncertainty (:func:`~hsmla_med.inference.uncertainty.uncertainty_map`) of
    ``case["probs"]`` (and ``case["mean_entropy"]``) on the grid of ``case["image"]``, where the
    network predicted, mapped to the input's grid as one more probability channel is
    (:func:`~hsmla_med.inference.geometry.invert`: the same resampling and un-crop; 0, certain
    background, outside the foreground crop), float32 ``(*shape)``.

    Computed before the mapping rather than from the mapped probabilities: resampling mixes
    neighbouring voxels' probabilities, which would add entropy (and a mutual information that
    no member's disagreement caused) wherever it interpolates across a boundary."""
    measure = uncertainty_map(kind, case["probs"], case.get("mean_entropy"))
    return geometry.invert(measure[None], case["image"], transform)[0].numpy()


def labels_in_input_geometry(case: dict, transform: Compose, probabilities: bool = False,
                             regions_class_order: list[int] | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """The argmax of ``case["probs"]`` (classes on the grid of ``case["image"]``, the output of
    ``transform``) in the input's grid, and with ``probabilities`` every class's probability
    there (:func:`hsmla_med.inference.geometry.labels_in_input_geometry`: one class at a time,
    background 1 outside the foreground crop); a region-based model's label map is built from
    its regions in ``regions_class_order`` instead, as nnU-Net builds it."""
    return geometry.labels_in_input_geometry(case["probs"], case["image"], transform, probabilities, regions_class_order)


def bundle(config: dict) -> BundleParts:
    """``export --format bundle``: BTCV's parts of a MONAI Bundle of a module ``config``
    (:mod:`hsmla_med.export.bundle`): :func:`infer`'s transforms as MONAI config items
    (:func:`_bundle_inference`), NIfTI in and out. With ``ct_window`` or ``zscore`` intensities
    they need MONAI alone; the Otsu kinds (``zscore_foreground``, ``percentile``) have no MONAI
    equivalent and name ``hsmla_med``'s transforms. A model of several input channels or of
    regions is refused: the bundle reads one single-channel file per case and takes the argmax."""
    if config.get("regions") or config["in_channels"] > 1:
        raise InputError("--format bundle: the bundle reads one single-channel file per case and takes the argmax; this model takes "
                         f"{config['in_channels']} channel(s){' and predicts regions' if config.get('regions') else ''}: "
                         "use --format torchscript or onnx with hsmla-med infer")
    imports, items = preprocessing_items(config["data"])
    kind, dims = config["data"]["intensity"]["kind"], config["spatial_dims"]
    return BundleParts(
        imports=imports,
        inference=partial(_bundle_inference, config, items),
        written="case(s) segmented; labels",
        description=("HSMLA segmentation of CT/MRI volumes (NIfTI), trained with hsmla-med on task btcv; "
                     f"{'slice-wise 2D' if dims == 2 else '3D'} network, sliding-window inference, labels written in each input's geometry."),
        image={"type": "image", "format": "hounsfield" if kind == "ct_window" else "magnitude", "modality": "CT" if kind == "ct_window" else "MR",
               "num_channels": config["in_channels"], "channel_def": {"0": "image"}},
        packages={"nibabel": "nibabel"},
        needs_hsmla=kind not in ("ct_window", "zscore"),
        inputs="a folder of NIfTI volumes (`*.nii.gz`, `*.nii`)",
        outputs="`OUT/<case>.nii.gz`, uint8 labels in each input's shape and affine",
        # the training recipe's mode, and its crop as the window the checkpoint infers with
        recipe={"data": {f"roi_size_{dims}d": list(config["inference"]["roi_size"])}, "mode": f"{dims}d"},
    )


def _bundle_inference(config: dict, items: list[dict], size: Sequence[int]) -> dict:
    """The bundle's volumes as :func:`infer` segments them, with windows of ``size``: loading,
    then the ``items`` of :func:`preprocessing_items` (the definition training and ``infer``
    instantiate), the sliding window (:func:`hsmla_med.inference.sliding.predict_volume`:
    ``SliceInferer`` for a 2D network, Gaussian blending), softmax, ``Invertd`` of every class's
    probability and the argmax (what :func:`labels_in_input_geometry` computes), saved as uint8
    NIfTI in the input's geometry."""
    inference = config["inference"]
    if config["spatial_dims"] == 2:
        inferer = {"_target_": "SliceInferer", "spatial_dim": 2, "roi_size": list(size), "sw_batch_size": int(inference["sw_batch_size"]) * int(inference["slab"]),
                   "overlap": float(inference["overlap"]), "mode": "gaussian"}
    else:
        inferer = {"_target_": "SlidingWindowInferer", "roi_size": list(size), "sw_batch_size": int(inference["sw_batch_size"]),
                   "overlap": float(inference["overlap"]), "mode": "gaussian"}
    return {
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
    }


def crossval_score(folds: list[tuple[Datalist, Path]], output: Path, config: dict) -> dict:
    """Every fold's validation label maps (as ``infer`` names them) in ``output/predictions``,
    their label files under the same names in ``output/labels`` (links), scored by the folder
    evaluator; post-processing is then chosen on the same two folders."""
    from hsmla_med.crossval import pool_file

    for cases, folder in folds:
        for case in cases.validation:
            name, prediction = case_name(case["image"]), prediction_path(folder, case["image"])
            pool_file(prediction, output / "predictions" / prediction.name)
            label = Path(case["label"])  # a DICOM SEG keeps its kind: the evaluator reads it onto its series; a volume its format
            pool_file(label, output / "labels" / f"{name}{SEG_SUFFIX if is_seg_file(label) else VOLUME_FILE.search(label.name).group(0)}")
            if label.suffix == ".hdr":  # a NIfTI pair's voxels: beside the header, of its name
                pool_file(label.with_suffix(".img"), output / "labels" / f"{name}.img")
            elif (voxels := data_file(label)) is not None:  # a detached ITK header's: under the name it gives them
                pool_file(voxels, output / "labels" / voxels.name)
    options = {"dataset_json": folds[0][0].source, "nsd_tolerance": config["inference"].get("nsd_tolerance", 2.0),
               "dicom": folds[0][0].source.parent}  # where the series of SEG labels are
    return score_predictions(output / "predictions", output / "labels", output, options)


def score_predictions(predictions: Path, labels: Path, output: Path, options: dict) -> dict:
    """NIfTI label maps (or DICOM SEG files, their series under ``options["dicom"]``) of any tool
    against reference label maps of the same names (:func:`~hsmla_med.evaluation.evaluate_folder`)."""
    from hsmla_med.evaluation import evaluate_folder

    tolerance = options.get("nsd_tolerance")
    return evaluate_folder(predictions, labels, options.get("dataset_json"), output, DEFAULT_NSD_TOLERANCE if tolerance is None else tolerance,
                           dicom=options.get("dicom"))


class BTCV(Task):
    """BTCV and any NIfTI segmentation dataset in MSD / nnU-Net layout (CT or MRI)."""

    name = "btcv"
    module_class = SegmentationModule
    in_channels = 1
    postprocesses = True

    def dataset_config(self, cases: Datalist) -> dict:
        """The dataset's input channels and label kinds (ignore label, regions:
        :meth:`~hsmla_med.data.datalist.Datalist.label_config`)."""
        return {"in_channels": cases.channels, **cases.label_config()}

    def evaluation_outputs(self, module: SegmentationModule, output: Path, options: dict) -> None:
        """``evaluate --checkpoint`` writes each validation case's label map in its original
        geometry to ``OUTPUT/validation/<case>.nii.gz`` (what ``infer`` would write), and with
        ``save_probabilities`` its probabilities to ``<case>.npz`` (nnU-Net's ``--npz``); NSD at
        ``nsd_tolerance`` mm when given (else the checkpoint's ``inference.nsd_tolerance``)."""
        if options.get("nsd_tolerance") is not None:
            check_nsd_tolerance(options["nsd_tolerance"], "--nsd-tolerance")
            module.config["inference"]["nsd_tolerance"] = float(options["nsd_tolerance"])
        module.save_validation(output / "validation", bool(options.get("save_probabilities")))

    def evaluation_reports(self, module: SegmentationModule, output: Path) -> list[Path]:
        """``summary.json`` and ``metrics_per_case.csv`` of the validation, in nnU-Net's shape
        (:meth:`~hsmla_med.engine.segmentation.SegmentationModule.case_summary`)."""
        return list(write_reports(module.case_summary(), output))

    def score_lines(self, summary: dict, output: Path) -> list[str]:
        means = {k: "n/a" if v is None else f"{v:.4f}" for k, v in summary["foreground_mean"].items()}
        nsd = summary.get("nsd_tolerance_mm")
        return [f"{len(summary['metric_per_case'])} cases, foreground mean: Dice {means['Dice']}, HD95 {means['HD95']} mm, "
                f"NSD ({nsd:g} mm) {means['NSD']}", f"summary: {output / 'summary.json'}, {output / 'metrics_per_case.csv'}"]


TASK = BTCV()
