"""The CAMELYON16 challenge's submission files (camelyon16.grand-challenge.org/Evaluation):
one lesion CSV per slide and one slide-level CSV, written by ``wsi-heatmap`` and read by
``evaluate --predictions`` (:mod:`hsmla_med.evaluation.pathology`).

A lesion CSV is named as its slide and holds a row ``Confidence,X,Y`` (level-0 pixels, no
header) per detected lesion; ``Evaluation_FROC.py`` reads them from a folder of nothing else
(every ``*.csv`` there is a slide's). The slide CSV holds ``Image,Confidence`` rows, the
probability of metastasis per slide, for the slide-level ROC. Hand-written: the challenge's
format is plain CSV with the official reader's rules, which no library implements.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

from hsmla_med.errors import DataError
from hsmla_med.io.atomic import atomic_path

__all__ = ["LESIONS", "SLIDE_CSV", "SLIDE_CSV_HEADER", "write_lesion_csv", "write_slide_csv", "read_lesion_csv", "read_slide_csv"]

LESIONS = "lesions"
SLIDE_CSV = "slides.csv"
SLIDE_CSV_HEADER = ("Image", "Confidence")


def write_lesion_csv(path: Path, confidences: np.ndarray, points: np.ndarray) -> None:
    """A slide's lesion CSV: ``Confidence,X,Y`` rows, most confident first, no header. X and Y are
    integers (the official reader takes them with ``int()``); confidences are written to round
    trip exactly (``repr``), so a submission scores as the maps it came from."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text("".join(f"{float(p)!r},{int(x)},{int(y)}\n" for p, (x, y) in zip(confidences, np.asarray(points).reshape(-1, 2))))


def write_slide_csv(path: Path, scores: dict[str, float]) -> None:
    """The slide-level CSV: header ``Image,Confidence``, then ``<slide name>,<score>`` per slide."""
    with atomic_path(path) as tmp, tmp.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(SLIDE_CSV_HEADER)
        writer.writerows([name, repr(float(score))] for name, score in sorted(scores.items()))


def _number(text: str, path: Path, line: int, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise DataError(f"{path}: line {line}: {what} {text.strip()!r} is not a finite number")
    return value


def _coordinate(text: str, path: Path, line: int, axis: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise DataError(f"{path}: line {line}: {axis} {text.strip()!r} is not an integer (level-0 pixels; "
                        "Evaluation_FROC.py reads coordinates with int(), which refuses decimals)") from None


def read_lesion_csv(path: Path) -> np.ndarray:
    """A lesion CSV as ``(n, 3)`` float64 ``(confidence, x, y)``; blank lines skipped.

    Where the official ``readCSVContent`` would stop with a traceback (a header, a word, a
    missing column, a coordinate with decimals, which its ``int()`` refuses), this raises one
    :class:`DataError` naming the file and line. Coordinates must be non-negative integers."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split(",")
        if len(fields) != 3:
            raise DataError(f"{path}: line {number}: {line.strip()!r} is not 'Confidence,X,Y' (three numbers, no header)")
        rows.append([_number(fields[0], path, number, "confidence"), *(_coordinate(t, path, number, a) for t, a in zip(fields[1:], "XY"))])
        if min(rows[-1][1:]) < 0:
            raise DataError(f"{path}: line {number}: negative coordinate in {line.strip()!r} (level-0 pixels start at 0)")
    return np.array(rows, np.float64).reshape(-1, 3)


def read_slide_csv(path: Path) -> dict[str, float]:
    """The slide-level CSV: ``{image name: confidence}`` from ``name,confidence`` rows, names as
    written (a slide file's name or its stem); a first line whose second field is not a number is
    a header."""
    scores = {}
    with path.open(newline="") as f:
        for number, fields in enumerate(csv.reader(f), 1):
            if not fields or not "".join(fields).strip():
                continue
            if len(fields) != 2:
                raise DataError(f"{path}: line {number}: {','.join(fields)!r} is not 'Image,Confidence'")
            if number == 1 and _is_header(fields[1]):
                continue
            scores[fields[0].strip()] = _number(fields[1], path, number, "confidence")
    return scores


def _is_header(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return True
    return False
