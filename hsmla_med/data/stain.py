"""H&E stain: one Macenko stain matrix per slide, the patch normalisation it gives, and HED-space
stain augmentation, as MONAI transforms.

Stain colour differs between hospitals (stain batches, staining times, scanners), the first thing
that breaks a pathology model on another centre's slides. Macenko et al. (2009) find the two stain
directions of an image in optical density (OD) space; normalisation expresses every pixel in
stain concentrations and re-colours them with a reference stain matrix and reference maximum
concentrations.

MONAI's ``NormalizeHEStains`` (and torchstain) estimate the stain matrix of each patch from that
patch alone, so two overlapping patches of one slide are normalised differently (MONAI #4015),
and a patch of nuclei only, or of stroma only, gets a matrix fitted to one stain. Here the matrix
is the slide's: estimated once from tissue tiles read at the patches' level, spread over the
tissue a low-resolution picture of the whole slide shows (:func:`slide_stain`; never all of
level 0: a CAMELYON16 slide is 100,000 x 200,000 pixels), cached beside the slide's patch grid, and applied to every patch as a pointwise per-pixel map
(:func:`normalize_stain`): a pixel value gives the same normalised value in every patch it is in.

What comes from MONAI: the reference stain matrix and maximum concentrations
(:data:`REFERENCE_STAINS`, :data:`REFERENCE_MAX_CONCENTRATIONS`: ``NormalizeHEStains``' defaults,
Macenko's standard reference), and the estimation steps of its ``ExtractHEStains``. The
estimation is hand-written (:func:`estimate_stains`) because ``ExtractHEStains`` (MONAI 1.6) does
not fit a slide: it drops every pixel with *any* channel's OD below ``beta``, which discards
eosin-rich pixels (eosin absorbs green; their red OD is small) and pulls the eosin vector toward
haematoxylin (on a synthetic slide, cosine 0.968 to the true eosin vector against 0.999 here,
where a pixel is dropped when its OD vector is shorter than ``beta``); it orders the two vectors
by their red/blue ratio, which puts eosin first for its own reference matrix (haematoxylin's
red/blue is 1.39 there, eosin's 0.39), where Macenko's implementations put first the vector with
the larger red OD (haematoxylin absorbs red); and it takes one scalar glass brightness, where a
slide's glass has a tint (per-channel ``background`` here).

HED augmentation (:class:`RandHEDJitterd`): Tellez et al. (2018), stain amounts from
scikit-image's ``rgb2hed`` (Ruifrok & Johnston's colour deconvolution) scaled and shifted per
stain by random amounts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from monai.config import KeysCollection
from monai.transforms import MapTransform, RandomizableTransform
from monai.utils import convert_to_numpy, convert_to_tensor
from skimage.color import rgb2hed, rgb_from_hed

from hsmla_med.data.slides import open_slide, read_region, select_level, slide_mpp, thumbnail, tissue_mask
from hsmla_med.errors import ConfigError
from hsmla_med.io import atomic_path, read_npz_cache

__all__ = [
    "REFERENCE_STAINS", "REFERENCE_MAX_CONCENTRATIONS", "REFERENCE_BACKGROUND", "METHODS", "SlideStain", "optical_density",
    "estimate_stains", "slide_stain", "normalize_stain", "NormalizeStaind", "RandHEDJitterd", "stain_normalization", "hed_jitter",
]

log = logging.getLogger("hsmla_med")

# Macenko's standard reference (MONAI NormalizeHEStains' target_he and max_cref): columns
# haematoxylin, eosin; rows the OD of red, green, blue per unit concentration.
REFERENCE_STAINS = np.array([[0.5626, 0.2159], [0.7201, 0.8012], [0.4062, 0.5581]])
REFERENCE_MAX_CONCENTRATIONS = np.array([1.9705, 1.0308])
REFERENCE_BACKGROUND = 240.0  # Macenko's transmitted light Io (MONAI's tli): the normalised glass
METHODS = ("macenko",)

_VERSION = 2  # of the cached estimate, in its key
# (min_size, max_size) of the picture the tissue mask is computed on (tissue_mask's defaults): by
# default the stains are estimated from exactly the pixels it calls tissue.
_PICTURE = (2048, 4096)
_TILES = 64  # tiles read at the patches' level per slide (slide_stain's default)
_TILE = 256  # their side, pixels of that level: 64 of them, 4 million pixels, a second's reading
_MAX_PIXELS = 1 << 20  # tissue pixels used at most (evenly spaced): the estimate needs no more
_MIN_PIXELS = 1000  # fewer stained tissue pixels than this: no estimate (the reference parameters)
_GLASS_GREY = 200  # non-tissue pixels at least this bright (mean of RGB) are glass: black scanner margins and pen excluded
_MIN_GLASS = 1000  # fewer glass pixels than this: background REFERENCE_BACKGROUND in every channel


@dataclass(frozen=True)
class SlideStain:
    """A slide's stain parameters.

    Attributes:
        stains: float64 ``(3, 2)``: unit OD vectors of haematoxylin (column 0) and eosin
            (column 1), rows red, green, blue.
        max_concentrations: float64 ``(2,)``: the 99th percentile of each stain's concentration
            over the slide's tissue pixels.
        background: float64 ``(3,)``: the brightness ``Io`` of the slide's glass per channel, so
            that ``OD = -log((I + 1) / Io)`` is 0 on glass.
    """

    stains: np.ndarray
    max_concentrations: np.ndarray
    background: np.ndarray


def _reference() -> SlideStain:
    """The reference parameters: a slide without enough stain to estimate is taken as stained with the reference stains."""
    return SlideStain(REFERENCE_STAINS.copy(), REFERENCE_MAX_CONCENTRATIONS.copy(), np.full(3, REFERENCE_BACKGROUND))


def optical_density(rgb: np.ndarray, background: np.ndarray | float = REFERENCE_BACKGROUND) -> np.ndarray:
    """Beer-Lambert optical density ``-log((I + 1) / Io)``, 0 for pixels at least as bright as the glass.

    Args:
        rgb: intensities 0..255, ``(..., 3)``.
        background: ``Io``, one per channel ``(3,)`` or one for all.

    Returns:
        float64 ``(..., 3)``, >= 0.
    """
    background = np.asarray(background, np.float64)
    return -np.log(np.minimum(np.asarray(rgb, np.float64) + 1.0, background) / background)


def estimate_stains(rgb: np.ndarray, background: np.ndarray | float = REFERENCE_BACKGROUND, alpha: float = 1.0,
                    beta: float = 0.15) -> tuple[np.ndarray, np.ndarray]:
    """Macenko's stain matrix and maximum concentrations of a set of pixels (of tissue).

    Pixels whose OD vector is shorter than ``beta`` (nearly transparent) are dropped; the others'
    OD is projected onto the plane of the two largest eigenvectors of its covariance, and the
    stain vectors are the directions at the ``alpha`` and ``100 - alpha`` percentiles of the angle
    in that plane (robust extremes); haematoxylin is the one with the larger red OD. The
    concentrations solve ``OD = stains @ c`` in the least-squares sense.

    Args:
        rgb: intensities 0..255, ``(n, 3)``.
        background: glass brightness ``Io`` (see :func:`optical_density`).
        alpha: percentile (0..50) of the extreme angles.
        beta: shortest OD vector kept.

    Returns:
        ``(stains, max_concentrations)``: float64 ``(3, 2)`` unit columns (haematoxylin, eosin)
        and float64 ``(2,)`` the 99th percentile of each stain's concentration.

    Raises:
        ValueError: fewer than 1000 pixels above ``beta``, or the pixels hold one stain direction only.
    """
    od = optical_density(np.asarray(rgb).reshape(-1, 3), background)
    od = od[np.linalg.norm(od, axis=1) >= beta]
    if len(od) < _MIN_PIXELS:
        raise ValueError(f"{len(od)} stained pixels (OD >= {beta}): too few to estimate the stains")
    _, vectors = np.linalg.eigh(np.cov(od.T))
    # In-plane axes with the mean OD at angle 0: the stained pixels lie in the cone between the two
    # stains around it, so their angles never wrap across +-pi whatever signs eigh gave.
    mean = vectors[:, 1:] @ (vectors[:, 1:].T @ od.mean(axis=0))
    first = mean / np.linalg.norm(mean)
    second = np.cross(vectors[:, 0], first)
    projected = od @ np.stack([first, second], axis=1)
    angles = np.percentile(np.arctan2(projected[:, 1], projected[:, 0]), [alpha, 100 - alpha])
    ends = np.outer(first, np.cos(angles)) + np.outer(second, np.sin(angles))  # (3, 2) unit columns
    if abs(float(ends[:, 0] @ ends[:, 1])) > 1 - 1e-6:
        raise ValueError("the stained pixels hold one colour only: no second stain to separate")
    stains = ends if ends[0, 0] >= ends[0, 1] else ends[:, ::-1]  # haematoxylin (larger red OD) first
    concentrations = np.linalg.lstsq(stains, od.T, rcond=None)[0]
    return np.ascontiguousarray(stains), np.percentile(concentrations, 99, axis=1)


def _glass(picture: np.ndarray, tissue: np.ndarray) -> np.ndarray:
    """Per-channel ``Io``: one grey level above the median of the bright non-tissue pixels (so the
    median glass pixel has OD 0); :data:`REFERENCE_BACKGROUND` without enough glass."""
    around = picture[~tissue]
    glass = around[around.mean(axis=1) >= _GLASS_GREY]
    if len(glass) < _MIN_GLASS:
        return np.full(3, REFERENCE_BACKGROUND)
    return np.median(glass, axis=0).astype(np.float64) + 1.0


def _tissue_tiles(slide, tissue: np.ndarray, tissue_ds: float, level: int, count: int, size: int) -> np.ndarray:
    """The tissue pixels of up to ``count`` tiles of ``size`` x ``size`` pixels of ``level``, centred
    on tissue-mask pixels evenly spaced through the mask's tissue (row-major order, so every piece
    of tissue contributes in proportion to its area); a tile's pixels outside the mask are left out.

    Returns:
        uint8 ``(n, 3)``.
    """
    rows, cols = np.nonzero(tissue)
    if not len(rows):
        return np.empty((0, 3), np.uint8)
    level_ds = float(slide.level_downsamples[level])
    offsets = (np.arange(size) + 0.5) * level_ds  # a tile pixel's centre from the tile's corner, level 0
    pixels = []
    for i in np.unique(np.linspace(0, len(rows) - 1, min(count, len(rows))).round().astype(np.int64)):
        x0 = int((cols[i] + 0.5) * tissue_ds - size * level_ds / 2)
        y0 = int((rows[i] + 0.5) * tissue_ds - size * level_ds / 2)
        tile = read_region(slide, x0, y0, level, size)
        mask_rows = np.clip(((y0 + offsets) / tissue_ds).astype(np.int64), 0, tissue.shape[0] - 1)
        mask_cols = np.clip(((x0 + offsets) / tissue_ds).astype(np.int64), 0, tissue.shape[1] - 1)
        pixels.append(tile[tissue[np.ix_(mask_rows, mask_cols)]])
    return np.concatenate(pixels)


def _estimate(path: Path, tissue_min_area_um2: float, alpha: float, beta: float, size: tuple[int, int], level: int | None,
              mpp: float | None, tiles: int) -> SlideStain:
    slide = open_slide(path)
    try:
        picture, _ = thumbnail(slide, *size)
        # debris below the same physical area as the patch grid's mask (the task's tissue_min_area_um2)
        slide_res = slide_mpp(slide)
        tissue, tissue_ds = tissue_mask(slide, *size, min_area=tissue_min_area_um2 / slide_res**2 if slide_res else 2.0**18)
        if tiles:
            pixels = _tissue_tiles(slide, tissue, tissue_ds, select_level(slide, None if mpp else level, mpp), tiles, _TILE)
        else:
            pixels = picture[tissue]
    finally:
        slide.close()
    background = _glass(picture, tissue)
    pixels = pixels[:: max(1, math.ceil(len(pixels) / _MAX_PIXELS))]
    try:
        stains, maxima = estimate_stains(pixels, background, alpha, beta)
    except ValueError as err:
        log.warning("%s: stains not estimated (%s); normalised as if stained with the reference stains", path, err)
        return _reference()
    return SlideStain(stains, maxima, background)


def _cached(cache: Path) -> SlideStain | None:
    """The estimate cached in ``cache``, or ``None`` when there is none or it is damaged (then it
    is estimated again and the file replaced, with a log line saying so)."""
    values = read_npz_cache(cache, {"stains", "max_concentrations", "background"}, "stain")
    if values is None:
        return None
    stain = SlideStain(**{k: v.astype(np.float64) for k, v in values.items()})
    if stain.stains.shape == (3, 2) and stain.max_concentrations.shape == (2,) and stain.background.shape == (3,):
        return stain
    log.warning("%s: damaged stain cache (arrays of other shapes); computing it again", cache)
    return None


def slide_stain(slide: str | Path, cache_dir: str | Path | None, tissue_min_area_um2: float = 15000.0, alpha: float = 1.0,
                beta: float = 0.15, picture: tuple[int, int] = _PICTURE, level: int | None = 0, mpp: float | None = None,
                tiles: int = _TILES) -> SlideStain:
    """The Macenko stain parameters of a whole slide: where the tissue is, and the glass brightness
    (from the bright pixels outside it), from a low-resolution picture of the slide (by default the
    one :func:`~hsmla_med.data.slides.tissue_mask` reads: about 2,000-4,000 pixels on the long
    side); the stain vectors and maximum concentrations from the tissue pixels of ``tiles`` tiles of
    256 x 256 pixels read at the patches' level (``level`` / ``mpp``, as the patch grid selects it),
    centred on tissue evenly spread over the mask.

    Why tiles and not the low-resolution picture itself: a picture pixel is a block mean of the
    slide's, nuclei averaged with stroma, and Macenko's extremes and concentration percentiles
    taken there are not the patches' (on the synthetic 4096 x 3072 slides the colour distance
    between two stainings of one slide shrinks 2.9 times with the matrix from the level-1 picture,
    4.1 times from level 0: docs/benchmarks.md); on a real CAMELYON16 slide the picture is level 6,
    about 15 µm per pixel, where whole nuclei are averaged away. 64 tiles are a few dozen patch
    reads per slide, once, cached. ``tiles=0`` estimates from the picture's tissue pixels.

    A slide with too little stain (fewer than 1000 tissue pixels with OD above ``beta``, or one
    colour only) gets the reference parameters (its pixels are taken as stained with the
    reference stains) and a warning.

    Args:
        slide: the slide file (any format OpenSlide reads).
        cache_dir: folder of the cache ``<slide stem>-stain-<key>.npz``, keyed on the slide file
            (path, size, modification time) and the parameters; ``None``: no cache.
        tissue_min_area_um2: tissue pieces (and holes) smaller than this are dropped (filled), as
            for the patch grid.
        alpha, beta: see :func:`estimate_stains`.
        picture: ``(min_size, max_size)`` of the picture (:func:`~hsmla_med.data.slides.thumbnail`):
            the coarsest pyramid level whose long side is at least ``min_size``, reduced by whole
            blocks to at most ``max_size``.
        level, mpp: the level the tiles are read at, by index or (when ``mpp`` is set, which
            wins) by resolution (:func:`~hsmla_med.data.slides.select_level`).
        tiles: tiles read (0: none, the picture's tissue pixels instead).
    """
    path = Path(slide)
    picture = tuple(int(n) for n in picture)
    if tiles < 0:
        raise ValueError(f"tiles must be >= 0, got {tiles}")
    if cache_dir is None:
        return _estimate(path, tissue_min_area_um2, alpha, beta, picture, level, mpp, tiles)
    stat = path.stat()
    key = json.dumps([_VERSION, str(path.resolve()), stat.st_size, stat.st_mtime_ns, tissue_min_area_um2, alpha, beta, picture,
                      level, mpp, tiles])
    cache = Path(cache_dir).expanduser() / f"{path.stem}-stain-{hashlib.sha1(key.encode()).hexdigest()[:12]}.npz"
    stain = _cached(cache)
    if stain is None:
        stain = _estimate(path, tissue_min_area_um2, alpha, beta, picture, level, mpp, tiles)
        cache.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(cache) as tmp:
            np.savez(tmp, stains=stain.stains, max_concentrations=stain.max_concentrations, background=stain.background)
    return stain


def _od_map(stain: SlideStain) -> np.ndarray:
    """``(3, 3)``: a pixel's OD to its normalised OD, ``REFERENCE_STAINS @ diag(reference max / max) @ pinv(stains)``
    (concentrations by least squares, scaled to the reference maxima, re-coloured)."""
    scale = REFERENCE_MAX_CONCENTRATIONS / np.maximum(stain.max_concentrations, 1e-6)
    return REFERENCE_STAINS @ (scale[:, None] * np.linalg.pinv(stain.stains))


def _tables(stain: SlideStain) -> np.ndarray:
    """float32 ``(3, 3, 256)``: ``tables[c, k, v]`` the factor that input channel ``k`` at value ``v``
    contributes to output channel ``c``, ``exp(-map[c, k] * OD_k(v))`` (times the reference ``Io``
    for ``k = 0``). The normalised OD is linear in the input OD, so the output
    ``Io * exp(-map @ OD) - 1`` is the product of three looked-up factors, minus 1: a per-pixel map
    of 8-bit values without a logarithm or an exponential per pixel (a third of the time)."""
    od = optical_density(np.repeat(np.arange(256.0)[:, None], 3, axis=1), stain.background)  # (256, 3)
    tables = np.exp(-_od_map(stain)[:, :, None] * od.T[None])
    tables[:, 0] *= REFERENCE_BACKGROUND
    return tables.astype(np.float32)


def normalize_stain(image: torch.Tensor | np.ndarray, stain: SlideStain) -> torch.Tensor:
    """Macenko normalisation of an RGB image with a slide's stain parameters: a pointwise map of each
    pixel's value (``OD = -log((I + 1) / Io)``, stain concentrations by least squares with the
    slide's matrix, scaled to the reference maxima, re-coloured with the reference matrix and
    ``Io = 240``: ``I' = 240 * exp(-OD') - 1``), the same in every patch of the slide.

    Args:
        image: channel-first ``(3, H, W)``: uint8 0..255, or float in 0..1 (taken to the nearest
            of its 256 grey levels, which a patch as read is exactly).
        stain: the slide's parameters (:func:`slide_stain`).

    Returns:
        a tensor of ``image``'s shape and dtype (uint8: rounded), in 0..255 or 0..1, with the
        input's memory layout (a channels-last view stays one).
    """
    image = convert_to_tensor(image, track_meta=False)
    if image.ndim != 3 or image.shape[0] != 3:
        raise ValueError(f"expected an RGB image (3, H, W), got shape {tuple(image.shape)}")
    pixels = image.permute(1, 2, 0).numpy()  # (H, W, 3): channels last, the layout patches are read in
    if image.dtype != torch.uint8:
        pixels = np.rint(np.clip(pixels, 0.0, 1.0) * 255.0).astype(np.uint8)
    tables = _tables(stain)
    out = np.empty(pixels.shape, np.float32)
    for c in range(3):
        np.multiply(tables[c, 0][pixels[..., 0]], tables[c, 1][pixels[..., 1]], out=out[..., c])
        out[..., c] *= tables[c, 2][pixels[..., 2]]
    out -= 1.0
    np.clip(out, 0.0, 255.0, out=out)
    if image.dtype == torch.uint8:
        return torch.from_numpy(np.rint(out).astype(np.uint8)).permute(2, 0, 1)
    return torch.from_numpy(out / np.float32(255.0)).to(image.dtype).permute(2, 0, 1)


class NormalizeStaind(MapTransform):
    """:func:`normalize_stain` of ``keys`` with the stain parameters of the item's slide (its
    ``slide_key`` path), :func:`slide_stain` looked up once per slide and process (the cache
    written by the main process, which estimates each slide before the loader starts).

    Args:
        keys: images ``(3, H, W)``, uint8 or float in 0..1.
        cache_dir: the stain cache's folder (:func:`slide_stain`).
        tissue_min_area_um2: as for the slide's patch grid.
        level, mpp: the patches' level, by index or resolution (:func:`slide_stain`'s tiles are read there).
        slide_key: the item's key holding the slide path.
    """

    def __init__(self, keys: KeysCollection, cache_dir: str | Path | None, tissue_min_area_um2: float, level: int | None = 0,
                 mpp: float | None = None, slide_key: str = "slide", allow_missing_keys: bool = False) -> None:
        super().__init__(keys, allow_missing_keys)
        self.cache_dir, self.tissue_min_area_um2, self.slide_key = cache_dir, tissue_min_area_um2, slide_key
        self.level, self.mpp = level, mpp
        self._stains: dict[str, SlideStain] = {}

    def stain(self, slide: str | Path) -> SlideStain:
        """The parameters of ``slide`` (estimated, or read from the cache, on first use)."""
        key = str(slide)
        if key not in self._stains:
            self._stains[key] = slide_stain(slide, self.cache_dir, self.tissue_min_area_um2, level=self.level, mpp=self.mpp)
        return self._stains[key]

    def __call__(self, data: Mapping[Hashable, torch.Tensor]) -> dict:
        d = dict(data)
        stain = self.stain(d[self.slide_key])
        for key in self.key_iterator(d):
            d[key] = normalize_stain(d[key], stain)
        return d


# combine_stains' scale: rgb2hed's amounts are OD / ln(1e6)
_HED_SCALE = -math.log(1e-6)


class RandHEDJitterd(RandomizableTransform, MapTransform):
    """HED stain augmentation (Tellez et al. 2018): with probability ``prob``, the stain amounts
    of scikit-image's ``rgb2hed`` (haematoxylin, eosin, DAB) become ``a * s + b`` per stain, ``a``
    uniform in ``[1 - sigma, 1 + sigma]`` and ``b`` uniform in ``[-bias, bias]`` (``rgb2hed``'s
    units: natural OD / ln(1e6), haematoxylin about 0..0.15 on H&E), one draw per image.

    The change is applied to the pixels as the factor ``exp(-ln(1e6) * ((a - 1) * s + b) @
    rgb_from_hed)``: for a pixel whose amounts are non-negative, exactly ``hed2rgb(a * s + b)``;
    ``rgb2hed`` sets negative amounts (sensor noise on pale pixels) to 0, so
    ``hed2rgb(rgb2hed(x))`` is not ``x`` there, while the factor is 1 at ``a = 1, b = 0``.

    Args:
        keys: RGB images ``(3, H, W)``, float in 0..1.
        prob: chance of transforming an image.
        sigma: largest relative change of a stain's amount, in [0, 1).
        bias: largest shift of a stain's amount, >= 0.
    """

    def __init__(self, keys: KeysCollection, prob: float = 0.5, sigma: float = 0.05, bias: float = 0.01, allow_missing_keys: bool = False) -> None:
        MapTransform.__init__(self, keys, allow_missing_keys)
        RandomizableTransform.__init__(self, prob)
        self.sigma, self.bias = float(sigma), float(bias)
        self.scale, self.shift = np.ones(3), np.zeros(3)

    def randomize(self, data=None) -> None:
        super().randomize(None)
        if self._do_transform:
            self.scale = self.R.uniform(1 - self.sigma, 1 + self.sigma, 3)
            self.shift = self.R.uniform(-self.bias, self.bias, 3)

    def __call__(self, data: Mapping[Hashable, torch.Tensor]) -> dict:
        d = dict(data)
        self.randomize()
        if not self._do_transform:
            return d
        for key in self.key_iterator(d):
            image = d[key]
            rgb = np.moveaxis(convert_to_numpy(image, dtype=np.float64), 0, -1)
            change = (self.scale - 1) * rgb2hed(rgb) + self.shift
            rgb = np.clip(rgb * np.exp(-_HED_SCALE * (change @ rgb_from_hed)), 0.0, 1.0)
            d[key] = convert_to_tensor(np.ascontiguousarray(np.moveaxis(rgb, -1, 0)), dtype=torch.float32, track_meta=False)
        return d


def stain_normalization(data: Mapping, cache_dir: str | Path | None, keys: KeysCollection = "image") -> list[NormalizeStaind]:
    """The transforms of ``data.stain_normalization`` (a task's data section): none for null,
    :class:`NormalizeStaind` for ``macenko`` (stain cache in ``cache_dir``).

    Raises:
        ConfigError: naming the key, for another value.
    """
    method = data.get("stain_normalization")
    if method is None:
        return []
    if method not in METHODS:
        raise ConfigError(f"data.stain_normalization must be null or one of {', '.join(METHODS)}, got {method!r}")
    return [NormalizeStaind(keys, cache_dir, data["tissue_min_area_um2"], data.get("level", 0), data.get("mpp"))]


def hed_jitter(aug: Mapping, keys: KeysCollection = "image") -> RandHEDJitterd:
    """:class:`RandHEDJitterd` from a ``data.augment`` section: ``hed_prob`` (0 switches it
    off), ``hed_sigma``, ``hed_bias``.

    Raises:
        ConfigError: naming the key, for a value out of range.
    """
    def number(key: str, low: float, high: float, high_open: bool = False) -> float:
        value = aug[key]
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high and not (high_open and value == high)
        if not ok:
            raise ConfigError(f"data.augment.{key} must be a number in [{low:g}, {high:g}{')' if high_open else ']'}, got {value!r}")
        return float(value)

    return RandHEDJitterd(keys, prob=number("hed_prob", 0, 1), sigma=number("hed_sigma", 0, 1, high_open=True), bias=number("hed_bias", 0, math.inf))
