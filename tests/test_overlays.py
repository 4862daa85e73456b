"""Heatmap and gate overlay PNGs: readable files, the thumbnail's geometry, transparent NaN.

The thumbnail is a flat colour that no colormap, text or background contains; the map is high
on its left half and NaN on its right half. In the PNG the right half must show the thumbnail
colour exactly and the left half the documented blend (opacity 0.5) of the colormap over it.
"""

import matplotlib
import numpy as np
import pytest
from matplotlib.image import imread

from hsmla_med.io.overlays import gate_overlay, heatmap_overlay

TISSUE = np.array([230, 60, 200])  # bright magenta: not in inferno, viridis, black or white
HIGH = 0.95

OVERLAYS = [(heatmap_overlay, "inferno"), (gate_overlay, "viridis")]


def draw(function, path, height, width):
    """Write the overlay of a flat thumbnail and a map that is HIGH left, NaN right; read it back
    as (H, W, 3) floats 0..255."""
    thumbnail = np.broadcast_to(TISSUE.astype(np.uint8), (height, width, 3)).copy()
    grid = np.full((height // 10, width // 10), np.nan)
    grid[:, : grid.shape[1] // 2] = HIGH
    assert function(path, thumbnail, grid, title="slide 1") == path
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return imread(path)[..., :3] * 255.0


@pytest.mark.parametrize("function, cmap", OVERLAYS)
@pytest.mark.parametrize("height, width", [(60, 120), (150, 60)])
def test_overlay_geometry_colours_and_transparency(tmp_path, function, cmap, height, width):
    path = tmp_path / "pic" / "overlay.png"
    png = draw(function, path, height, width)
    blend = 0.5 * np.asarray(matplotlib.colormaps[cmap](HIGH)[:3]) * 255 + 0.5 * TISSUE
    bare = np.abs(png - TISSUE).max(-1) <= 3  # NaN: thumbnail shows through unchanged
    tinted = np.abs(png - blend).max(-1) <= 3  # high probability: colour blended over tissue
    assert bare.sum() > 1000 and tinted.sum() > 1000
    assert abs(bare.sum() / tinted.sum() - 1) < 0.05  # the two halves

    rows, cols = np.nonzero(bare | tinted)
    drawn_h, drawn_w = rows.max() - rows.min() + 1, cols.max() - cols.min() + 1
    assert drawn_w / drawn_h == pytest.approx(width / height, rel=0.02)
    assert (bare | tinted)[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1].all()
    # high probability on the left, NaN on the right: not flipped or transposed
    assert np.nonzero(tinted)[1].max() < np.nonzero(bare)[1].min()
    assert [p.name for p in path.parent.iterdir()] == ["overlay.png"]  # no temporary file left


def test_heatmap_and_gate_colours_differ(tmp_path):
    heat = draw(heatmap_overlay, tmp_path / "heat.png", 60, 120)
    gate = draw(gate_overlay, tmp_path / "gate.png", 60, 120)
    assert heat.shape == gate.shape and np.abs(heat - gate).max() > 50


@pytest.mark.parametrize("function, _", OVERLAYS)
def test_overlay_rejects_bad_input_and_writes_nothing(tmp_path, function, _):
    thumbnail = np.zeros((20, 20, 3), np.uint8)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        function(tmp_path / "a.png", thumbnail, np.full((2, 2), 3.0))  # logits, not probabilities
    with pytest.raises(ValueError, match="uint8"):
        function(tmp_path / "a.png", thumbnail.astype(float), np.zeros((2, 2)))
    assert list(tmp_path.iterdir()) == []
