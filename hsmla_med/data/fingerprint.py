"""The dataset fingerprint, as nnU-Net's ``dataset_fingerprint.json`` records it.

nnU-Net plans every dataset from a few properties of its training cases: their voxel spacings,
their shapes after cropping to the non-zero region, and the intensities of the foreground (the
labelled voxels) per input channel. :func:`compute_fingerprint` measures the same from the
labelled cases of a :class:`~hsmla_med.data.datalist.Datalist`, each loaded as training loads it
(NIfTI or DICOM series, a SEG label read onto its series) and turned to RAS; the plan
(:mod:`hsmla_med.data.plans`) is derived from it. MONAI's ``DataAnalyzer`` (Auto3DSeg) measures
similar statistics, but in its own layout and without nnU-Net's fields, which are what users of
nnU-Net compare; hence this module.

The file keeps nnU-Net's keys and meanings, with two differences stated in it: spacings and
shapes are in RAS order ``(x, y, z)``, the order of ``data.spacing`` (nnU-Net's are SimpleITK's
``(z, y, x)``), and the foreground intensities are sampled without replacement (all of a case's
foreground voxels when it has at most its share), so that a small dataset's statistics are exact.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hsmla_med.data.datalist import Datalist
from hsmla_med.errors import DataError

__all__ = ["FINGERPRINT_FILE", "FINGERPRINT_VERSION", "compute_fingerprint", "case_properties", "intensity_properties", "case_ids"]

log = logging.getLogger("hsmla_med")

FINGERPRINT_FILE = "dataset_fingerprint.json"
FINGERPRINT_VERSION = 1  # bump when what is measured changes: older files are measured again
FOREGROUND_SAMPLES = 10_000_000  # nnU-Net's num_foreground_voxels_for_intensitystats, shared by the cases


def _loader(cases: Datalist):
    """Load a case as training does (:class:`~hsmla_med.data.checks.LoadCased`, checked by
    :class:`~hsmla_med.data.checks.CheckCased`: a bad volume is refused here as training would
    refuse it), in RAS."""
    from monai.transforms import Compose, Orientationd

    from hsmla_med.data.checks import CheckCased, LoadCased

    keys = ["image", "label"]
    return Compose([LoadCased(keys, ensure_channel_first=True, image_only=True, label_names=cases.label_names),
                    CheckCased(cases.channels, cases.num_classes, label_values=cases.label_values()),
                    Orientationd(keys, axcodes="RAS", labels=[["L", "R"], ["P", "A"], ["I", "S"]])])


def case_properties(image: np.ndarray, label: np.ndarray, spacing: Sequence[float], samples: int,
                    rng: np.random.Generator) -> dict:
    """One case's part of the fingerprint.

    Args:
        image: ``(C, x, y, z)`` intensities in RAS.
        label: ``(x, y, z)`` label map on the same grid; foreground is ``label > 0``.
        spacing: the voxel size in mm along ``x, y, z``.
        samples: at most this many foreground voxels are kept per channel (all of them when the
            case has no more; else drawn without replacement by ``rng``).

    Returns ``spacing``, ``shape_after_crop`` (the bounding box of the voxels that are non-zero
    in any channel: nnU-Net's crop), ``relative_size_after_crop`` and ``foreground`` (per channel,
    the sampled foreground intensities, float64)."""
    nonzero = np.any(image != 0, axis=0)
    if nonzero.any():
        box = [np.flatnonzero(nonzero.any(axis=tuple(a for a in range(3) if a != axis))) for axis in range(3)]
        cropped = [int(b[-1] - b[0] + 1) for b in box]
    else:
        cropped = list(image.shape[1:])  # an all-zero image keeps its shape, as nnU-Net's crop does
    foreground = np.flatnonzero(label.reshape(-1) > 0)
    if len(foreground) > samples:
        foreground = np.sort(rng.choice(foreground, samples, replace=False))
    return {"spacing": [float(s) for s in spacing], "shape_after_crop": cropped,
            "relative_size_after_crop": float(np.prod(cropped) / np.prod(image.shape[1:])),
            "foreground": [c.reshape(-1)[foreground].astype(np.float64) for c in image]}


def intensity_properties(values: np.ndarray) -> dict:
    """nnU-Net's ``foreground_intensity_properties_per_channel`` entry of one channel's pooled
    foreground intensities (all ``None`` when there are none)."""
    if len(values) == 0:
        return dict.fromkeys(("max", "mean", "median", "min", "percentile_00_5", "percentile_99_5", "std"))
    low, median, high = np.percentile(values, [0.5, 50.0, 99.5])
    return {"max": float(values.max()), "mean": float(values.mean()), "median": float(median), "min": float(values.min()),
            "percentile_00_5": float(low), "percentile_99_5": float(high), "std": float(values.std())}


def compute_fingerprint(cases: Datalist, root: Path | None = None, seed: int = 0) -> dict:
    """The fingerprint of the labelled cases of ``cases`` (its training and validation lists:
    a plan must not depend on the fold), every one read. Foreground is every labelled voxel but
    the ignore label's. ``root``: the dataset folder, cases are recorded relative to it;
    ``seed``: of the foreground sampling."""
    labelled = cases.training + cases.validation
    if not labelled:
        raise DataError("no labelled cases to take a dataset fingerprint from")
    load = _loader(cases)
    rng = np.random.default_rng(seed)
    share = FOREGROUND_SAMPLES // len(labelled)
    measured = []
    for case in labelled:
        item = load(dict(case))
        image, label = item["image"], item["label"].numpy()[0]
        if cases.ignore_label is not None:
            label = np.where(label == cases.ignore_label, 0, label)
        measured.append(case_properties(image.numpy(), label, [float(s) for s in image.pixdim[:3]], share, rng))
    channels = len(measured[0]["foreground"])
    pooled = [np.concatenate([m["foreground"][c] for m in measured]) for c in range(channels)]
    return {
        "foreground_intensity_properties_per_channel": {str(c): intensity_properties(v) for c, v in enumerate(pooled)},
        "median_relative_size_after_cropping": float(np.median([m["relative_size_after_crop"] for m in measured])),
        "shapes_after_crop": [m["shape_after_crop"] for m in measured],
        "spacings": [m["spacing"] for m in measured],
        "axes": "RAS (x, y, z), the order of data.spacing (nnU-Net's files: z, y, x)",
        "cases": case_ids(labelled, root),
        "version": FINGERPRINT_VERSION,
    }


def case_ids(cases: Sequence[dict], root: Path | None) -> list[str]:
    """The cases' image paths (a multi-channel case's files joined by ``+``), relative to
    ``root`` where they lie under it: what a fingerprint records it was taken of."""
    def relative(path) -> str:
        try:
            return str(Path(path).relative_to(root)) if root is not None else str(path)
        except ValueError:
            return str(path)

    return ["+".join(relative(p) for p in (c["image"] if isinstance(c["image"], list) else [c["image"]])) for c in cases]
