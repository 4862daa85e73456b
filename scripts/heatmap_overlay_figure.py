"""Render docs/heatmap_overlay.png: a ``wsi-heatmap`` heatmap TIFF laid over its slide by the two
files' pixel sizes alone, both read through OpenSlide, with the slide's tumour outlines.

The heatmap is placed as a viewer places a second image (QuPath's Align extension starts from the
ratio of the two pixel sizes): the slide spans ``width x mpp`` µm from the origin, the heatmap
``heatmap width x heatmap mpp`` µm from the same origin; nothing else (no grid step, no patch
size, no file name) ties them. Each picture is drawn in µm with those extents; the outlines come
from the ASAP XML in level-0 pixels times the slide's mpp. If the heatmap were off in scale or
origin, the hot cells would leave the outlines, visibly so in the zoomed panel (full resolution
around a metastasis).

Without ``--slide``, the slide is the synthetic CAMELYON16 test slide ``test_001`` (a metastasis;
the same pixels as in the dataset ``hsmla-med demo`` generates, where it is held out) and its
heatmap comes from ``hsmla-med wsi-heatmap --checkpoint CKPT``: the committed picture used the
checkpoint of ``hsmla-med demo --task camelyon16`` (``runs/demo/camelyon16/best.ckpt``).

Usage: .venv/bin/python scripts/heatmap_overlay_figure.py --checkpoint CKPT [--output docs/heatmap_overlay.png]
       .venv/bin/python scripts/heatmap_overlay_figure.py --slide S.tif --heatmap S_heatmap.tif [--annotation S.xml]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import openslide
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from PIL import Image

from hsmla_med.cli import main as hsmla_med
from hsmla_med.data.asap import TUMOUR_GROUPS, read_asap_xml
from hsmla_med.data.synthetic.wsi import generate_camelyon16
from hsmla_med.io import atomic_path

OVERVIEW_SIDE = 900  # pixels of the slide level drawn for the overview (its longer side, at least)
ZOOM_UM = 1000.0  # side of the zoomed window around the largest metastasis, µm
CMAP = "inferno"  # as the pipeline's own overlay PNGs (hsmla_med.io.overlays)


def _mpp(slide: openslide.OpenSlide, path) -> float:
    if "openslide.mpp-x" not in slide.properties:
        raise SystemExit(f"{path}: no pixel size (openslide.mpp-x): cannot be placed by physical size")
    return float(slide.properties["openslide.mpp-x"])


def _level_for(slide: openslide.OpenSlide, side: int) -> int:
    """The smallest level whose longer side still has at least ``side`` pixels (else level 0)."""
    fits = [level for level, dims in enumerate(slide.level_dimensions) if max(dims) >= side]
    return fits[-1] if fits else 0


def _region_um(slide: openslide.OpenSlide, mpp: float, box_um, side: int) -> tuple[np.ndarray, list[float]]:
    """RGB pixels of ``slide`` covering ``box_um`` = (x0, y0, x1, y1) µm (clipped to the slide),
    at the level with about ``side`` pixels across the box; the extent actually read, in µm, as
    matplotlib's ``[left, right, bottom, top]``."""
    width, height = slide.dimensions
    x0, y0 = max(0.0, box_um[0] / mpp), max(0.0, box_um[1] / mpp)  # level-0 pixels
    x1, y1 = min(width, box_um[2] / mpp), min(height, box_um[3] / mpp)
    level = slide.get_best_level_for_downsample(max(1.0, max(x1 - x0, y1 - y0) / side))
    # level-0 pixels per pixel of the level, per axis (OpenSlide's downsample is their mean)
    dx, dy = (full / part for full, part in zip(slide.dimensions, slide.level_dimensions[level]))
    col0, row0 = int(x0 // dx), int(y0 // dy)
    cols, rows = int(np.ceil(x1 / dx)) - col0, int(np.ceil(y1 / dy)) - row0
    # OpenSlide takes the corner in level-0 pixels: the level pixel's own corner
    rgb = np.asarray(slide.read_region((round(col0 * dx), round(row0 * dy)), level, (cols, rows)).convert("RGB"))
    return rgb, [col0 * dx * mpp, (col0 + cols) * dx * mpp, (row0 + rows) * dy * mpp, row0 * dy * mpp]


def _coloured(prob: np.ndarray) -> np.ndarray:
    """RGBA of tumour probability (0..1): inferno, opacity growing with the probability so that
    the tissue under low values stays visible."""
    rgba = colormaps[CMAP](prob)
    rgba[..., 3] = 0.8 * prob
    return rgba


def render(slide_path: Path, heatmap_path: Path, annotation: Path | None, output: Path) -> Path:
    slide, heat = openslide.OpenSlide(slide_path), openslide.OpenSlide(heatmap_path)
    slide_mpp, heat_mpp = _mpp(slide, slide_path), _mpp(heat, heatmap_path)
    slide_um = np.array(slide.dimensions) * slide_mpp
    heat_um = np.array(heat.dimensions) * heat_mpp
    outlines = [p.points * slide_mpp for p in (read_asap_xml(annotation) if annotation else []) if p.group in TUMOUR_GROUPS]

    figure = Figure(figsize=(12, 3.9), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, 3, gridspec_kw={"width_ratios": [1, 1, 0.75]})
    pad = 0.02 * max(*slide_um, *heat_um)  # room around both extents, so that their edges show
    whole = (-pad, -pad, max(slide_um[0], heat_um[0]) + pad, max(slide_um[1], heat_um[1]) + pad)  # (x0, y0, x1, y1) µm
    if outlines:  # zoom on the largest metastasis
        centre = max(outlines, key=lambda pts: np.ptp(pts[:, 0]) * np.ptp(pts[:, 1])).mean(axis=0)
    else:  # no outlines: on the heatmap's hottest pixel
        level = _level_for(heat, OVERVIEW_SIDE)
        values = np.asarray(heat.read_region((0, 0), level, heat.level_dimensions[level]).convert("L"))
        row, col = np.unravel_index(np.argmax(values), values.shape)
        centre = np.array([col + 0.5, row + 0.5]) * heat.level_downsamples[level] * heat_mpp
    zoom = (*(centre - ZOOM_UM / 2), *(centre + ZOOM_UM / 2))

    for ax, box, side, with_heat in ((axes[0], whole, OVERVIEW_SIDE, False), (axes[1], whole, OVERVIEW_SIDE, True), (axes[2], zoom, 700, True)):
        rgb, extent = _region_um(slide, slide_mpp, box, side)
        ax.imshow(rgb, extent=extent, interpolation="bilinear")
        if with_heat:
            values, heat_extent = _region_um(heat, heat_mpp, box, side)
            ax.imshow(_coloured(values[..., 0] / 255.0), extent=heat_extent, interpolation="nearest")
            # the heatmap's own extent: its pixel count times its pixel size, from the origin
            ax.add_patch(Rectangle((0, 0), *heat_um, fill=False, linestyle="--", linewidth=0.8, edgecolor="0.3"))
        for pts in outlines:
            ax.plot(*np.vstack([pts, pts[:1]]).T, color="#00e5ff", linewidth=1.2)
        ax.set_xlim(box[0], box[2])
        ax.set_ylim(box[3], box[1])  # y down, as in the slide
        ax.set_xlabel("µm")
        ax.tick_params(labelsize=8)
    axes[0].set_title(f"slide: {slide.dimensions[0]} x {slide.dimensions[1]} px at {slide_mpp:.3f} µm", fontsize=9)
    axes[1].set_title(f"+ heatmap: {heat.dimensions[0]} x {heat.dimensions[1]} px at {heat_mpp:.3f} µm", fontsize=9)
    axes[2].set_title(f"{ZOOM_UM:.0f} µm around a metastasis", fontsize=9)
    axes[0].set_ylabel("µm")
    figure.colorbar(ScalarMappable(Normalize(0, 1), CMAP), ax=axes[2], label="tumour probability", fraction=0.06, pad=0.02)
    figure.suptitle(f"{heatmap_path.name} over {slide_path.name}, placed by pixel size only (dashed: the heatmap's extent, "
                    f"{heat_um[0]:.0f} x {heat_um[1]:.0f} µm; the slide's {slide_um[0]:.0f} x {slide_um[1]:.0f} µm); cyan: annotated tumour",
                    fontsize=10)
    canvas = figure.canvas
    canvas.draw()
    picture = Image.fromarray(np.asarray(canvas.buffer_rgba())[..., :3])
    with atomic_path(output) as tmp:
        picture.save(tmp, format="PNG", optimize=True)
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="run `hsmla-med wsi-heatmap` with this checkpoint on the slide")
    parser.add_argument("--slide", type=Path, help="slide (default: the synthetic test_001)")
    parser.add_argument("--heatmap", type=Path, help="the slide's <slide>_heatmap.tif, instead of --checkpoint")
    parser.add_argument("--annotation", type=Path, help="ASAP XML of the slide's tumour (default with the synthetic slide: its own)")
    parser.add_argument("--output", type=Path, default=Path("docs/heatmap_overlay.png"))
    args = parser.parse_args()
    if (args.checkpoint is None) == (args.heatmap is None):
        parser.error("give --checkpoint (to write the heatmap) or --heatmap (written before), one of them")
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        slide, annotation = args.slide, args.annotation
        if slide is None:
            root = generate_camelyon16(work / "data", num_normal=1, num_tumor=0, num_test=1)  # one training slide: the generator needs one
            slide = root / "testing" / "images" / "test_001.tif"
            annotation = annotation or root / "testing" / "lesion_annotations" / "test_001.xml"
        heatmap = args.heatmap
        if heatmap is None:
            if hsmla_med(["wsi-heatmap", "--checkpoint", args.checkpoint, "--slide", str(slide), "--output", str(work / "heat")]):
                raise SystemExit("wsi-heatmap failed (its message is above)")
            heatmap = work / "heat" / f"{slide.stem}_heatmap.tif"
        print(render(slide, heatmap, annotation, args.output))


if __name__ == "__main__":
    main()
