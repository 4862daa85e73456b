"""Which model takes a series: the first route of the node's configuration whose every pattern
matches the series' attribute (:class:`~hsmla_med.serve.config.Route`), read from the header of
one of its instances. A series that no route takes stays in the spool and is logged once by its
UIDs and accession number, never by the patient's name or ID."""

from __future__ import annotations

from collections.abc import Sequence

from hsmla_med.serve.config import Route

__all__ = ["attribute_text", "choose_route", "series_line"]


def attribute_text(ds, keyword: str) -> str:
    """An attribute as a route's pattern reads it: its values joined with ``\\`` (as DICOM
    writes several values), ``""`` when absent or empty."""
    from pydicom.multival import MultiValue

    value = ds.get(keyword)
    if value is None:
        return ""
    if isinstance(value, (list, tuple, MultiValue)):
        return "\\".join(str(v) for v in value)
    return str(value)


def choose_route(routes: Sequence[Route], ds) -> Route | None:
    """The first route that takes the series whose header is ``ds``, or ``None``."""
    for route in routes:
        if all(pattern.fullmatch(attribute_text(ds, keyword)) for keyword, pattern in route.match.items()):
            return route
    return None


def series_line(ds) -> str:
    """A series as the log names it: UIDs, accession number and the attributes routes look at
    most, without the patient."""
    return (f"series {ds.get('SeriesInstanceUID', '?')} of study {ds.get('StudyInstanceUID', '?')} (accession {ds.get('AccessionNumber') or '-'}; "
            f"{attribute_text(ds, 'Modality') or '?'}, body part {attribute_text(ds, 'BodyPartExamined') or '-'}, "
            f"description {attribute_text(ds, 'SeriesDescription')!r})")
