"""The report's worst cases as pictures: where a prediction fails, shown instead of counted.

* Volumes (an evaluation of label maps: ``summary.json`` rows with ``reference_file`` and
  ``prediction_file``): three orthogonal slices through the largest connected region where the
  prediction and the reference disagree, the image (found beside the reference: the dataset
  JSON's pair, else nnU-Net's ``imagesTr/<case>_0000``) in grey, the reference's class outlines
  solid and the prediction's dotted, in each class's colour, the error's centre marked.
* Slides (CAMELYON16 rows with ``slide_file``): the thumbnail with the tumour outlines and the
  submission's detections, the slides of most missed lesions, then most false positives.
* Frames (rows with ``label_files``, EndoVis): the frame with the reference's and the
  prediction's outlines.
* Missed nodules (LUNA16 rows' ``missed``, with the scan's file): an axial crop of the lung
  window through each, its annotated size as a circle.
* The uncertainty review queue of ``infer --uncertainty``: its most uncertain cases, the axial
  slice holding the most uncertainty, with the predicted label map's outlines.

The cases are those of the lowest mean Dice (:func:`~hsmla_med.report.inputs.mean_dice`, the
case table's order). Drawn with matplotlib's object API (:mod:`hsmla_med.report.figures`'s
reason); volumes are shown in RAS orientation, the patient's right on the image's right, the
voxels at their physical aspect. MONAI's ``matshow3d`` and ``blend_images`` show a volume or
an overlay, not contours of two label maps through a chosen point, hence these few functions.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path

import nibabel as nib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from scipy import ndimage

from hsmla_med.errors import DataError
from hsmla_med.io.overlays import class_colour
from hsmla_med.report.figures import _png
from hsmla_med.report.inputs import mean_dice

__all__ = ["MAX_WORST", "MAX_CROPS", "worst_rows", "image_of", "volume_views", "frame_view", "label_map_of", "uncertainty_view", "missed_nodules",
           "axial_crop", "nodule_crops", "worst_slides", "slide_view"]

log = logging.getLogger("hsmla_med")

MAX_WORST = 4  # cases shown as pictures
VIEWS = ("axial", "coronal", "sagittal")
MAX_CROPS = 12  # missed nodules shown
CROP_MM = 64.0  # a nodule crop's width
LUNG_WINDOW = (-1000.0, 400.0)  # HU shown in the crops
OUTLINE_SCALE = 3  # outline pixels per voxel side: thin lines, a prediction's dashes visible


def worst_rows(rows: Sequence[dict], most: int = MAX_WORST) -> list[dict]:
    """The ``most`` rows of lowest mean Dice whose files are there to draw (rows without a
    Dice, e.g. a frame empty in both, are never the worst)."""
    scored = [(mean_dice([(s or {}).get("Dice") for s in (r.get("metrics") or {}).values() if isinstance(s, dict)]), i, r)
              for i, r in enumerate(rows) if isinstance(r, dict)]
    ordered = sorted((d, i, r) for d, i, r in scored if d is not None)
    return [r for _, _, r in ordered if _drawable(r)][:most]


def _drawable(row: dict) -> bool:
    files = [row.get("reference_file"), row.get("prediction_file")]
    return all(isinstance(f, str) and Path(f).exists() for f in files)


def image_of(reference: Path) -> Path | None:
    """The image of a reference label map: its pair in the dataset JSON two folders up (MSD,
    nnU-Net), else nnU-Net's ``imagesTr``/``imagesTs`` file ``<case>_0000`` or of the same name;
    ``None`` where there is none (the outlines are drawn on black)."""
    from hsmla_med.data.datalist import find_dataset_json, read_json  # see _canonical
    from hsmla_med.io.volumes import file_stem

    root = reference.parent.parent
    try:
        meta = read_json(find_dataset_json(root))
    except DataError:
        meta = {}
    for entry in [*(meta.get("training") or []), *(meta.get("validation") or [])]:
        if isinstance(entry, dict) and isinstance(entry.get("label"), str) and (root / entry["label"]).resolve() == reference.resolve():
            image = entry.get("image")
            image = image[0] if isinstance(image, list) and image else image
            return root / image if isinstance(image, str) and (root / image).is_file() else None
    stem, ending = file_stem(reference), reference.name[len(file_stem(reference)):]
    for folder in ("imagesTr", "imagesTs"):
        for name in (f"{stem}_0000{ending}", reference.name):
            if (root / folder / name).is_file():
                return root / folder / name
    return None


def _canonical(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A volume's voxels in RAS order, their spacing (mm) and the RAS affine of that order."""
    # the volume readers load MONAI and torch (seconds): only when there is a volume to draw,
    # so that the report of a training run or a slide folder is written without them
    from hsmla_med.io.volumes import volume_format

    data, affine = volume_format(path).read(path)
    data = np.asarray(data)
    while data.ndim > 3:  # a 4D image: its first channel
        data = data[..., 0]
    orientation = nib.orientations.io_orientation(affine)
    affine = affine @ nib.orientations.inv_ornt_aff(orientation, data.shape)
    data = nib.orientations.apply_orientation(data, orientation)
    return data, np.sqrt((affine[:3, :3] ** 2).sum(axis=0)), affine


def _error_centre(reference: np.ndarray, prediction: np.ndarray) -> tuple[int, int, int]:
    """The voxel of the largest connected disagreement nearest its centre of mass (the
    reference's foreground centre where they agree, the volume's centre where both are empty)."""
    error = reference != prediction
    if not error.any():
        error = reference > 0
    if not error.any():
        return tuple(s // 2 for s in reference.shape)
    components, count = ndimage.label(error)
    largest = 1 + int(np.argmax(np.bincount(components.ravel())[1:])) if count > 1 else 1
    points = np.argwhere(components == largest)
    centre = points.mean(axis=0)
    return tuple(int(v) for v in points[np.argmin(((points - centre) ** 2).sum(axis=1))])


def _slices(volume: np.ndarray, point: tuple[int, int, int]) -> list[np.ndarray]:
    """Axial, coronal and sagittal slices through ``point``, rows upward (shown with origin lower)."""
    x, y, z = point
    return [volume[:, :, z].T, volume[:, y, :].T, volume[x, :, :].T]


def _aspects(spacing: np.ndarray) -> list[float]:
    sx, sy, sz = (float(s) for s in spacing)
    return [sy / sx, sz / sx, sz / sy]


def _window(image: np.ndarray) -> tuple[float, float]:
    low, high = np.percentile(image, [1, 99]) if image.size else (0.0, 1.0)
    return float(low), float(high if high > low else low + 1)


def _outlines(labels: np.ndarray, dotted: bool, scale: int = OUTLINE_SCALE, width: int = 1) -> np.ndarray:
    """An RGBA picture, ``scale`` times finer than the slice, of its class outlines (the pixels
    of a class with a 4-neighbour of another value, ``width`` of them inward) in each class's
    colour; ``dotted``: in dashes, the prediction's outlines beside the reference's solid ones.
    Pixels, not matplotlib contours: a tenth of the time, and the voxels the scores count."""
    labels = np.kron(labels, np.ones((scale, scale), labels.dtype))
    padded = np.pad(labels, 1, mode="edge")
    neighbours = (padded[:-2, 1:-1], padded[2:, 1:-1], padded[1:-1, :-2], padded[1:-1, 2:])
    edge = (labels != 0) & np.logical_or.reduce([n != labels for n in neighbours])
    if width > 1:
        edge = ndimage.binary_dilation(edge, iterations=width - 1) & (labels != 0)
    if dotted:
        rows, cols = np.indices(labels.shape)
        edge &= (rows // (2 * width) + cols // (2 * width)) % 2 == 0
    picture = np.zeros((*labels.shape, 4), np.float32)
    for value in np.unique(labels[edge]):
        picture[edge & (labels == value)] = (*(np.array(class_colour(int(value))) / 255), 1.0)
    return picture


def _show(ax, picture: np.ndarray, shape: tuple[int, int], lower: bool = True, **options) -> None:
    """``picture`` over the pixels of a slice of ``shape`` (a finer outline picture on the same extent)."""
    h, w = shape
    extent = (-0.5, w - 0.5, -0.5, h - 0.5) if lower else (-0.5, w - 0.5, h - 0.5, -0.5)
    ax.imshow(picture, origin="lower" if lower else "upper", extent=extent, interpolation="nearest", **options)


def _legend(fig: Figure) -> None:
    fig.legend(handles=[Line2D([], [], color="0.3", ls="solid", label="reference"), Line2D([], [], color="0.3", ls="dotted", label="prediction")],
               loc="lower right", fontsize=8, ncol=2, frameon=False)


def volume_views(row: dict, title: str) -> bytes:
    """Three orthogonal slices of a row's case through its largest error (module docstring)."""
    reference, prediction = Path(row["reference_file"]), Path(row["prediction_file"])
    truth, spacing, _ = _canonical(reference)
    predicted = _canonical(prediction)[0]
    if predicted.shape != truth.shape:
        raise DataError(f"{prediction}: grid {predicted.shape} differs from {reference}'s {truth.shape}")
    image_path = image_of(reference)
    image = _canonical(image_path)[0] if image_path is not None else np.zeros(truth.shape, np.float32)
    if image.shape != truth.shape:
        image = np.zeros(truth.shape, np.float32)
    point = _error_centre(truth, predicted)
    marks = [(point[0], point[1]), (point[0], point[2]), (point[1], point[2])]  # the point in each view's (column, row)
    low, high = _window(image)
    fig = Figure(figsize=(12, 4.4))
    FigureCanvasAgg(fig)
    for i, (view, picture, ref, pred, aspect) in enumerate(zip(VIEWS, _slices(image, point), _slices(truth, point), _slices(predicted, point),
                                                               _aspects(spacing), strict=True)):
        ax = fig.add_subplot(1, 3, i + 1)
        _show(ax, picture, picture.shape, cmap="gray", vmin=low, vmax=high, aspect=aspect)
        for labels, dotted in ((ref, False), (pred, True)):
            _show(ax, _outlines(labels, dotted), picture.shape, aspect=aspect)
        ax.plot(*marks[i], "+", color="yellow", ms=12, mew=1.2)
        ax.set_title(f"{view} (voxel {', '.join(map(str, point))})", fontsize=9)
        ax.set_axis_off()
    fig.suptitle(title, fontsize=10)
    _legend(fig)
    fig.subplots_adjust(left=0.01, right=0.99, top=0.86, bottom=0.08, wspace=0.04)
    return _png(fig)


def frame_view(row: dict, problem: str, title: str) -> bytes:
    """A frame with its reference's and its prediction's outlines (the prediction's values as
    written: class indices, or TernausNet's grey levels, each value its own outline)."""
    from hsmla_med.data.endovis import merge_labels, read_label  # frames only: PIL readers of the dataset

    frame = np.asarray(_read_rgb(Path(row["reference_file"])))
    truth = merge_labels(row["label_files"], problem, frame=row["reference_file"])
    predicted = read_label(row["prediction_file"])
    fig = Figure(figsize=(7, 7 * frame.shape[0] / frame.shape[1] + 0.6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    _show(ax, frame, truth.shape, lower=False)
    width = max(1, round(frame.shape[1] / 320))  # about 2 pixels of the picture, whatever the frame's size
    for labels, dotted in ((truth, False), (predicted, True)):
        _show(ax, _outlines(labels, dotted, scale=1, width=width), truth.shape, lower=False)
    ax.set_title(title, fontsize=9)
    ax.set_axis_off()
    _legend(fig)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return _png(fig)


def _read_rgb(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def label_map_of(folder: Path, case: str) -> Path | None:
    """``infer``'s label map of ``case`` in ``folder`` (``<case>.<a volume ending>``), if any."""
    from hsmla_med.io.volumes import file_format  # see _canonical

    return next((p for p in sorted(folder.glob(f"{case}.*")) if file_format(p) is not None), None)


def uncertainty_view(uncertainty: Path, labels: Path | None, title: str) -> bytes:
    """The axial slice holding the most uncertainty of a case's map, with the outlines of the
    label map it was measured on (``infer``'s prediction beside it) where that is there."""
    values, spacing, _ = _canonical(uncertainty)
    values = np.nan_to_num(values.astype(np.float32))
    predicted = _canonical(labels)[0] if labels is not None else None
    z = int(np.argmax(values.reshape(-1, values.shape[2]).sum(axis=0)))
    fig = Figure(figsize=(5.5, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    aspect = float(spacing[1] / spacing[0])
    shape = values.shape[1], values.shape[0]
    _show(ax, values[:, :, z].T, shape, cmap="magma", vmin=0, vmax=1, aspect=aspect)
    mappable = ax.images[-1]
    if predicted is not None and predicted.shape == values.shape:
        _show(ax, _outlines(predicted[:, :, z].T, False), shape, aspect=aspect)
    fig.colorbar(mappable, ax=ax, fraction=0.046, label="uncertainty (normalised to [0, 1])")
    ax.set_title(f"{title}\naxial slice {z} of {values.shape[2]}, the one of most uncertainty", fontsize=9)
    ax.set_axis_off()
    fig.tight_layout()
    return _png(fig)


def missed_nodules(rows: Sequence[dict], most: int = MAX_CROPS) -> list[tuple[dict, list[float]]]:
    """``(row, nodule)`` of the nodules no candidate hit (LUNA16 rows' ``missed``: x, y, z,
    diameter in LPS mm), largest first, of the scans whose file is there."""
    found = [(row, nodule) for row in rows if isinstance(row, dict) and isinstance(row.get("scan_file"), str) and Path(row["scan_file"]).is_file()
             for nodule in row.get("missed") or [] if isinstance(nodule, list) and len(nodule) == 4]
    return sorted(found, key=lambda item: -item[1][3])[:most]


def axial_crop(volume: np.ndarray, affine: np.ndarray, lps_mm: Sequence[float], half_mm: float) -> np.ndarray:
    """The axial crop ``(x, y)`` of a RAS-ordered ``volume`` (affine RAS) centred on the voxel
    of the LPS point ``lps_mm``, ``half_mm`` to each side (outside the volume: air, -1000 HU)."""
    x, y, z = lps_mm
    # LUNA16 places nodules in LPS millimetres, the volume readers in RAS
    i0, j0, k0 = (int(round(v)) for v in np.linalg.solve(affine, [-x, -y, z, 1.0])[:3])
    k0 = min(max(k0, 0), volume.shape[2] - 1)
    hx, hy = (int(math.ceil(half_mm / s)) for s in np.sqrt((affine[:3, :2] ** 2).sum(axis=0)))
    crop = np.full((2 * hx + 1, 2 * hy + 1), LUNG_WINDOW[0], np.float32)
    xs, ys = slice(max(i0 - hx, 0), min(i0 + hx + 1, volume.shape[0])), slice(max(j0 - hy, 0), min(j0 + hy + 1, volume.shape[1]))
    if xs.start < xs.stop and ys.start < ys.stop:
        crop[xs.start - (i0 - hx):xs.stop - (i0 - hx), ys.start - (j0 - hy):ys.stop - (j0 - hy)] = volume[xs, ys, k0]
    return crop


def nodule_crops(missed: Sequence[tuple[dict, list[float]]], half_mm: float = CROP_MM / 2) -> bytes:
    """Axial crops (``CROP_MM`` wide, the lung window) through the centres of missed nodules,
    their annotated diameter drawn as a circle (a -1 diameter: the 10 mm the evaluation takes)."""
    from matplotlib.patches import Ellipse

    across = min(4, len(missed))
    rows = math.ceil(len(missed) / across)
    fig = Figure(figsize=(3 * across, 3.2 * rows))
    FigureCanvasAgg(fig)
    scans: dict[str, tuple] = {}
    for i, (row, (x, y, z, diameter)) in enumerate(missed):
        if row["scan_file"] not in scans:
            scans = {row["scan_file"]: _canonical(Path(row["scan_file"]))}  # one scan held at a time
        volume, spacing, affine = scans[row["scan_file"]]
        crop = axial_crop(volume, affine, (x, y, z), half_mm)
        hx, hy = crop.shape[0] // 2, crop.shape[1] // 2
        ax = fig.add_subplot(rows, across, i + 1)
        _show(ax, crop.T, crop.T.shape, cmap="gray", vmin=LUNG_WINDOW[0], vmax=LUNG_WINDOW[1], aspect=float(spacing[1] / spacing[0]))
        size = 10.0 if diameter < 0 else diameter
        ax.add_patch(Ellipse((hx, hy), size / spacing[0], size / spacing[1], fill=False, color="yellow", lw=1.2))
        ax.set_title(f"{row['seriesuid'][-12:]}\n({x:.1f}, {y:.1f}, {z:.1f}) mm, {size:g} mm", fontsize=8)
        ax.set_axis_off()
    fig.subplots_adjust(left=0.01, right=0.99, top=0.9, bottom=0.01, wspace=0.05, hspace=0.25)
    return _png(fig)


def worst_slides(rows: Sequence[dict], most: int = MAX_WORST) -> list[dict]:
    """CAMELYON16 rows (``slide_file``, the lesion CSV as ``prediction_file``) with a missed
    lesion or a false positive, most missed lesions first, then most false positives."""
    def drawable(row: dict) -> bool:
        return all(isinstance(row.get(k), str) and Path(row[k]).is_file() for k in ("slide_file", "prediction_file"))

    failed = [r for r in rows if isinstance(r, dict) and drawable(r) and (r.get("lesions", 0) > r.get("detected", 0) or r.get("false_positives"))]
    return sorted(failed, key=lambda r: (-(r.get("lesions", 0) - r.get("detected", 0)), -r.get("false_positives", 0)))[:most]


def _mask_outline(ax, path: Path, downsample: float) -> None:
    """The outline of a ground-truth mask TIFF's tumour (non-zero), from its pyramid level
    nearest the picture's ``downsample`` (level-0 pixels per picture pixel)."""
    from hsmla_med.data.slides import open_slide

    mask = open_slide(path)
    try:
        level = mask.get_best_level_for_downsample(downsample)
        width, height = mask.level_dimensions[level]
        tumour = np.asarray(mask.read_region((0, 0), level, (width, height)))[..., 0] > 0
        scale = mask.level_downsamples[level] / downsample
    finally:
        mask.close()
    if tumour.any() and min(tumour.shape) > 1:
        ax.contour((np.arange(width) + 0.5) * scale - 0.5, (np.arange(height) + 0.5) * scale - 0.5, tumour.astype(np.float32),
                   levels=[0.5], colors="lime", linewidths=1.2)


def slide_view(row: dict, title: str) -> bytes:
    """A slide's thumbnail with its tumour outlines (the ASAP XML or the mask TIFF it was
    scored against; an XML's exclusions dashed) and the submission's detections (circles, the
    colour their confidence)."""
    from hsmla_med.data.asap import EXCLUSION_GROUPS, read_asap_xml
    from hsmla_med.data.slides import open_slide, thumbnail
    from hsmla_med.io.lesion_csv import read_lesion_csv

    slide = open_slide(row["slide_file"])
    try:
        picture, downsample = thumbnail(slide, min_size=512, max_size=1024)
    finally:
        slide.close()
    reference = row.get("reference_file")
    is_xml = isinstance(reference, str) and reference.lower().endswith(".xml")
    outlines = read_asap_xml(Path(reference)) if is_xml else []
    found = read_lesion_csv(Path(row["prediction_file"]))
    fig = Figure(figsize=(7, 7 * picture.shape[0] / picture.shape[1] + 0.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.imshow(picture, interpolation="nearest")
    for polygon in outlines:
        points = np.vstack([polygon.points, polygon.points[:1]]) / downsample
        ax.plot(points[:, 0], points[:, 1], color="lime", lw=1.2, ls="--" if polygon.group in EXCLUSION_GROUPS else "-")
    if isinstance(reference, str) and not is_xml and Path(reference).is_file():
        _mask_outline(ax, Path(reference), downsample)
    if len(found):
        marks = ax.scatter(found[:, 1] / downsample, found[:, 2] / downsample, c=found[:, 0], cmap="inferno", vmin=0, vmax=1, s=40,
                           facecolors="none", linewidths=1.3)
        fig.colorbar(marks, ax=ax, fraction=0.046, label="detection confidence")
    ax.set_title(f"{title}: {row.get('lesions', 0)} lesion(s), {row.get('detected', 0)} detected, {row.get('false_positives', 0)} false "
                 f"positive(s)", fontsize=9)
    ax.set_axis_off()
    fig.tight_layout()
    return _png(fig)
