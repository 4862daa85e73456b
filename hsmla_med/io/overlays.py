"""PNG pictures of whole-slide results: a per-patch map laid over the slide thumbnail; of a
label map (a segmentation, e.g. a DICOM SEG read back) over its image slice (:func:`label_overlay`);
and of the tiles each gated layer refined for one validation input (:func:`gate_panels`).

Two pictures per slide: :func:`heatmap_overlay` shows the tumour probability, and
:func:`gate_overlay` shows where HSMLA's gate sent tiles to softmax refinement, so a reader can
check that the expensive attention went to the suspicious tissue. Both colour the map on a fixed
0..1 scale with a perceptually uniform colormap (so colour differences mean value differences
and pictures of different slides compare directly), leave patch-less cells (NaN) transparent so
the tissue stays visible, and add a labelled colour bar.

The title and colour bar are drawn with matplotlib's object API on an Agg canvas, not pyplot: no
global backend or figure state is touched, so it works headless and beside other plotting code.
The picture itself is blended in NumPy at its drawn size and pasted into the rendered figure, and
PIL writes the PNG, atomically (:func:`hsmla_med.io.atomic_path`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Colormap, ListedColormap, Normalize
from matplotlib.figure import Figure
from PIL import Image

from hsmla_med.io.atomic import atomic_path

__all__ = ["class_colour", "gate_overlay", "gate_panels", "heatmap_overlay", "label_overlay", "sample_panels"]

DPI = 100
# long side of the drawn thumbnail in pixels: small thumbnails are enlarged so that the colour
# bar and title stay in proportion, huge ones reduced to keep the PNG a reasonable size
MIN_SIDE, MAX_SIDE = 512, 2048
# fixed margins in inches: outer border, colour bar width, gap and room for its ticks and label
MARGIN, BAR, GAP, BAR_TEXT, TITLE = 0.15, 0.25, 0.15, 0.9, 0.45
CHAR_WIDTH = 0.075  # inches per character of a tick label at matplotlib's default 10 pt font


def _resize_nearest(values: np.ndarray, height: int, width: int) -> np.ndarray:
    """``(h, w, ...)`` map -> ``(height, width, ...)``, each output pixel taking the cell under
    its centre."""
    rows = ((np.arange(height) + 0.5) * values.shape[0] / height).astype(int)
    cols = ((np.arange(width) + 0.5) * values.shape[1] / width).astype(int)
    return values[np.minimum(rows, values.shape[0] - 1)][:, np.minimum(cols, values.shape[1] - 1)]


def _overlay(path, thumbnail, values, title: str, alpha: float, cmap_name: str | Colormap, label: str,
             ticks: Sequence[float] = tuple(np.linspace(0, 1, 6)), tick_labels: Sequence[str] | None = None, bar_text: float = BAR_TEXT) -> Path:
    """Draw ``values`` (0..1, NaN transparent) over ``thumbnail`` with a colour bar (``ticks``,
    named by ``tick_labels`` if given, ``bar_text`` inches for them and the bar's label); write a PNG."""
    thumbnail = np.asarray(thumbnail)
    values = np.asarray(values, dtype=np.float64)
    if thumbnail.ndim != 3 or thumbnail.shape[2] != 3 or thumbnail.dtype != np.uint8:
        raise ValueError(f"thumbnail must be an (H, W, 3) uint8 RGB image, got {thumbnail.shape} {thumbnail.dtype}")
    if values.ndim != 2 or values.size == 0:
        raise ValueError(f"the map must be a non-empty 2D (h, w) array, got shape {values.shape}")
    finite = values[~np.isnan(values)]
    # values outside 0..1 (logits, percentages) would silently saturate the colormap
    if finite.size and (finite.min() < 0 or finite.max() > 1):
        raise ValueError(f"map values must lie in [0, 1] (NaN = no patch), got [{finite.min()}, {finite.max()}]")
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")

    height, width = thumbnail.shape[:2]
    scale = np.clip(max(height, width), MIN_SIDE, MAX_SIDE) / max(height, width) / DPI
    img_w, img_h = width * scale, height * scale  # inches, the thumbnail's aspect ratio
    title_h = TITLE if title else 0.0
    fig_w = MARGIN + img_w + GAP + BAR + bar_text
    fig_h = MARGIN + img_h + max(MARGIN, title_h)

    cmap = colormaps[cmap_name] if isinstance(cmap_name, str) else cmap_name
    norm = Normalize(vmin=0.0, vmax=1.0)
    # the picture is blended here at its drawn size and pasted pixel for pixel into the rendered
    # figure: Agg resampling two translucent imshow layers took seconds per overlay at 2048 px
    rows, cols = round(img_h * DPI), round(img_w * DPI)
    tissue = _resize_nearest(thumbnail, rows, cols).astype(np.float32)
    colour = _resize_nearest(cmap(np.nan_to_num(values), bytes=True)[..., :3], rows, cols).astype(np.float32)
    weight = _resize_nearest(np.where(np.isnan(values), 0.0, alpha).astype(np.float32), rows, cols)[..., None]  # NaN: thumbnail alone
    picture = np.rint(tissue * (1 - weight) + colour * weight).astype(np.uint8)

    fig = Figure(figsize=(fig_w, fig_h), dpi=DPI, facecolor="white")
    canvas = FigureCanvasAgg(fig)
    if title:  # an empty axes over the picture carries the title where imshow's would be
        ax = fig.add_axes((MARGIN / fig_w, MARGIN / fig_h, img_w / fig_w, img_h / fig_h))
        ax.set_axis_off()
        ax.set_title(title)
    cax = fig.add_axes(((MARGIN + img_w + GAP) / fig_w, MARGIN / fig_h, BAR / fig_w, img_h / fig_h))
    # the legend shows the full-strength colours, not the translucent ones blended over tissue
    bar = fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), cax=cax, label=label, ticks=list(ticks))
    if tick_labels is not None:
        bar.set_ticklabels(list(tick_labels))

    canvas.draw()
    rendered = np.asarray(canvas.buffer_rgba())[..., :3].copy()
    top, left = rendered.shape[0] - round(MARGIN * DPI) - rows, round(MARGIN * DPI)
    rendered[top : top + rows, left : left + cols] = picture
    with atomic_path(path) as tmp:
        # zlib level 1: a third of the default's encoding time for a few percent more bytes
        Image.fromarray(rendered).save(tmp, format="PNG", compress_level=1)
    return Path(path)


def heatmap_overlay(path, thumbnail: np.ndarray, prob_map: np.ndarray, title: str = "", alpha: float = 0.5) -> Path:
    """Write a PNG of the tumour-probability map over the slide thumbnail.

    Args:
        path: PNG file to write (folders are created; written atomically).
        thumbnail: ``(H, W, 3)`` uint8 RGB thumbnail of the slide.
        prob_map: ``(h, w)`` tumour probabilities in [0, 1] on the patch grid, covering the same
            area as the thumbnail; NaN = no patch (drawn transparent). Any size: it is resized
            to the thumbnail with nearest-neighbour sampling, so patches stay sharp squares.
        title: text above the picture; none when empty.
        alpha: opacity of the colours over the tissue (0 = thumbnail only, 1 = map only).

    Returns:
        ``path``. The picture uses the perceptual colormap "inferno" on a fixed 0..1 scale,
        with a colour bar labelled "tumour probability".
    """
    return _overlay(path, thumbnail, prob_map, title, alpha, "inferno", "tumour probability")


def gate_overlay(path, thumbnail: np.ndarray, gate_map: np.ndarray, title: str = "") -> Path:
    """Write a PNG of HSMLA gate activity over the slide thumbnail.

    Args:
        path: PNG file to write (folders are created; written atomically).
        thumbnail: ``(H, W, 3)`` uint8 RGB thumbnail of the slide.
        gate_map: ``(h, w)`` per patch, the share of its tiles that the gate sent to softmax
            refinement, in [0, 1]; NaN = no patch (drawn transparent). Resized like
            :func:`heatmap_overlay`'s map.
        title: text above the picture; none when empty.

    Returns:
        ``path``. The picture uses the colormap "viridis" (perceptual, and distinct from the
        probability heatmap's) at the heatmap's default opacity 0.5 on a fixed 0..1 scale, with
        a colour bar labelled "share of tiles refined (alpha)" (the gate's alpha, not opacity).
    """
    return _overlay(path, thumbnail, gate_map, title, 0.5, "viridis", "share of tiles refined (alpha)")


def gate_panels(path, image: np.ndarray, refined: dict[str, np.ndarray], title: str = "") -> Path:
    """Write a PNG of where each gated HSMLA layer refined, for one network input: a panel per
    layer, the input ``image`` ``(H, W)`` in grey (1st-99th percentile) under the layer's
    ``(h, w)`` refined tiles (bool, covering the image), drawn in "viridis"'s bright end at half
    opacity; each panel's title names the layer and its share of tiles refined."""
    image = np.asarray(image, dtype=np.float64)
    low, high = np.percentile(image, [1, 99]) if image.size else (0.0, 1.0)
    grey = np.clip((image - low) / max(high - low, 1e-12), 0, 1)
    across = min(4, len(refined))
    fig = Figure(figsize=(3.2 * across, 3.4 * -(-len(refined) // across) + (0.4 if title else 0)))
    FigureCanvasAgg(fig)
    bright = np.array(colormaps["viridis"](1.0)[:3])
    for i, (name, tiles) in enumerate(refined.items()):
        mask = _resize_nearest(np.asarray(tiles, dtype=bool), *grey.shape)
        picture = np.repeat(grey[..., None], 3, axis=2)
        picture[mask] = 0.5 * picture[mask] + 0.5 * bright
        ax = fig.add_subplot(-(-len(refined) // across), across, i + 1)
        ax.imshow(picture, interpolation="nearest")
        ax.set_title(f"{name}\n{np.mean(tiles):.0%} of {np.size(tiles)} tiles refined", fontsize=8)
        ax.set_axis_off()
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=DPI)
    return Path(path)


def class_colour(value: int) -> tuple[int, int, int]:
    """The RGB colour (0..255) of class ``value`` (1..): colour ``value - 1`` of matplotlib's
    qualitative "tab20" (distinct neighbouring hues, not a scale: classes are no ordered
    values). Our pictures draw classes in it, and our DICOM SEGs recommend it to viewers."""
    return tuple(int(round(255 * c)) for c in colormaps["tab20"]((value - 1) % 20)[:3])


def label_overlay(path, image: np.ndarray, labels: np.ndarray, names: Sequence[str], title: str = "", alpha: float = 0.5) -> Path:
    """Write a PNG of a label map over its grey image slice, for looking at a segmentation (our
    DICOM SEG read back over its CT series, ``scripts/render_seg_overlay.py``).

    Args:
        path: PNG file to write (folders are created; written atomically).
        image: ``(H, W)`` slice in display orientation (rows down), any numbers: drawn grey from
            its minimum (black) to its maximum (white).
        labels: ``(H, W)`` integer label map on the same pixels; 0 (background) is transparent.
        names: class names by label value, background first; the colour bar names each class.
        title: text above the picture; none when empty.
        alpha: opacity of the class colours over the image.

    Returns:
        ``path``. Class ``k`` is drawn in :func:`class_colour` ``(k)``.
    """
    image, labels = np.asarray(image, dtype=np.float64), np.asarray(labels)
    if image.shape != labels.shape or image.ndim != 2:
        raise ValueError(f"image and labels must be 2D of one shape, got {image.shape} and {labels.shape}")
    classes = len(names) - 1
    if classes < 1 or labels.min() < 0 or labels.max() > classes:
        raise ValueError(f"label values must lie in 0..{classes} (the names after the background), got {labels.min()}..{labels.max()}")
    low, high = image.min(), image.max()
    grey = np.rint(255 * (image - low) / ((high - low) or 1.0)).astype(np.uint8)
    # class k at the middle of the k-th of ``classes`` equal bins of 0..1, coloured by the k-th
    # colour of a listed colormap of exactly ``classes`` colours: one flat colour per class
    values = np.where(labels > 0, (labels - 0.5) / classes, np.nan)
    cmap = ListedColormap([np.asarray(class_colour(k)) / 255 for k in range(1, classes + 1)])
    centres = (np.arange(1, classes + 1) - 0.5) / classes
    room = 0.5 + CHAR_WIDTH * max(len(n) for n in names[1:])  # the class names and the bar label, not cut off
    return _overlay(path, np.repeat(grey[..., None], 3, axis=2), values, title, alpha, cmap, "class", centres, list(names[1:]), room)


def sample_panels(image: np.ndarray, truth: np.ndarray, prediction: np.ndarray, alpha: float = 0.5) -> np.ndarray:
    """A validation sample as a logger shows it: the image, its reference and the prediction side
    by side, the classes drawn in :func:`class_colour` over the grey image.

    Args:
        image: ``(C, H, W)`` or ``(C, H, W, D)`` network input (the first channel is drawn; RGB
            frames in colour).
        truth, prediction: ``(H, W)`` or ``(H, W, D)`` integer label maps on the same grid; of a
            volume the slice with the most reference foreground is drawn (the middle one without).

    Returns:
        uint8 ``(H, 3 W, 3)``.
    """
    image, truth, prediction = np.asarray(image, np.float64), np.asarray(truth), np.asarray(prediction)
    if truth.ndim == 3:
        slice_ = int(np.argmax((truth > 0).sum(axis=(0, 1)))) if truth.any() else truth.shape[2] // 2
        image, truth, prediction = image[..., slice_], truth[..., slice_], prediction[..., slice_]
    channels = image[:3] if image.shape[0] == 3 else image[:1].repeat(3, axis=0)
    low, high = channels.min(), channels.max()
    base = np.rint(255 * (channels - low) / ((high - low) or 1.0)).transpose(1, 2, 0)
    panels = [base]
    for labels in (truth, prediction):
        painted = base.copy()
        for value in np.unique(labels[labels > 0]):
            painted[labels == value] = (1 - alpha) * painted[labels == value] + alpha * np.array(class_colour(int(value)))
        panels.append(painted)
    return np.concatenate(panels, axis=1).astype(np.uint8)
