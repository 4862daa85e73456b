"""The node: a pynetdicom AE that answers C-ECHO and takes C-STORE (into the spool) from the
calling AE titles and hosts of its configuration, a scheduler thread that turns each series that
stopped growing into a job of the route that takes it, and worker processes that run the jobs
(:func:`~hsmla_med.serve.worker.work`).

One node per spool: it holds an exclusive lock on ``spool/node.lock`` while it runs (the kernel
drops it when the process ends, however it ends, and its workers end with it), so a job found
``running`` at the start is one of a node that was killed, and runs again. A stop
(:meth:`Node.stop`) refuses new associations, lets the running jobs end within ``stop_grace_s``,
ends the workers and re-queues the jobs that did not end.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue as queues
import ssl
import threading
import time

from hsmla_med.errors import ConfigError, InputError
from hsmla_med.serve.config import NodeConfig
from hsmla_med.serve.queue import QUEUE_FILE, JobQueue
from hsmla_med.serve.routing import choose_route, series_line
from hsmla_med.serve.spool import Refused, Spool, instances
from hsmla_med.serve.tls import server_context
from hsmla_med.serve.worker import quiet_pydicom, work

__all__ = ["Node", "LOCK_FILE"]

log = logging.getLogger("hsmla_med")

LOCK_FILE = "node.lock"
# association rejection: permanent, by the service user, calling AE title not recognised (PS3.8 9.3.4)
_REJECTED, _SERVICE_USER, _CALLING_AE_NOT_RECOGNISED = 0x01, 0x01, 0x03


class Node:
    """A running DICOM node of ``config`` (:meth:`start`, then :meth:`stop`)."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.spool = Spool(config.spool)
        self.stopping = threading.Event()
        self.server = None
        self.workers: list = []  # multiprocessing's processes
        self._stop_workers = None  # their stop event
        self._threads: list[threading.Thread] = []
        self._lock_fd: int | None = None
        self._unrouted: dict = {}  # series folder -> the time it was found without a route (logged once per change)
        self.queue: JobQueue | None = None
        self._started = 0.0

    def _lock(self) -> None:
        import fcntl

        self.config.spool.mkdir(parents=True, exist_ok=True)
        path = self.config.spool / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise InputError(f"spool {self.config.spool}: another node runs with it (pid {path.read_text().strip() or '?'})") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd

    def start(self) -> None:
        """Take the spool, recover what a killed node left, start the workers (each loads the
        models), listen, and start the scheduler."""
        from pynetdicom import AE, ALL_TRANSFER_SYNTAXES, evt
        from pynetdicom.presentation import AllStoragePresentationContexts
        from pynetdicom.sop_class import Verification

        config = self.config
        self._lock()
        self.spool.prepare()
        self.queue = JobQueue(config.spool / QUEUE_FILE)
        requeued = self.queue.requeue_running()
        recovered = self.spool.recover(self.queue.folders())
        if requeued or recovered:
            log.info("spool %s: %d job(s) of an interrupted node queued again, %d series returned to the spool", config.spool, requeued, recovered)
        try:
            server_tls = server_context(config.tls) if config.tls is not None else None
        except (ssl.SSLError, OSError) as err:  # (the same files make the workers' client context)
            raise InputError(f"{config.source}: tls: cannot use the certificate, key and ca ({err})") from None
        self._start_workers()
        self._started = time.time()  # series in the spool from before: quiet only from now on (Spool.stable)
        logging.getLogger("pynetdicom").setLevel(logging.CRITICAL)  # its lines repeat ours, per PDU; ours name the peer and the reason
        quiet_pydicom()

        ae = AE(ae_title=config.ae_title)
        for context in AllStoragePresentationContexts:
            ae.add_supported_context(context.abstract_syntax, ALL_TRANSFER_SYNTAXES)
        ae.add_supported_context(Verification)
        handlers = [(evt.EVT_REQUESTED, self._check_peer), (evt.EVT_C_ECHO, lambda event: 0x0000), (evt.EVT_C_STORE, self._store)]
        try:
            self.server = ae.start_server((config.bind, config.port), block=False, evt_handlers=handlers, ssl_context=server_tls)
        except OSError as err:
            self.stop()
            raise InputError(f"{config.source}: port {config.port} on {config.bind}: cannot listen ({err.strerror or err})") from None
        self._threads = [threading.Thread(target=self._schedule, name="hsmla-med-scheduler", daemon=True)]
        for thread in self._threads:
            thread.start()
        log.info("node %s listening on %s:%d%s: %d route(s), %d destination(s), %d worker(s); spool %s", config.ae_title, config.bind,
                 config.port, " (TLS)" if config.tls else "", len(config.routes), len(config.destinations), config.workers, config.spool)

    def _start_workers(self) -> None:
        """Start the worker processes and wait until each has its models; a ConfigError with the
        first one's problem (a checkpoint that cannot serve its route, a missing GPU) stops them all."""
        context = multiprocessing.get_context("spawn")  # torch and CUDA in a forked copy of a threaded process are unsafe
        self._stop_workers, ready = context.Event(), context.Queue()
        self.workers = [context.Process(target=work, args=(self.config, i, self._stop_workers, ready, os.getpid()), name=f"hsmla-med-worker-{i}")
                        for i in range(self.config.workers)]
        for process in self.workers:
            process.start()
        waiting = len(self.workers)
        while waiting:
            try:
                problem = ready.get(timeout=1)
            except queues.Empty:
                if not any(p.exitcode is not None for p in self.workers):
                    continue
                problem = "a worker process ended while loading the models (see the lines above)"
            if problem is not None:
                self.stop()
                raise ConfigError(problem)
            waiting -= 1

    def _check_peer(self, event) -> None:
        """Refuse, before any negotiation, an association of a calling AE title and host the
        configuration does not accept."""
        assoc = event.assoc
        calling = str(assoc.requestor.primitive.calling_ae_title).strip()
        address = assoc.requestor.address
        if not self.config.admits(calling, address):
            log.warning("association from %r at %s refused: calling AE title not accepted from that host", calling, address)
            assoc.acse.send_reject(_REJECTED, _SERVICE_USER, _CALLING_AE_NOT_RECOGNISED)
            assoc.kill()  # as pynetdicom's own rejections: waits until the rejection is sent, then ends the association

    def _store(self, event) -> int:
        request = event.request
        try:
            path, _ = self.spool.store(event.encoded_dataset(), str(request.AffectedSOPClassUID), str(request.AffectedSOPInstanceUID))
        except Refused as err:
            log.warning("C-STORE from %s at %s of instance %.64s refused (status 0x%04X): %s", event.assoc.requestor.ae_title,
                        event.assoc.requestor.address, request.AffectedSOPInstanceUID, err.status, err)
            return err.status
        return 0x0000

    def _schedule(self) -> None:
        tick = min(1.0, self.config.stable_after_s / 2)
        while not self.stopping.wait(tick):
            try:
                self.queue_stable_series()
            except Exception:  # a damaged folder must not stop the scheduling of the others
                log.exception("scheduler")

    def queue_stable_series(self) -> None:
        """Each series that no instance reached for ``stable_after_s``: a job of the route that
        takes it, or left in the spool (logged once per change) when none does."""
        import pydicom

        stable = self.spool.stable(self.config.stable_after_s, since=self._started)
        self._unrouted = {folder: mtime for folder, mtime in stable if self._unrouted.get(folder) == mtime}  # forget those gone or changed
        for folder, mtime in stable:
            if self._unrouted.get(folder) == mtime:
                continue
            files = list(instances(folder))
            ds = pydicom.dcmread(files[0], stop_before_pixels=True)
            route = choose_route(self.config.routes, ds)
            if route is None:
                log.info("%s: no route takes it; left in the spool", series_line(ds))
                self._unrouted[folder] = mtime
                continue
            token = self.spool.take(folder, mtime)
            if token is None:
                continue
            self._unrouted.pop(folder, None)
            job = self.queue.add(str(ds.StudyInstanceUID), str(ds.SeriesInstanceUID), str(ds.get("AccessionNumber") or ""), route.name, token,
                                 len(files))
            log.info("%s: %d instance(s) received, queued for route %s", job.line(), len(files), route.name)

    def stop(self) -> None:
        """Refuse new associations, end the running jobs within ``stop_grace_s``, end the workers,
        re-queue the jobs that did not end."""
        self.stopping.set()
        if self.server is not None:
            self.server.shutdown()
            self.server = None
        if self._stop_workers is not None:
            self._stop_workers.set()
        deadline = time.monotonic() + self.config.stop_grace_s
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.workers:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:  # past the grace: its job runs again at the next start
                process.kill()
                process.join()
        self.workers = []
        # the jobs that did not end (past the grace, or stopped between sending attempts)
        requeued = self.queue.requeue_running() if self.queue is not None else 0
        if requeued:
            log.info("stopped with %d job(s) not done: queued again for the next start", requeued)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        log.info("node %s stopped", self.config.ae_title)
