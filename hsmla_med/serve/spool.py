"""What the node receives: each C-STORE instance is checked, then written atomically (and
synced) to ``spool/<StudyInstanceUID>/<SeriesInstanceUID>/<SOPInstanceUID>.dcm``; a series folder
that no instance changed for ``stable_after_s`` is moved whole into a job's folder,
``spool/jobs/<token>/series``, where the prediction reads it and writes beside it (``out``,
``burned_in`` and ``report``).

An instance is refused, with a C-STORE failure status, when it cannot be read as DICOM, when its
UIDs are missing, malformed or not those of the request, or when it holds no pixel data or less
than its header announces (a truncated transfer): the sender learns it at once, and the spool
holds only instances that a series reader can take. UIDs name folders and files, so only UIDs of
the standard's syntax (digits and dots, at most 64 characters) are written: a crafted UID cannot
reach outside the spool.

Writes into the spool and the move of a series into a job are serialised by one lock, so that an
instance that arrives while its series is moved lands either in the job or in a new series folder
of the spool, never in a folder that is going away.
"""

from __future__ import annotations

import io
import logging
import os
import re
import shutil
import threading
import time
import uuid
from pathlib import Path

from hsmla_med.io.atomic import atomic_path, is_temporary, remove_stale_temporaries

__all__ = ["Spool", "Refused", "check_instance", "CANNOT_UNDERSTAND", "DOES_NOT_MATCH", "OUT_OF_RESOURCES"]

log = logging.getLogger("hsmla_med")

# C-STORE failure statuses (DICOM PS3.4 B.2.3)
OUT_OF_RESOURCES = 0xA700
DOES_NOT_MATCH = 0xA900  # data set does not match SOP class
CANNOT_UNDERSTAND = 0xC000

_UID = re.compile(r"[0-9]+(\.[0-9]+)*")
JOBS = "jobs"
SERIES = "series"  # a job's input folder
OUTPUT = "out"  # a job's prediction folder
BURNED_IN = "burned_in"  # a job's Secondary Capture series (apart from the prediction's folder, which records its own outputs)
REPORT = "report"  # a job's structured report (apart from the prediction's folder, as BURNED_IN)


def is_uid(value: object) -> bool:
    return isinstance(value, str) and len(value) <= 64 and _UID.fullmatch(value) is not None


class Refused(Exception):
    """An instance the node does not store: the C-STORE ``status`` and the reason."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


def _pixel_problem(ds) -> Refused | None:
    """Why the pixel data of ``ds`` cannot be used (none: the data set does not match an image
    class; less than its header says: cut short), or ``None``."""
    from pydicom.encaps import generate_frames

    keyword = next((k for k in ("PixelData", "FloatPixelData", "DoubleFloatPixelData") if k in ds), None)
    if keyword is None:
        return Refused(DOES_NOT_MATCH, "no pixel data")
    value = ds[keyword].value
    frames = int(ds.get("NumberOfFrames") or 1)
    if keyword == "PixelData" and ds.file_meta.TransferSyntaxUID.is_encapsulated:
        try:
            found = sum(1 for _ in generate_frames(value, number_of_frames=frames))
        except Exception as err:  # pydicom raises several types for broken item structures
            return Refused(CANNOT_UNDERSTAND, f"encapsulated pixel data cannot be read ({err})")
        return None if found == frames else Refused(CANNOT_UNDERSTAND, f"truncated pixel data: {found} of {frames} encapsulated frame(s)")
    bits = {"PixelData": int(ds.BitsAllocated), "FloatPixelData": 32, "DoubleFloatPixelData": 64}[keyword]
    expected = (int(ds.Rows) * int(ds.Columns) * int(ds.get("SamplesPerPixel") or 1) * frames * bits + 7) // 8
    if len(value) < expected:
        return Refused(CANNOT_UNDERSTAND, f"truncated pixel data: {len(value)} of {expected} bytes")
    return None


def check_instance(raw: bytes, sop_class: str, sop_instance: str):
    """The dataset of ``raw`` (a DICOM file's bytes: preamble, file meta, data set) if the node
    can use it as the instance ``sop_instance`` of class ``sop_class`` that the C-STORE request
    names; else :class:`Refused` with the status and the reason."""
    import pydicom

    try:
        ds = pydicom.dcmread(io.BytesIO(raw))
        uids = {k: ds.get(k) for k in ("SOPClassUID", "SOPInstanceUID", "StudyInstanceUID", "SeriesInstanceUID")}
    except Exception as err:  # pydicom raises several types for foreign or cut streams
        raise Refused(CANNOT_UNDERSTAND, f"cannot be read as DICOM ({type(err).__name__}: {err})") from None
    bad = [k for k, v in uids.items() if not is_uid(str(v) if v is not None else None)]
    if bad:
        raise Refused(CANNOT_UNDERSTAND, f"no valid {', '.join(bad)} (not a DICOM data set, or a damaged one)")
    if uids["SOPInstanceUID"] != sop_instance or uids["SOPClassUID"] != sop_class:
        raise Refused(DOES_NOT_MATCH, "its SOP Class/Instance UID differ from those of the C-STORE request")
    try:
        problem = _pixel_problem(ds)
    except Exception as err:  # an unreadable Rows, BitsAllocated, ... in a damaged header
        problem = Refused(CANNOT_UNDERSTAND, f"pixel attributes cannot be read ({type(err).__name__}: {err})")
    if problem is not None:
        raise problem
    return ds


class Spool:
    """The node's spool folder: received series, and the jobs' folders under ``jobs/``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.jobs = self.root / JOBS
        self._lock = threading.Lock()

    def prepare(self) -> None:
        """Create the folders, and delete the temporaries that killed writes left."""
        self.jobs.mkdir(parents=True, exist_ok=True)
        removed = remove_stale_temporaries(self.root, below=3)
        if removed:
            log.info("spool: removed %d partial file(s) of interrupted writes", len(removed))

    def store(self, raw: bytes, sop_class: str, sop_instance: str) -> tuple[Path, object]:
        """Check the instance (:func:`check_instance`) and write it into its series' folder;
        returns its path and dataset. :class:`Refused` for an instance the node does not take
        or cannot write."""
        ds = check_instance(raw, sop_class, sop_instance)
        path = self.root / str(ds.StudyInstanceUID) / str(ds.SeriesInstanceUID) / f"{ds.SOPInstanceUID}.dcm"
        try:
            with self._lock, atomic_path(path) as tmp:
                with open(tmp, "wb") as f:
                    f.write(raw)
                    f.flush()
                    os.fsync(f.fileno())  # the success status tells the sender it may forget the instance
        except OSError as err:
            raise Refused(OUT_OF_RESOURCES, f"cannot be written to {path.parent} ({err.strerror or err})") from None
        return path, ds

    def series_folders(self) -> list[Path]:
        """The folders of series being received (``<Study>/<Series>``)."""
        return [series for study in sorted(self.root.iterdir()) if study.is_dir() and is_uid(study.name)
                for series in sorted(study.iterdir()) if series.is_dir() and is_uid(series.name)]

    def stable(self, seconds: float, since: float = 0.0) -> list[tuple[Path, float]]:
        """The series folders (with their modification time) that no instance was written to
        for ``seconds``: a write creates a temporary and renames it, each changing the folder's
        time, which survives a restart of the node. The quiet time counts from ``since`` at the
        earliest (the node's start): a series that was arriving when a node stopped gets
        ``seconds`` after the restart for its sender to resume, as if it had arrived then."""
        now = time.time()
        found = []
        for folder in self.series_folders():
            mtime = folder.stat().st_mtime
            if now - max(mtime, since) >= seconds and any(instances(folder)):
                found.append((folder, mtime))
        return found

    def take(self, folder: Path, mtime: float) -> str | None:
        """Move a series folder into a new job folder (``jobs/<token>/series``) and return the
        token; ``None`` when an instance arrived since its time was read ``mtime`` (it is not
        stable after all)."""
        token = uuid.uuid4().hex
        with self._lock:
            if not folder.is_dir() or folder.stat().st_mtime != mtime:
                return None
            (self.jobs / token).mkdir(parents=True)
            os.rename(folder, self.jobs / token / SERIES)
            try:
                folder.parent.rmdir()  # the study's folder, when this was its last series
            except OSError:
                pass
        return token

    def job_folder(self, token: str) -> Path:
        return self.jobs / token

    def remove(self, token: str) -> None:
        shutil.rmtree(self.jobs / token, ignore_errors=True)

    def recover(self, tokens: set[str]) -> int:
        """Return into the spool the series of job folders that no job names (a node killed
        between the move of a series and the job's record): they become jobs again when
        stable. Returns how many."""
        import pydicom

        recovered = 0
        for folder in sorted(self.jobs.iterdir()):
            if folder.name in tokens or not folder.is_dir():
                continue
            files = list(instances(folder / SERIES)) if (folder / SERIES).is_dir() else []
            if files:
                ds = pydicom.dcmread(files[0], stop_before_pixels=True)
                target = self.root / str(ds.StudyInstanceUID) / str(ds.SeriesInstanceUID)
                target.mkdir(parents=True, exist_ok=True)
                for f in files:
                    os.replace(f, target / f.name)
                recovered += 1
            shutil.rmtree(folder)
        return recovered


def instances(folder: Path):
    """The instance files of a series folder (no temporaries of writes in progress)."""
    return (f for f in sorted(folder.iterdir()) if f.suffix == ".dcm" and not is_temporary(f))
