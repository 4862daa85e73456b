"""Cross-validation splits that persist: nnU-Net's ``splits_final.json``.

The file is a JSON list with one ``{"train": [case IDs], "val": [case IDs]}`` per fold, exactly
as nnU-Net v2 writes and reads it, so a split made by either tool (or edited by hand) is used by
both. It is made once, seeded, on first use (:func:`fold_cases`) and read from then on: training,
``evaluate`` and ``cross-validate`` see the same folds whatever their ``--seed``.

Where it lives: ``data.splits_file`` when set; else beside the dataset (the folder of its
dataset JSON, slides or videos), where nnU-Net keeps it in its preprocessed folder; else, when
that folder is read-only, in the run's output folder.

How folds are drawn (:func:`make_splits`): the units of a split are groups of cases that must
stay together (an EndoVis video, a LUNA16 ``subsetK``; by default each case alone); a fold
given by the data (a dataset JSON's ``validation`` list, the official LUNA16 subsets) is kept;
the other units are shuffled with the seed and dealt round robin, one class after the other
where classes are given (CAMELYON16 tumour/normal), so each fold gets its share of each class.
nnU-Net draws its folds with scikit-learn's ``KFold``; the cases differ, the format does not.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from hsmla_med.data.datalist import Datalist, case_name
from hsmla_med.errors import ConfigError, DataError

__all__ = ["SPLITS_FILE", "make_splits", "read_splits", "fold_cases", "fold_datalist", "other_dataset"]

SPLITS_FILE = "splits_final.json"

log = logging.getLogger("hsmla_med")


def make_splits(
    ids: Sequence[str],
    folds: int,
    seed: int,
    groups: Sequence[str] | None = None,
    classes: Sequence | None = None,
    fixed: dict[str, int] | None = None,
) -> list[dict]:
    """Folds of ``ids``: ``[{"train": [...], "val": [...]}, ...]``, every case in exactly one
    ``val``, each list in the order of ``ids``.

    Args:
        ids: case IDs, unique.
        folds: number of folds wanted; fewer when there are fewer units than that (each fold
            needs one unit to hold out), never fewer than 2.
        seed: seed of the shuffle.
        groups: one per case: cases of a group always share a fold (default: each case alone).
        classes: one per case: units are dealt class by class, so every fold gets its share of
            each (a group takes its first case's class).
        fixed: ``{group: fold}`` for units whose fold the data gives (a dataset JSON's
            validation list as fold 0; the official LUNA16 subsets). With it, the other units
            fill the folds ``fixed`` leaves free, or are dealt over all folds when it uses all.
    """
    ids = [str(i) for i in ids]
    if len(set(ids)) != len(ids):
        raise ValueError("case IDs must be unique")
    groups = [str(g) for g in groups] if groups is not None else ids
    if len(groups) != len(ids) or (classes is not None and len(classes) != len(ids)):
        raise ValueError("groups and classes need one entry per case")
    fixed = dict(fixed or {})
    units = list(dict.fromkeys(groups))  # first-seen order: deterministic before the shuffle
    free = [u for u in units if u not in fixed]
    used = sorted(set(fixed.values()))
    if used and used != list(range(len(used))):
        raise ValueError(f"fixed folds must be 0..{len(used) - 1}, got {used}")
    # the free units fill the folds after the fixed ones, as many as wanted and as there are units;
    # when the fixed ones already make every fold wanted, the free units join them
    extra = min(folds - len(used), len(free))
    open_folds = list(range(len(used), len(used) + extra)) if extra > 0 else list(range(len(used)))
    first_class = {}
    for group, cls in zip(groups, classes if classes is not None else [None] * len(ids)):
        first_class.setdefault(group, cls)
    order = np.random.default_rng(seed).permutation(len(free))
    shuffled = [free[i] for i in order]
    # class by class, continuing the deal, so every fold gets its share of each class
    by_class: dict = {}
    for unit in shuffled:
        by_class.setdefault(first_class[unit], []).append(unit)
    fold_of = dict(fixed)
    position = 0
    for key in sorted(by_class, key=repr):
        for unit in by_class[key]:
            fold_of[unit] = open_folds[position % len(open_folds)]
            position += 1
    count = max(fold_of.values()) + 1 if fold_of else 0
    if count < 2:
        raise DataError(f"cannot make two folds of {len(units)} unit(s) ({len(ids)} cases): need at least two to hold one out")
    return [
        {"train": [i for i, g in zip(ids, groups) if fold_of[g] != k], "val": [i for i, g in zip(ids, groups) if fold_of[g] == k]}
        for k in range(count)
    ]


def read_splits(path: Path, ids: Sequence[str]) -> list[dict]:
    """The folds of ``path`` (nnU-Net's format), checked against the dataset's case ``ids``: a
    :class:`DataError` naming the file if it is not a list of ``{"train", "val"}`` lists of
    strings, names a case the dataset lacks, or leaves a case out of a fold."""
    import json

    try:
        splits = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: cannot read the splits ({err})") from None
    shape_ok = isinstance(splits, list) and splits and all(
        isinstance(s, dict) and all(isinstance(s.get(k), list) and all(isinstance(i, str) for i in s[k]) for k in ("train", "val"))
        for s in splits)
    if not shape_ok:
        raise DataError(f"{path}: expected nnU-Net's splits format, a list of {{\"train\": [case IDs], \"val\": [case IDs]}} per fold")
    known = set(ids)
    for k, split in enumerate(splits):
        unknown = sorted(set(split["train"] + split["val"]) - known)
        if unknown:
            raise DataError(f"{path}: fold {k} names {len(unknown)} case(s) the dataset does not have: {', '.join(unknown[:5])}"
                            + (" ..." if len(unknown) > 5 else "") + "; it is the record of what models trained with it used: correct it, "
                            "or set data.splits_file to a new path to split this dataset again")
        overlap = sorted(set(split["train"]) & set(split["val"]))
        if overlap:
            raise DataError(f"{path}: fold {k} has case(s) in both train and val: {', '.join(overlap[:5])}")
    return splits


def _writable(folder: Path) -> bool:
    return folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)


def beside_dataset(config: dict, dataset_dir: Path, name: str) -> Path:
    """Where a file made from a dataset is kept: beside the dataset, else (a read-only
    dataset) in the run folder, as nnU-Net keeps its files per dataset."""
    beside = dataset_dir / name
    if beside.is_file() or _writable(dataset_dir):
        return beside
    return Path(config["output"]) / name


def _location(config: dict, dataset_dir: Path) -> Path:
    """``data.splits_file``, else :func:`beside_dataset`."""
    chosen = config["data"].get("splits_file")
    return Path(chosen).expanduser() if chosen else beside_dataset(config, dataset_dir, SPLITS_FILE)


def other_dataset(config: dict, ids: Sequence[str]) -> bool:
    """Whether ``config`` scores a checkpoint on a dataset other than the one it trained on:
    ``config["trained_split"]`` (the split record a checkpoint keeps, set by ``evaluate`` and
    ``calibrate``) names a case the dataset of ``ids`` lacks. Its splits file then says nothing
    about this dataset (another site's scans, in their own folder)."""
    trained = config.get("trained_split") or {}
    named = set(trained.get("train") or []) | set(trained.get("val") or [])
    return bool(named) and not named <= set(ids)


def fold_cases(
    config: dict,
    dataset_dir: Path,
    cases: Sequence,
    ids: Sequence[str],
    synthetic: bool = False,
    groups: Sequence[str] | None = None,
    classes: Sequence | None = None,
    fixed: dict[str, int] | None = None,
    held_out: Sequence[str] = (),
    fixed_option: str | None = None,
) -> tuple[list, list, dict]:
    """Training and validation cases of fold ``config["fold"]``, from the splits file (made now,
    with ``config["data"]["folds"]`` folds and ``config["seed"]``, when it does not exist).

    ``ids`` (and ``groups``, ``classes``, ``fixed``, see :func:`make_splits`) describe
    ``cases``, one each. A file that no longer fits the dataset is an error naming it, except
    for the synthetic default data (``synthetic``), whose cases change with its settings: its
    splits are then made again. Returns ``(training, validation, record)``; ``record`` is what
    a checkpoint keeps: ``{"file", "fold", "folds", "train", "val"}``.

    ``fixed_option``: the option ``fixed`` comes from (``data.validation_videos``). An existing
    file that holds out other units in those folds than the option names is then refused, naming
    both (the synthetic default's splits are made again), rather than the option being ignored;
    a dataset's own validation list (``fixed`` without an option) yields to a splits file, as
    nnU-Net's ``splits_final.json`` rules.

    A checkpoint scored on another dataset (:func:`other_dataset`) is scored on the cases that
    dataset holds out itself (``held_out``: the IDs of a dataset JSON's validation list), else
    on all of them; no splits file is read or written, and the record names the dataset
    (``"file"`` and ``"fold"`` are ``None``). The checkpoint's training cases among them are
    refused by ID by the caller.
    """
    if other_dataset(config, ids):
        chosen = set(held_out) & set(ids) or set(ids)
        log.info("%s is not the dataset the checkpoint trained on (it lacks cases of its split): scoring %s (%d case(s))",
                 dataset_dir, "its validation list" if set(held_out) & set(ids) else "all its cases", len(chosen))
        record = {"file": None, "fold": None, "folds": None, "dataset": str(dataset_dir), "train": [], "val": sorted(chosen)}
        return [], [c for c, i in zip(cases, ids) if i in chosen], record
    path = _location(config, dataset_dir)
    fold, wanted = config["fold"], config["data"]["folds"]
    splits = None
    if path.is_file():
        try:
            splits = read_splits(path, ids)
            if synthetic and sorted(splits[0]["train"] + splits[0]["val"]) != sorted(ids):
                splits = None  # the synthetic data was generated again with other settings
        except DataError:
            if not synthetic:
                raise
        if splits is not None and fixed_option and fixed:
            differs = _fixed_differs(splits, fixed, ids)
            if differs and synthetic:
                splits = None
            elif differs:
                raise ConfigError(f"{fixed_option} {differs[0]}, but {path} holds out {differs[1]}: {fixed_option} is read only when "
                                  "the splits are made; set it to match the file, or set data.splits_file to a new path to split again")
        if splits is not None:
            log.debug("splits: %s (%d folds)", path, len(splits))
    if splits is None:
        from hsmla_med.io import write_json

        splits = make_splits(ids, wanted, config["seed"], groups, classes, fixed)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json(path, splits)
        except OSError as err:
            raise DataError(f"{path}: cannot write the splits ({err.strerror or err}); set data.splits_file to a writable path") from None
        log.info("splits: wrote %s (%d folds, seed %d)", path, len(splits), config["seed"])
    if not 0 <= fold < len(splits):
        raise ConfigError(f"--fold {fold}: {path} has folds 0..{len(splits) - 1}")
    val = set(splits[fold]["val"])
    train = set(splits[fold]["train"])
    training = [c for c, i in zip(cases, ids) if i in train]
    validation = [c for c, i in zip(cases, ids) if i in val]
    if not validation or not training:
        raise DataError(f"{path}: fold {fold} leaves no {'validation' if not validation else 'training'} case of this dataset")
    record = {"file": str(path), "fold": fold, "folds": len(splits), "train": sorted(train & set(ids)), "val": sorted(val & set(ids))}
    return training, validation, record


def _fixed_differs(splits: list[dict], fixed: dict[str, int], ids: Sequence[str]) -> tuple[str, str] | None:
    """Where a splits file's held-out units of the folds ``fixed`` uses are not those ``fixed``
    puts there: ``(what fixed holds out, what the file does)``, or ``None``. Units of no fixed
    fold may join a fixed fold only when the fixed folds are all the file's (make_splits)."""
    used = sorted(set(fixed.values()))
    for fold in used:
        want = {u for u, f in fixed.items() if f == fold}
        have = set(splits[fold]["val"]) & set(ids) if fold < len(splits) else set()
        if not want <= have or (have - want and len(splits) > len(used)):
            return (f"holds out {sorted(want)} in fold {fold}", f"{sorted(have)} there")
    return None


def fold_datalist(config: dict, cases: Datalist) -> Datalist:
    """A dataset JSON's cases (:func:`~hsmla_med.data.datalist.load_datalist`) as fold
    ``config["fold"]`` of :func:`fold_cases`: the case ID is the image's name without extension
    and channel suffix (nnU-Net's), and the JSON's ``validation`` list (BTCV's
    ``dataset_0.json``), if any, is fold 0."""
    labelled = cases.training + cases.validation
    ids = [case_name(c["image"]) for c in labelled]
    fixed = {case_name(c["image"]): 0 for c in cases.validation}
    training, validation, record = fold_cases(config, cases.source.parent, labelled, ids, cases.synthetic, fixed=fixed, held_out=list(fixed))
    return replace(cases, training=training, validation=validation, split=record)
