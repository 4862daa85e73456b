"""Compressed voxels checked before a reader trusts them: the zlib stream of a MetaImage (a
``.zraw``, or a compressed ``.mha``) or the gzip stream of a ``.nii.gz``, inflated and counted
against the size its header describes.

Why here and not in the readers: ITK inflates a MetaImage's stream into a buffer of the header's
size and, when the stream is damaged or ends early, prints "Uncompress failed" on stderr at most:
the rest of the buffer stays zeros (or what the memory held) and the scan is read as if whole.
nibabel reads a ``.nii.gz`` only as far as its voxels, so a damaged stream that still inflates
passes unseen (its checksum is at the end), and a short one is zlib's EOFError, after the header's
size has been allocated. Counting the stream first, a chunk at a time, keeps no voxels and stops
as soon as the count passes the header's size: a header that claims far more voxels than its file
holds is refused as soon as the stream ends, before anything is allocated.
"""

from __future__ import annotations

import zlib
from pathlib import Path

from hsmla_med.errors import DataError

__all__ = ["check_inflated"]

_CHUNK = 1 << 20  # bytes read, and at most inflated, at a time
_ZLIB_OR_GZIP = 47  # window bits: a zlib or a gzip header, told apart by zlib, as ITK's MetaIO inflates


def _inflate(path: Path, start: int, cap: int) -> tuple[int, str | None]:
    """How many bytes the compressed data of ``path`` from byte ``start`` inflate to, counted up to
    ``cap``, and what stopped the stream short: ``None`` when it ended (its checksum verified by
    zlib) or reached ``cap``; ``"cut off"`` when the file ends first; zlib's message when the data
    are damaged. Concatenated gzip members (bgzip's) are read on, as gzip reads them; other bytes
    after the stream end it."""
    count, inflater = 0, zlib.decompressobj(_ZLIB_OR_GZIP)
    with open(path, "rb") as f:
        f.seek(start)
        pending = b""
        while count < cap:
            pending = pending or f.read(_CHUNK)
            if not pending:
                return count, "cut off"
            try:
                count += len(inflater.decompress(pending, min(_CHUNK, cap - count)))
            except zlib.error as err:
                return count, str(err).removeprefix("Error -3 while decompressing data: ")
            pending = inflater.unconsumed_tail
            if inflater.eof:
                pending = inflater.unused_data + f.read(2)
                if not pending.startswith(b"\x1f\x8b"):
                    return count, None  # the end, or bytes after the stream that the readers skip (gzip's zero padding)
                inflater = zlib.decompressobj(_ZLIB_OR_GZIP)  # the next gzip member
    return count, None


def check_inflated(path: str | Path, start: int, expected: int, describes: str) -> None:
    """Refuse, naming ``path``, compressed data (from byte ``start``) that are damaged, cut off or
    do not inflate to exactly ``expected`` bytes. More is refused too, for a NIfTI file as for a
    MetaImage (whose voxels are exactly the header's): the stream's checksum, which catches
    damaged data that still inflate, is at its end, past the header's size. ``describes``
    completes the message: what describes ``expected`` ("the header X.mhd describes (48 x 48 x
    16 MET_SHORT)")."""
    count, problem = _inflate(Path(path), start, expected + 1)
    if count > expected:
        raise DataError(f"{path}: its compressed data inflate to more than the {expected} bytes {describes}")
    if problem == "cut off":
        raise DataError(f"{path}: its compressed data are cut off (the file ends inside the stream) after {count} of the {expected} bytes {describes}")
    if problem:
        raise DataError(f"{path}: its compressed data are damaged (zlib: {problem}); they should inflate to the {expected} bytes {describes}")
    if count < expected:
        raise DataError(f"{path}: its compressed data inflate to {count} of the {expected} bytes {describes}")
