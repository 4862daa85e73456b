"""CAMELYON16: whole-slide images through OpenSlide, ASAP XML lesion annotations, tumour/normal
patch classification, and whole-slide heatmaps.

What is specific to the benchmark lives in this package, by role as MONAI's ``apps/pathology``
keeps it: :mod:`.data` (finding slides and annotations in the CAMELYON16 folders, a flat
``images/`` + ``annotations/`` layout or the synthetic default; the patch grid inside tissue,
labelled by tumour coverage, cached per slide; the DataModule), :mod:`.patch_transforms` (reading
patches lazily, stain normalisation and augmentation), :mod:`.writers` (heatmaps, the
challenge's submission files, QuPath/ASAP regions, CLAM features), and here the task itself:
its module config, whole-slide inference and the glue of ``evaluate --predictions``. Scoring is
:mod:`hsmla_med.evaluation.pathology`'s (the official CAMELYON16 rules), the submission files
:mod:`hsmla_med.io.lesion_csv`'s; the loop and checkpoints are the generic engine's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

import lightning as L
from monai.transforms import Compose

from hsmla_med.data.datalist import Datalist
from hsmla_med.data.slides import SLIDE_SUFFIXES
from hsmla_med.engine.base import hparams
from hsmla_med.engine.classification import ClassificationModule, final_linear
from hsmla_med.errors import DataError, InputError
from hsmla_med.evaluation.pathology import mask_folder, score_slides, slide_auc, slide_truth
from hsmla_med.io import write_json
from hsmla_med.io.lesion_csv import LESIONS, SLIDE_CSV, read_lesion_csv, read_slide_csv, write_slide_csv
from hsmla_med.metrics.pathology import GROW_UM, ITC_UM
from hsmla_med.pipelines.camelyon16.data import LABELS, _grid_params, _slides, datalist, datamodule, find_slides, grid_patches, slide_patches
from hsmla_med.pipelines.camelyon16.patch_transforms import ReadPatchd, _stain, patch_collate, transforms
from hsmla_med.pipelines.camelyon16.writers import FEATURES_H5, FEATURES_PT, SlideFeatures, SlideHeatmaps
from hsmla_med.pipelines.task import InferenceOptions, Task, input_files, predict_cases

__all__ = ["TASK", "LABELS", "find_slides", "datalist", "slide_patches", "datamodule", "transforms", "ReadPatchd", "patch_collate",
           "module_config", "grid_patches", "SlideHeatmaps", "SlideFeatures", "held_out", "infer", "extract_features", "slide_truth",
           "read_lesion_csv", "read_slide_csv", "score_predictions", "crossval_score", "pool_lesions", "LESIONS", "SLIDE_CSV", "FEATURES_H5", "FEATURES_PT"]

log = logging.getLogger("hsmla_med")


def module_config(config: dict, model: dict, label_names: list[str], in_channels: int = 3) -> dict:
    """The hyper-parameters of :class:`ClassificationModule` for this task config."""
    # stain_normalization: wsi-heatmap and wsi-features normalise as training did
    data = _grid_params(config["data"]) | {"cache_dir": config["data"]["cache_dir"], "stain_normalization": config["data"].get("stain_normalization")}
    return hparams(config, model, label_names, 2, in_channels, dict(config["inference"]), data)


def held_out(cases: Datalist) -> list[list[str]]:
    """The slides ``demo`` writes heatmaps of after training: the test slides, as one input
    list, so that they share one slide CSV."""
    return [[c["slide"] for c in cases.test]]


def infer(module: ClassificationModule, inputs: str | Path | Iterable[str | Path], output: str | Path,
          options: InferenceOptions = InferenceOptions()) -> list[Path]:
    """Tumour-probability heatmaps (:class:`SlideHeatmaps`) of a slide, a folder of slides or a list of them in
    Lightning's predict loop (:func:`predict_cases`): slides split over processes and shards;
    patches read by ``options.num_workers`` DataLoader workers (one OpenSlide handle each), in
    batches of ``options.batch_size`` (else the checkpoint's), at pyramid level
    ``options.level`` (else the checkpoint's level or mpp), mixed precision on CUDA. A slide
    whose ``<slide>.json`` exists is skipped, so an interrupted run resumes slide by slide (the
    JSON is written last)."""
    output = Path(output)
    slides, data = _run_slides(module, inputs, options, "heatmaps")
    if options.uncertainty not in (None, "entropy"):
        raise InputError(f"--uncertainty {options.uncertainty}: a slide's patches are predicted once; wsi-heatmap writes --uncertainty entropy")
    heatmaps = SlideHeatmaps(module, output, data, options.progress, options.uncertainty)
    items = [{"name": slide.stem, "slide": str(slide), "output": output / f"{slide.stem}.json"} for slide in slides]

    def slide_csv() -> list[Path]:
        """The run's slide-level CSV from the scores of its slides done so far (resumed ones too)."""
        done = [item for item in items if item["output"].is_file()]
        if len(done) < len(items):
            options.progress(f"{SLIDE_CSV}: {len(done)} of {len(items)} slide(s) so far (the others are other shards')")
        scores = {item["name"]: json.loads(item["output"].read_text())["score"] for item in done}
        write_slide_csv(output / SLIDE_CSV, scores)
        return [output / SLIDE_CSV]

    return _predict_patches(module, items, heatmaps, options, finish=slide_csv, flush=heatmaps.flush)


def extract_features(module: ClassificationModule, inputs: str | Path | Iterable[str | Path], output: str | Path,
                     options: InferenceOptions = InferenceOptions()) -> list[Path]:
    """Patch features for multiple-instance learning (CLAM, Trident) of a slide, a folder of
    slides or a list of them, in CLAM's layout (:class:`SlideFeatures`): ``h5_files/<slide>.h5``
    and ``pt_files/<slide>.pt`` under ``output``. A patch's features are the classifier's
    penultimate activations, the input of its final linear layer
    (:func:`~hsmla_med.engine.classification.penultimate`), of the patches scaled to 0..1 at the
    patch size (``mean`` 0, ``std`` 1 and ``input_size`` the patch size in the h5); the patches
    are the heatmap's (the same grid, reading, loop, processes and shards as :func:`infer`). A
    slide whose h5 this checkpoint wrote with the same options is skipped (the h5 is written last).
    Any other encoder (timm, TorchScript): :func:`~hsmla_med.pipelines.camelyon16.encoders.encode_slides`.

    Returns (first process) every slide's h5; on other processes, the files they wrote.

    Raises:
        ConfigError: the network has no final linear layer (before any slide is read).
        DataError: naming a slide OpenSlide cannot read.
    """
    name, layer = final_linear(module.network, getattr(module, "checkpoint_path", None) or "the network")
    slides, data = _run_slides(module, inputs, options, "features")
    encoder = {"encoder": f"{getattr(module, 'checkpoint_path', None) or type(module.network).__name__}: input of {name}",
               "mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0), "input_size": int(data["patch_size"])}
    module.predict_features = True
    try:
        return _write_features(module, slides, data, layer.in_features, encoder, output, options)
    finally:
        module.predict_features = False


def _write_features(module: L.LightningModule, slides: list[Path], data: dict, width: int, encoder: dict, output: str | Path,
                   options: InferenceOptions) -> list[Path]:
    """The features of ``slides`` in CLAM's layout under ``output`` (:class:`SlideFeatures`),
    through the heatmap's loop (:func:`_predict_patches`): ``module.predict_step`` gives each
    batch's ``features`` ``(B, width)`` with the patches' places. What :func:`extract_features`
    and :func:`~hsmla_med.pipelines.camelyon16.encoders.encode_slides` share.

    Args:
        module: the LightningModule that predicts (its ``config["inference"]["batch_size"]``
            when ``options`` gives none; its weights' digest and options say whose outputs are in
            ``output``, so that slides done before by the same are skipped).
        slides: the slide files.
        data: the data section the grid is cut by (:func:`grid_patches`).
        width: ``D``, the features per patch.
        encoder: the ``features`` attributes that describe the encoder (:class:`SlideFeatures`).
        output: the run's folder.
        options: the run's options.
    """
    output = Path(output)
    features = SlideFeatures(output, data, width, encoder, options.progress)
    items = [{"name": slide.stem, "slide": str(slide), "output": output / FEATURES_H5 / f"{slide.stem}.h5"} for slide in slides]
    return _predict_patches(module, items, features, options, folder=output)


def _run_slides(module: ClassificationModule, inputs: str | Path | Iterable[str | Path], options: InferenceOptions,
                what: str) -> tuple[list[Path], dict]:
    """The slides of ``inputs`` and the data section their patch grid is cut by: the
    checkpoint's, at ``options.level`` when given (else its level or mpp)."""
    slides = input_files(inputs, _slides)
    if not slides:
        raise DataError(f"{inputs}: no slides ({', '.join(SLIDE_SUFFIXES)}) found")
    if options.tta:
        log.warning("camelyon16: --tta is not used for %s", what)
    return slides, module.config["data"] if options.level is None else {**module.config["data"], "level": options.level, "mpp": None}


def _predict_patches(module: ClassificationModule, items: list[dict], sink: SlideHeatmaps | SlideFeatures, options: InferenceOptions,
                     **extra) -> list[Path]:
    """The patches of the slide ``items`` (``sink.patches``) in Lightning's predict loop
    (:func:`predict_cases`, ``extra`` its ``finish``/``flush``), read as bytes (one
    :class:`ReadPatchd` per loader worker) in batches of ``options.batch_size`` (else the
    checkpoint's), each batch's predictions handed to ``sink.write``."""
    read = Compose([ReadPatchd(keep=1, uint8=True), *_stain(sink.data)])  # normalised bytes, rounded, as validation saw them
    return predict_cases(module, items, read, sink.write, options, collate=patch_collate, expand=sink.patches,
                         batch_size=options.batch_size or module.config["inference"]["batch_size"], **extra)


def crossval_score(folds: list[tuple[Datalist, Path]], output: Path, config: dict) -> dict:
    """Every fold's validation heatmaps scored together (:func:`pool_lesions`), the slides'
    sizes from the dataset."""
    return pool_lesions([(folder, cases.validation) for cases, folder in folds], output, folds[0][0].source)


def pool_lesions(folds: list[tuple[Path, list[dict]]], output: Path, data_dir: Path | None) -> dict:
    """Folders of ``wsi-heatmap``'s files scored together, as the official rules score one: per
    folder, the slides (``{"slide", "annotation"}``) whose lesion CSVs it holds. Their lesion
    CSVs linked into ``output/predictions/lesions``, their slide scores merged into one
    ``slides.csv``, their annotations linked into ``output/labels``; :func:`score_predictions`
    writes ``output/summary.json``."""
    from hsmla_med.crossval import pool_file

    scores: dict[str, float] = {}
    for folder, cases in folds:
        scores.update(read_slide_csv(folder / SLIDE_CSV))
        for case in cases:
            name = Path(case["slide"]).stem
            pool_file(folder / LESIONS / f"{name}.csv", output / "predictions" / LESIONS / f"{name}.csv")
            if case["annotation"]:
                pool_file(Path(case["annotation"]), output / "labels" / f"{name}.xml")
    (output / "labels").mkdir(parents=True, exist_ok=True)  # all normal: no annotation at all
    write_slide_csv(output / "predictions" / SLIDE_CSV, scores)
    return score_predictions(output / "predictions", output / "labels", output, {"data_dir": data_dir})


def score_predictions(predictions: Path, labels: Path, output: Path, options: dict) -> dict:
    """Score a CAMELYON16 submission (``evaluate --task camelyon16 --predictions DIR --labels XML_DIR``).

    ``DIR`` holds the lesion CSVs (``DIR/lesions/<slide>.csv``, as ``wsi-heatmap`` writes them,
    or ``DIR/<slide>.csv``, the challenge's layout) and, optionally, the slide-level
    ``DIR/slides.csv``. The slides scored are those with a lesion CSV; ``XML_DIR/<slide>.xml``
    is a slide's ASAP annotation, and a slide without one (or with one without tumour outlines)
    is normal. Lesion-level FROC by the official rules
    (:func:`~hsmla_med.evaluation.pathology.score_slides`); slide AUC of ``slides.csv`` over its
    slides when it has both classes.

    A slide's tumour mask is its ground-truth mask TIFF ``<slide>_Mask.tif`` where there is one
    (``options["masks"]``, ``evaluate --masks DIR``; else a ``Masks`` or ``Ground_Truth/Masks``
    folder beside the annotation folder, :func:`~hsmla_med.evaluation.pathology.mask_folder`), read as the official script reads
    it; else the mask ASAP makes of its XML (:func:`~hsmla_med.data.asap.asap_mask`). The
    XML's mask needs the slide's level-0 size and resolution: the slide file of the same name is
    looked for under ``--data-dir`` (else under the annotation folder's parent, e.g.
    CAMELYON16's ``testing/images``); without one, the mask covers the outlines' extent (plus
    the growth) at the official 0.243 µm and level 5, which gives the official result on
    CAMELYON16's slides, and a detection beyond it counts as a false positive. Where the slide's
    size is known, a detection outside the slide, or in the last partial row or column of its
    evaluation mask (which the official lookup cannot index), is refused in one line.

    Writes ``OUTPUT/summary.json`` (atomically): ``froc``, ``sensitivity`` at the six rates,
    ``lesions``, ``slides``, ``auc`` (null without a slide CSV or with one class),
    ``metric_per_case`` (a row per slide) and the ``rules``.
    """
    if not predictions.is_dir():
        raise DataError(f"{predictions}: --predictions for camelyon16 is a folder of lesion CSVs (and {SLIDE_CSV})")
    if not labels.is_dir():
        raise DataError(f"{labels}: --labels for camelyon16 is the folder of ASAP XML annotations")
    folder = predictions / LESIONS if (predictions / LESIONS).is_dir() else predictions
    csvs = sorted(p for p in folder.glob("*.csv") if not (folder == predictions and p.name == SLIDE_CSV))
    if not csvs:
        raise DataError(f"{folder}: no lesion CSVs (<slide>.csv)")
    data_dir = Path(options["data_dir"]) if options.get("data_dir") else None
    masks = mask_folder(labels, options.get("masks"))
    if masks is not None:
        log.info("ground-truth masks: %s (<slide>_Mask.tif; a slide without one: its XML, rasterised as ASAP does)", masks)
    froc, rows = score_slides(csvs, labels, data_dir, masks)
    summary = {"task": "camelyon16", **froc, "auc": None, "auc_slides": 0}
    if (predictions / SLIDE_CSV).is_file():
        value, count = slide_auc(predictions / SLIDE_CSV, labels, masks)
        summary.update(auc=value, auc_slides=count)
    summary["rules"] = {"grow_um": GROW_UM, "itc_major_axis_um": ITC_UM, "evaluation": "Evaluation_FROC.py (CAMELYON16)"}
    summary["metric_per_case"] = rows
    write_json(output / "summary.json", summary)
    return summary


class CAMELYON16(Task):
    """CAMELYON16 tumour/normal patch classification and whole-slide heatmaps."""

    name = "camelyon16"
    module_class = ClassificationModule
    in_channels = 3
    input_key = "slide"

    def score_lines(self, summary: dict, output: Path) -> list[str]:
        fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
        sens = ", ".join(f"{rate} FP: {fmt(v)}" for rate, v in summary["sensitivity"].items())
        return [f"{summary['slides']} slides, {summary['lesions']} lesions: FROC {fmt(summary['froc'])} ({sens}); "
                f"slide AUC {fmt(summary['auc'])}", f"summary: {output / 'summary.json'}"]


TASK = CAMELYON16()
