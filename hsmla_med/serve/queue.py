"""The node's durable job queue: ``spool/queue.sqlite``, SQLite (the standard library's) in WAL
mode, so that ``serve status`` and ``serve retry`` read and write it while the node runs.

A job is one series: ``received`` when its series is complete (moved into its folder), then
``running`` while a worker predicts and sends, then ``sent`` or ``failed`` (with the reason,
``last_error``). A worker takes a job by one ``UPDATE ... RETURNING`` statement, which SQLite
runs atomically, so no job runs twice at once, across threads and processes. Each delivery of a
result to a destination is recorded (``deliveries``), so that a job run again (after a restart
or ``serve retry``) sends only what did not arrive.

The SOP Instance UID of a job's SEG (``seg_uid``) is chosen when the job is queued, before any
prediction: a job run again writes (or, when the SEG was written before, sends that same file:
its folder is kept until the job is sent, and the prediction skips a case whose output exists)
an object of that UID, which a destination that received it once stores once.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path

from hsmla_med.errors import InputError

__all__ = ["Job", "JobQueue", "STATES", "QUEUE_FILE"]

QUEUE_FILE = "queue.sqlite"
STATES = ("received", "running", "sent", "failed")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    study_uid TEXT NOT NULL,
    series_uid TEXT NOT NULL,
    accession TEXT NOT NULL DEFAULT '',
    route TEXT NOT NULL,
    folder TEXT NOT NULL UNIQUE,
    instances INTEGER NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('received', 'running', 'sent', 'failed')),
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    seg_uid TEXT,
    result TEXT,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs (state, id);
CREATE TABLE IF NOT EXISTS deliveries (
    job INTEGER NOT NULL REFERENCES jobs (id),
    destination TEXT NOT NULL,
    sop_uid TEXT NOT NULL,
    sent REAL NOT NULL,
    PRIMARY KEY (job, destination, sop_uid)
);
"""
_COLUMNS = "id, study_uid, series_uid, accession, route, folder, instances, state, attempts, last_error, seg_uid, result, created, updated"


@dataclass(frozen=True)
class Job:
    id: int
    study_uid: str
    series_uid: str
    accession: str
    route: str
    folder: str  # the token of its folder in the spool (spool/jobs/<folder>)
    instances: int
    state: str
    attempts: int
    last_error: str | None
    seg_uid: str  # the SOP Instance UID of its SEG, when one is written (no foreground predicted: none is)
    result: str | None
    created: float
    updated: float

    def line(self) -> str:
        """The job as the log names it: its UIDs and accession number, never the patient."""
        return f"job {self.id} (series {self.series_uid} of study {self.study_uid}, accession {self.accession or '-'})"


class JobQueue:
    """The queue in ``path``; each call opens its own connection, so threads share nothing."""

    def __init__(self, path: Path, create: bool = True) -> None:
        self.path = Path(path)
        if not create and not self.path.is_file():
            raise InputError(f"{self.path}: no job queue there (the node has not run with this spool)")
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._db() as db:
                db.execute("PRAGMA journal_mode=WAL")  # persistent: readers never block the node's writers
                db.executescript(_SCHEMA)
                self._choose_missing_seg_uids(db)

    @staticmethod
    def _choose_missing_seg_uids(db: sqlite3.Connection) -> None:
        """A queue of a node that chose the SEG's UID when it wrote it: its jobs not sent yet
        (none of which wrote a SEG, which recorded its UID at once) get theirs now."""
        from pydicom.uid import generate_uid

        for (job_id,) in db.execute("SELECT id FROM jobs WHERE seg_uid IS NULL AND state != 'sent'").fetchall():
            db.execute("UPDATE jobs SET seg_uid = ? WHERE id = ?", (generate_uid(), job_id))

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        """A connection in autocommit mode (each statement its own transaction, or an explicit
        ``BEGIN IMMEDIATE``), waiting up to 30 s for another writer."""
        with closing(sqlite3.connect(self.path, timeout=30, isolation_level=None)) as db:
            db.execute("PRAGMA foreign_keys=ON")
            yield db

    def add(self, study_uid: str, series_uid: str, accession: str, route: str, folder: str, instances: int) -> Job:
        """A new ``received`` job, with the SOP Instance UID its SEG will have."""
        from pydicom.uid import generate_uid

        now = time.time()
        with self._db() as db:
            row = db.execute(f"INSERT INTO jobs (study_uid, series_uid, accession, route, folder, instances, state, seg_uid, created, updated) "
                             f"VALUES (?, ?, ?, ?, ?, ?, 'received', ?, ?, ?) RETURNING {_COLUMNS}",
                             (study_uid, series_uid, accession, route, folder, instances, generate_uid(), now, now)).fetchone()
        return Job(*row)

    def claim(self) -> Job | None:
        """The oldest received job, now ``running`` (one more attempt), or ``None``."""
        with self._db() as db:
            row = db.execute(f"UPDATE jobs SET state = 'running', attempts = attempts + 1, updated = ? "
                             f"WHERE id = (SELECT id FROM jobs WHERE state = 'received' ORDER BY id LIMIT 1) RETURNING {_COLUMNS}",
                             (time.time(),)).fetchone()
        return None if row is None else Job(*row)

    def finish(self, job: Job, state: str, result: str | None = None, error: str | None = None) -> bool:
        """End a running job as ``sent``, ``failed`` or (stopped) ``received`` again; ``False``
        when it is no longer running (re-queued meanwhile by a stop)."""
        with self._db() as db:
            changed = db.execute("UPDATE jobs SET state = ?, result = COALESCE(?, result), last_error = ?, updated = ? "
                                 "WHERE id = ? AND state = 'running'", (state, result, error, time.time(), job.id)).rowcount
        return changed == 1

    def delivered(self, job: Job, destination: str, sop_uid: str) -> bool:
        with self._db() as db:
            return db.execute("SELECT 1 FROM deliveries WHERE job = ? AND destination = ? AND sop_uid = ?",
                              (job.id, destination, sop_uid)).fetchone() is not None

    def record_delivery(self, job: Job, destination: str, sop_uid: str) -> None:
        with self._db() as db:
            db.execute("INSERT OR IGNORE INTO deliveries VALUES (?, ?, ?, ?)", (job.id, destination, sop_uid, time.time()))

    def deliveries(self, job_id: int) -> list[tuple[str, str]]:
        """``(destination, SOP Instance UID)`` of each delivery of a job, in order."""
        with self._db() as db:
            return db.execute("SELECT destination, sop_uid FROM deliveries WHERE job = ? ORDER BY sent", (job_id,)).fetchall()

    def requeue_running(self) -> int:
        """Every running job back to ``received``: at a node's start (it holds the spool's lock,
        so these are of a node that was killed), and at its stop for the jobs it could not end."""
        with self._db() as db:
            return db.execute("UPDATE jobs SET state = 'received', updated = ? WHERE state = 'running'", (time.time(),)).rowcount

    def retry(self, job_id: int) -> Job:
        """A failed job back to ``received`` (``serve retry``); :class:`InputError` for an
        unknown job or one that did not fail."""
        with self._db() as db:
            db.execute("BEGIN IMMEDIATE")
            row = db.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                db.execute("ROLLBACK")
                raise InputError(f"job {job_id}: no such job in {self.path}")
            if row[0] != "failed":
                db.execute("ROLLBACK")
                raise InputError(f"job {job_id}: is {row[0]}; only a failed job is retried")
            db.execute("UPDATE jobs SET state = 'received', updated = ? WHERE id = ?", (time.time(), job_id))
            db.execute("COMMIT")
        return self.job(job_id)

    def job(self, job_id: int) -> Job:
        with self._db() as db:
            row = db.execute(f"SELECT {_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise InputError(f"job {job_id}: no such job in {self.path}")
        return Job(*row)

    def folders(self) -> set[str]:
        with self._db() as db:
            return {row[0] for row in db.execute("SELECT folder FROM jobs")}

    def counts(self) -> dict[str, int]:
        """Jobs by state, every state listed."""
        with self._db() as db:
            found = dict(db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall())
        return {state: found.get(state, 0) for state in STATES}

    def jobs(self, state: str | None = None, limit: int = 10) -> list[Job]:
        """The latest jobs (of ``state``), the most recently changed first."""
        where, values = ("WHERE state = ?", (state,)) if state else ("", ())
        with self._db() as db:
            rows = db.execute(f"SELECT {_COLUMNS} FROM jobs {where} ORDER BY updated DESC, id DESC LIMIT ?", (*values, limit)).fetchall()
        return [Job(*row) for row in rows]
