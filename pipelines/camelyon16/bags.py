"""The bags of slide-label training: each slide's patch features and coordinates as CLAM's h5
files hold them (``hsmla-med wsi-features``: ``FEATS/h5_files/<slide>.h5``), the slides'
labels and splits from a label CSV, and the LightningDataModule that serves the bags (CLAM's
``Generic_MIL_Dataset``, one bag per item)."""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from hsmla_med.data.slides import SLIDE_SUFFIXES
from hsmla_med.errors import DataError, InputError
from hsmla_med.pipelines.camelyon16.writers import FEATURES_H5

__all__ = ["LABEL_WORDS", "SPLITS", "Bag", "BagDataModule", "feature_files", "held_out", "load_bags", "read_bag", "read_slide_labels",
           "training_statistics"]

log = logging.getLogger("hsmla_med")

#: label words of a label CSV, case-insensitively (CAMELYON16's reference.csv: Tumor, Normal)
LABEL_WORDS = {"0": 0, "1": 1, "normal": 0, "tumor": 1, "tumour": 1}
SPLITS = ("train", "test")


@dataclass
class Bag:
    """One slide's bag: ``file`` its h5, ``patches`` and ``dim`` the shape of its ``(N, D)``
    features (read when served, not held), ``label`` (1 tumour) and ``split`` (``train``,
    ``test`` or ``None``: the label CSV's)."""

    slide: str
    label: int
    split: str | None
    file: Path
    patches: int
    dim: int
    attrs: dict = field(default_factory=dict)  # the attributes of coords (patch_level, patch_size, downsample, ...)


def _slide_name(name: str) -> str:
    """A slide's name as the feature files name it: a slide file's extension dropped."""
    return Path(name).stem if Path(name).suffix.lower() in SLIDE_SUFFIXES else name


def read_slide_labels(path: str | Path) -> list[dict]:
    """The slides of a label CSV: ``[{"slide", "label", "split"}]`` in the file's order.

    Two layouts: CAMELYON16's ``reference.csv`` (no header; ``test_001,Tumor,Micro`` /
    ``test_002,Normal``) and CLAM's, with a header naming ``slide_id`` and ``label`` (other
    columns, e.g. ``case_id``, ignored) and optionally ``split`` (``train`` / ``test``). A label
    is 0 or 1, or ``normal`` / ``tumor`` (``tumour``) in any case; 1 is tumour.

    Raises:
        DataError: naming the file (and line) of a missing file, an empty table, a header
            without ``slide_id`` or ``label``, a label or split outside those, or a slide
            listed twice.
    """
    path = Path(path)
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            rows = [(number, row) for number, row in enumerate(csv.reader(f), 1) if any(cell.strip() for cell in row)]
    except FileNotFoundError:
        raise DataError(f"{path}: label CSV not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: cannot read the label CSV ({err})") from None
    if not rows:
        raise DataError(f"{path}: the label CSV lists no slide")
    header = [cell.strip().lower() for cell in rows[0][1]]
    if "slide_id" in header or "label" in header:
        missing = [name for name in ("slide_id", "label") if name not in header]
        if missing:
            raise DataError(f"{path}: the header has no {' or '.join(missing)} column (CLAM's layout: slide_id,label[,split])")
        slide_at, label_at, split_at = header.index("slide_id"), header.index("label"), header.index("split") if "split" in header else None
        rows = rows[1:]
    else:  # CAMELYON16's reference.csv
        slide_at, label_at, split_at = 0, 1, None
    slides, seen = [], set()
    for number, row in rows:
        cells = [cell.strip() for cell in row]
        if len(cells) <= max(slide_at, label_at, split_at or 0):
            raise DataError(f"{path}: line {number}: expected a slide and its label, got {','.join(cells)!r}")
        slide, word = _slide_name(cells[slide_at]), cells[label_at].lower()
        if word not in LABEL_WORDS:
            raise DataError(f"{path}: line {number}: label {cells[label_at]!r} of slide {slide} is not 0, 1, normal or tumor")
        split = cells[split_at].lower() or None if split_at is not None else None
        if split not in (None, *SPLITS):
            raise DataError(f"{path}: line {number}: split {cells[split_at]!r} of slide {slide} is not {' or '.join(SPLITS)}")
        if slide in seen:
            raise DataError(f"{path}: line {number}: slide {slide} is listed twice")
        seen.add(slide)
        slides.append({"slide": slide, "label": LABEL_WORDS[word], "split": split})
    return slides


def held_out(slides: list[dict]) -> list[str]:
    """The held-out slides of a label CSV's rows (:func:`read_slide_labels`): those of split
    ``test`` where the CSV has a split column; else CAMELYON16's own test set, the slides named
    ``test_*``; else none (the folds of the training slides decide)."""
    if any(s["split"] is not None for s in slides):
        return [s["slide"] for s in slides if s["split"] == "test"]
    return [s["slide"] for s in slides if s["slide"].lower().startswith("test_")]


def feature_files(features: str | Path) -> Path:
    """The folder of a feature folder's h5 files: ``FEATS/h5_files`` (CLAM's layout, as
    ``wsi-features`` writes it), else ``FEATS`` itself when it holds h5 files."""
    root = Path(features)
    if (root / FEATURES_H5).is_dir():
        return root / FEATURES_H5
    if root.is_dir() and any(root.glob("*.h5")):
        return root
    raise DataError(f"{root}: no feature files ({FEATURES_H5}/<slide>.h5, as hsmla-med wsi-features writes them)")


def read_bag(path: Path, coords: bool = False) -> tuple[torch.Tensor, np.ndarray | None]:
    """A bag's features ``(N, D)`` float32 and, with ``coords``, its int64 ``(N, 2)`` level-0
    x, y patch corners."""
    import h5py  # here: only slide-label training reads HDF5

    with h5py.File(path, "r") as f:
        return torch.from_numpy(np.asarray(f["features"][:], np.float32)), np.asarray(f["coords"][:], np.int64) if coords else None


def _describe(path: Path) -> tuple[int, int, dict]:
    """The patches, width and ``coords`` attributes of the h5 at ``path``, checked: one line
    naming it when it is no CLAM feature file or an empty bag."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            if not {"features", "coords"} <= set(f):
                raise DataError(f"{path}: no features and coords datasets (CLAM's h5 layout)")
            shape, where = f["features"].shape, f["coords"].shape
            attrs = {k: v.tolist() if isinstance(v, np.ndarray) else v.item() if isinstance(v, np.generic) else v
                     for k, v in f["coords"].attrs.items()}
    except OSError as err:
        raise DataError(f"{path}: not a readable HDF5 feature file ({err})") from None
    if len(shape) != 2 or where != (shape[0], 2):
        raise DataError(f"{path}: features {shape} and coords {where}: expected (N, D) and (N, 2)")
    if shape[0] == 0:
        raise DataError(f"{path}: an empty bag (0 patches): its slide had no tissue patch; leave the slide out of the label CSV")
    return shape[0], shape[1], attrs


def load_bags(features: str | Path, slides: list[dict], labels: str | Path) -> list[Bag]:
    """The bags of ``slides`` (:func:`read_slide_labels`'s rows of the file ``labels``) from the
    feature folder ``features`` (:func:`feature_files`), described, not loaded.

    Raises:
        DataError: one line naming the file: a slide of the label CSV without a feature file, a
            file that is no CLAM feature file, an empty bag, or features of another width than
            the first slide's.
    """
    folder = feature_files(features)
    bags = []
    for row in slides:
        path = folder / f"{row['slide']}.h5"
        if not path.is_file():
            raise DataError(f"{labels}: slide {row['slide']} has no features ({path} not found)")
        patches, dim, attrs = _describe(path)
        if bags and dim != bags[0].dim:
            raise DataError(f"{path}: {dim} features per patch, but {bags[0].file} has {bags[0].dim}: the bags come from different encoders")
        bags.append(Bag(row["slide"], row["label"], row["split"], path, patches, dim, attrs))
    if not bags:
        raise DataError(f"{labels}: the label CSV lists no slide")
    return bags


def training_statistics(bags: list[Bag]) -> torch.Tensor:
    """The features of every training patch, ``(n, D)``: what the module's standardisation is
    fitted on (mean and standard deviation per dimension)."""
    return torch.cat([read_bag(bag.file)[0] for bag in bags])


class _Bags(Dataset):
    """The bags as items ``{"features": (N, D), "label", "slide"}``, read from their h5 when
    served; in training a bag is subsampled (seeded by ``seed``, the item and how often it was
    served): ``patch_dropout`` of its patches left out at random, and at most ``max_patches``
    kept."""

    def __init__(self, bags: list[Bag], train: bool, max_patches: int, patch_dropout: float, seed: int) -> None:
        self.bags, self.train, self.max_patches, self.patch_dropout, self.seed = bags, train, max_patches, patch_dropout, seed
        self.served = [0] * len(bags)

    def __len__(self) -> int:
        return len(self.bags)

    def __getitem__(self, index: int) -> dict:
        bag = self.bags[index]
        features = read_bag(bag.file)[0]
        if self.train:
            rng = np.random.default_rng([self.seed, index, self.served[index]])
            self.served[index] += 1
            keep = min(self.max_patches, max(1, round(len(features) * (1 - self.patch_dropout))))
            if keep < len(features):
                features = features[np.sort(rng.choice(len(features), keep, replace=False))]
        return {"features": features, "label": bag.label, "slide": bag.slide}


def _collate(items: list[dict]) -> dict:
    """Bags of any sizes side by side: a list of ``(N_i, D)`` tensors, not one padded tensor."""
    return {"features": [i["features"] for i in items], "label": torch.tensor([i["label"] for i in items], dtype=torch.float32),
            "slide": [i["slide"] for i in items]}


class BagDataModule(L.LightningDataModule):
    """Training and validation bags (CLAM's bags, one slide each), ``batch_size`` bags per
    training step, shuffled by a generator seeded with ``seed``; validation one bag at a time,
    whole.

    Args:
        training, validation: the bags (:func:`load_bags`).
        batch_size: bags per training step.
        max_patches: a training bag of more patches is subsampled to this many.
        patch_dropout: share of a training bag's patches left out at each step.
        seed: of the shuffle and the subsampling (in the main process: a loader worker's count
            of the draws would start again every epoch).
    """

    def __init__(self, training: list[Bag], validation: list[Bag], batch_size: int = 1, max_patches: int = 4096, patch_dropout: float = 0.0,
                 seed: int = 0) -> None:
        super().__init__()
        if not validation:
            raise InputError("slide-label training needs validation slides (the fold's, or the held-out ones)")
        self.training, self.validation = training, validation
        self.batch_size, self.max_patches, self.patch_dropout, self.seed = batch_size, max_patches, patch_dropout, seed

    def train_dataloader(self) -> DataLoader:
        if not self.training:
            raise DataError("slide-label training has no training slides")
        return DataLoader(_Bags(self.training, True, self.max_patches, self.patch_dropout, self.seed), batch_size=self.batch_size, shuffle=True,
                          generator=torch.Generator().manual_seed(self.seed), collate_fn=_collate)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_Bags(self.validation, False, self.max_patches, 0.0, self.seed), batch_size=1, collate_fn=_collate)
