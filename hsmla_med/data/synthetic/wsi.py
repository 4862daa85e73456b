"""Synthetic whole-slide images in the on-disk format of CAMELYON16, the default slide data.

CAMELYON16 (lymph-node sections, breast-cancer metastases) is ~700 GB behind a registration, so a
user without it gets this stand-in with the same layout::

    training/normal/normal_001.tif ...        training/tumor/tumor_001.tif ...
    training/lesion_annotations/tumor_001.xml ...
    testing/images/test_001.tif ...           testing/lesion_annotations/test_001.xml ...
    testing/Ground_Truth/Masks/test_001_Mask.tif ...
    testing/reference.csv                     slide_labels.csv
    synthetic.json

Slides are RGB pyramidal tiled JPEG TIFFs (:func:`hsmla_med.io.tiff.write_pyramidal_tiff`)
that OpenSlide opens, with the microns per pixel in the TIFF resolution. Their sides are odd (an
even side asked loses its last pixel), so that the levels, halved and rounded up, have downsamples
that are not whole numbers (1.9995, 3.9985, ... for 4095 x 3071), as real pyramids do (Aperio's
CMU-1.svs: 4.000121): code that assumes ``level_downsamples`` are integers fails on them. Each shows one to three
tissue islands on bright glass, coloured by Beer-Lambert mixing of haematoxylin and eosin: pink
fibrous stroma with small purple nuclei. Tumour slides add one to three metastases, a few hundred
pixels across at the default size, of clearly different texture: denser, larger and darker nuclei
on a more purple background, and, where the tissue leaves room, an isolated tumour cell cluster
(100 µm across) and an elongated lesion of 300 x 100 µm, smaller than half a 256-pixel patch. They are outlined in ASAP XML as in CAMELYON16: level-0 pixel
coordinates, group ``Tumor`` on even-numbered slides and the ``_0``/``_2`` convention on
odd-numbered ones, where a ``_2`` polygon cuts a region of normal tissue (painted as such) out of
a ``_0`` metastasis. Each test slide with metastases has its ground-truth mask TIFF, as the
challenge's ``Ground_Truth/Masks`` (0/255, ASAP's rasterisation of the XML and its
nearest-neighbour pyramid; what ``Evaluation_FROC.py`` reads). ``reference.csv`` lists the test slides as CAMELYON16's does
(``test_001,Tumor,Micro`` / ``test_002,Normal``, no header); odd-numbered test slides have tumour.
``slide_labels.csv`` gives the diagnosis of every slide, training and test, as CLAM's slide-label
training reads it (``slide_id,label,split``: 1 tumour, 0 normal; ``train`` or ``test``), for
multiple-instance learning from slide labels alone.

The default ``mpp`` of 0.972 µm is 4 x 0.243 µm, the level-0 pixel of CAMELYON16's Radboudumc
scanner: a slide is its level 2 (about a 10x objective), at which nuclei are still a few pixels
wide, and a 4096 x 3072 slide covers 4 x 3 mm. Nuclei have physical sizes (lymphocytes ~7 µm,
tumour nuclei ~12 µm) and so shrink in pixels as ``mpp`` grows; tissue and metastases scale with
the slide. Nothing here is real tissue.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from scipy import ndimage as ndi
from scipy.spatial.distance import pdist
from skimage.measure import approximate_polygon, find_contours
import torch

from hsmla_med.io.tiff import write_pyramidal_tiff
from hsmla_med.io import atomic_path, write_json
from hsmla_med.data.asap import asap_mask, read_asap_xml
from hsmla_med.io.annotations import write_asap_xml

__all__ = ["generate_camelyon16", "DEFAULT_STAIN", "OTHER_STAIN", "SLIDE_LABELS", "TUMOURS"]

# 2: odd sides, fractional level downsamples; 3: an ITC cluster and a lesion under half a patch; 4: test masks; 5: slide_labels.csv
_GENERATOR_VERSION = 5
SLIDE_LABELS = "slide_labels.csv"  # every slide's diagnosis, CLAM's slide_id,label,split
_MIN_SIDE = 256  # pixels; smaller slides leave no room for tissue islands with metastases

# Optical density per unit stain (Ruifrok & Johnston's H&E vectors, normalised), and of glass.
_OD_HAEMATOXYLIN = np.array([0.650, 0.704, 0.286], dtype=np.float32)
_OD_EOSIN = np.array([0.072, 0.990, 0.105], dtype=np.float32)
_OD_GLASS = np.array([0.060, 0.069, 0.056], dtype=np.float32)  # about (240, 238, 241)
# generate_camelyon16's stain: (haematoxylin, eosin) as above; and another laboratory's H&E for the
# same tissue stained elsewhere (stain normalisation's tests and benchmark): a bluer haematoxylin
# 1.25 times as strong and a more purple eosin 0.8 times as strong, 24 degrees apart (Macenko's
# reference stains are 22 degrees apart, Ruifrok's above 39)
DEFAULT_STAIN = (_OD_HAEMATOXYLIN, _OD_EOSIN)
OTHER_STAIN = ((0.687, 0.949, 0.437), (0.136, 0.688, 0.384))
_NOISE = 2.5  # grey levels of sensor noise

# Tissue classes: nucleus radius (µm), share of the area covered by nuclei, haematoxylin in
# nuclei and around them, eosin of the background.
_NORMAL = dict(radius_um=3.5, coverage=0.20, nucleus=(0.85, 1.15), haematoxylin=0.06, eosin=0.45)
_TUMOUR = dict(radius_um=6.0, coverage=0.45, nucleus=(1.35, 1.75), haematoxylin=0.22, eosin=0.28)
# generate_camelyon16's ``tumour``: ``clear``, the default above, found by its shapes alone; and
# ``subtle``, a tumour whose nuclei are only a little larger and denser than the normal tissue's
# but darker (hyperchromatic), so its main cue is the strength of the haematoxylin, the thing a
# second laboratory's stain changes (the stain-shift benchmark, hsmla-med bench --only stain)
TUMOURS = {"clear": _TUMOUR, "subtle": dict(radius_um=4.0, coverage=0.24, nucleus=(1.25, 1.55), haematoxylin=0.10, eosin=0.40)}

_MIN_METASTASIS = 0.02  # smallest metastasis radius, as a share of the slide's shorter side
_MACRO_UM = 2000.0  # CAMELYON: a macro-metastasis is larger than 2 mm, a micro-metastasis smaller
# Small lesions of every tumour slide (where the tissue leaves room), the cases the official FROC
# treats apart: semi-axes in µm of an isolated tumour cell cluster (100 µm across: under the 200 µm
# ITC limit, a detection on it counts neither way) and of a lesion 300 x 100 µm, above the limit but
# covering less than half of a 256-pixel patch at 0.972 µm (a patch-grid lesion rule loses it).
_SMALL_LESIONS_UM = ((50.0, 50.0), (150.0, 50.0))


def generate_camelyon16(
    root: str | os.PathLike,
    num_normal: int = 4,
    num_tumor: int = 4,
    num_test: int = 2,
    size: tuple[int, int] = (4096, 3072),
    mpp: float = 0.972,
    seed: int = 0,
    stain: tuple[Sequence[float], Sequence[float]] | None = None,
    tumour: str = "clear",
) -> Path:
    """Write a synthetic CAMELYON16-format dataset under ``root`` and return ``root``.

    Args:
        root: dataset folder; created if missing.
        num_normal, num_tumor: training slides in ``training/normal`` and ``training/tumor``;
            every tumour slide has an ASAP XML file in ``training/lesion_annotations``.
        num_test: slides in ``testing/images``; odd-numbered ones have metastases (and XML files
            in ``testing/lesion_annotations``), and ``testing/reference.csv`` lists them all.
            ``slide_labels.csv`` lists every slide with its label and split.
        size: (width, height) of level 0 in pixels, each at least 256; an even side is cut by
            one pixel (fractional level downsamples, see the module's docstring).
        mpp: microns per pixel of level 0, stored in the TIFF resolution.
        seed: a slide depends only on ``seed`` and its name, so the same seed gives the same
            pixels, and a larger dataset starts with the slides of a smaller one.
        stain: (haematoxylin, eosin) optical densities (red, green, blue) per unit of stain, as
            another laboratory's staining would colour the same tissue; ``None``: Ruifrok &
            Johnston's H&E vectors. The same seed with another stain gives the same tissue
            (same shapes, nuclei and noise) in other colours.
        tumour: the metastases' tissue, one of :data:`TUMOURS`: ``clear`` (larger, denser and
            darker nuclei than the normal tissue's) or ``subtle`` (nearly the normal nuclei's
            size and density, darker), whose detection depends on the stain's strength.

    Returns at once if ``root/synthetic.json`` records the same parameters and the files it lists
    exist. Every file is written under a temporary name and renamed, ``synthetic.json`` last, so a
    folder with one is complete. Raises :class:`FileExistsError` rather than overwrite a
    ``synthetic.json`` that this generator did not write.
    """
    root = Path(root)
    width, height = (int(n) for n in size)
    if min(width, height) < _MIN_SIDE:
        raise ValueError(f"size must be (width, height) of at least {_MIN_SIDE} pixels, got {tuple(size)}")
    if min(num_normal, num_tumor, num_test) < 0 or num_normal + num_tumor == 0:
        raise ValueError("need num_normal, num_tumor, num_test >= 0 and at least one training slide")
    if not (math.isfinite(mpp) and mpp > 0):
        raise ValueError(f"mpp must be positive, got {mpp}")
    seed = int(seed)
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    if tumour not in TUMOURS:
        raise ValueError(f"tumour must be one of {sorted(TUMOURS)}, got {tumour!r}")
    if stain is not None:
        stain = np.asarray(stain, dtype=np.float32)
        if stain.shape != (2, 3) or not np.isfinite(stain).all() or (stain < 0).any() or not (stain.sum(axis=1) > 0).all():
            raise ValueError(f"stain must be two non-negative RGB optical densities (haematoxylin, eosin), got {stain.tolist()}")
    width, height = (n - 1 + n % 2 for n in (width, height))  # odd: the pyramid's downsamples are fractional
    params = {
        "version": _GENERATOR_VERSION,
        "seed": seed,
        "size": [width, height],
        "mpp": float(mpp),
        "num_normal": int(num_normal),
        "num_tumor": int(num_tumor),
        "num_test": int(num_test),
    }
    if stain is not None:  # absent by default: the datasets written before it stay valid
        params["stain"] = stain.tolist()
    if tumour != "clear":  # likewise
        params["tumour"] = tumour
    marker = root / "synthetic.json"
    if marker.is_file():
        meta = _read_marker(marker)
        if meta["generator"] == params and all((root / f).is_file() for f in meta["files"]):
            return root
        # Ours but stale: remove it first (the folder is incomplete until the new one is written),
        # and the files it lists, so that a smaller dataset leaves no slides of the larger one.
        marker.unlink()
        for rel in meta["files"]:
            (root / rel).unlink(missing_ok=True)

    # (slide file, annotation file or None, rng key); a slide's pixels depend only on its key.
    slides = [(f"training/normal/normal_{i:03d}.tif", None, (seed, 0, i)) for i in range(1, num_normal + 1)]
    for i in range(1, num_tumor + 1):
        slides.append((f"training/tumor/tumor_{i:03d}.tif", f"training/lesion_annotations/tumor_{i:03d}.xml", (seed, 1, i)))
    for i in range(1, num_test + 1):
        xml = f"testing/lesion_annotations/test_{i:03d}.xml" if i % 2 else None  # odd numbers: metastases
        slides.append((f"testing/images/test_{i:03d}.tif", xml, (seed, 2, i)))
    files, reference, labels = [], [], []
    for slide_rel, xml_rel, key in slides:
        number = key[2]
        exclusion = xml_rel is not None and number % 2 == 1
        image, polygons = _slide(np.random.default_rng(key), width, height, mpp, xml_rel is not None, exclusion, stain, TUMOURS[tumour])
        write_pyramidal_tiff(root / slide_rel, image, mpp, compression="jpeg")
        del image
        files.append(slide_rel)
        if xml_rel is not None:
            write_asap_xml(root / xml_rel, polygons)
            files.append(xml_rel)
        if xml_rel is not None and slide_rel.startswith("testing/"):  # the evaluation's ground-truth mask, as ASAP makes it
            mask_rel = f"testing/Ground_Truth/Masks/{Path(slide_rel).stem}_Mask.tif"
            mask = asap_mask(read_asap_xml(root / xml_rel), (width, height), 1).astype(np.uint8) * 255
            write_pyramidal_tiff(root / mask_rel, mask, mpp, tile=512, nearest=True)
            files.append(mask_rel)
        if slide_rel.startswith("testing/"):
            reference.append(_reference_line(Path(slide_rel).stem, polygons, mpp))
        labels.append(f"{Path(slide_rel).stem},{int(xml_rel is not None)},{'test' if slide_rel.startswith('testing/') else 'train'}")
    if num_test:
        with atomic_path(root / "testing" / "reference.csv") as tmp:
            tmp.write_text("".join(line + "\n" for line in reference))
        files.append("testing/reference.csv")
    with atomic_path(root / SLIDE_LABELS) as tmp:
        tmp.write_text("slide_id,label,split\n" + "".join(line + "\n" for line in labels))
    files.append(SLIDE_LABELS)
    write_json(
        marker,
        {
            "name": "CAMELYON16-synthetic",
            "description": "Synthetic H&E-like slides in the CAMELYON16 layout (textures, not tissue), "
            "written by hsmla_med.data.synthetic.wsi as the default data.",
            "synthetic": True,
            "generator": params,
            "files": files,
        },
    )
    return root


def _read_marker(marker: Path) -> dict:
    """The contents of an existing ``synthetic.json``; refuse to touch one we did not write."""
    try:
        meta = json.loads(marker.read_text())
    except ValueError:
        meta = None
    if not (isinstance(meta, dict) and isinstance(meta.get("generator"), dict) and isinstance(meta.get("files"), list)):
        raise FileExistsError(f"{marker}: not written by the synthetic CAMELYON16 generator; refusing to overwrite it")
    return meta


def _slide(rng: np.random.Generator, width: int, height: int, mpp: float, tumour: bool, exclusion: bool, stain: np.ndarray | None = None,
           kind: dict = _TUMOUR):
    """One slide: its RGB level 0 (uint8, (height, width, 3)) and its outlines; ``stain``: the
    (2, 3) haematoxylin and eosin optical densities (default Ruifrok & Johnston's); ``kind``: the
    metastases' tissue (:data:`TUMOURS`).

    The outlines are ``(group, points)`` with points an (n, 2) array of (x, y) level-0 pixels:
    group ``Tumor`` (or ``_0`` with ``exclusion``) for each metastasis and, with ``exclusion``,
    one ``_2`` hole of normal tissue inside the first metastasis. Without ``tumour``: none.
    """
    soft, tissue = _tissue(rng, width, height)
    tumour_mask = np.zeros((height, width), dtype=bool)
    polygons = []
    if tumour:
        tumour_mask, polygons = _metastases(rng, tissue, exclusion, mpp)

    # Stain concentrations: eosin of the fibrous background, haematoxylin of nuclei and cytoplasm.
    fibres = _smooth_noise(rng, height, width, cell=max(4, round(12 / mpp)), stretch=4)
    eosin = np.float32(_NORMAL["eosin"]) * (1 + 0.35 * fibres)
    haematoxylin = np.full((height, width), _NORMAL["haematoxylin"], dtype=np.float32)
    if polygons:
        eosin[tumour_mask] *= np.float32(kind["eosin"] / _NORMAL["eosin"])
        haematoxylin[tumour_mask] = kind["haematoxylin"]
    _nuclei(rng, haematoxylin, tissue & ~tumour_mask, mpp, _NORMAL)
    if polygons:
        _nuclei(rng, haematoxylin, tumour_mask, mpp, kind)

    # Beer-Lambert: transmitted light falls exponentially with the optical density of the stains,
    # 255 * exp(-density) = exp(log(255) - density). In place: these are the costly passes.
    haematoxylin *= soft
    eosin *= soft
    # Uniform noise with standard deviation _NOISE (random bytes: the fastest draw numpy has).
    grain = np.frombuffer(rng.bytes(height * width), dtype=np.uint8).reshape(height, width).astype(np.float32)
    grain -= np.float32(127.5)
    grain *= np.float32(_NOISE / 73.9)
    image = np.empty((height, width, 3), dtype=np.uint8)
    channel, term = np.empty_like(soft), np.empty_like(soft)
    od_haematoxylin, od_eosin = (_OD_HAEMATOXYLIN, _OD_EOSIN) if stain is None else stain
    for c in range(3):
        np.multiply(haematoxylin, -od_haematoxylin[c], out=channel)
        channel += np.multiply(eosin, -od_eosin[c], out=term)
        channel += np.float32(math.log(255) - _OD_GLASS[c])
        np.exp(channel, out=channel)
        channel += grain
        np.clip(channel, 0, 255, out=channel)
        image[..., c] = channel
    return image, polygons


def _tissue(rng: np.random.Generator, width: int, height: int):
    """One to three smooth irregular islands: a soft mask (float32 0..1, blurred edge a few
    pixels wide) and the hard mask (soft >= 0.5) whose area gets nuclei."""
    cell = 8  # the shapes are computed on a grid this much coarser, then interpolated
    ch, cw = height // cell + 2, width // cell + 2
    # Grid point i lies at pixel (i + 0.5) * cell - 0.5, where _resize puts it.
    y, x = (np.mgrid[0:ch, 0:cw].astype(np.float32) + 0.5) * cell - 0.5
    side = min(width, height)
    count = int(rng.integers(1, 4))
    field = np.full((ch, cw), -1.0, dtype=np.float32)
    for _ in range(count):
        radius = side * rng.uniform(0.22, 0.32) / math.sqrt(count)
        cx = rng.uniform(0.25, 0.75) * width
        cy = rng.uniform(0.25, 0.75) * height
        reach = _star(rng, x - cx, y - cy, radius, harmonics=6, roughness=0.45)
        field = np.maximum(field, 1 - reach)
    field += 0.08 * _smooth_noise(rng, ch, cw, cell=6)
    # 1 - reach grows by ~1/radius per pixel, so this edge is ~3 pixels wide at level 0. The
    # field is interpolated before the clipping, which keeps the outline smooth.
    edge = 3 * math.sqrt(count) / (side * 0.27)
    soft = _resize(field, width, height, cell)
    soft *= np.float32(1 / edge)
    soft += np.float32(0.5)
    np.clip(soft, 0, 1, out=soft)
    return soft, soft >= 0.5


def _metastases(rng: np.random.Generator, tissue: np.ndarray, exclusion: bool, mpp: float):
    """The small lesions of :data:`_SMALL_LESIONS_UM` (first, so that the metastases, which
    shrink to the room left, cannot crowd them out) and one to three metastases well inside the
    tissue: the tumour mask and the outlines.

    With ``exclusion`` the first metastasis is larger and has a hole of normal tissue, outlined
    as ``_2`` inside its ``_0`` outline; otherwise outlines are in group ``Tumor``.
    """
    height, width = tissue.shape
    side = min(width, height)
    cell = 8
    # The largest radius a metastasis centred on each coarse grid point may have: its outline
    # (within 1.3 radii) stays 0.2 radii inside the tissue and clear of the ones placed before.
    grid_y, grid_x = np.mgrid[0:height:cell, 0:width:cell]
    room = ndi.distance_transform_edt(np.pad(tissue[::cell, ::cell], 1))[1:-1, 1:-1] * (cell / 1.5)
    mask = np.zeros_like(tissue)
    polygons = []
    for a, b in ((u / mpp for u in axes) for axes in _SMALL_LESIONS_UM):
        fits = np.flatnonzero(room >= a)
        if not fits.size:
            continue
        pick = rng.choice(fits)
        py, px = int(grid_y.flat[pick]), int(grid_x.flat[pick])
        room = np.minimum(room, (np.hypot(grid_y - py, grid_x - px) - 8) / 1.4 - a)
        half, angle = int(math.ceil(a)) + 2, rng.uniform(0, np.pi)
        y0, y1, x0, x1 = max(0, py - half), min(height, py + half), max(0, px - half), min(width, px + half)
        dy, dx = np.mgrid[y0 - py : y1 - py, x0 - px : x1 - px]
        u, v = dx * math.cos(angle) + dy * math.sin(angle), dy * math.cos(angle) - dx * math.sin(angle)
        region = ((u / a) ** 2 + (v / b) ** 2 <= 1) & tissue[y0:y1, x0:x1]
        mask[y0:y1, x0:x1] |= region
        polygons += [("_0" if exclusion else "Tumor", points) for points in _outlines(region, x0, y0)]
    for index in range(int(rng.integers(1, 4))):
        holed = exclusion and index == 0
        radius = side * (rng.uniform(0.075, 0.09) if holed else rng.uniform(0.04, 0.07))
        radius = min(radius, float(room.max()))  # smaller where the tissue leaves no room
        if radius < _MIN_METASTASIS * side:
            if index == 0:
                raise RuntimeError(f"no room for a metastasis in the tissue of a {width} x {height} slide")
            break
        pick = rng.choice(np.flatnonzero(room >= radius))
        py, px = int(grid_y.flat[pick]), int(grid_x.flat[pick])
        room = np.minimum(room, (np.hypot(grid_y - py, grid_x - px) - 8) / 1.4 - radius)

        # The region and its hole in a box around the centre; both are star-shaped blobs.
        half = int(math.ceil(1.35 * radius)) + 2
        y0, y1, x0, x1 = max(0, py - half), min(height, py + half), max(0, px - half), min(width, px + half)
        y, x = np.mgrid[y0:y1, x0:x1].astype(np.float32)
        region = _star(rng, x - px, y - py, radius, harmonics=5, roughness=0.3) <= 1
        region = ndi.binary_fill_holes(region & tissue[y0:y1, x0:x1])
        hole = np.zeros_like(region)
        if holed:  # within 0.4 radii: well inside the region, which reaches at least 0.7
            hole = _star(rng, x - px, y - py, 0.35 * radius, harmonics=3, roughness=0.15) <= 1
        mask[y0:y1, x0:x1] |= region & ~hole
        group = "_0" if exclusion else "Tumor"
        polygons += [(group, points) for points in _outlines(region, x0, y0)]
        if holed:
            polygons += [("_2", points) for points in _outlines(hole, x0, y0)]
    return mask, polygons


def _star(rng: np.random.Generator, dx: np.ndarray, dy: np.ndarray, radius: float, harmonics: int, roughness: float):
    """Distance from the centre relative to a random star-shaped outline: <= 1 inside.

    The outline's radius is ``radius`` times 1 plus random cosines of orders 2..``harmonics``
    whose amplitudes add up to ``roughness`` at most (so it stays within 1 +- ``roughness``).
    """
    orders = np.arange(2, harmonics + 1)
    amplitude = rng.dirichlet(np.ones(orders.size)) * roughness * rng.uniform(0.5, 1.0)
    phase = rng.uniform(0, 2 * np.pi, orders.size)
    angle = np.arctan2(dy, dx)
    outline = np.ones_like(angle)
    for k, a, p in zip(orders, amplitude, phase):
        outline += np.float32(a) * np.cos(k * angle + np.float32(p))
    return np.hypot(dx, dy) / (np.float32(radius) * outline)


def _nuclei(rng: np.random.Generator, haematoxylin: np.ndarray, where: np.ndarray, mpp: float, kind: dict) -> None:
    """Stamp elliptical nuclei of ``kind`` into ``haematoxylin`` at random points of ``where``.

    One nucleus per square of a grid, anywhere in it (a jittered grid): cells pack evenly, so
    even a small metastasis shows the coverage of its kind rather than a lucky draw. Kernels of
    three sizes and four orientations are rasterised once; each nucleus picks one, and the
    stamps of all nuclei sharing a kernel are written with one fancy-indexing assignment.
    """
    height, width = haematoxylin.shape
    radius = max(1.0, kind["radius_um"] / mpp)
    spacing = radius * math.sqrt(math.pi / kind["coverage"])
    grid_y, grid_x = np.meshgrid(np.arange(0, height, spacing), np.arange(0, width, spacing), indexing="ij")
    cy = (grid_y + rng.uniform(0, spacing, grid_y.shape)).astype(np.intp).ravel()
    cx = (grid_x + rng.uniform(0, spacing, grid_x.shape)).astype(np.intp).ravel()
    keep = (cy < height) & (cx < width)
    cy, cx = cy[keep], cx[keep]
    keep = where[cy, cx]
    cy, cx = cy[keep], cx[keep]
    strength = rng.uniform(*kind["nucleus"], cy.size).astype(np.float32)
    kernel = rng.integers(0, 12, cy.size)
    for k in range(12):
        scale, angle = (0.8, 1.0, 1.25)[k // 4], k % 4 * np.pi / 4
        a, b = radius * scale * 1.2, radius * scale / 1.2  # semi-axes: slightly elongated
        reach = int(math.ceil(a)) + 1
        oy, ox = np.mgrid[-reach : reach + 1, -reach : reach + 1]
        u = ox * math.cos(angle) + oy * math.sin(angle)
        v = -ox * math.sin(angle) + oy * math.cos(angle)
        # Soft edge one pixel wide: weight 1 inside, falling to 0 across the outline.
        weight = np.clip((1 - np.sqrt((u / a) ** 2 + (v / b) ** 2)) * b + 0.5, 0, 1)
        oy, ox, weight = oy[weight > 0], ox[weight > 0], weight[weight > 0].astype(np.float32)
        sel = kernel == k
        py = np.clip(cy[sel, None] + oy, 0, height - 1)
        px = np.clip(cx[sel, None] + ox, 0, width - 1)
        haematoxylin[py, px] = np.maximum(haematoxylin[py, px], strength[sel, None] * weight)


def _smooth_noise(rng: np.random.Generator, height: int, width: int, cell: int, stretch: int = 1) -> np.ndarray:
    """Smooth random field (float32, about unit scale) with features ~``cell`` pixels across,
    ``stretch`` times longer horizontally: blurred noise on a coarse grid, interpolated."""
    coarse = rng.standard_normal((height // cell + 2, width // (cell * stretch) + 2)).astype(np.float32)
    coarse = ndi.gaussian_filter(coarse, 0.7)
    coarse /= max(float(coarse.std()), 1e-6)
    return _resize(coarse, width, height, (cell, cell * stretch))


def _resize(coarse: np.ndarray, width: int, height: int, cell) -> np.ndarray:
    """Bilinear interpolation of a coarse grid onto ``height`` x ``width`` pixels: grid point
    ``i`` lies at pixel ``(i + 0.5) * cell - 0.5``; ``cell`` is (y, x) or one number for both.
    The grid must reach past the image (at least ``size / cell + 1`` points)."""
    scale = (float(cell), float(cell)) if np.isscalar(cell) else tuple(float(c) for c in cell)
    full = torch.nn.functional.interpolate(
        torch.from_numpy(coarse)[None, None], scale_factor=scale, mode="bilinear", recompute_scale_factor=False
    )
    return np.ascontiguousarray(full[0, 0, :height, :width].numpy())


def _outlines(mask: np.ndarray, x0: int, y0: int) -> list[np.ndarray]:
    """Simplified outlines of the pieces of ``mask`` as (n, 2) (x, y) arrays, offset by the
    mask's position; each polygon is open (ASAP does not repeat the first point)."""
    padded = np.pad(mask, 1).astype(np.float32)  # a piece touching the box edge still closes
    result = []
    for contour in find_contours(padded, 0.5):
        points = approximate_polygon(contour, tolerance=1.0)[:-1]
        if len(points) >= 3:
            result.append(np.column_stack([points[:, 1] + x0 - 1, points[:, 0] + y0 - 1]))
    return result


def _reference_line(name: str, polygons: list[tuple[str, np.ndarray]], mpp: float) -> str:
    """The slide's line of ``reference.csv``: ``name,Normal`` or ``name,Tumor,Macro|Micro`` by the
    largest metastasis (its longest vertex-to-vertex extent)."""
    tumours = [points for group, points in polygons if group != "_2"]
    if not tumours:
        return f"{name},Normal"
    extent = max(float(pdist(points).max()) for points in tumours)
    return f"{name},Tumor,{'Macro' if extent * mpp > _MACRO_UM else 'Micro'}"
