"""A report page checked in a real headless Chromium (the harness of
:mod:`hsmla_med.report.browser`): no console error, every image decoded, the case table sorted
both ways by a click."""

from __future__ import annotations

from pathlib import Path

from hsmla_med.report.browser import load_page


def check_page(page: Path, work: Path) -> dict:
    """Load ``page`` and assert what a report page must hold to: no console error, every image
    decoded, the case table (where there is one) sorted both ways by a click."""
    found = load_page(page, work)
    assert found["errors"] == [], found["errors"]
    assert found["broken"] == [], found["broken"]
    if found["sorted"] is not None:
        assert found["sorted"]["ascending"] and found["sorted"]["descending"], found["sorted"]
    return found
