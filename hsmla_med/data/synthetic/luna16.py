"""Synthetic chest CT in LUNA16's on-disk format: the embedded default of the LUNA16 pipeline.

The folder is laid out as LUNA16 is distributed, quirks included::

    subset0/ .. subset9/           <seriesuid>.mhd + .raw, scan i in subset{i % 10}
    seg-lungs-LUNA16/              lung masks with the scans' names (.mhd + .zraw): not scans
    CSVFILES/annotations.csv       the nodules
    CSVFILES/candidates.csv        seriesuid,coordX,coordY,coordZ,class (1 near a nodule)
    evaluationScript/annotations/  annotations.csv again, annotations_excluded.csv and
                                   seriesuids.csv (one UID per line, no header)

and no CSV at the top. Options lay the folder out as many users hold it, with ``subset0``
alone (``subsets=1``), and add broken cases for the tests of their refusal (``damage``): a
scan whose compressed voxels (``.zraw``) are cut off, a nodule outside its scan. Without them
the folder is the default dataset's.

``annotations_excluded.csv`` holds, as the real one does, irrelevant findings with
``diameter_mm`` -1 (small 2-3 mm blobs in every scan), findings with their diameter (3-5 mm
nodule-like blobs that are not targets, in odd scans) and, in even scans, a second mark of a
real nodule 0.4 radii off its centre with -1 (the script's 10 mm): a candidate on that nodule
hits both, one just outside it only the excluded finding.

Each scan (int16 Hounsfield units) has its own geometry: in-plane spacing 0.7-1.0 mm, slices 1.25-2.5 mm, and for some scans a direction
other than the identity (x and y flipped, or a rotation about z), so world <-> voxel mapping is
exercised. The body is soft tissue (+40 HU) in air (-1000 HU) with two lungs (-850 HU),
vessel-like tubes (+40 HU, about 1.5 mm thick) through the lungs, and 1-3 spherical nodules of
4-20 mm (+30 HU, soft edge) inside the lungs; the CSVs give world (LPS) millimetres. A
``synthetic.json`` marker, written first as
incomplete and last as complete, makes the generation happen once (an interrupted one is redone)
and marks the folder as the generator's: it never writes into a folder that holds other files
without that marker, and deletes only the files a marker of its own lists.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from scipy import ndimage

from hsmla_med.data.luna16 import COLUMNS, LUNG_MASKS, Geometry, voxel_to_world
from hsmla_med.errors import DataError
from hsmla_med.io import atomic_path, write_json

__all__ = ["DAMAGE", "generate_luna16"]

_MARKER = "synthetic.json"
_PARAMS = ("num_scans", "shape", "seed", "version")
_OPTIONS = {"subsets": 10, "damage": []}  # parameters added later: a marker without them was written with these
#: the broken cases ``damage`` may add (:func:`generate_luna16`)
DAMAGE = ("truncated-zraw", "nodule-outside")
_VERSION = 2  # 2: LUNA16's distributed layout and annotations_excluded.csv's -1 rows
_EVALUATION = "evaluationScript/annotations"
_CSVS = ("CSVFILES/annotations.csv", "CSVFILES/candidates.csv", f"{_EVALUATION}/annotations.csv",
         f"{_EVALUATION}/annotations_excluded.csv", f"{_EVALUATION}/seriesuids.csv")


def _uid(seed: int, index: int) -> str:
    return f"1.3.6.1.4.1.14519.5.2.1.6279.6001.{seed:03d}{index:06d}"


def _subset(index: int, subsets: int) -> str:
    return f"subset{index % subsets}"


def _voxels(params: dict, index: int) -> str:
    """The voxel file's extension of scan ``index``: ``.zraw`` for the cut-off scan of ``damage``."""
    return ".zraw" if index == 0 and "truncated-zraw" in params["damage"] else ".raw"


def _files(params: dict) -> list[str]:
    """The files that the generator writes for ``params``, relative to its folder (version 1
    wrote every scan into subset0 and the two CSVs at the top)."""
    uids = [_uid(params["seed"], i) for i in range(params["num_scans"])]
    if params["version"] < 2:
        return [f"subset0/{uid}{ext}" for uid in uids for ext in (".mhd", ".raw")] + ["annotations.csv", "annotations_excluded.csv"]
    scans = [f"{_subset(i, params['subsets'])}/{uid}{ext}" for i, uid in enumerate(uids) for ext in (".mhd", _voxels(params, i))]
    masks = [f"{LUNG_MASKS}/{uid}{ext}" for uid in uids for ext in (".mhd", ".zraw")]
    return scans + masks + list(_CSVS)


def _read_marker(marker: Path) -> dict:
    """An existing marker's parameters and ``complete`` flag (markers before the flag were
    written last, so complete); :class:`DataError` for a marker this generator did not write."""
    try:
        meta = json.loads(marker.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        meta = None
    if not (
        isinstance(meta, dict)
        and set(_PARAMS) <= set(meta) <= {*_PARAMS, *_OPTIONS, "complete"}
        and isinstance(meta["num_scans"], int)
        and isinstance(meta["seed"], int)
    ):
        raise DataError(
            f"{marker.parent}: its {_MARKER} was not written by the synthetic LUNA16 generator; "
            "refusing to write synthetic scans into this folder (choose another cache_dir)"
        )
    return {"complete": True, **_OPTIONS, **meta}


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


def _blob(hu: np.ndarray, point: np.ndarray, diameter: float, spacing: np.ndarray) -> None:
    """Draw a nodule-like sphere (+30 HU, soft edge) of ``diameter`` mm at voxel ``point`` (x, y, z)."""
    box, dist = _ball(hu.shape, point, diameter / 2, spacing)
    blob = np.clip(diameter / 2 + 0.5 - dist, 0, 1)
    hu[box] = hu[box] * (1 - blob) + 30.0 * blob


def _scan(rng: np.random.Generator, shape_xyz: tuple[int, int, int], spacing: np.ndarray, index: int):
    """HU volume ``(z, y, x)`` int16, lung mask ``(z, y, x)`` uint8 (LUNA16's 3 and 4), and the
    nodules and the excluded findings as voxel x, y, z and diameter (mm; -1 for unknown)."""
    nx, ny, nz = shape_xyz
    z, y, x = np.meshgrid(*(np.arange(n, dtype=np.float32) for n in (nz, ny, nx)), indexing="ij")
    size = np.array([nx, ny, nz]) * spacing  # mm
    centre = size / 2
    xm, ym, zm = x * spacing[0], y * spacing[1], z * spacing[2]
    body = ((xm - centre[0]) / (0.46 * size[0])) ** 2 + ((ym - centre[1]) / (0.40 * size[1])) ** 2 <= 1
    hu = np.where(body, 40.0, -1000.0).astype(np.float32)
    mask = np.zeros(hu.shape, dtype=np.uint8)
    for side, value in ((-1, 3), (1, 4)):
        lung = centre + [side * 0.2 * size[0], 0, 0]
        radii = size * [0.16, 0.28, 0.45]
        mask[((xm - lung[0]) / radii[0]) ** 2 + ((ym - lung[1]) / radii[1]) ** 2 + ((zm - lung[2]) / radii[2]) ** 2 <= 1] = value
    lungs = mask > 0
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
    pick = lambda: inner[rng.integers(len(inner))].astype(np.float64)  # noqa: E731
    nodules = [(pick(), float(rng.uniform(4.0, 20.0))) for _ in range(rng.integers(1, 4))]
    irrelevant = [(pick(), float(rng.uniform(2.0, 3.0)))]  # drawn, listed with diameter -1
    sized = [(pick(), float(rng.uniform(3.0, 5.0)))] if index % 2 else []  # drawn, listed with theirs
    for point, diameter in nodules + irrelevant + sized:
        _blob(hu, point, diameter, spacing)
    excluded = [(*p, -1.0) for p, _ in irrelevant] + [(*p, round(d, 3)) for p, d in sized]
    if index % 2 == 0:  # another reader's mark of the first nodule, off its centre
        point, diameter = nodules[0]
        offset = rng.normal(size=3)
        excluded.append((*(point + 0.4 * diameter / 2 * offset / np.linalg.norm(offset) / spacing), -1.0))
    hu = ndimage.gaussian_filter(hu, 0.6) + rng.normal(0, 15, hu.shape)
    return np.round(hu).astype(np.int16), mask, [(*p, d) for p, d in nodules], excluded


def _candidates(rng: np.random.Generator, uid: str, nodules: list, excluded: list, geometry: Geometry) -> list[list]:
    """``candidates.csv`` rows of a scan: class 1 within 1 mm of each nodule, class 0 on each
    excluded finding (as LUNA16's candidate detectors mark them)."""
    rows = []
    for found, label in ((nodules, 1), (excluded, 0)):
        for *point, _ in found:
            jitter = rng.uniform(-0.5, 0.5, 3) if label else 0.0
            world = voxel_to_world([point], geometry)[0] + jitter
            rows.append([uid, *np.round(world, 4).tolist(), label])
    return rows


def _write_csv(path: Path, header, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, tmp.open("w", newline="") as f:
        writer = csv.writer(f)
        if header:
            writer.writerow(header)
        writer.writerows(rows)


def _write_image(path: Path, voxels_zyx: np.ndarray, geometry: Geometry, compress: bool = False) -> None:
    import SimpleITK as sitk  # imported when writing only: the CLI loads this module for every task

    path.parent.mkdir(parents=True, exist_ok=True)
    image = sitk.GetImageFromArray(voxels_zyx)
    image.SetSpacing(geometry.spacing.tolist())
    image.SetOrigin(geometry.origin.tolist())
    image.SetDirection(geometry.direction.flatten().tolist())
    sitk.WriteImage(image, str(path), useCompression=compress)


def _cut_off(header: Path) -> None:
    """Cut the compressed voxels of ``header`` to half their length, and drop the header's
    CompressedDataSize (an optional field): ITK then inflates what the file holds, reports the
    broken stream on stderr only and reads the rest of the scan as zeros; the pipeline must refuse
    such a file by name instead."""
    zraw = header.with_suffix(".zraw")
    zraw.write_bytes(zraw.read_bytes()[: zraw.stat().st_size // 2])
    header.write_text("".join(line for line in header.read_text().splitlines(keepends=True) if not line.startswith("CompressedDataSize")))


def generate_luna16(
    root: str | Path, num_scans: int = 12, shape: tuple[int, int, int] = (112, 112, 48), seed: int = 0, *,
    subsets: int = 10, damage: Sequence[str] = (),
) -> Path:
    """Write ``num_scans`` synthetic scans of ``shape`` (x, y, z voxels), their lung masks and the
    CSVs into ``root`` in LUNA16's layout (module docstring), unless a complete set with the
    same parameters is there.

    Scan ``i`` goes into ``subset{i % subsets}``. ``damage`` (:data:`DAMAGE`) breaks the folder
    on purpose: ``"truncated-zraw"`` stores scan 0 compressed, its ``.zraw`` cut to half;
    ``"nodule-outside"`` adds to ``annotations.csv`` a nodule of scan 0 that lies outside the
    scan (ten voxels before its first column).

    A set of the generator's own with other parameters, or an interrupted one, is replaced (only
    the files its marker implies are deleted). Raises :class:`~hsmla_med.errors.DataError`,
    touching nothing, when ``root`` holds files but no marker of this generator (e.g. real data).
    """
    root = Path(root)
    if int(subsets) < 1 or not set(damage) <= set(DAMAGE):
        raise ValueError(f"subsets must be at least 1 and damage among {DAMAGE}, got {subsets}, {list(damage)}")
    params = {"num_scans": int(num_scans), "shape": [int(n) for n in shape], "seed": int(seed), "version": _VERSION,
              "subsets": int(subsets), "damage": sorted(set(damage))}
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
    rng = np.random.default_rng(seed)
    rows = {"nodules": [], "excluded": [], "candidates": []}
    uids = [_uid(params["seed"], i) for i in range(num_scans)]
    for i, uid in enumerate(uids):
        spacing = np.array([rng.uniform(0.7, 1.0)] * 2 + [rng.choice([1.25, 2.0, 2.5])])
        geometry = Geometry(rng.uniform(-200, -100, 3), spacing, _direction(rng, i % 3), shape)
        hu, mask, nodules, excluded = _scan(rng, shape, spacing, i)
        scan = root / _subset(i, subsets) / f"{uid}.mhd"
        _write_image(scan, hu, geometry, compress=_voxels(params, i) == ".zraw")
        if _voxels(params, i) == ".zraw":
            _cut_off(scan)
        _write_image(root / LUNG_MASKS / f"{uid}.mhd", mask, geometry, compress=True)
        for key, found in (("nodules", nodules), ("excluded", excluded)):
            for *point, diameter in found:
                world = voxel_to_world([point], geometry)[0]
                rows[key].append([uid, *np.round(world, 4).tolist(), -1 if diameter < 0 else round(diameter, 3)])
        if i == 0 and "nodule-outside" in damage:
            world = voxel_to_world([[-10.0, shape[1] / 2, shape[2] / 2]], geometry)[0]
            rows["nodules"].append([uid, *np.round(world, 4).tolist(), 6.0])
        rows["candidates"] += _candidates(rng, uid, nodules, excluded, geometry)
    for name in ("CSVFILES/annotations.csv", f"{_EVALUATION}/annotations.csv"):
        _write_csv(root / name, COLUMNS, rows["nodules"])
    _write_csv(root / "CSVFILES/candidates.csv", [*COLUMNS[:4], "class"], rows["candidates"])
    _write_csv(root / _EVALUATION / "annotations_excluded.csv", COLUMNS, rows["excluded"])
    _write_csv(root / _EVALUATION / "seriesuids.csv", None, [[uid] for uid in uids])
    write_json(marker, {**params, "complete": True})
    return root
