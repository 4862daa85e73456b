"""Synthetic chest CT in LUNA16's on-disk format: the embedded default of the LUNA16 pipeline.

Each scan is ``subset0/<seriesuid>.mhd`` + ``.raw`` (int16 Hounsfield units) with its own
geometry: in-plane spacing 0.7-1.0 mm, slices 1.25-2.5 mm, and for some scans a direction
other than the identity (x and y flipped, or a rotation about z), so world <-> voxel mapping is
exercised. The body is soft tissue (+40 HU) in air (-1000 HU) with two lungs (-850 HU),
vessel-like tubes (+40 HU, about 1.5 mm thick) through the lungs, and 1-3 spherical nodules of
4-20 mm (+30 HU, soft edge) inside the lungs. ``annotations.csv`` lists the nodules in world
(LPS) millimetres; ``annotations_excluded.csv`` lists small 2-3 mm blobs that, as in LUNA16,
count neither as hits nor as false positives. A ``synthetic.json`` marker, written first as
incomplete and last as complete, makes the generation happen once (an interrupted one is redone)
and marks the folder as the generator's: it never writes into a folder that holds other files
without that marker, and deletes only the files a marker of its own lists.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import SimpleITK as sitk
from scipy import ndimage

from hsmla_med.data.luna16 import COLUMNS, Geometry, voxel_to_world
from hsmla_med.errors import DataError
from hsmla_med.io import atomic_path, write_json

__all__ = ["generate_luna16"]

_MARKER = "synthetic.json"
_PARAMS = ("num_scans", "shape", "seed", "version")


def _uid(seed: int, index: int) -> str:
    return f"1.3.6.1.4.1.14519.5.2.1.6279.6001.{seed:03d}{index:06d}"


def _files(params: dict) -> list[str]:
    """The files that the generator writes for ``params``, relative to its folder."""
    scans = [f"subset0/{_uid(params['seed'], i)}{ext}" for i in range(params["num_scans"]) for ext in (".mhd", ".raw")]
    return scans + ["annotations.csv", "annotations_excluded.csv"]


def _read_marker(marker: Path) -> dict:
    """An existing marker's parameters and ``complete`` flag (markers before the flag were
    written last, so complete); :class:`DataError` for a marker this generator did not write."""
    try:
        meta = json.loads(marker.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        meta = None
    if not (
        isinstance(meta, dict)
        and set(_PARAMS) <= set(meta) <= {*_PARAMS, "complete"}
        and isinstance(meta["num_scans"], int)
        and isinstance(meta["seed"], int)
    ):
        raise DataError(
            f"{marker.parent}: its {_MARKER} was not written by the synthetic LUNA16 generator; "
            "refusing to write synthetic scans into this folder (choose another cache_dir)"
        )
    return {"complete": True, **meta}


def _direction(rng: np.random.Generator, kind: int) -> np.ndarray:
    if kind == 0:
        return np.eye(3)
    if kind == 1:
        return np.diag([-1.0, -1.0, 1.0])
    angle = rng.uniform(0.2, 0.5)
    c, s = math.cos(angle), math.sin(angle)
    return np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])


def _ball(shape_zyx, centre_xyz, radius_mm: float, spacing: np.ndarray):
    """Slices of the box around a ball and the distances (mm) of its voxels from the centre."""
    centre = np.asarray(centre_xyz, dtype=np.float64)[::-1]  # z, y, x
    step = spacing[::-1]
    reach = np.ceil((radius_mm + 1) / step).astype(int)
    lo = np.maximum(np.floor(centre).astype(int) - reach, 0)
    hi = np.maximum(np.minimum(np.ceil(centre).astype(int) + reach + 1, shape_zyx), lo)
    box = tuple(slice(a, b) for a, b in zip(lo, hi))
    grids = np.meshgrid(*(np.arange(a, b) for a, b in zip(lo, hi)), indexing="ij")
    dist = np.sqrt(sum(((g - c) * st) ** 2 for g, c, st in zip(grids, centre, step)))
    return box, dist


def _scan(rng: np.random.Generator, shape_xyz: tuple[int, int, int], spacing: np.ndarray):
    """HU volume ``(z, y, x)`` int16, nodule centres (voxel x, y, z) and diameters (mm), and the
    excluded blobs likewise."""
    nx, ny, nz = shape_xyz
    z, y, x = np.meshgrid(*(np.arange(n, dtype=np.float32) for n in (nz, ny, nx)), indexing="ij")
    size = np.array([nx, ny, nz]) * spacing  # mm
    centre = size / 2
    xm, ym, zm = x * spacing[0], y * spacing[1], z * spacing[2]
    body = ((xm - centre[0]) / (0.46 * size[0])) ** 2 + ((ym - centre[1]) / (0.40 * size[1])) ** 2 <= 1
    hu = np.where(body, 40.0, -1000.0).astype(np.float32)
    lungs = np.zeros(hu.shape, dtype=bool)
    for side in (-1, 1):
        lung = centre + [side * 0.2 * size[0], 0, 0]
        radii = size * [0.16, 0.28, 0.45]
        lungs |= ((xm - lung[0]) / radii[0]) ** 2 + ((ym - lung[1]) / radii[1]) ** 2 + ((zm - lung[2]) / radii[2]) ** 2 <= 1
    hu[lungs] = -850.0
    inner = np.argwhere(ndimage.binary_erosion(lungs, iterations=2))[:, ::-1]  # (n, 3) voxel x, y, z
    # vessels: random smooth walks of 1.6 mm thick tubes through the lungs
    for _ in range(6):
        point = inner[rng.integers(len(inner))].astype(np.float64)
        direction = rng.normal(size=3)
        for _ in range(50):
            direction = 0.8 * direction / np.linalg.norm(direction) + 0.3 * rng.normal(size=3)
            point = point + direction * 1.2 / spacing
            box, dist = _ball(hu.shape, point, 0.8, spacing)
            hu[box][(dist <= 0.8) & lungs[box]] = 40.0
    found = {"nodules": [], "excluded": []}
    for kind, count, sizes in (("nodules", rng.integers(1, 4), (4.0, 20.0)), ("excluded", rng.integers(0, 2), (2.0, 3.0))):
        for _ in range(count):
            point = inner[rng.integers(len(inner))]
            diameter = float(rng.uniform(*sizes))
            box, dist = _ball(hu.shape, point, diameter / 2, spacing)
            blob = np.clip(diameter / 2 + 0.5 - dist, 0, 1)  # soft edge
            hu[box] = hu[box] * (1 - blob) + 30.0 * blob
            found[kind].append((*point.tolist(), diameter))
    hu = ndimage.gaussian_filter(hu, 0.6) + rng.normal(0, 15, hu.shape)
    return np.round(hu).astype(np.int16), found["nodules"], found["excluded"]


def generate_luna16(
    root: str | Path, num_scans: int = 12, shape: tuple[int, int, int] = (112, 112, 48), seed: int = 0
) -> Path:
    """Write ``num_scans`` synthetic scans of ``shape`` (x, y, z voxels) and the two CSVs into
    ``root`` in LUNA16's layout, unless a complete set with the same parameters is there.

    A set of the generator's own with other parameters, or an interrupted one, is replaced (only
    the files its marker implies are deleted). Raises :class:`~hsmla_med.errors.DataError`,
    touching nothing, when ``root`` holds files but no marker of this generator (e.g. real data).
    """
    root = Path(root)
    params = {"num_scans": int(num_scans), "shape": [int(n) for n in shape], "seed": int(seed), "version": 1}
    marker = root / _MARKER
    if marker.is_file():
        old = _read_marker(marker)
        if old == {**params, "complete": True} and all((root / f).is_file() for f in _files(params)):
            return root
        # ours but stale or interrupted: remove what it wrote (the marker, rewritten only after
        # this, keeps naming whatever an interruption here leaves)
        for rel in _files(old):
            (root / rel).unlink(missing_ok=True)
    elif root.exists() and not root.is_dir():
        raise DataError(f"{root}: not a folder; cannot write synthetic LUNA16 scans there")
    elif root.exists() and any(root.iterdir()):
        raise DataError(
            f"{root}: not empty and without the synthetic LUNA16 generator's {_MARKER}; refusing to "
            "write synthetic scans into it (choose an empty or new cache_dir)"
        )
    write_json(marker, {**params, "complete": False})
    (root / "subset0").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    annotations, excluded_rows = [], []
    for i in range(num_scans):
        uid = _uid(params["seed"], i)
        spacing = np.array([rng.uniform(0.7, 1.0)] * 2 + [rng.choice([1.25, 2.0, 2.5])])
        geometry = Geometry(rng.uniform(-200, -100, 3), spacing, _direction(rng, i % 3), shape)
        hu, nodules, excluded = _scan(rng, shape, spacing)
        image = sitk.GetImageFromArray(hu)
        image.SetSpacing(spacing.tolist())
        image.SetOrigin(geometry.origin.tolist())
        image.SetDirection(geometry.direction.flatten().tolist())
        sitk.WriteImage(image, str(root / "subset0" / f"{uid}.mhd"))
        for rows, found in ((annotations, nodules), (excluded_rows, excluded)):
            for xc, yc, zc, diameter in found:
                world = voxel_to_world([[xc, yc, zc]], geometry)[0]
                rows.append([uid, *np.round(world, 4).tolist(), round(diameter, 3)])
    for name, rows in (("annotations.csv", annotations), ("annotations_excluded.csv", excluded_rows)):
        with atomic_path(root / name) as tmp, tmp.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(COLUMNS)
            writer.writerows(rows)
    write_json(marker, {**params, "complete": True})
    return root
