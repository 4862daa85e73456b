"""The report's pictures: curves, per-class box plots and the FROC drawn with matplotlib, and
the folder's own PNGs, all inlined as ``data:`` URIs.

Drawn with matplotlib's object API on an Agg canvas, not pyplot (as :mod:`hsmla_med.io.overlays`
does): no global backend or figure state is touched, so a report can be written from a notebook
or beside a training that plots. Inlined images are held to :data:`MAX_WIDTH` pixels and
:data:`MAX_BYTES` each (downscaled, then JPEG-encoded if the PNG stays too large) and to a total
of :data:`BUDGET` base64 characters, so a report of hundreds of slides stays a file a browser
opens quickly; what does not fit is named, not shown.
"""

from __future__ import annotations

import base64
import io
import logging
import math
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image, UnidentifiedImageError

from hsmla_med.report.page import figure, text

__all__ = ["Images", "class_boxes", "curves", "froc", "learning_rate", "refined_bars"]

log = logging.getLogger("hsmla_med")

MAX_WIDTH = 1200  # pixels of an inlined image
MAX_BYTES = 250_000  # of one inlined image, before base64
BUDGET = 7_000_000  # base64 characters of all inlined images: the page stays under 10 MB
DPI = 100
#: columns of the curve files that count or index rather than measure
NOT_CURVES = {"epoch", "step", "cases", "slides", "samples", "foreground_samples", "auc_slides"}


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def learning_rate(column: str) -> bool:
    """Whether a logged column is a learning rate (``lr-AdamW``: Lightning's ``LearningRateMonitor``)."""
    name = column.split("/", 1)[-1]
    return name.startswith("lr") or "learning_rate" in name


def _panel(column: str, names: set[str]) -> str:
    """The panel a logged column is drawn in: loss, learning rate and gate terms each share one;
    a metric shares its panel with its per-class columns (``dice`` with ``dice_spleen``, ...)."""
    name = column.split("/", 1)[-1]  # train/loss, val/dice -> loss, dice
    if learning_rate(column):
        return "learning rate"
    if "loss" in name:
        return "loss"
    if name.startswith("gate") or "alpha" in name:
        return "gate"
    parts = name.split("_")
    return next(("_".join(parts[:i]) for i in range(1, len(parts)) if "_".join(parts[:i]) in names), name)


def curves(rows: list[dict[str, float]]) -> bytes | None:
    """Every logged quantity against the step (the epoch, the row where there is no step), a
    panel per quantity (:func:`_panel`), each axis labelled with it; the learning rate, where it
    was logged, in the last panel. ``None`` when nothing was logged."""
    columns = list(dict.fromkeys(k for row in rows for k in row if k not in NOT_CURVES))
    if not columns:
        return None
    names = {c.split("/", 1)[-1] for c in columns}
    panels: dict[str, list[str]] = {}
    for column in columns:
        panels.setdefault(_panel(column, names), []).append(column)
    order = sorted(panels, key=lambda p: (p != "loss", p in ("gate", "learning rate"), p == "learning rate"))
    across = 2 if len(order) > 1 else 1
    fig = Figure(figsize=(6 * across, 3.2 * math.ceil(len(order) / across)))
    FigureCanvasAgg(fig)
    x_key = "step" if any("step" in r for r in rows) else "epoch" if any("epoch" in r for r in rows) else None
    for i, panel in enumerate(order):
        ax = fig.add_subplot(math.ceil(len(order) / across), across, i + 1)
        if len(panels[panel]) > 10:  # per-class lines: more colours than the default cycle's ten
            ax.set_prop_cycle(color=colormaps["tab20"].colors)
        for column in panels[panel]:
            points = [(row.get(x_key, j) if x_key else j, row[column]) for j, row in enumerate(rows) if column in row]
            main = column.split("/", 1)[-1] == panel
            sparse = len(points) < 0.5 * len(rows)  # validation rows: markers, so a single one shows
            ax.plot(*zip(*points), marker="o" if sparse else None, ms=3, lw=1.8 if main else 0.9, label=column)
        ax.set(title=panel, xlabel=x_key or "row", ylabel=panel)
        ax.legend(fontsize=6 if len(panels[panel]) > 6 else 8, ncol=2 if len(panels[panel]) > 8 else 1)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def class_boxes(score: str, per_class: dict[str, list[float]]) -> bytes:
    """Box plot of ``score`` per class with every case as a point (jittered across the box,
    seeded, so the picture is the same each time)."""
    names = list(per_class)
    fig = Figure(figsize=(min(18, max(5, 0.6 * len(names) + 2)), 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.boxplot([per_class[n] for n in names], showfliers=False)  # the points show the outliers
    rng = np.random.default_rng(0)
    for i, name in enumerate(names, start=1):
        ax.scatter(i + rng.uniform(-0.2, 0.2, len(per_class[name])), per_class[name], s=8, alpha=0.5, color="tab:blue")
    ax.set_xticks(range(1, len(names) + 1), names, rotation=40 if len(names) > 4 else 0, ha="right" if len(names) > 4 else "center")
    ax.set(title=f"{score} per class ({max(map(len, per_class.values()))} cases)", ylabel=score)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def froc(points: dict[str, float | None], band: dict[str, dict] | None = None) -> bytes:
    """Sensitivity against the false positives per scan or slide (``points``: rate -> value, as
    summaries write them), with the bootstrap ``band`` (rate -> ``low``/``high``) if given."""
    rates = sorted((float(r), v) for r, v in points.items() if v is not None)
    fig = Figure(figsize=(5.5, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(*zip(*rates), "o-", label="sensitivity")
    bounds = sorted((float(r), b.get("low"), b.get("high")) for r, b in (band or {}).items() if isinstance(b, dict))
    bounds = [b for b in bounds if b[1] is not None and b[2] is not None]
    if bounds:
        ax.fill_between([b[0] for b in bounds], [b[1] for b in bounds], [b[2] for b in bounds], alpha=0.2, label="bootstrap band")
    ax.set_xscale("log", base=2)
    ax.set_xticks([r for r, _ in rates], [f"{r:g}" for r, _ in rates])
    ax.set(xlabel="false positives per item", ylabel="sensitivity", ylim=(0, 1.02), title="FROC")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def refined_bars(per_layer: dict[str, float]) -> bytes:
    """The share of tiles each gated HSMLA layer refined, a bar per layer in network order."""
    names = list(per_layer)
    fig = Figure(figsize=(7, 0.9 + 0.32 * len(names)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.barh(range(len(names)), [per_layer[n] for n in names], color="tab:green")
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set(xlim=(0, 1), xlabel="share of tiles refined (alpha)", title="tiles refined per layer")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def _encoded(path: Path) -> tuple[bytes, str]:
    """A PNG's bytes as inlined: the file itself when small enough, else downscaled to
    :data:`MAX_WIDTH` and re-encoded (JPEG where PNG stays above :data:`MAX_BYTES`)."""
    raw = path.read_bytes()
    with Image.open(io.BytesIO(raw)) as image:
        if image.format == "PNG" and image.width <= MAX_WIDTH and len(raw) <= MAX_BYTES:
            return raw, "png"
        image.load()
        if image.width > MAX_WIDTH:
            image = image.resize((MAX_WIDTH, max(1, round(image.height * MAX_WIDTH / image.width))), Image.LANCZOS)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG", optimize=True)
        if buffer.tell() <= MAX_BYTES:
            return buffer.getvalue(), "png"
        buffer = io.BytesIO()
        image.convert("RGB").save(buffer, format="JPEG", quality=85)
        return buffer.getvalue(), "jpeg"


class Images:
    """Inlines pictures as ``<figure>`` blocks within the page's :data:`BUDGET`."""

    def __init__(self, budget: int = BUDGET) -> None:
        self.left = budget

    def _figure(self, data: bytes, kind: str, caption: str) -> str:
        uri = f"data:image/{kind};base64,{base64.b64encode(data).decode('ascii')}"
        if len(uri) > self.left:
            return f"<p class=note>{text(caption)}: not inlined, the report's image budget is spent.</p>"
        self.left -= len(uri)
        return figure(uri, caption)

    def drawn(self, png: bytes, caption: str) -> str:
        """A figure drawn here (:func:`curves`, ...)."""
        return self._figure(png, "png", caption)

    def file(self, path: Path, caption: str) -> str:
        """A picture file of the folder; an unreadable one is named, not shown."""
        try:
            data, kind = _encoded(path)
        except (OSError, UnidentifiedImageError, ValueError) as err:
            log.warning("%s: not shown in the report (%s)", path, err)
            return f"<p class=note>{text(caption)}: not readable as an image ({text(err)}).</p>"
        return self._figure(data, kind, caption)
