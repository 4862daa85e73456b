"""The HTML of the report: escaped text, tables whose cells carry the exact value they show,
collapsible blocks, and the page around them, with its style sheet and sorting script inline (no
framework, no network: the file opens from disk anywhere).

A number is shown to 4 significant digits; its cell's ``data-value`` holds the value itself
(``repr`` of the float, which reads back to the same float), so a reader or a test compares the
page with the JSON or CSV it came from exactly, and the script sorts by it. Every header cell of a
table has ``data-sort``: a click sorts the rows by that column, a second click reverses them;
empty cells (no value) stay last either way.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

__all__ = ["details", "figure", "number", "page", "shown", "subsection", "table", "text"]

#: what a cell may hold: a number, a text, a flag, or nothing (a JSON null, a CSV ``nan``)
Value = float | int | str | bool | None


def text(value: str) -> str:
    """``value`` escaped for HTML text and attribute values."""
    return html.escape(str(value), quote=True)


def shown(value: Value) -> str:
    """How a cell shows ``value``: 4 significant digits for a float (whole numbers for large
    ones, where exponents would hide the magnitude), ``n/a`` for none."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def _exact(value: Value) -> str:
    """The ``data-value`` of ``value``: the number itself (``repr``, exact; infinities as
    JavaScript and Python both read them), empty for none and NaN (a score that is undefined)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return repr(value) if isinstance(value, float) else str(value)


def number(value: Value) -> str:
    """``value`` in running text, shown as a cell shows it, with its exact ``data-value``."""
    return f'<span class=value data-value="{text(_exact(value))}">{text(shown(value))}</span>'


def _cell(value: Value) -> str:
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    return f'<td data-value="{text(_exact(value))}"{" class=num" if numeric else ""}>{text(shown(value))}</td>'


def table(columns: Sequence[str], rows: Sequence[Sequence[Value]], caption: str = "", titles: dict[str, str] | None = None,
          ascending: str | None = None) -> str:
    """A sortable table (see the module docstring); ``titles``: a tooltip per column name;
    ``ascending``: the column the rows are already sorted by, marked so (a click reverses them)."""
    tips = {c: f' title="{text(tip)}"' for c, tip in (titles or {}).items()}
    head = "".join(f"<th data-sort{tips.get(c, '')}{' data-order=asc' if c == ascending else ''}>{text(c)}</th>" for c in columns)
    body = "\n".join(f"<tr>{''.join(_cell(v) for v in row)}</tr>" for row in rows)
    caption = f"<caption>{text(caption)}</caption>" if caption else ""
    return f'<div class="scroll"><table>{caption}<thead><tr>{head}</tr></thead><tbody>\n{body}\n</tbody></table></div>'


def details(summary: str, content: str) -> str:
    """A collapsible block of preformatted ``content`` (closed at first)."""
    return f"<details><summary>{text(summary)}</summary><pre>{text(content)}</pre></details>"


def subsection(anchor: str, heading: str, parts: Sequence[str]) -> list[str]:
    """A section within a section (its own ``id``, a smaller heading), as a list of one part;
    none where ``parts`` is empty, so that a question's section holds only what the folder has."""
    if not parts:
        return []
    return [f'<section id="{anchor}"><h3>{text(heading)}</h3>\n' + "\n".join(parts) + "\n</section>"]


def figure(uri: str, caption: str) -> str:
    """An image (a ``data:`` URI) with its caption."""
    return f'<figure><img src="{uri}" alt="{text(caption)}"><figcaption>{text(caption)}</figcaption></figure>'


_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em auto;max-width:1400px;padding:0 1em;color:#222}
h1{font-size:1.5em;margin-bottom:.2em} h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.6em} h3{margin:1.2em 0 .4em}
dl.answer{display:grid;grid-template-columns:max-content auto;gap:.3em 1em;font-size:15px} dl.answer dt{font-weight:600} dl.answer dd{margin:0}
nav a{margin-right:1em} .note{color:#666}
.scroll{overflow:auto;max-height:42em;margin:.5em 0 1em}
table{border-collapse:collapse;font-size:13px} caption{text-align:left;font-weight:600;padding:.3em 0}
th,td{border:1px solid #ddd;padding:.2em .5em;white-space:nowrap} td.num{text-align:right;font-variant-numeric:tabular-nums}
th{background:#f3f3f3;position:sticky;top:0;cursor:pointer;user-select:none}
th[data-order=asc]::after{content:" \\25B2"} th[data-order=desc]::after{content:" \\25BC"}
tbody tr:nth-child(even){background:#fafafa}
figure{display:inline-block;margin:.5em 1em .5em 0;vertical-align:top} figure img{max-width:100%;height:auto}
figcaption{color:#555;font-size:12px} details{margin:.5em 0} pre{background:#f7f7f7;padding:.6em;overflow:auto;max-height:40em}
"""

# Sorting by the data-value of the clicked column: numerically where both values are numbers,
# as text otherwise; empty cells last in either direction, so cases without a value never hide
# the worst ones.
_SCRIPT = """
(function () {
  function compare(a, b) {
    var x = Number(a), y = Number(b);
    if (a !== "" && b !== "" && !isNaN(x) && !isNaN(y)) return x - y;
    return a.localeCompare(b);
  }
  document.querySelectorAll("th[data-sort]").forEach(function (th) {
    th.addEventListener("click", function () {
      var table = th.closest("table"), body = table.tBodies[0], column = th.cellIndex;
      var up = th.getAttribute("data-order") !== "asc";
      table.querySelectorAll("th").forEach(function (h) { h.removeAttribute("data-order"); });
      th.setAttribute("data-order", up ? "asc" : "desc");
      var rows = Array.prototype.slice.call(body.rows);
      rows.sort(function (r, s) {
        var a = r.cells[column].getAttribute("data-value"), b = s.cells[column].getAttribute("data-value");
        if (a === "" || b === "") return (a === "") - (b === "");
        return up ? compare(a, b) : compare(b, a);
      });
      rows.forEach(function (row) { body.appendChild(row); });
    });
  });
})();
"""


def page(title: str, subtitle: str, sections: Sequence[tuple[str, str, Sequence[str]]]) -> str:
    """The whole document: ``sections`` are ``(anchor, heading, html parts)`` (parts may be
    :func:`subsection` blocks), listed in a navigation bar at the top."""
    nav = " ".join(f'<a href="#{anchor}">{text(heading)}</a>' for anchor, heading, _ in sections)
    body = "\n".join(f'<section id="{anchor}"><h2>{text(heading)}</h2>\n' + "\n".join(parts) + "\n</section>"
                     for anchor, heading, parts in sections)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{text(title)}</title>'
            f"<style>{_STYLE}</style></head><body>\n<h1>{text(title)}</h1><p class=note>{text(subtitle)}</p><nav>{nav}</nav>\n"
            f"{body}\n<script>{_SCRIPT}</script></body></html>\n")
