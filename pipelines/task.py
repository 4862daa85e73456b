"""The interface every task pipeline implements, and the options of one inference run.

A task is one benchmark's data, transforms, LightningModule and output format. The command line
(train, infer, evaluate, demo) drives every task through :class:`Task` alone; what is specific to
a benchmark (its layout, geometry, file formats, summary lines, help text) lives in its module.
Adding a task: a module ``pipelines/<name>.py`` with a :class:`Task` subclass as ``TASK``, its
YAML ``configs/<name>.yaml``, and its card in :data:`hsmla_med.pipelines.CARDS`, which declares
what it supports (docs/design.md §5.3 has a worked example).
"""

from __future__ import annotations

import logging
import re
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import lightning as L
from lightning.fabric.utilities.rank_zero import rank_zero_only

from hsmla_med.config import check_model_settings, model_config
from hsmla_med.data.datalist import Datalist
from hsmla_med.defaults import GATE_REFINED
from hsmla_med.engine.base import GatedModule
from hsmla_med.engine.distributed import check_launcher
from hsmla_med.engine.prediction import PredictionDataModule, Shard, claim_outputs, model_record, output_folder, run_prediction
from hsmla_med.errors import DataError, InputError
from hsmla_med.inference.uncertainty import DEFAULT_THRESHOLD
from hsmla_med.inference.uncertainty import KINDS as UNCERTAINTY_KINDS
from hsmla_med.io.volumes import output_format
from hsmla_med.pipelines import CARDS, TaskCard, tasks_with

__all__ = ["Task", "InferenceOptions", "BundleParts", "input_files", "predict_cases", "synthetic_root"]

log = logging.getLogger("hsmla_med")


def input_files(inputs: str | Path | Iterable[str | Path], in_folder: Callable[[Path], list[Path]]) -> list[Path]:
    """The input files of ``infer --input`` (a file, a folder or a list of them): a file as
    given, a folder through the task's ``in_folder``, a list in the list (a case's channel
    files, as cross-validate passes a fold's cases) as its files, which the pipeline groups into
    cases again; a missing path, or a special file (a device such as ``/dev/zero``, a pipe), is
    one :class:`~hsmla_med.errors.DataError`."""
    files = []
    for path in [inputs] if isinstance(inputs, (str, Path)) else inputs:
        if isinstance(path, (list, tuple)):
            files += input_files(path, in_folder)
            continue
        path = Path(path)
        if path.is_dir():
            files += in_folder(path)
        elif path.is_file():
            files.append(path)
        elif path.exists():  # a device, pipe or socket: not "not found", it is there
            raise DataError(f"{path}: not a regular file or a folder (a device, pipe or socket); give a volume, an image or a folder of them")
        else:
            raise DataError(f"{path}: input not found")
    return files


def predict_cases(
    module: GatedModule,
    items: list[dict],
    transform: Callable | None,
    write: Callable[[dict], list[Path]],
    options: InferenceOptions,
    finish: Callable[[], list[Path]] | None = None,
    flush: Callable[[], list[Path]] | None = None,
    folder: str | Path | None = None,
    settings: dict | None = None,
    **loader,
) -> list[Path]:
    """Predict this job's shard of ``items`` (see :mod:`hsmla_med.engine.prediction`) on
    ``options``' devices and processes, skipping cases whose output this model wrote with these
    options before. Returns, on the first process, every item's ``output`` (all exist then) and
    what ``finish`` wrote; on any other, what the process wrote itself. ``flush`` (optional) waits
    for writes that ``write`` left to a background thread and returns their paths.

    ``folder`` (default: the folder that holds every output) records where its outputs came
    from (:func:`~hsmla_med.engine.prediction.claim_outputs`): outputs of another model or
    other options there are refused unless ``options.overwrite``. An output that would replace
    one of its case's inputs is refused. When this returns, every item's output in ``folder``
    is this model's with these options, so ``finish`` may merge exactly the items' outputs.

    ``settings``: the run's inference settings (the checkpoint's with the run's options,
    ``InferenceOptions.apply``), which the module holds for the run
    (:attr:`~hsmla_med.engine.base.GatedModule.run_inference`); ``None``: the checkpoint's.
    """
    folder = Path(folder) if folder is not None else output_folder(items)
    items = options.shard.select(items)
    _refuse_outputs_over_inputs(items)
    record = {"format": 1, "model": model_record(module), "options": options.provenance()}
    todo = claim_outputs(items, folder, record, options.overwrite, write=rank_zero_only.rank == 0) if items else []
    if len(todo) < len(items):
        options.progress(f"{len(items) - len(todo)} of {len(items)} case(s) done before by this checkpoint with these options: skipped")
    data = PredictionDataModule(todo, transform, num_workers=options.num_workers, **loader)
    module.use_cuda_graphs(options.cuda_graphs)
    module.run_inference = settings
    try:
        written, finished, first = run_prediction(
            module, data, write, options.device, options.devices, options.strategy, options.num_nodes, options.precision, finish, flush
        )
    finally:
        module.run_inference = None
    return [Path(item["output"]) for item in items] + finished if first else written


def _refuse_outputs_over_inputs(items: list[dict]) -> None:
    """An item whose ``output`` is one of its own input paths (``infer --output`` = ``--input``
    for frames or volumes) would be taken as done, or replace the input: an
    :class:`~hsmla_med.errors.InputError`. Every path of an item but its ``name`` (which is
    relative to the output folder, not to the working directory) is an input."""
    for item in items:
        output = Path(item["output"]).resolve()
        if any(isinstance(v, (str, Path)) and Path(v).resolve() == output for k, v in item.items() if k not in ("name", "output")):
            raise InputError(f"{item['output']}: the output of {item['name']} would be its own input; give an --output folder apart from the input")


_WARNED: set[Path] = set()  # synthetic roots this process has logged


def synthetic_root(data: dict, task: str, files: str, nature: str, generate: Callable[[Path], object]) -> Path:
    """A task's synthetic default dataset (``data.cache_dir/<task>-synthetic``), made current by
    ``generate(root)`` (a generator returns at once when its cache is current), and logged as
    synthetic: ``files`` in the benchmark's format, ``nature`` what they really are.

    ``generate`` runs under an exclusive lock beside the folder, so that the processes of one
    run, and runs sharing the cache, generate once: the first writes, the others wait and then
    find the cache current (a generator deletes a stale cache's files, so two at once would
    delete each other's). A lock rather than a barrier: torchrun and SLURM start every rank
    before any process group exists, and it covers independent jobs too; a node-local cache is
    generated once per node, a shared one once.
    """
    from filelock import FileLock

    root = Path(data["cache_dir"]).expanduser() / f"{task}-synthetic"
    if rank_zero_only.rank == 0 and root not in _WARNED:  # once per process: cross-validate reads it per fold
        _WARNED.add(root)
        log.warning("No --data-dir given: using SYNTHETIC %s in %s (%s)", files, root, nature)
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(root.parent / f".{root.name}.lock")
        lock.acquire()
    except OSError as err:
        raise InputError(f"data.cache_dir {root.parent}: cannot write the synthetic dataset there ({err.strerror or err}); "
                         "set data.cache_dir to a writable folder") from None
    try:
        generate(root)
    except FileExistsError as err:  # a dataset the generator did not write (real data): never overwritten
        raise DataError(f"{err}; set data.cache_dir to another folder") from None
    finally:
        lock.release()
    return root


_SHAPES_OUTPUTS = {"shapes_outputs": True}


_UID = re.compile(r"(0|[1-9][0-9]*)(\.(0|[1-9][0-9]*))*")  # DICOM PS3.5 9.1: numbers without leading zeros, joined by dots


def _check_seg_uids(seg_uids: Mapping[str, str]) -> None:
    """SEG UIDs that DICOM takes (digits and dots, at most 64 characters), one per series: two
    series' SEGs of one UID would be one object to a PACS, which keeps only one of them."""
    bad = next((uid for uid in seg_uids.values() if not (isinstance(uid, str) and len(uid) <= 64 and _UID.fullmatch(uid))), None)
    if bad is not None:
        raise InputError(f"seg_uids: {bad!r} is no valid DICOM UID (digits and dots, at most 64 characters)")
    if len(set(seg_uids.values())) < len(seg_uids):
        raise InputError("seg_uids: one SOP Instance UID given to several series; each series' SEG needs its own")


@dataclass(frozen=True)
class InferenceOptions:
    """The options of one inference run, given as arguments rather than written into a
    checkpoint's config; ``None`` keeps the checkpoint's value.

    Attributes:
        device: ``cpu``, ``cuda`` or ``cuda:N``.
        tta: mirroring test-time augmentation.
        overlap: sliding-window overlap in [0, 1).
        batch_size: patches per forward pass (whole-slide heatmaps).
        level: pyramid level of the patches (whole-slide heatmaps).
        crop: ``auto`` crops only frames of the challenge's raw size to the training crop,
            ``none`` never crops (EndoVis frames).
        devices, strategy, num_nodes: processes per node, Lightning strategy (``ddp``) and
            nodes of the predict loop; each process predicts its share of the cases.
        precision: ``auto`` (mixed precision on CUDA, float32 on the CPU) or a Lightning value.
        shard: this job's :class:`~hsmla_med.engine.prediction.Shard` of the cases.
        num_workers: DataLoader workers that read and preprocess the inputs.
        save_probabilities: also write the class probabilities (volumes: ``<case>.npz``).
        output_formats: the formats of a volume's label map, by their registry names
            (:data:`~hsmla_med.io.volumes.OUTPUT_FORMATS`, tasks whose card declares them:
            :attr:`~hsmla_med.pipelines.TaskCard.output_formats`): ``nifti`` (``<case>.nii.gz``),
            ``metaimage`` (``.mha``), ``nrrd``, ``dicom-seg`` (``<case>.seg.dcm``, for DICOM series
            inputs only); empty: the input's own format (NIfTI for a series), as nnU-Net writes
            predictions. Not recorded as shaping the outputs: a format changes which files are
            written, not their content, and a case counts as done when its last format's file
            exists (the SEG when asked).
        postprocessing: the kept steps of a ``postprocessing.json``
            (:func:`~hsmla_med.inference.postprocessing.apply_postprocessing`), applied to each
            label map; ``None`` for none (tasks with :attr:`Task.postprocesses`).
        overwrite: predict every case again, also into a folder of another checkpoint or other
            options (else refused; see :func:`predict_cases`).
        series_uid: the DICOM series (SeriesInstanceUID) to read from an input folder that holds
            files of several series (volume tasks).
        series_rules: rules that pick the series of DICOM inputs by their attributes
            (:class:`~hsmla_med.io.dicom.SeriesRules`: MONAI Deploy's format), instead of the
            checkpoint's ``inference.series_selection``; ``series_uid`` overrides both.
        seg_uids: the SOP Instance UID of the DICOM SEG of a series, by the series' Series
            Instance UID (series not named get new ones): a caller that records the SEG before
            it exists (the DICOM node, when it queues a job) gets that object, also from a run
            again. Not recorded as shaping the outputs: UIDs name the file's object, not its labels.
        uncertainty: also write a voxel-wise uncertainty map of each volume and the run's review
            queue (tasks whose card declares the kind, :attr:`~hsmla_med.pipelines.TaskCard.uncertainty`):
            ``entropy`` or ``mutual-information``
            (:mod:`hsmla_med.inference.uncertainty`); ``None`` for none.
        uncertainty_threshold: the uncertainty (normalised, in [0, 1]) above which a voxel counts
            in the review queue's uncertain volume.
        progress: called with one line per input.
        extra: the values of the options a task declares on its card
            (:attr:`~hsmla_med.pipelines.TaskCard.options`) that no field here holds, by their
            ``dest``, for its pipeline to read.
        cuda_graphs: on CUDA, replay the network from a CUDA graph captured per window or
            patch-batch shape (:class:`~hsmla_med.inference.cuda_graph.GraphedCallable`); the
            same kernels as an eager run, so not recorded as shaping the outputs.

    The options that change what is written (:meth:`provenance`) are recorded with the outputs;
    those that only place the work (devices, shards, workers) are not.
    """

    device: str = "cpu"
    tta: bool = field(default=False, metadata=_SHAPES_OUTPUTS)
    overlap: float | None = field(default=None, metadata=_SHAPES_OUTPUTS)
    batch_size: int | None = None
    level: int | None = field(default=None, metadata=_SHAPES_OUTPUTS)
    crop: str = field(default="auto", metadata=_SHAPES_OUTPUTS)
    devices: int | None = None
    strategy: str = "auto"
    num_nodes: int = 1
    precision: str = field(default="auto", metadata=_SHAPES_OUTPUTS)
    shard: Shard = Shard()
    num_workers: int = 0
    cuda_graphs: bool = True
    save_probabilities: bool = field(default=False, metadata=_SHAPES_OUTPUTS)
    output_formats: tuple[str, ...] = ()
    postprocessing: list[dict] | None = field(default=None, metadata=_SHAPES_OUTPUTS)
    overwrite: bool = False
    series_uid: str | None = None
    series_rules: dict | list | None = None
    seg_uids: Mapping[str, str] = field(default_factory=dict)
    uncertainty: str | None = field(default=None, metadata=_SHAPES_OUTPUTS)
    uncertainty_threshold: float = field(default=DEFAULT_THRESHOLD, metadata=_SHAPES_OUTPUTS)
    extra: Mapping[str, Any] = field(default_factory=dict, metadata=_SHAPES_OUTPUTS)
    progress: Callable[[str], None] = field(default=print, compare=False)

    def __post_init__(self) -> None:
        if self.overlap is not None and not 0.0 <= self.overlap < 1.0:
            raise InputError(f"--overlap must lie in [0, 1), got {self.overlap}")
        if self.batch_size is not None and self.batch_size < 1:
            raise InputError(f"--batch-size must be a positive number of patches, got {self.batch_size}")
        if self.level is not None and self.level < 0:
            raise InputError(f"--level must be a pyramid level >= 0, got {self.level}")
        if self.crop not in ("auto", "none"):
            raise InputError(f"--crop must be auto or none, got {self.crop!r}")
        if self.devices is not None and self.devices < 1:
            raise InputError(f"--devices must be a positive number of processes, got {self.devices}")
        if self.num_nodes < 1:
            raise InputError(f"--num-nodes must be positive, got {self.num_nodes}")
        check_launcher(self.num_nodes)
        if self.num_workers < 0:
            raise InputError(f"--num-workers must be >= 0, got {self.num_workers}")
        for name in self.output_formats:
            output_format(name)
        if self.seg_uids:
            _check_seg_uids(self.seg_uids)
        if self.uncertainty is not None and self.uncertainty not in UNCERTAINTY_KINDS:
            raise InputError(f"--uncertainty must be one of {', '.join(UNCERTAINTY_KINDS)}, got {self.uncertainty!r}")
        if not 0.0 <= self.uncertainty_threshold < 1.0:
            raise InputError(f"--uncertainty-threshold must lie in [0, 1) (uncertainty normalised by its maximum), got {self.uncertainty_threshold}")

    def provenance(self) -> dict:
        """The options that shape the outputs, as recorded with them; the uncertainty's only
        when one is asked for (the threshold shapes nothing else), and a task's own options only
        where it declares some, so that folders written before either existed still resume."""
        recorded = {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("shapes_outputs")}
        if self.uncertainty is None:
            del recorded["uncertainty"], recorded["uncertainty_threshold"]
        if not self.extra:
            del recorded["extra"]
        else:
            recorded["extra"] = dict(self.extra)
        return recorded

    def apply(self, inference: dict) -> dict:
        """A checkpoint's ``inference`` settings with this run's ``tta``, ``overlap`` and
        ``uncertainty``."""
        return {**inference, "tta": self.tta, **({"overlap": self.overlap} if self.overlap is not None else {}),
                **({"uncertainty": self.uncertainty} if self.uncertainty is not None else {})}


@dataclass(frozen=True)
class BundleParts:
    """What a MONAI Bundle of a checkpoint (``hsmla-med export --format bundle``) holds that is
    its task's own; :mod:`hsmla_med.export.bundle` writes the rest around it (the network items,
    the run, the train config, the metadata's schema and versions). A task whose card declares
    ``bundle`` returns them from :meth:`Task.bundle`.

    Attributes:
        imports: the imports of ``configs/inference.json`` beyond the common ones.
        inference: the window's spatial size -> the items of ``configs/inference.json`` from
            ``datalist`` to ``postprocessing``, in order: what ``infer`` does, as MONAI config.
        written: what the run's last log line counts, e.g. ``case(s) segmented; labels``.
        description: ``configs/metadata.json``'s description.
        image: the metadata's input ``image`` entry (type, format, modality, channels), to which
            the window's shape and dtype are added.
        packages: the packages beyond MONAI and PyTorch that the inference imports, each with the
            module whose ``__version__`` is its version (``{"pillow": "PIL"}``); ``hsmla-med``
            is added where ``needs_hsmla``.
        needs_hsmla: whether ``configs/inference.json`` imports ``hsmla_med``.
        inputs: the README's words for what the bundle reads.
        outputs: the README's words for what the bundle writes.
        recipe: what the training recipe of ``configs/train.json`` sets beyond the checkpoint's
            recorded sections (a section's keys are merged into it).
    """

    imports: list[str]
    inference: Callable[[Sequence[int]], dict]
    written: str
    description: str
    image: dict
    packages: dict[str, str]
    needs_hsmla: bool
    inputs: str
    outputs: str
    recipe: dict[str, Any] = field(default_factory=dict)


class Task(ABC):
    """One benchmark pipeline.

    Class attributes: ``name`` (the ``--task`` value and ``config["task"]``), ``module_class``
    (its LightningModule) and ``in_channels``; what the help says of it and what it supports
    is its card (:attr:`card`, its :data:`~hsmla_med.pipelines.CARDS` entry).

    A subclass that does not define one of :data:`MODULE_FUNCTIONS` gets the function of that
    name in its own module (``predict``: the module's ``infer``), so a pipeline module keeps
    its steps as plain functions that tests and scripts call directly.
    """

    MODULE_FUNCTIONS: ClassVar[dict[str, str]] = {
        "datalist": "datalist", "datamodule": "datamodule", "module_config": "module_config", "held_out": "held_out", "predict": "infer",
        "score_predictions": "score_predictions", "crossval_score": "crossval_score", "bundle": "bundle",
    }

    def __init_subclass__(cls, **kwargs) -> None:
        # runs inside type.__new__, before ABCMeta collects what is still abstract
        super().__init_subclass__(**kwargs)
        module = sys.modules[cls.__module__]
        for method, function in Task.MODULE_FUNCTIONS.items():
            if method not in cls.__dict__ and callable(getattr(module, function, None)):
                setattr(cls, method, staticmethod(getattr(module, function)))

    name: ClassVar[str]
    module_class: ClassVar[type[GatedModule]]
    in_channels: ClassVar[int]
    #: the key of a case dict (:class:`~hsmla_med.data.datalist.Datalist`) that :meth:`predict` takes
    input_key: ClassVar[str] = "image"
    #: whether :meth:`predict` applies ``options.postprocessing`` (``postprocessing.json``) to its label maps
    postprocesses: ClassVar[bool] = False

    @property
    def card(self) -> TaskCard:
        """What the task declares: its help texts and capabilities."""
        return CARDS[self.name]

    @abstractmethod
    def datalist(self, config: dict) -> Datalist:
        """The cases of ``config["data"]``: the user's folder or the synthetic default."""

    @abstractmethod
    def datamodule(self, config: dict, cases: Datalist) -> L.LightningDataModule:
        """Training and validation data of ``cases`` with the task's transforms."""

    @abstractmethod
    def module_config(self, config: dict, model: dict, label_names: list[str]) -> dict:
        """The hyper-parameters of :attr:`module_class`: everything a checkpoint needs to rebuild
        the module and to prepare new inputs as in training (its ``data`` section)."""

    @abstractmethod
    def held_out(self, cases: Datalist) -> list:
        """The inputs ``demo`` runs :meth:`predict` on after training, each one ``inputs`` value."""

    @abstractmethod
    def predict(self, module: GatedModule, inputs, output: str | Path, options: InferenceOptions) -> list[Path]:
        """Run ``module`` on ``inputs`` (a file, a folder or a list of them) and write the task's
        outputs into ``output``; returns the written paths."""

    def score_predictions(self, predictions: Path, labels: Path, output: Path, options: dict) -> dict:
        """``evaluate --predictions P --labels L``: score predictions of any tool in the task's
        native format against the reference files, write ``summary.json`` (and the task's other
        reports) into ``output`` and return it. ``options``: the command's task-specific options
        (``dataset_json``, ``nsd_tolerance``, ``excluded``, ``seriesuids``), ``None`` where not given.
        A task without a pipeline function ``score_predictions`` refuses."""
        raise InputError(f"--predictions with --task {self.name}: this task does not score predictions without a checkpoint")

    def bundle(self, config: dict) -> BundleParts:
        """``export --format bundle``: the parts of a MONAI Bundle of a checkpoint of this task
        (``config``: its hyper-parameters) that are the task's own; an
        :class:`~hsmla_med.errors.InputError` for a checkpoint the bundle cannot run. A task
        without a pipeline function ``bundle`` (its card declares no ``bundle``) refuses."""
        raise InputError(f"--format bundle: task {self.name} has no volume or frame output; bundles are written for {', '.join(tasks_with('bundle'))}")

    def evaluation_outputs(self, module: GatedModule, output: Path, options: dict) -> None:
        """Before ``evaluate --checkpoint``: set ``module`` up to keep what this task keeps of its
        validation in ``output`` (``options``: the command's ``nsd_tolerance`` and
        ``save_probabilities``, ``None``/False where not given); by default nothing."""

    def evaluation_reports(self, module: GatedModule, output: Path) -> list[Path]:
        """After ``evaluate --checkpoint``, on the first process: the per-case reports of the
        validation ``module`` ran, written into ``output``; by default none."""
        return []

    def crossval_score(self, folds: list[tuple[Datalist, Path]], output: Path, config: dict) -> dict | None:
        """``cross-validate``: score every fold's validation predictions together. ``folds``:
        per fold its cases and the folder :meth:`predict` wrote its validation cases into. A
        task pools them into ``output`` (links, merged CSVs) and scores them with
        :meth:`score_predictions`, which writes ``output/summary.json``; ``None`` (no pipeline
        function ``crossval_score``): the folds' own validation summaries are averaged instead."""
        return None

    def score_lines(self, summary: dict, output: Path) -> list[str]:
        """What ``evaluate --predictions`` prints after :meth:`score_predictions`."""
        cases = summary.get("metric_per_case")
        means = summary.get("foreground_mean") or {}
        fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
        return [f"{len(cases) if cases is not None else 'n/a'} cases; " + ", ".join(f"{k} {fmt(v)}" for k, v in means.items() if not isinstance(v, dict)),
                f"summary: {output / 'summary.json'}"]

    def inference_values(self, values: dict, checkpoints: Sequence[str | Path], progress: Callable[[str], None] = print) -> dict:
        """:class:`InferenceOptions` keyword arguments of the values of the ``infer`` options the
        task declares on its card (by ``dest``): ``series_rules`` read from its file, the
        post-processing of a task that post-processes its label maps (``--postprocessing F``, else
        the ``postprocessing.json`` beside the checkpoints; ``none``: none), and the values no
        field holds as ``extra``."""
        from hsmla_med.config import load_yaml

        values = dict(values)
        if values.get("series_rules"):
            values["series_rules"] = load_yaml(values["series_rules"])
        if self.postprocesses:
            values["postprocessing"] = self._postprocessing(values.get("postprocessing"), checkpoints, progress)
        known = {f.name for f in fields(InferenceOptions)}
        extra = {k: v for k, v in values.items() if k not in known}
        return {**{k: v for k, v in values.items() if k in known}, **({"extra": extra} if extra else {})}

    def _postprocessing(self, given: str | None, checkpoints: Sequence[str | Path], progress: Callable[[str], None]) -> list[dict] | None:
        """The kept steps of ``--postprocessing F``, or of the ``postprocessing.json`` beside the
        checkpoints (``none``: no post-processing)."""
        from hsmla_med.inference.postprocessing import beside_checkpoints, read_postprocessing

        if given == "none":
            return None
        path = Path(given) if given is not None else beside_checkpoints(checkpoints)
        if path is None:
            return None
        steps = read_postprocessing(path)
        progress(f"post-processing ({path}): " + ("; ".join(f"largest connected component of classes {s['labels']}" for s in steps) or "none kept"))
        return steps or None

    def load(self, checkpoint: str | Path | Sequence[str | Path], tta: bool = False) -> tuple[GatedModule, dict]:
        """The module of a checkpoint of this task (``weights_only=True``), in eval mode on the
        CPU, with ``tta`` for its validation; a checkpoint of another task is refused with a
        :class:`~hsmla_med.errors.DataError` naming both. Returns it and the checkpoint's
        ``epoch``/``step``.

        Several checkpoints: their ensemble (:func:`~hsmla_med.inference.ensemble.ensemble`, the
        float32 mean of their probabilities; members of other labels, dims or data preparation
        are refused), with ``members``: each one's ``checkpoint``, ``epoch`` and ``step``."""
        from hsmla_med.engine.run import load_module
        from hsmla_med.inference.ensemble import ensemble

        paths = [checkpoint] if isinstance(checkpoint, (str, Path)) else list(checkpoint)
        modules, metas = [], []
        for path in paths:
            module, meta = load_module(path, self.module_class, task=self.name, inference={"tta": tta})
            module.checkpoint_path = str(path)  # named in the provenance of its outputs
            modules.append(module)
            metas.append(meta)
        if len(modules) == 1:
            return modules[0], metas[0]
        return ensemble(modules), {"members": [{"checkpoint": str(p), **m} for p, m in zip(paths, metas, strict=True)]}

    def build_module(self, config: dict, cases: Datalist) -> GatedModule:
        """The module of a new run, its network the config's ``model`` resolved here, once
        (:func:`~hsmla_med.config.model_config`; the module builds it from that record); its
        checkpoints keep the fold it trains on (``split``: :func:`~hsmla_med.data.splits.fold_cases`'
        record, with the case IDs of both sides) and the plan of the dataset (``plan``:
        :func:`~hsmla_med.data.plans.plan_dataset`, ``None`` for a task or config without one).
        A ``norm`` the user set that the network would not be built with is refused
        (:func:`~hsmla_med.config.check_model_settings`)."""
        module = self.module_config(config, model_config(config["model"]), cases.label_names)
        check_model_settings(config, module["network"], cases.plan)
        return self.module_class({**module, **self.dataset_config(cases), "split": cases.split, "plan": cases.plan})

    def dataset_config(self, cases: Datalist) -> dict:
        """What a new module's config takes from the dataset beyond its label names (a task
        whose datasets vary in input channels or label kinds); by default nothing."""
        return {}

    def evaluation_config(self, config: dict, module: GatedModule) -> dict:
        """``config`` with the data preparation of ``module``'s training (a checkpoint is
        evaluated on data prepared exactly as it was trained on), and the fold it trained on
        (its splits file too, where it still exists and ``data.splits_file`` is not set). The
        split's cases (``trained_split``) tell its dataset from another one, which is scored on
        its own held-out cases (:func:`~hsmla_med.data.splits.fold_cases`)."""
        data = {**config["data"], **module.config["data"]}
        split = module.config.get("split") or {}
        if not data.get("splits_file") and split.get("file") and Path(split["file"]).is_file():
            data["splits_file"] = split["file"]
        fold = split.get("fold")
        return {**config, "data": data, "fold": config["fold"] if fold is None else fold, "trained_split": split,
                "mode": {2: "2d", 3: "3d"}[module.config["spatial_dims"]]}

    def summary_lines(self, summary: dict) -> list[str]:
        """The validation summary as printed after training and evaluation."""
        fmt = lambda v: "n/a" if v is None else f"{v:.4g}"  # noqa: E731
        scalars = [f"{k} {fmt(v)}" for k, v in summary.items() if not isinstance(v, dict) and k != "cases"]
        lines = [f"{'   '.join(scalars)}   ({summary.get('cases')} validation items)"]
        titles = {"dice": "Dice", "hd95": "HD95", "nsd": "NSD", "iou": "IoU"}
        per_class = [k for k in titles if f"{k}_per_class" in summary]
        for name in summary[f"{per_class[0]}_per_class"] if per_class else []:
            lines.append(f"  {name:<26} " + "   ".join(f"{titles[k]} {fmt(summary[f'{k}_per_class'][name])}" for k in per_class))
        if summary.get(GATE_REFINED):
            lines.append("tiles refined per gated layer: " + ", ".join(f"{name} {share:.2f}" for name, share in summary[GATE_REFINED].items()))
        return lines
