"""Synthetic abdominal CT in the on-disk format of BTCV (Beyond the Cranial Vault), the default data.

BTCV itself needs a registration to download, so a user without data gets this stand-in, laid out
as MONAI's BTCV tutorial reads the real one: ``imagesTr/img0001.nii.gz`` with
``labelsTr/label0001.nii.gz``, held-out images in ``imagesTs/`` (the first also as a DICOM series
in ``imagesTs_dicom/``), and ``dataset_0.json`` with the ``training``/``validation`` lists and the
``test`` list of plain paths; the same 13 organ labels,
int16 images in Hounsfield units and uint8 labels. Each case is a phantom: an elliptical body with
a fat rim and a muscle wall, a spine, and the 13 organs as deformed ellipsoids and tubes at
plausible positions, each with its own mean HU (:data:`ORGAN_HU`) so that a small network learns
it in minutes on a CPU, and air (-1000 HU) around the body, below every CT window, so that the
foreground crop cuts as it does on real scans.

The files exercise what real data throws at a pipeline: anisotropic spacing that differs per case,
arbitrary origins, every third case stored in a non-RAS orientation (array flipped, affine
adjusted), one case whose axes are oblique to the world's (:data:`_OBLIQUE_CASE`), and NIfTI
headers whose qform or sform is marked unknown (code 0) or "aligned" (code 2), as converters
write them (:data:`_HEADER_CODES`); the anatomy stays put in world coordinates throughout.
Nothing here is real anatomy.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import NamedTuple

import nibabel as nib
import numpy as np

from hsmla_med.data.synthetic.dicom_series import write_ct_series
from hsmla_med.io import atomic_path, write_json

__all__ = ["BTCV_LABELS", "ORGAN_HU", "generate_btcv"]

BTCV_LABELS: dict[int, str] = {
    0: "background",
    1: "spleen",
    2: "right_kidney",
    3: "left_kidney",
    4: "gallbladder",
    5: "esophagus",
    6: "liver",
    7: "stomach",
    8: "aorta",
    9: "inferior_vena_cava",
    10: "portal_and_splenic_vein",
    11: "pancreas",
    12: "right_adrenal_gland",
    13: "left_adrenal_gland",
}

# Mean HU of each organ: 25 HU apart, all inside the usual abdominal window -175..250 so that
# they stay apart after windowing. Not the real ordering: the values are arranged so that organs
# that touch in the phantom mostly differ by 50 HU or more (liver/IVC, spleen/kidney,
# pancreas/stomach, the three large vessels), as do the left/right pairs, which a 2D network
# otherwise tells apart by position alone.
ORGAN_HU: dict[int, float] = {
    4: -55.0,  # gallbladder
    7: -30.0,  # stomach
    12: -5.0,  # right adrenal gland
    11: 20.0,  # pancreas
    13: 45.0,  # left adrenal gland
    5: 70.0,  # esophagus
    6: 95.0,  # liver
    1: 120.0,  # spleen
    9: 145.0,  # inferior vena cava
    3: 170.0,  # left kidney
    10: 195.0,  # portal and splenic vein
    2: 220.0,  # right kidney
    8: 245.0,  # aorta
}

_AIR_HU, _FAT_HU, _MUSCLE_HU = -1000.0, -100.0, 50.0
_BONE_HU = (400.0, 700.0)  # cancellous core .. cortical shell
_ORGAN_TEXTURE_HU = 5.0  # amplitude of the smooth within-organ texture
_NOISE_HU = (10.0, 14.0)  # std of the global Gaussian noise, drawn per case

# Spacing ranges for the default shape; other shapes scale them so that the field of view stays
# about 200 x 200 x 150 mm and the anatomy fits whatever the shape.
_DEFAULT_SHAPE = (128, 128, 48)
_INPLANE_MM = (1.2, 1.8)
_SLICE_MM = (2.5, 4.0)
_MIN_SEMI_AXIS_MM = 8.0
# Visible voxels each organ must keep at the default shape (scaled with the voxel count).
_MIN_ORGAN_VOXELS = 300
_NON_RAS = ("LAS", "LPS", "RPS")
# (qform_code, sform_code) by case index modulo 4: both scanner (1); sform only, "aligned" (2),
# as dcm2niix-style converters mark it; qform only (sform unknown, 0); qform aligned (2) and sform
# scanner. One form is always set: a file with both codes 0 has no orientation at all (nibabel
# then mirrors x), which no converter writes for CT. Image and label share their header.
_HEADER_CODES = ((1, 1), (0, 2), (1, 0), (2, 1))
_OBLIQUE_CASE = 2  # this case's voxel axes are rotated against the world's (gantry tilt, oblique plan)
_OBLIQUE_DEGREES = (12.0, 6.0)  # about z (feet-head) and about x (tilt)
_JSON_NAME = "dataset_0.json"  # MONAI's BTCV datalist
# 2: dataset_0.json, header codes 0 and 2, an oblique case; 3: the first test case also as a DICOM
# series; 4: the anatomy mirrored to the patient's true sides (liver right, RAS x > 0), see _ANATOMY
_GENERATOR_VERSION = 4


class _Ellipsoid(NamedTuple):
    label: int
    center: tuple[float, float, float]
    semi_axes: tuple[float, float, float]
    yaw_deg: float  # rotation about z (patient's feet-head axis)


class _Tube(NamedTuple):
    label: int
    points: tuple[tuple[float, float, float], ...]  # quadratic Bezier control points
    radii: tuple[float, float]  # at the first and last point


# Anatomy of a nominal patient in RAS+ millimetres, NIfTI's world (x: towards the patient's RIGHT,
# y: anterior, z: head; DICOM's LPS negates x and y), body centred at x = y = 0, field of view z in
# -75..75 mm, body semi-axes 85 x 65 mm. :func:`_phantom` paints on a voxel grid along +x, +y, +z
# and :func:`_case`'s affine maps it so (flips and rotations keep the world position), so the
# liver (x > 0) lies on the patient's right. (Up to version 3 x and the yaws had the opposite
# sign, LAS: every case was the mirror image of a patient.)
# Listed in painting order: later structures overwrite earlier ones where they overlap, so small
# ones come late and stay visible (and each case is checked to keep enough voxels of each).
_BODY_SEMI_AXES = (85.0, 65.0)
_FOV_Z = 150.0
_ANATOMY: tuple[_Ellipsoid | _Tube, ...] = (
    _Ellipsoid(6, (32.0, 6.0, 26.0), (40.0, 34.0, 46.0), -15.0),  # liver: right, upper
    _Ellipsoid(1, (-48.0, -12.0, 28.0), (15.0, 27.0, 32.0), 35.0),  # spleen: left, posterior
    # Esophagus before the stomach, which covers its lower end as the cardia would.
    _Tube(5, ((-16.0, 16.0, 44.0), (-12.0, 14.0, 66.0), (-8.0, 10.0, 92.0)), (9.0, 9.0)),  # esophagus
    _Ellipsoid(7, (-26.0, 22.0, 28.0), (26.0, 19.0, 28.0), -30.0),  # stomach: left, anterior
    _Ellipsoid(2, (42.0, -22.0, -16.0), (15.0, 18.0, 34.0), 20.0),  # right kidney
    _Ellipsoid(3, (-42.0, -22.0, -8.0), (15.0, 18.0, 34.0), -20.0),  # left kidney
    _Tube(11, ((16.0, 14.0, -10.0), (-6.0, 16.0, -2.0), (-40.0, 0.0, 14.0)), (14.0, 10.0)),  # pancreas
    _Ellipsoid(4, (34.0, 30.0, -2.0), (13.0, 14.0, 20.0), -10.0),  # gallbladder: under the liver
    _Tube(8, ((-5.0, -6.0, -90.0), (-3.0, -6.0, 0.0), (-6.0, -4.0, 90.0)), (10.0, 11.0)),  # aorta
    _Tube(9, ((20.0, -3.0, -90.0), (22.0, -2.0, 0.0), (20.0, 0.0, 70.0)), (11.0, 11.0)),  # IVC
    _Tube(10, ((24.0, 8.0, 14.0), (-2.0, 2.0, -8.0), (-40.0, -10.0, 20.0)), (8.0, 8.0)),  # portal/splenic vein
    _Ellipsoid(12, (30.0, -22.0, 26.0), (12.0, 10.0, 18.0), -20.0),  # right adrenal gland
    _Ellipsoid(13, (-28.0, -22.0, 28.0), (12.0, 10.0, 18.0), 20.0),  # left adrenal gland
)


def generate_btcv(
    root: str | os.PathLike,
    num_train: int = 10,
    num_validation: int = 4,
    num_test: int = 2,
    shape: tuple[int, int, int] = (128, 128, 48),
    seed: int = 0,
) -> Path:
    """Write a synthetic BTCV-format dataset under ``root`` and return ``root/dataset_0.json``.

    Args:
        root: dataset folder; created if missing.
        num_train, num_validation: labelled cases in the JSON's ``training`` and ``validation``
            lists (``imagesTr/img0001.nii.gz``... with ``labelsTr/label0001.nii.gz``...).
        num_test: unlabelled cases in ``imagesTs``, numbered after the labelled ones; the first
            is also written as a CT DICOM series, ``imagesTs_dicom/img<N>/`` (one file per
            slice, random names: :func:`~hsmla_med.data.synthetic.dicom_series.write_ct_series`),
            listed as ``test_dicom`` in the JSON.
        shape: voxels per case (x, y, z); the spacing adapts so the field stays about
            200 x 200 x 150 mm.
        seed: case ``i`` depends only on ``seed`` and ``i``, so the same seed gives the same
            bytes, and a larger dataset starts with the cases of a smaller one.

    Returns immediately if ``root/dataset_0.json`` was written by this generator with the same
    parameters (its ``generator`` entry) and the files it lists exist. Every file is written under
    a temporary name and renamed, the JSON last, so a folder with a ``dataset_0.json`` is
    complete. Raises :class:`FileExistsError` rather than overwrite a dataset JSON that this
    generator did not write (real data in the same folder); a ``dataset.json`` of version 1 of
    this generator is removed.
    """
    root = Path(root)
    shape = tuple(int(n) for n in shape)
    if len(shape) != 3 or min(shape) < 8:
        raise ValueError(f"shape must be three sizes of at least 8 voxels, got {shape}")
    if num_train < 1 or num_validation < 0 or num_test < 0:
        raise ValueError("need num_train >= 1, num_validation >= 0 and num_test >= 0")
    params = {
        "version": _GENERATOR_VERSION,
        "seed": int(seed),
        "shape": list(shape),
        "num_train": int(num_train),
        "num_validation": int(num_validation),
        "num_test": int(num_test),
    }
    json_path = root / _JSON_NAME
    if json_path.is_file():
        if _is_cached(json_path, root, params):
            return json_path
        json_path.unlink()  # ours but stale: the folder is incomplete until the new one is written
    former = root / "dataset.json"  # version 1's name: a reader looking for dataset.json first would take it
    if former.is_file():
        _is_cached(former, root, params)  # refuses a foreign one
        former.unlink()

    cases, dicom = [], []
    for index in range(1, num_train + num_validation + num_test + 1):
        labelled = index <= num_train + num_validation
        image, label, affine = _case(np.random.default_rng((int(seed), index)), shape, index)
        codes = _HEADER_CODES[index % len(_HEADER_CODES)]
        image_rel = f"imagesTr/img{index:04d}.nii.gz" if labelled else f"imagesTs/img{index:04d}.nii.gz"
        _save_nifti(image, affine, root / image_rel, codes)
        if labelled:
            label_rel = f"labelsTr/label{index:04d}.nii.gz"
            _save_nifti(label, affine, root / label_rel, codes)
            cases.append({"image": image_rel, "label": label_rel})
        else:
            cases.append(image_rel)
            if not dicom:  # one DICOM case: enough to show the path, cheap to write
                dicom.append(f"imagesTs_dicom/img{index:04d}")
                shutil.rmtree(root / dicom[0], ignore_errors=True)  # slices of another shape would join the series
                write_ct_series(root / dicom[0], image, affine, np.random.default_rng((int(seed), index, 1)), f"SYN{index:04d}")
    meta = {
        "name": "BTCV-synthetic",
        "description": "Synthetic abdominal CT phantoms in the BTCV layout (not real anatomy), "
        "written by hsmla_med.data.synthetic.btcv as the default data.",
        "synthetic": True,
        "tensorImageSize": "3D",
        "modality": {"0": "CT"},
        "labels": {str(k): v for k, v in BTCV_LABELS.items()},
        # MSD's meaning: labelled cases in imagesTr, whichever list they are in.
        "numTraining": num_train + num_validation,
        "numTest": num_test,
        "training": cases[:num_train],
        "validation": cases[num_train : num_train + num_validation],
        "test": cases[num_train + num_validation :],
        "test_dicom": dicom,  # the first test case again, as a DICOM series folder
        "generator": params,
    }
    write_json(json_path, meta)
    return json_path


def _is_cached(json_path: Path, root: Path, params: dict) -> bool:
    """Whether ``json_path`` describes this very dataset; refuse to touch one we did not write."""
    try:
        meta = json.loads(json_path.read_text())
    except ValueError:
        meta = None
    if not isinstance(meta, dict) or not isinstance(meta.get("generator"), dict):
        raise FileExistsError(f"{json_path}: not written by the synthetic BTCV generator; refusing to overwrite it")
    if meta["generator"] != params:
        return False
    listed = meta.get("training", []) + meta.get("validation", [])
    files = [c[k] for c in listed for k in ("image", "label")] + list(meta.get("test", []))
    return all((root / f).is_file() for f in files) and all((root / d).is_dir() and any((root / d).iterdir()) for d in meta.get("test_dicom", []))


def _save_nifti(array: np.ndarray, affine: np.ndarray, path: Path, codes: tuple[int, int]) -> None:
    """Write ``array`` with ``affine`` as both qform and sform, with the ``(qform, sform)``
    ``codes`` (a form with code 0 still holds the matrix, as converters leave it), units mm."""
    img = nib.Nifti1Image(array, affine)
    img.set_qform(affine, code=codes[0])
    img.set_sform(affine, code=codes[1])
    img.header.set_xyzt_units("mm")
    with atomic_path(path) as tmp:  # keeps the .nii.gz suffix, from which nibabel picks gzip
        nib.save(img, str(tmp))


def _case(rng: np.random.Generator, shape: tuple[int, int, int], index: int):
    """One case as stored: int16 image, uint8 label and their affine.

    Cases whose index is 1 modulo 3 are stored in a non-RAS orientation, and case
    :data:`_OBLIQUE_CASE` with voxel axes rotated about the field's centre; fixed rules rather
    than chance, so that even a dataset of two cases has one of each.
    """
    inplane = rng.uniform(*_INPLANE_MM)  # one value for x and y: square pixels, like CT's
    spacing = np.array(
        [
            inplane * _DEFAULT_SHAPE[0] / shape[0],
            inplane * _DEFAULT_SHAPE[1] / shape[1],
            rng.uniform(*_SLICE_MM) * _DEFAULT_SHAPE[2] / shape[2],
        ]
    )
    image, label = _phantom(rng, shape, spacing)

    # World position of the field's centre: arbitrary, like scanner table coordinates.
    centre = np.array([rng.uniform(-30, 30), rng.uniform(-30, 30), rng.uniform(-400, 0)])
    affine = np.diag([*spacing, 1.0])
    affine[:3, 3] = centre - spacing * (np.array(shape) - 1) / 2
    if index % 3 == 1:
        code = _NON_RAS[rng.integers(len(_NON_RAS))]
        for axis, letter in enumerate(code):
            if letter != "RAS"[axis]:
                # Voxel j' = n - 1 - j: same world position, so the anatomy does not move.
                image, label = np.flip(image, axis), np.flip(label, axis)
                affine[:3, 3] += affine[:3, axis] * (shape[axis] - 1)
                affine[:3, axis] *= -1
    if index == _OBLIQUE_CASE:
        # the voxels stay, the world turns: the phantom is rotated in the world, not distorted
        rotation = np.eye(4)
        rotation[:3, :3] = _rotation(2, _OBLIQUE_DEGREES[0]) @ _rotation(0, _OBLIQUE_DEGREES[1])
        to_centre = np.eye(4)
        to_centre[:3, 3] = -centre
        affine = np.linalg.inv(to_centre) @ rotation @ to_centre @ affine
    return np.ascontiguousarray(image), np.ascontiguousarray(label), affine


def _phantom(rng: np.random.Generator, shape: tuple[int, int, int], spacing: np.ndarray):
    """Image (int16 HU) and label (uint8) of one phantom on a RAS voxel grid.

    Resamples the anatomy until every organ keeps enough visible voxels; the draws come from
    ``rng``, so the result stays deterministic.
    """
    fov = np.array(shape) * spacing
    a = rng.uniform(0.40, 0.45) * fov[0]  # body semi-axes (mm)
    b = min(rng.uniform(0.72, 0.80) * a, 0.45 * fov[1])
    scale = np.array([a / _BODY_SEMI_AXES[0], b / _BODY_SEMI_AXES[1], fov[2] / _FOV_Z])
    offset = rng.uniform(-0.03, 0.03, 2) * fov[:2]  # body centre within the field
    # Voxel centres in mm relative to the body centre (x, y) and the field's centre (z).
    x = (np.arange(shape[0]) - (shape[0] - 1) / 2) * spacing[0] - offset[0]
    y = (np.arange(shape[1]) - (shape[1] - 1) / 2) * spacing[1] - offset[1]
    z = (np.arange(shape[2]) - (shape[2] - 1) / 2) * spacing[2]
    X, Y = x[:, None, None], y[None, :, None]

    # The body varies slowly along z: semi-axes within +-4 %, centre drifting a few mm.
    t = z / (fov[2] / 2)
    wobble = 1 + 0.04 * np.sin(np.pi * t * rng.uniform(0.5, 1.0) + rng.uniform(0, 2 * np.pi))
    drift = rng.uniform(-3, 3, 2)[:, None] * t
    BX, BY = X - drift[0], Y - drift[1]
    fat = rng.uniform(7, 13) * scale[0]
    muscle = rng.uniform(6, 9) * scale[0]
    body = _ellipse(BX, BY, a * wobble, b * wobble) <= 1
    inside_wall = _ellipse(BX, BY, a * wobble - fat, b * wobble - fat) <= 1
    interior = _ellipse(BX, BY, a * wobble - fat - muscle, b * wobble - fat - muscle) <= 1

    # Spine: vertebral body and spinous process (bone, label 0) flanked by paraspinal muscles.
    sx, sy = scale[:2]
    vertebra = _ellipse(BX, BY + 30 * sy, 15 * sx, 13 * sy)
    spinous = _ellipse(BX, BY + 50 * sy, 5 * sx, 9 * sy)
    bone = (vertebra <= 1) | (spinous <= 1)
    paraspinal = (_ellipse(BX - 22 * sx, BY + 42 * sy, 15 * sx, 10 * sy) <= 1) | (
        _ellipse(BX + 22 * sx, BY + 42 * sy, 15 * sx, 10 * sy) <= 1
    )
    free = interior & ~bone & ~paraspinal  # where organs may be painted

    min_voxels = math.ceil(_MIN_ORGAN_VOXELS * np.prod(shape) / np.prod(_DEFAULT_SHAPE))
    for _ in range(20):
        label = np.zeros(shape, dtype=np.uint8)
        for structure in _ANATOMY:
            box, inside = _draw(structure, rng, scale, x, y, z)
            label[box][inside & free[box]] = structure.label
        counts = np.bincount(label.ravel(), minlength=len(BTCV_LABELS))
        if counts[1:].min() >= min_voxels:
            break
    else:
        raise RuntimeError(f"shape {shape} is too small to show every organ with {min_voxels} voxels")

    texture = _smooth_field(rng, shape)
    image = np.full(shape, _AIR_HU, dtype=np.float32)
    image[body] = _FAT_HU + 8 * texture[body]
    wall = inside_wall & ~interior
    image[wall] = _MUSCLE_HU + 5 * texture[wall]
    image[interior] = _FAT_HU + 10 * texture[interior]
    image[paraspinal] = _MUSCLE_HU + 5 * texture[paraspinal]
    # Bone: brighter towards the edge of each part, like a cortical shell around cancellous bone.
    rim = np.clip(np.where(vertebra <= 1, vertebra, spinous), 0, 1) ** 2
    image[bone] = (_BONE_HU[0] + (_BONE_HU[1] - _BONE_HU[0]) * rim)[bone]

    # Organs: their mean HU plus texture centred on zero within each organ, so the mean is exact.
    organ = label > 0
    hu = np.zeros(len(BTCV_LABELS), dtype=np.float32)
    for k, v in ORGAN_HU.items():
        hu[k] = v
    texture_mean = np.bincount(label.ravel(), weights=texture.ravel(), minlength=len(hu)) / np.maximum(counts, 1)
    ids = label[organ]
    image[organ] = hu[ids] + _ORGAN_TEXTURE_HU * (texture[organ] - texture_mean[ids].astype(np.float32))

    image += rng.standard_normal(shape, dtype=np.float32) * np.float32(rng.uniform(*_NOISE_HU))
    # -1024..3071 is the range of CT scanners' 12-bit output.
    return np.clip(np.rint(image), -1024, 3071).astype(np.int16), label


def _ellipse(x, y, a, b):
    """Squared normalised radius: <= 1 inside the ellipse with semi-axes ``a``, ``b``."""
    return (x / a) ** 2 + (y / b) ** 2


def _draw(structure, rng: np.random.Generator, scale: np.ndarray, x, y, z):
    """Randomise one structure of :data:`_ANATOMY` for this case and rasterise it.

    Returns the bounding box (a tuple of slices) and the boolean mask within it; working inside
    the box keeps the cost proportional to the organ, not the volume.
    """
    if isinstance(structure, _Ellipsoid):
        centre = (np.array(structure.center) + rng.uniform(-6, 6, 3)) * scale
        semi = np.maximum(np.array(structure.semi_axes) * rng.uniform(0.88, 1.12, 3) * scale, _MIN_SEMI_AXIS_MM)
        rotation = (
            _rotation(2, structure.yaw_deg + rng.uniform(-12, 12))
            @ _rotation(0, rng.uniform(-8, 8))
            @ _rotation(1, rng.uniform(-8, 8))
        )
        # Smooth deformation: the surface radius varies by up to 15 % as a sum of low-frequency waves.
        freq = rng.normal(size=(3, 3))
        freq *= rng.uniform(1.5, 3.0, (3, 1)) / np.linalg.norm(freq, axis=1, keepdims=True)
        amp, phase = rng.uniform(0.03, 0.05, 3), rng.uniform(0, 2 * np.pi, 3)
        reach = semi.max() * 1.2
        box = _box(x, y, z, centre - reach, centre + reach)
        d = (x[box[0]][:, None, None] - centre[0], y[box[1]][None, :, None] - centre[1], z[box[2]][None, None, :] - centre[2])
        # Coordinates in the ellipsoid's frame, in units of its semi-axes.
        q = [sum(rotation[j, i] * d[j] for j in range(3)) / semi[i] for i in range(3)]
        surface = 1 + sum(amp[m] * np.sin(sum(freq[m, i] * q[i] for i in range(3)) + phase[m]) for m in range(3))
        return box, q[0] ** 2 + q[1] ** 2 + q[2] ** 2 <= surface**2

    # Tube: a sweep of spheres along a quadratic Bezier curve, the radius interpolated end to end.
    points = (np.array(structure.points) + rng.uniform(-6, 6, (3, 3))) * scale
    radii = np.maximum(np.array(structure.radii) * rng.uniform(0.9, 1.1, 2) * scale[:2].mean(), _MIN_SEMI_AXIS_MM)
    s = np.linspace(0, 1, 64)[:, None]
    curve = (1 - s) ** 2 * points[0] + 2 * (1 - s) * s * points[1] + s**2 * points[2]
    radius = radii[0] + (radii[1] - radii[0]) * s[:, 0]
    box = _box(x, y, z, curve.min(0) - radii.max(), curve.max(0) + radii.max())
    bx, by, bz = x[box[0]][:, None, None], y[box[1]][None, :, None], z[box[2]][None, None, :]
    nearest = np.full((bx.size, by.size, bz.size), np.inf, dtype=np.float32)
    for c, r in zip(curve, radius):
        np.minimum(nearest, ((bx - c[0]) ** 2 + (by - c[1]) ** 2 + (bz - c[2]) ** 2) / r**2, out=nearest)
    return box, nearest <= 1


def _box(x, y, z, low, high):
    """Slices of the voxels whose coordinates lie within ``low``..``high`` (mm), per axis."""
    return tuple(
        slice(int(np.searchsorted(c, lo)), int(np.searchsorted(c, hi, side="right")))
        for c, lo, hi in zip((x, y, z), low, high)
    )


def _rotation(axis: int, degrees: float) -> np.ndarray:
    """Rotation matrix about coordinate ``axis``."""
    c, s = math.cos(math.radians(degrees)), math.sin(math.radians(degrees))
    i, j = [k for k in range(3) if k != axis]
    r = np.eye(3)
    r[i, i], r[i, j], r[j, i], r[j, j] = c, -s, s, c
    return r


def _smooth_field(rng: np.random.Generator, shape: tuple[int, int, int]) -> np.ndarray:
    """Smooth random field of unit scale: noise on a grid 8 times coarser, linearly interpolated."""
    coarse = rng.standard_normal(tuple(max(2, n // 8 + 1) for n in shape))
    field = coarse
    for axis, n in enumerate(shape):
        pos = np.linspace(0, field.shape[axis] - 1, n)
        lo = np.minimum(pos.astype(int), field.shape[axis] - 2)
        w = (pos - lo).reshape([-1 if a == axis else 1 for a in range(3)])
        field = np.take(field, lo, axis) * (1 - w) + np.take(field, lo + 1, axis) * w
    return field.astype(np.float32)
