"""``hsmla-med cross-validate``: every fold of ``splits_final.json`` trained, its validation cases
predicted, and the pooled validation scored, as nnU-Net's default workflow does.

Layout of the run folder (``--output``), after nnU-Net's::

    fold_K/                     a training run (last.ckpt, best.ckpt, metrics.json, logs ...)
    fold_K/validation/          fold K's validation cases predicted by fold K's last.ckpt
                                (label maps in the input geometry and, for volumes,
                                <case>.npz with key "probabilities", float16, classes first)
    crossval/predictions/       every fold's validation predictions, pooled (hard links)
    crossval/labels/            their reference label maps (links to the dataset's files)
    crossval/summary.json       the pooled per-case report (hsmla_med.metrics.summary)
    postprocessing.json         the post-processing chosen on the pooled predictions
    crossval.json               per fold: cases, its validation summary, seconds

The validation predictions come from ``last.ckpt``, as nnU-Net's from its final checkpoint:
``best.ckpt`` is chosen on the same validation cases and would flatter them. Resumable: a fold
whose ``validation`` folder is complete is skipped, a fold with a ``last.ckpt`` is resumed.

The pooled scoring is the task's own (``Task.crossval_score``: BTCV's folder evaluator, LUNA16's
official FROC over the pooled submission, EndoVis's frame evaluation, CAMELYON16's lesion FROC
and slide AUC); a task without one gets the mean of its folds' validation summaries.
Post-processing is chosen for tasks that apply it (BTCV).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from hsmla_med.io import write_json

__all__ = ["cross_validate", "pool_file"]

log = logging.getLogger("hsmla_med")

_DONE = ".complete"  # written into fold_K/validation once every validation case is predicted


def pool_file(source: Path, target: Path) -> None:
    """``target`` (in a pooled folder) as a link to ``source``, replacing an older one: a hard
    link where it can be (the pooled folder stays valid when a fold's folder moves), else a
    symbolic one (a dataset on another file system)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError:
        target.symlink_to(Path(source).resolve())


def _fold(task, config: dict, k: int, train: Callable[[dict, bool], dict], options) -> dict:
    """Train fold ``k`` (resuming a started one) and predict its validation cases."""
    folder = Path(config["output"]) / f"fold_{k}"
    validation = folder / "validation"
    cases = task.datalist({**config, "fold": k})
    if (validation / _DONE).is_file():
        log.info("fold %d: done before (%s)", k, validation)
        return {"fold": k, "cases": cases.split["val"], "skipped": True}
    started = time.perf_counter()
    summary = train({**config, "fold": k, "output": str(folder)}, (folder / "last.ckpt").is_file())
    module, _ = task.load(folder / "last.ckpt")
    task.predict(module, [c[task.input_key] for c in cases.validation], validation, options)
    (validation / _DONE).write_text("")
    return {"fold": k, "cases": cases.split["val"], "validation": summary, "seconds": round(time.perf_counter() - started, 1)}


def _pool(task, config: dict, folds: list[int], root: Path) -> dict | None:
    """Every fold's validation predictions scored together by the task
    (:meth:`~hsmla_med.pipelines.task.Task.crossval_score`) into ``crossval/``; ``None`` for a
    task without pooled scoring."""
    done = [(task.datalist({**config, "fold": k}), root / f"fold_{k}" / "validation") for k in folds]
    return task.crossval_score(done, root / "crossval", config)


def cross_validate(task, config: dict, train: Callable[[dict, bool], dict], options, folds: list[int] | None = None,
                   progress: Callable[[str], None] = print) -> dict:
    """Run the folds of ``config`` (all, or ``folds``) into ``config["output"]`` and score the
    pooled validation; returns ``crossval.json``'s document.

    Args:
        task: a :class:`~hsmla_med.pipelines.task.Task`.
        config: the validated task config; ``output`` is the cross-validation folder.
        train: ``train(config, resume)`` runs one training (the command line's, which prints
            its summary) and returns the final validation summary.
        options: the :class:`~hsmla_med.pipelines.task.InferenceOptions` of the validation
            predictions.
        folds: the folds to run (default: all of the splits file).
    """
    root = Path(config["output"])
    count = task.datalist({**config, "fold": 0}).split["folds"]  # makes splits_final.json on first use
    wanted = list(range(count)) if folds is None else folds
    bad = [k for k in wanted if not 0 <= k < count]
    if bad:
        from hsmla_med.errors import InputError

        raise InputError(f"--folds {bad}: the splits have folds 0..{count - 1}")
    started = time.perf_counter()
    runs = []
    for k in wanted:
        progress(f"cross-validation: fold {k} of 0..{count - 1}")
        runs.append(_fold(task, config, k, train, options))
    report = {"task": task.name, "folds": runs, "seconds": round(time.perf_counter() - started, 1)}
    if sorted(wanted) == list(range(count)):
        summary = _pool(task, config, wanted, root)
        if summary is not None:
            report["pooled"] = {"summary": str(root / "crossval" / "summary.json"), "foreground_mean": summary.get("foreground_mean")}
            report["postprocessing"] = _postprocessing(task, root, task.datalist({**config, "fold": 0}).source)
        else:
            report["pooled"] = _mean_of_folds(root, wanted)
    write_json(root / "crossval.json", report)
    return report


def _postprocessing(task, root: Path, dataset_json: Path | None) -> str | None:
    """``postprocessing.json`` chosen on the pooled predictions (``crossval/predictions`` and
    ``crossval/labels``), for tasks that apply one."""
    if not task.postprocesses:
        return None
    from hsmla_med.inference.postprocessing import choose_postprocessing

    path = root / "postprocessing.json"
    choose_postprocessing(root / "crossval" / "predictions", root / "crossval" / "labels", path, dataset_json)
    return str(path)


def _mean_of_folds(root: Path, folds: list[int]) -> dict:
    """Each scalar of the folds' final validation summaries (``fold_K/metrics.json``), averaged
    over the folds: the pooled figure of tasks without per-case folder scoring."""
    import json

    scores: dict[str, list[float]] = {}
    for k in folds:
        metrics = json.loads((root / f"fold_{k}" / "metrics.json").read_text())
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("cases", "epoch", "step"):
                scores.setdefault(key, []).append(float(value))
    return {"mean_of_folds": {key: sum(values) / len(values) for key, values in scores.items()}}
