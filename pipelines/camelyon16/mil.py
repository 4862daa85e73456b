"""CAMELYON16 from slide labels alone: attention multiple-instance learning on frozen patch
features (``hsmla-med train --task camelyon16 --supervision slide``), its held-out scores, and
where the tumour is by its attention, scored as the patch classifier's heatmaps are.

A run (:func:`train_slides`): the feature folder (``--features``, CLAM's layout; without it the
dataset's slides are encoded first with ``mil.features``' encoder into ``OUTPUT/features``), the
label CSV (``--labels``; without it the dataset's ``slide_labels.csv``) and the held-out slides
(:func:`~.bags.held_out`). The dataset is ``--data-dir``, else the synthetic slides of
``mil.synthetic`` (many small slides: MIL learns from the number of bags, and the encoding costs
the tissue area; the patch classifier's ``data.synthetic`` are a few large ones). Every other
slide trains (nnU-Net's fold ``all``; without held-out slides, the fold's training slides of
``splits_final.json``, its validation slides then held out) for ``mil.epochs`` epochs, and the
final weights are scored on the held-out slides (:func:`score_bags`, also ``evaluate
--features``): the run validates once, after its last step, on the slides it trained on (a check
of the fit, nothing chosen by it), so ``best.ckpt`` and ``last.ckpt`` hold the same weights.

The attention map of a slide is ``score * a / max(a)`` on its patch grid: ``a`` the attention
of each patch (it sums to 1 over the bag, so its scale falls with the bag's size; divided by
the slide's largest it is 1 where the model looked most, whatever the slide's size), times the
slide's tumour probability ``score``, so that the maps of all slides share one scale: a normal
slide's stays low, and a lesion detection's confidence ranks across slides as the lesion FROC
requires (a map normalised per slide alone would give every normal slide a detection at 1).
"""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from hsmla_med.data.synthetic.wsi import SLIDE_LABELS, generate_camelyon16
from hsmla_med.data.splits import fold_cases
from hsmla_med.engine.base import hparams
from hsmla_med.engine.mil import MIL_MODES, MILModule
from hsmla_med.metrics.pathology import auc_interval
from hsmla_med.engine.run import evaluate, fit, load_module
from hsmla_med.errors import ConfigError, DataError, InputError
from hsmla_med.io import atomic_path, write_json
from hsmla_med.io.lesion_csv import SLIDE_CSV, write_slide_csv
from hsmla_med.pipelines.camelyon16.bags import Bag, BagDataModule, held_out, load_bags, read_bag, read_slide_labels, training_statistics
from hsmla_med.pipelines.camelyon16.data import LABELS, _grid_params, find_slides
from hsmla_med.pipelines.camelyon16.writers import SlideHeatmaps
from hsmla_med.pipelines.task import InferenceOptions, synthetic_root

__all__ = ["ATTENTION", "HEATMAPS", "TOP_PATCHES", "SlideBags", "attention_in_lesions", "check_mil_config", "evaluate_slides", "module_config",
           "score_bags", "slide_bags", "slide_checkpoint", "slide_fold", "train_bags", "train_slides"]

log = logging.getLogger("hsmla_med")

ATTENTION, HEATMAPS = "attention", "heatmaps"  # OUTPUT/attention/<slide>.csv; OUTPUT/heatmaps: wsi-heatmap's files of the held-out slides
TOP_PATCHES = 10  # attention_in_lesions: the patches of a tumour slide ranked first by attention
#: check_val_every_n_epoch of a run: never by the schedule, so the only validation is the final
#: step's (:class:`~hsmla_med.engine.callbacks.ValidateFinalStep`)
_FINAL_ONLY = 1_000_000


def check_mil_config(config: dict) -> dict:
    """The ``mil`` section of a task config, its ranges checked (one line naming the key)."""
    mil = config["mil"]
    if mil["mil_mode"] not in MIL_MODES:
        raise ConfigError(f"mil.mil_mode must be one of {', '.join(MIL_MODES)}, got {mil['mil_mode']!r}")
    synthetic = mil["synthetic"]
    for key, value, low in (("trans_blocks", mil["trans_blocks"], 1), ("epochs", mil["epochs"], 1), ("max_patches", mil["max_patches"], 1),
                            ("batch_size", mil["batch_size"], 1), ("synthetic.num_normal", synthetic["num_normal"], 1),
                            ("synthetic.num_tumor", synthetic["num_tumor"], 1), ("synthetic.num_test", synthetic["num_test"], 2),
                            ("synthetic.seed", synthetic["seed"], 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(f"mil.{key} must be a whole number >= {low}, got {value!r}")
    for key, value in (("dropout", mil["dropout"]), ("patch_dropout", mil["patch_dropout"])):
        if not 0 <= value < 1:
            raise ConfigError(f"mil.{key} must be in [0, 1), got {value!r}")
    if not 0 <= mil["features"]["min_tissue"] <= 1:
        raise ConfigError(f"mil.features.min_tissue must be in [0, 1], got {mil['features']['min_tissue']!r}")
    if not mil["lr"] > 0 or mil["weight_decay"] < 0:
        raise ConfigError(f"mil.lr must be > 0 and mil.weight_decay >= 0, got {mil['lr']!r} and {mil['weight_decay']!r}")
    if mil["gradient_clip_val"] is not None and not mil["gradient_clip_val"] > 0:
        raise ConfigError(f"mil.gradient_clip_val must be > 0 or null (no clipping), got {mil['gradient_clip_val']!r}")
    return mil


def module_config(config: dict, dim: int, split: dict, min_tissue: float | None = None) -> dict:
    """The hyper-parameters of :class:`MILModule` for a task config and features of width ``dim``:
    the network (``mil_mode``, ``in_features``, dropouts), AdamW's ``lr`` and ``weight_decay``
    from ``mil``, the task's ``inference`` (the heatmaps' lesion and region settings), ``data``
    (the grid settings the heatmaps re-cut a slide's grid by; ``min_tissue`` the features' as
    their h5 attributes record it, else ``data.min_tissue``, ``wsi-features``' default), ``supervision:
    slide`` and the ``split`` the bags were drawn from."""
    mil = check_mil_config(config)
    network = {"mil_mode": mil["mil_mode"], "in_features": dim, "dropout": mil["dropout"], "feature_dropout": mil["dropout"],
               "trans_blocks": mil["trans_blocks"]}
    data = _grid_params(config["data"]) | {"cache_dir": config["data"]["cache_dir"]}
    if min_tissue is not None:
        data["min_tissue"] = min_tissue
    config = {**config, "optim": {"lr": mil["lr"], "weight_decay": mil["weight_decay"], "warmup_steps": 0}}
    return {**hparams(config, network, LABELS, 1, dim, dict(config["inference"]), data), "supervision": "slide", "split": split}


def slide_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint of slide-label training (its hyper-parameters say
    ``supervision: slide``); an exported network never is."""
    from hsmla_med.engine.checkpoint import exported_file, read_hparams

    return exported_file(path) is None and (read_hparams(path) or {}).get("supervision") == "slide"


def _dataset(config: dict) -> tuple[Path, bool, dict[str, dict]]:
    """The dataset of the run: its folder (``data.data_dir``, else the synthetic slides of
    ``mil.synthetic``, generated once into ``data.cache_dir/camelyon16-slide-synthetic``),
    whether it is synthetic, and its slides by name (``{"slide", "annotation", "label"}``)."""
    data, synthetic = config["data"], not config["data"]["data_dir"]
    if synthetic:
        settings = config["mil"]["synthetic"]
        root = synthetic_root(data, "camelyon16-slide", "CAMELYON16-format slides", "textures, not tissue", lambda root: generate_camelyon16(
            root, settings["num_normal"], settings["num_tumor"], settings["num_test"], tuple(settings["size"]), seed=settings["seed"]))
    else:
        root = Path(data["data_dir"])
    training, test = find_slides(root)
    return root, synthetic, {Path(c["slide"]).stem: c for c in [*training, *test]}


def _encode(config: dict, slides: list[str], output: Path, progress) -> Path:
    """The slides encoded with ``mil.features``' encoder into ``output`` (CLAM's layout; slides
    done before with the same encoder and grid are skipped)."""
    from hsmla_med.pipelines.camelyon16.encoders import encode_slides, load_encoder

    settings = config["mil"]["features"]
    encoder = load_encoder(settings["encoder"], settings["weights"], input_size=settings["input_size"])
    log.info("camelyon16: encoding %d slide(s) with %s into %s", len(slides), encoder.description, output)
    encode_slides(encoder, slides, output, patch_size=settings["patch_size"], level=settings["level"], min_tissue=settings["min_tissue"],
                  batch_size=settings["batch_size"], options=InferenceOptions(progress=progress), cache_dir=config["data"]["cache_dir"])
    return output


@dataclass
class SlideBags:
    """The slides of a slide-label run, read once (:func:`slide_bags`) and trained on by one run
    or by each fold of a cross-validation.

    Attributes:
        root: the dataset folder (``None`` where features and labels are given without
            ``--data-dir``: no slide files, so no heatmaps).
        synthetic: whether it is the synthetic default.
        cases: its slides by name (``{"slide", "annotation", "label"}``).
        features: the feature folder; ``encoded`` whether the run wrote it (``mil.features``).
        labels: the label CSV.
        bags: a bag per labelled slide.
        test: the held-out slides the label CSV names (:func:`~.bags.held_out`).
    """

    root: Path | None
    synthetic: bool
    cases: dict[str, dict]
    features: Path
    encoded: bool
    labels: Path
    bags: list[Bag]
    test: set[str]


def slide_bags(config: dict, output: Path, features: str | Path | None = None, labels: str | Path | None = None, progress=print) -> SlideBags:
    """The slides of a run: ``features`` (``None``: the dataset's slides encoded with
    ``mil.features``' encoder into ``output/features``, slides done before skipped) and
    ``labels`` (``None``: the dataset's ``slide_labels.csv``) read into bags."""
    known = features is None or labels is None or config["data"]["data_dir"]
    root, synthetic, cases = _dataset(config) if known else (None, False, {})
    encoded = features is None
    if encoded:
        features = _encode(config, sorted(c["slide"] for c in cases.values()), output / "features", progress)
    if labels is None:
        labels = root / SLIDE_LABELS
        if not labels.is_file():
            raise InputError(f"{root}: no {SLIDE_LABELS}; give the slides' labels with --labels CSV (slide_id,label[,split] or CAMELYON16's reference.csv)")
    rows = read_slide_labels(labels)
    return SlideBags(root, synthetic, cases, Path(features), encoded, Path(labels), load_bags(features, rows, labels), set(held_out(rows)))


def train_slides(config: dict, output: Path, features: str | Path | None = None, labels: str | Path | None = None, resume: bool = False,
                 progress=print) -> dict:
    """Train attention MIL on slide labels and score it on the held-out slides (module docstring).

    Args:
        config: a validated camelyon16 task config (its ``mil`` section, ``data``, ``trainer``,
            ``fold``, ``seed``); ``trainer.max_epochs`` / ``max_steps`` as the run asks.
        output: the run folder: ``best.ckpt`` and ``last.ckpt`` (the final weights),
            ``metrics.json`` (the fit on the training slides), ``summary.json``,
            ``attention/``, ``heatmaps/`` (and ``features/`` when it encodes).
        features: a feature folder in CLAM's layout, or ``None`` to encode the dataset's slides.
        labels: the label CSV (:func:`~.bags.read_slide_labels`), or ``None`` for the
            dataset's ``slide_labels.csv``.
        resume: continue from ``output/last.ckpt``.
        progress: called with a line per slide encoded.

    Returns:
        The held-out summary (``summary.json``).
    """
    return train_bags(config, output, slide_bags(config, output, features, labels, progress), resume, progress)


def _pool(data: SlideBags) -> list[Bag]:
    """The slides that may train: all but the held-out ones."""
    pool = [b for b in data.bags if b.slide not in data.test]
    if not pool:
        raise DataError(f"{data.labels}: every slide is held out (split test): none left to train on")
    return pool


def slide_fold(config: dict, data: SlideBags) -> tuple[list[Bag], list[Bag], dict]:
    """Fold ``config["fold"]`` of ``splits_final.json`` over the slides that are not held out
    (:func:`~hsmla_med.data.splits.fold_cases`; made on first use, stratified by label, with
    ``data.folds`` folds): its training and validation bags and the checkpoint's record. The
    file lies beside the slides for features the run encoded (the patch classifier's folds of
    the same slides), else beside the features."""
    pool = _pool(data)
    return fold_cases(config, data.root if data.encoded else data.features, pool, [b.slide for b in pool], data.synthetic and data.encoded,
                      classes=[b.label for b in pool])


def train_bags(config: dict, output: Path, data: SlideBags, resume: bool = False, progress=print, fold: bool = False) -> dict:
    """:func:`train_slides` on slides read before: every slide but the held-out ones trains
    (nnU-Net's fold ``all``) and the held-out ones are scored; with ``fold`` (a fold of
    ``cross-validate``), or where the label CSV holds none out, fold ``config["fold"]`` of
    ``splits_final.json`` over the other slides, its validation slides scored."""
    if data.test and not fold:  # nnU-Net's fold "all": every labelled slide trains, and the final validation checks the fit on them
        training = validation = _pool(data)
        record = {"file": None, "fold": "all", "folds": None, "train": sorted(b.slide for b in training), "val": []}
    else:
        training, validation, record = slide_fold(config, data)
    scored = validation if fold or not data.test else [b for b in data.bags if b.slide in data.test]
    scored = [replace(b, split="test" if b.slide in data.test else "val") for b in scored]  # the rows of summary.json say which
    log.info("camelyon16 (slide labels): %d training slides, %d held-out slides (%s); %d features per patch", len(training), len(scored),
             "split test" if data.test and not fold else f"fold {config['fold']}'s validation", training[0].dim)
    mil = config["mil"]
    module = MILModule(module_config(config, training[0].dim, {**record, "test": sorted(data.test)}, training[0].attrs.get("min_tissue")))
    module.set_standardisation(training_statistics(training))
    loaders = BagDataModule(training, validation, mil["batch_size"], mil["max_patches"], mil["patch_dropout"], config["seed"])
    trainer = {**config["trainer"], "check_val_every_n_epoch": _FINAL_ONLY, "gradient_clip_val": mil["gradient_clip_val"],
               "log_every_n_steps": min(config["trainer"]["log_every_n_steps"], len(training))}
    fit(module, loaders, output, trainer, resume=resume)
    final, _ = load_module(output / "last.ckpt", MILModule, "camelyon16")
    return score_bags(final, scored, output, trainer, data.cases, data.root, {"checkpoint": str(output / "last.ckpt"),
                                                                            "features": str(data.features), "labels": str(data.labels)}, progress)


def evaluate_slides(checkpoint: str | Path, features: str | Path, labels: str | Path, output: Path, trainer: dict, data_dir: str | None = None,
                    allow_training: bool = False, progress=print) -> dict:
    """``evaluate --checkpoint CK --features FEATS --labels CSV``: a slide-label checkpoint
    scored on the slides of the label CSV (its held-out ones where it names some: split
    ``test`` or CAMELYON16's ``test_*``; else all), as :func:`train_slides` scores them; the
    heatmaps and lesion FROC where ``data_dir`` holds the slides. Slides the checkpoint trained
    on are refused unless ``allow_training``."""
    module, meta = load_module(checkpoint, MILModule, "camelyon16")
    rows = read_slide_labels(labels)
    test = set(held_out(rows))
    bags = load_bags(features, [r for r in rows if not test or r["slide"] in test], labels)
    if bags[0].dim != module.config["network"]["in_features"]:
        raise DataError(f"{bags[0].file}: {bags[0].dim} features per patch; --checkpoint {checkpoint} takes {module.config['network']['in_features']}")
    trained = sorted(set((module.config.get("split") or {}).get("train") or []) & {b.slide for b in bags})
    if trained and not allow_training:
        raise InputError(f"--checkpoint {checkpoint} trained on {len(trained)} of these {len(bags)} slides ({', '.join(trained[:5])}"
                         f"{' ...' if len(trained) > 5 else ''}); their scores would not be held-out scores; pass --allow-training-cases to score them anyway")
    for bag in bags:
        bag.split = "test"
    cases = {Path(c["slide"]).stem: c for part in find_slides(data_dir) for c in part} if data_dir else {}
    return score_bags(module, bags, output, trainer, cases, Path(data_dir) if data_dir else None,
                      {"checkpoint": str(checkpoint), **meta, "features": str(features), "labels": str(labels)}, progress)


def attention_in_lesions(attention: np.ndarray, coords: np.ndarray, footprint: int, annotation: str | Path, top: int = TOP_PATCHES) -> float | None:
    """The share of a tumour slide's ``top`` patches by attention whose centres lie inside its
    tumour outlines (a tumour group's polygon and no exclusion ``_2`` polygon): of the top ``n``
    where only ``n < top`` patch centres lie inside; ``None`` where none does.

    Args:
        attention: ``(N,)`` the patches' attention.
        coords: ``(N, 2)`` their level-0 x, y corners.
        footprint: a patch's side in level-0 pixels (the centre is ``corner + footprint // 2``).
        annotation: the slide's ASAP XML.
        top: how many patches count.

    Point-in-polygon at the centres (scikit-image) rather than a level-0 mask: a CAMELYON16
    slide's level 0 has billions of pixels.
    """
    from skimage.measure import points_in_poly

    from hsmla_med.data.asap import EXCLUSION_GROUPS, TUMOUR_GROUPS, read_asap_xml

    centres = np.asarray(coords, np.float64) + footprint // 2
    tumour, excluded = np.zeros(len(centres), bool), np.zeros(len(centres), bool)
    for polygon in read_asap_xml(annotation):
        if polygon.group in TUMOUR_GROUPS or polygon.group in EXCLUSION_GROUPS:
            hit = points_in_poly(centres, polygon.points)
            if polygon.group in TUMOUR_GROUPS:
                tumour |= hit
            else:
                excluded |= hit
    inside = tumour & ~excluded
    count = min(top, int(inside.sum()))
    if not count:
        return None
    return float(inside[np.argsort(-np.asarray(attention), kind="stable")[:count]].mean())


def score_bags(module: MILModule, bags: list[Bag], output: Path, trainer: dict, cases: dict[str, dict], data_dir: Path | None, provenance: dict,
               progress=print) -> dict:
    """Score ``module`` on ``bags`` and write into ``output``: ``summary.json`` (slide AUC with
    its bootstrap 95% interval, balanced accuracy at 0.5, the lesion FROC of the attention maps
    where the slides are known, a row per slide: ``slide``, ``label``, ``score``,
    ``n_patches``, ``split``; for the tumour slides whose outlines ``cases`` holds,
    ``attention_in_lesions`` (:func:`attention_in_lesions`) and its mean over them,
    ``attention_top10_in_lesions``), ``attention/<slide>.csv`` (``x``, ``y``: a patch's level-0
    corner, ``attention``: its weight, summing to 1 over the slide) and, for the slides found in
    ``cases``, ``heatmaps/``: ``wsi-heatmap``'s files of the attention map (module docstring)
    and ``slides.csv``, scored by the official lesion rules
    (:func:`~hsmla_med.pipelines.camelyon16.score_predictions`, its ``summary.json`` there)."""
    summary = evaluate(module, BagDataModule([], bags), trainer, output)
    records = {r["key"]: r for r in module.records}
    rows = []
    for bag in bags:
        record = records[bag.slide]
        coords = read_bag(bag.file, coords=True)[1]
        with atomic_path(output / ATTENTION / f"{bag.slide}.csv") as tmp, tmp.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["x", "y", "attention"])
            writer.writerows((int(x), int(y), repr(float(a))) for (x, y), a in zip(coords, record["attention"]))
        row = {"slide": bag.slide, "label": bag.label, "score": record["score"], "n_patches": bag.patches, "split": bag.split}
        annotation = (cases.get(bag.slide) or {}).get("annotation")
        if bag.label and annotation:
            footprint = int(bag.attrs.get("patch_size_level0") or round(bag.attrs["patch_size"] * np.max(bag.attrs["downsample"])))
            row["attention_in_lesions"] = attention_in_lesions(record["attention"], coords, footprint, annotation)
        rows.append(row)
    scores = [r["score"] for r in rows]
    shares = [r["attention_in_lesions"] for r in rows if r.get("attention_in_lesions") is not None]
    lesions = _attention_heatmaps(module, bags, records, output / HEATMAPS, cases, data_dir, progress)
    result = {"task": "camelyon16", "supervision": "slide", **summary, "auc_ci95": auc_interval(scores, [r["label"] for r in rows]),
              "auc_slides": len(rows), "bootstrap": {"draws": 1000, "seed": 0, "confidence": 0.95, "method": "percentile, slides resampled "
                                                    "with replacement, draws of one class left out"},
              "froc": lesions.get("froc"), "sensitivity": lesions.get("sensitivity"), "lesions": lesions.get("lesions"),
              "attention_map": "slide score x attention / the slide's largest attention",
              "attention_top10_in_lesions": float(np.mean(shares)) if shares else None, **provenance, "metric_per_case": rows}
    write_json(output / "summary.json", result)
    return result


def _attention_heatmaps(module: MILModule, bags: list[Bag], records: dict, folder: Path, cases: dict[str, dict], data_dir: Path | None,
                        progress) -> dict:
    """``wsi-heatmap``'s files of the attention maps of the bags whose slides ``cases`` holds
    (:class:`SlideHeatmaps`, the slide's grid cut again from the features' patch size and level
    and checked against their coords), ``slides.csv`` of their scores, and the lesion FROC of
    their detections (:func:`~hsmla_med.pipelines.camelyon16.score_predictions`); ``{}`` when
    no slide is found."""
    from hsmla_med.crossval import pool_file
    from hsmla_med.pipelines.camelyon16 import score_predictions

    found = [b for b in bags if b.slide in cases]
    if not found:
        log.info("camelyon16: no slide files of the scored slides (give --data-dir): no attention heatmaps, no lesion FROC")
        return {}
    if len(found) < len(bags):
        log.warning("camelyon16: %d of %d scored slides have no slide file in %s: left out of the heatmaps and the lesion FROC",
                    len(bags) - len(found), len(bags), data_dir)
    attrs = found[0].attrs
    data = {**module.config["data"], "level": int(attrs["patch_level"]), "mpp": None, "patch_size": int(attrs["patch_size"]),
            "stride": int(attrs["patch_size"]), "min_tissue": float(attrs.get("min_tissue", module.config["data"]["min_tissue"]))}
    heatmaps = SlideHeatmaps(module, folder, data, progress)
    heatmaps.patches([{"name": b.slide, "slide": cases[b.slide]["slide"], "output": folder / f"{b.slide}.json"} for b in found])
    drawn = []
    for index, (bag, slide) in enumerate(zip(found, heatmaps.slides)):
        coords, grid = read_bag(bag.file, coords=True)[1], slide["grid"]
        if not np.array_equal(coords, grid["coords"]):
            log.warning("%s: its patches are not the grid of %s at level %d, %d px (features of other grid settings): no heatmap",
                        bag.file, slide["slide"], data["level"], data["patch_size"])
            continue
        attention, score = records[bag.slide]["attention"], records[bag.slide]["score"]
        heatmaps.write({"slide_index": torch.full((len(coords),), index), "row": torch.from_numpy(grid["rows"]),
                        "col": torch.from_numpy(grid["cols"]), "prob": torch.from_numpy(score * attention / attention.max()), "alpha": None})
        drawn.append(bag)
    heatmaps.flush()
    if not drawn:
        return {}
    write_slide_csv(folder / SLIDE_CSV, {b.slide: records[b.slide]["score"] for b in drawn})
    outlines = folder / "annotations"  # the scored slides' outlines, linked as cross-validate pools them
    outlines.mkdir(parents=True, exist_ok=True)
    for bag in drawn:
        if cases[bag.slide]["annotation"]:
            pool_file(Path(cases[bag.slide]["annotation"]), outlines / f"{bag.slide}.xml")
    return score_predictions(folder, outlines, folder, {"data_dir": data_dir})
