"""A report page loaded in a real headless Chromium: console errors, images that do not decode,
the sort of the case table, and the time to the page's ``load`` event, read back from the
browser's DOM. The report's tests check pages with it (``tests/browser.py``), and the report
benchmark (``hsmla-med bench --only report``) times their rendering.

The page is copied with a harness script first in its ``<head>``: it records uncaught errors and
``console.error`` calls from the start, and on ``load`` counts the images whose ``naturalWidth``
is 0, clicks the first numeric column header of the case (or slide) table twice, checks that the
rows follow the order the header then shows (both ways), and writes its findings as JSON into ``<pre id=harness>``,
which ``--dump-dom`` returns. Chromium offers no other channel without a driver (Playwright or
CDP), which the environment need not have; hence this.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from pathlib import Path

__all__ = ["chromium", "load_page"]

_HARNESS = """<script>
(function () {
  var errors = [];
  window.addEventListener("error", function (e) { errors.push(String(e.message || e)); }, true);
  var logged = console.error;
  console.error = function () { errors.push(Array.prototype.join.call(arguments, " ")); logged.apply(console, arguments); };
  function values(table, column) {
    return Array.prototype.map.call(table.tBodies[0].rows, function (r) { return r.cells[column].getAttribute("data-value"); })
      .filter(function (v) { return v !== "" && !isNaN(Number(v)); }).map(Number);
  }
  function ordered(list, up) {
    for (var i = 1; i < list.length; i++) if (up ? list[i] < list[i - 1] : list[i] > list[i - 1]) return false;
    return true;
  }
  window.addEventListener("load", function () {
    var images = Array.prototype.slice.call(document.images);
    var result = {errors: errors, images: images.length,
                  broken: images.filter(function (i) { return !(i.complete && i.naturalWidth > 0); }).map(function (i) { return i.alt; }),
                  sorted: null, load_ms: performance.getEntriesByType("navigation")[0].loadEventStart};
    var tables = Array.prototype.filter.call(document.querySelectorAll("table"), function (t) { return t.querySelector("th[data-sort]"); });
    var table = tables.filter(function (t) { return ["case", "slide"].indexOf(t.querySelector("th").textContent.trim()) >= 0; })[0] || tables[0];
    if (table && table.tBodies[0].rows.length > 1) {
      var column = -1, first = table.tBodies[0].rows[0];
      for (var c = 1; c < first.cells.length && column < 0; c++) if (values(table, c).length > 1) column = c;
      if (column > 0) {
        var th = table.querySelectorAll("th")[column], seen = {};
        for (var k = 0; k < 2; k++) {  // the order a click gives is the one the header then shows
          th.click();
          var order = th.getAttribute("data-order");
          seen[order === "asc" ? "ascending" : "descending"] = ordered(values(table, column), order === "asc");
        }
        result.sorted = {column: th.textContent, ascending: seen.ascending === true, descending: seen.descending === true,
                         values: values(table, column).length};
      }
    }
    var out = document.createElement("pre");
    out.id = "harness";
    out.textContent = JSON.stringify(result);
    document.body.appendChild(out);
  });
})();
</script>"""


@functools.cache
def chromium() -> str | None:
    """A Chromium to load pages in: on the PATH, or the one Playwright installed, that starts
    headless here; None without one (an installed browser that cannot start, e.g. without a
    writable /dev/shm, is the host's problem, not a page's: the tests skip as without one, the
    report benchmark leaves the render time out)."""
    found = [shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)]
    found += [str(p) for p in sorted(Path.home().glob(".cache/ms-playwright/chromium-*/chrome-linux*/chrome"))[-1:]]
    for browser in found:
        try:
            done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", "about:blank"],
                                  capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0 and "<html" in done.stdout:
            return browser
    return None


def load_page(page: Path, work: Path, timeout: float = 120) -> dict:
    """Load ``page`` (a copy with the harness, written into ``work``) in headless Chromium;
    the harness's findings (module docstring), with ``stderr`` the browser's log.

    Raises:
        RuntimeError: Chromium failed, or the harness wrote nothing (the page did not load).
    """
    document = page.read_text(encoding="utf-8")
    work.mkdir(parents=True, exist_ok=True)
    copy = work / f"harness_{page.parent.name}_{page.name}"
    copy.write_text(document.replace("<head>", "<head>" + _HARNESS, 1), encoding="utf-8")
    done = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--virtual-time-budget=10000",
                           f"--user-data-dir={work / 'profile'}", "--dump-dom", copy.as_uri()],
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"chromium failed ({done.returncode}): {done.stderr[-2000:]}")
    found = re.search(r'<pre id="harness">(.*?)</pre>', done.stdout, re.S)
    if found is None:
        raise RuntimeError(f"the harness wrote nothing (the page did not load?): {done.stderr[-2000:]}")
    text = found.group(1).replace("&quot;", '"').replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
    return {**json.loads(text), "stderr": done.stderr}
