"""A small real-MRI segmentation dataset cut from the MNI ICBM152 2009a template that ships inside
the nilearn wheel (nothing is downloaded): grey and white matter on T1, in MSD layout.

Labels come from the template's tissue probability maps: each voxel takes the most probable of
background (``1 - gm - wm``: CSF and everything outside the brain), grey matter (1) and white
matter (2), i.e. the argmax of ``[1 - gm - wm, gm, wm]``.

Cases are axial slabs of the 1 mm brain at six heights (``SLAB_CENTRES``, cerebellum to vertex),
so every case shows different anatomy; the fourth (basal ganglia, ventricles) is held out in
``validation``. The geometry varies the way scans do, so a pipeline that ignores affines fails:
``slab1`` is stored LPS (DICOM order; flipped arrays with a fixed affine, the same world
coordinates) and ``slab2`` has 3 mm slices (1 x 1 x 3 mm). A perturbed copy of the held-out case
(``imagesPerturbed/``, ``labelsPerturbed/``, not in ``validation``) tests robustness: a smooth
multiplicative bias field (+-25 %), Rician noise (Gaussian noise of 3 % of the intensity range on
the real and imaginary channels, as a magnitude image has), 1.2 x 1.2 x 1.5 mm voxels and coronal
slices in FreeSurfer's LIA order. Images are resampled linearly after a Gaussian anti-aliasing
filter matching the coarser voxels; labels nearest.

    write_mni_dataset()  # -> ~/.cache/hsmla-med/mni-learning (written once, then reused)
"""

from __future__ import annotations

import json
import os
import shutil
from importlib.util import find_spec
from pathlib import Path

import nibabel as nib
import numpy as np
from nibabel.orientations import axcodes2ornt, io_orientation, ornt_transform
from nibabel.processing import resample_from_to
from scipy.ndimage import gaussian_filter

from hsmla_med.errors import DataError

__all__ = ["write_mni_dataset", "mni_template", "perturb", "save_nifti", "LABELS", "HELD_OUT", "SLAB_CENTRES"]

LABELS = {"0": "background", "1": "grey_matter", "2": "white_matter"}
SLAB_CENTRES = (24, 49, 74, 99, 124, 149)  # voxel z of the template (world z = index - 72 mm)
HELD_OUT = 3
MARGIN = 4  # voxels kept around the head in-plane
# case index -> (axis codes, voxel size in mm); the others stay RAS at 1 mm
GEOMETRY = {1: (("L", "P", "S"), None), 2: (("R", "A", "S"), (1.0, 1.0, 3.0))}
PERTURBED = {"axcodes": ("L", "I", "A"), "zooms": (1.2, 1.2, 1.5), "bias": 0.25, "noise": 0.03, "seed": 13}
_FILES = "mni_icbm152_{}_tal_nlin_sym_09a_converted.nii.gz"


def mni_template() -> tuple[nib.Nifti1Image, np.ndarray]:
    """The template T1 (float32, 0..255) and its label map (uint8, see the module docstring),
    read from nilearn's package data without importing nilearn (whose import is slow)."""
    spec = find_spec("nilearn")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("nilearn is not installed; the MNI152 template ships inside its wheel: pip install hsmla-med[bench]")
    folder = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data"
    t1, gm, wm = (nib.load(str(folder / _FILES.format(kind))) for kind in ("t1", "gm", "wm"))
    gm_p, wm_p = (np.asarray(img.dataobj, np.float32) / 255.0 for img in (gm, wm))
    labels = np.argmax(np.stack([1.0 - gm_p - wm_p, gm_p, wm_p]), axis=0).astype(np.uint8)
    return nib.Nifti1Image(np.asarray(t1.dataobj, np.float32), t1.affine), labels


def _head(image: nib.Nifti1Image, labels: np.ndarray) -> tuple[nib.Nifti1Image, nib.Nifti1Image]:
    """Image and labels cropped in-plane to the head's bounding box plus ``MARGIN`` (nibabel's
    slicer shifts the affine, so world positions stay; z is kept whole, so template voxel z
    indices still apply)."""
    head = np.argwhere(np.asarray(image.dataobj) > 0)
    lo = np.maximum(head.min(0) - MARGIN, 0)
    hi = np.minimum(head.max(0) + MARGIN + 1, image.shape)
    index = (slice(lo[0], hi[0]), slice(lo[1], hi[1]), slice(None))
    return image.slicer[index], nib.Nifti1Image(labels, image.affine).slicer[index]


def _slab(img: nib.Nifti1Image, centre: int, slices: int) -> nib.Nifti1Image:
    """Axial slab of ``slices`` voxels around template voxel z ``centre``."""
    z0 = centre - slices // 2
    return img.slicer[:, :, z0 : z0 + slices]


def _reorient(img: nib.Nifti1Image, axcodes: tuple[str, ...]) -> nib.Nifti1Image:
    """The same voxels stored in another axis order: arrays flipped/transposed, affine fixed."""
    return img.as_reoriented(ornt_transform(io_orientation(img.affine), axcodes2ornt(axcodes)))


def _grid(img: nib.Nifti1Image, axcodes: tuple[str, ...], zooms: tuple[float, ...]) -> tuple[tuple[int, ...], np.ndarray]:
    """Shape and affine of a grid with the given axis codes and voxel sizes covering ``img``'s
    world bounding box (voxel centres)."""
    corners = np.array([[i, j, k] for i in (0, img.shape[0] - 1) for j in (0, img.shape[1] - 1) for k in (0, img.shape[2] - 1)])
    world = nib.affines.apply_affine(img.affine, corners)
    low, high = world.min(0), world.max(0)
    affine = np.diag([0.0, 0.0, 0.0, 1.0])
    shape = []
    for axis, (world_axis, sign) in enumerate(axcodes2ornt(axcodes).astype(int)):
        affine[world_axis, axis] = sign * zooms[axis]
        affine[world_axis, 3] = low[world_axis] if sign > 0 else high[world_axis]
        shape.append(int(np.floor((high[world_axis] - low[world_axis]) / zooms[axis])) + 1)
    return tuple(shape), affine


def _resample(image: nib.Nifti1Image, label: nib.Nifti1Image, axcodes, zooms) -> tuple[nib.Nifti1Image, nib.Nifti1Image]:
    """Image and label on a new grid: the image Gaussian-filtered to the coarser voxel size
    (FWHM = the size increase, as a scanner's larger voxels average) then linear, labels nearest.
    ``image`` must be axis-aligned with its world axes (the template's slabs are RAS)."""
    target = _grid(image, axcodes, zooms)
    source_zooms = np.abs(np.diag(image.affine)[:3])
    target_zooms = np.abs(target[1][:3, :3]).sum(1)  # per world axis
    sigma = np.sqrt(np.maximum(target_zooms**2 - source_zooms**2, 0.0)) / 2.3548 / source_zooms
    smooth = nib.Nifti1Image(gaussian_filter(np.asarray(image.dataobj, np.float32), sigma), image.affine)
    out_image = resample_from_to(smooth, target, order=1)
    out_label = resample_from_to(label, target, order=0)
    return (nib.Nifti1Image(np.asarray(out_image.dataobj, np.float32), out_image.affine),
            nib.Nifti1Image(np.asarray(out_label.dataobj).round().astype(np.uint8), out_label.affine))


def _geometry(image, label, case: int):
    """A case in its stored geometry (``GEOMETRY``; RAS 1 mm when not listed)."""
    axcodes, zooms = GEOMETRY.get(case, (("R", "A", "S"), None))
    if zooms is not None:
        return _resample(image, label, axcodes, zooms)
    return _reorient(image, axcodes), _reorient(label, axcodes)


def perturb(image: nib.Nifti1Image, label: nib.Nifti1Image, bias: float = PERTURBED["bias"], noise: float = PERTURBED["noise"]
            ) -> tuple[nib.Nifti1Image, nib.Nifti1Image]:
    """The held-out case as another scanner might show it (see ``PERTURBED``): resampled, times
    a smooth quadratic bias field of amplitude ``bias``, with Rician noise of ``noise`` times
    the intensity range (0 leaves one out: ``hsmla-med bench --only scanner-shift`` scores each alone)."""
    image, label = _resample(image, label, PERTURBED["axcodes"], PERTURBED["zooms"])
    rng = np.random.default_rng(PERTURBED["seed"])
    data = np.asarray(image.dataobj, np.float32)
    x, y, z = np.meshgrid(*(np.linspace(-1, 1, n) for n in data.shape), indexing="ij")
    terms = [x, y, z, x * y, y * z, x * z, x**2 - 1 / 3, y**2 - 1 / 3, z**2 - 1 / 3]
    field = sum(c * t for c, t in zip(rng.normal(size=len(terms)), terms))
    field = 1.0 + bias * field / np.abs(field).max()
    sigma = noise * float(data.max() - data.min())
    real, imag = data * field + rng.normal(0, sigma, data.shape), rng.normal(0, sigma, data.shape)
    return nib.Nifti1Image(np.hypot(real, imag).astype(np.float32), image.affine), label


def save_nifti(img: nib.Nifti1Image, path: Path) -> None:
    """NIfTI with the affine in both q- and s-form (readers differ in which they trust)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    img.set_qform(img.affine, code=1)
    img.set_sform(img.affine, code=1)
    img.header.set_xyzt_units("mm")
    nib.save(img, str(path))


def _check_tissue(label: nib.Nifti1Image, name: str) -> None:
    present = set(np.unique(np.asarray(label.dataobj)).tolist())
    if not {0, 1, 2} <= present:
        raise DataError(f"MNI case {name} lacks grey or white matter ({sorted(present)}): use thicker slabs")


def _add(folder: Path, meta: dict, split: str, name: str, image: nib.Nifti1Image, label: nib.Nifti1Image) -> None:
    """Save one case into ``images<Tr|Perturbed>``/``labels<...>`` and list it under ``split``."""
    subdir = "Perturbed" if split == "perturbed" else "Tr"
    entry = {"image": f"images{subdir}/{name}.nii.gz", "label": f"labels{subdir}/{name}.nii.gz"}
    save_nifti(image, folder / entry["image"])
    save_nifti(label, folder / entry["label"])
    meta[split].append(entry)
    meta["cases"][name] = {"axcodes": "".join(nib.aff2axcodes(image.affine)),
                           "spacing_mm": [round(float(z), 4) for z in image.header.get_zooms()[:3]], "shape": list(image.shape)}


def _write(folder: Path, slices: int) -> None:
    """Every case, then ``dataset.json`` (the folder is renamed into place only after this)."""
    image, label = _head(*mni_template())
    meta = {"name": "MNI ICBM152 2009a grey/white matter", "labels": LABELS, "channel_names": {"0": "T1"}, "slices": slices,
            "training": [], "validation": [], "perturbed": [], "cases": {}}
    for case, centre in enumerate(SLAB_CENTRES):
        name = f"slab{case}"
        img, lab = _geometry(_slab(image, centre, slices), _slab(label, centre, slices), case)
        _check_tissue(lab, name)
        _add(folder, meta, "validation" if case == HELD_OUT else "training", name, img, lab)
        meta["cases"][name]["world_z_mm"] = float(nib.affines.apply_affine(image.affine, [0, 0, centre])[2])
        if case == HELD_OUT:
            _add(folder, meta, "perturbed", f"{name}_perturbed", *perturb(img, lab))
    (folder / "dataset.json").write_text(json.dumps(meta, indent=2) + "\n")


def write_mni_dataset(root: str | Path | None = None, slices: int = 24) -> Path:
    """The MNI dataset in ``root`` (default ``~/.cache/hsmla-med/mni-learning``), written once:
    a complete folder is reused as it is; otherwise every file goes into a temporary folder
    beside it that is renamed into place at the end, so an interrupted or concurrent write never
    leaves a partial dataset under ``root``.

    Args:
        root: the dataset folder.
        slices: thickness of each axial slab in 1 mm slices (fewer: a faster, smaller dataset).
    """
    root = Path(root or "~/.cache/hsmla-med/mni-learning").expanduser()
    meta = root / "dataset.json"
    if root.exists():
        if not meta.is_file():
            raise DataError(f"{root}: exists but holds no dataset.json; remove it or choose another folder")
        written = json.loads(meta.read_text()).get("slices")
        if written != slices:
            raise DataError(f"{root}: holds {written}-slice slabs, not {slices}; choose another folder")
        return root
    tmp = root.with_name(f".{root.name}.{os.getpid()}.tmp")
    try:
        _write(tmp, slices)
        os.rename(tmp, root)
    except OSError:
        if not meta.is_file():  # not another writer that finished first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # ours: named by this process's id
    return root
