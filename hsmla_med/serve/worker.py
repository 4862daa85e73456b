"""Running a job: the route's model predicts on the job's series (the task's ``predict``, as
``infer --output-format dicom-seg`` does, the SEG's UID the one the job got when queued), the
route's structured report (:mod:`.report`) and burned-in series (:mod:`.capture`) are made from
the SEG, then each result goes to each destination that has not received it yet.

Jobs run in worker processes (:func:`work`, ``workers`` of the configuration), each with its own
copy of every route's model on its own device (``auto``/``cuda``: worker ``i`` on GPU ``i`` modulo
the GPUs; on the CPU, the CPUs shared out), each claiming jobs from the queue (SQLite's atomic
update: a job is never run twice at once). A process rather than a thread: a prediction holds the
GIL in its Python parts (reading the series, writing the SEG), and one model's settings serve one
prediction at a time. The node's main process only listens, spools and queues. A worker dies with
the node (``PR_SET_PDEATHSIG``): a killed node leaves no worker running its jobs, which the next
start queues again.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

from hsmla_med.errors import ConfigError, InputError, find_input_error
from hsmla_med.serve.config import NodeConfig, Route
from hsmla_med.serve.queue import QUEUE_FILE, Job, JobQueue
from hsmla_med.serve.send import SendError, Stopped, send_files
from hsmla_med.serve.spool import BURNED_IN, OUTPUT, REPORT, SERIES, Spool

__all__ = ["Model", "load_models", "run_job", "work", "quiet_pydicom", "POLL_S"]

log = logging.getLogger("hsmla_med")

POLL_S = 0.5  # how often an idle worker looks for a job (another process may queue one: serve retry)


@dataclass
class Model:
    """A route's loaded model and the options of its predictions."""

    route: Route
    task: object
    module: object
    options: object


def _device(name: str, worker: int = 0) -> str:
    """The device of worker ``worker``: ``auto`` and ``cuda`` take the GPUs in turn, ``cuda:N`` and ``cpu`` as they say."""
    import torch

    if name == "auto" and not torch.cuda.is_available():
        return "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name}: no CUDA device on this machine; use device: cpu or auto")
    return f"cuda:{worker % torch.cuda.device_count()}" if name in ("auto", "cuda") else name


def load_models(config: NodeConfig, worker: int = 0) -> dict[str, Model]:
    """Each route's model, by route name, on worker ``worker``'s device, with the options
    ``infer`` would use for it (the post-processing beside its checkpoint, as ``infer`` finds
    it); :class:`ConfigError` naming the route for a checkpoint that cannot serve it."""
    from hsmla_med.engine.checkpoint import written_task
    from hsmla_med.pipelines import get_task
    from hsmla_med.pipelines.task import InferenceOptions

    device = _device(config.device, worker)
    models = {}
    for i, route in enumerate(config.routes):
        where = f"{config.source}: routes[{i}] ({route.name})"
        try:
            name = route.task or written_task(route.checkpoint)
            if name is None:
                raise ConfigError(f"checkpoint {route.checkpoint} does not record its task; give the route's task")
            task = get_task(name)
            unsupported = [f for f in route.output_formats if f not in task.card.output_formats]
            if unsupported:
                raise ConfigError(f"output_formats {', '.join(unsupported)}: task {task.name} does not write them")
            module, _ = task.load(route.checkpoint)
            declared = task.inference_values({}, [route.checkpoint], lambda line: log.info("route %s: %s", route.name, line))
        except InputError as err:
            raise ConfigError(f"{where}: {err}") from None
        options = InferenceOptions(device=device, output_formats=route.output_formats, progress=lambda _: None, **declared)
        models[route.name] = Model(route, task, module, options)
        log.info("route %s: %s model %s on %s", route.name, task.name, route.checkpoint, device)
    return models


def _sop_uid(path: Path) -> str:
    import pydicom

    return str(pydicom.dcmread(path, stop_before_pixels=True).SOPInstanceUID)


def _results(seg: Path, model: Model, job: Job, folder: Path) -> list[Path]:
    """The files a job sends: its SEG, with the route's ``structured_report`` the report of its
    segments' volumes, and with its ``burned_in`` the Secondary Capture series drawn from it over
    the series' slices."""
    from hsmla_med.io.dicom import find_series
    from hsmla_med.serve.capture import write_burned_in
    from hsmla_med.serve.report import REPORT_NAME, write_volume_report

    route = model.route
    if not (route.burned_in or route.structured_report):
        return [seg]
    (series,) = [s for s in find_series(folder / SERIES) if s.uid == job.series_uid]
    results = [seg]
    if route.structured_report:
        results.append(write_volume_report(seg, series.files, folder / REPORT / REPORT_NAME))
    if route.burned_in:
        results += write_burned_in(seg, series.files, model.module.label_names, folder / BURNED_IN, job.folder)
    return results


def _send(job: Job, results: list[Path], config: NodeConfig, queue: JobQueue, stop: threading.Event, tls) -> None:
    """Each result to each destination that has not stored it (deliveries are recorded one by one)."""
    uids = {path: _sop_uid(path) for path in results}
    for destination in config.destinations:
        todo = [path for path in results if not queue.delivered(job, destination.name, uids[path])]

        def stored(path: Path, name: str = destination.name) -> None:
            queue.record_delivery(job, name, uids[path])

        if todo:
            send_files(todo, destination, config.ae_title, config.retry, stop, tls if destination.tls else None, stored)


def run_job(job: Job, models: dict[str, Model], config: NodeConfig, spool: Spool, queue: JobQueue, stop: threading.Event,
            tls=None) -> None:
    """Predict and send one claimed job, and record how it ended: ``sent`` (its folder then
    removed), ``failed`` with the reason (its folder kept for ``serve retry``), or, when the node
    stops while it waits to send again, still running (the stop re-queues it)."""
    from hsmla_med.io.dicom_seg import SEG_SUFFIX

    started = time.perf_counter()
    log.info("%s: route %s, attempt %d", job.line(), job.route, job.attempts)
    try:
        model = models.get(job.route)
        if model is None:
            raise InputError(f"route {job.route!r} is not in {config.source} any more")
        folder = spool.job_folder(job.folder)
        if not (folder / SERIES).is_dir():
            raise InputError(f"its series folder {folder / SERIES} is gone")
        written = model.task.predict(model.module, folder / SERIES, folder / OUTPUT,
                                     replace(model.options, series_uid=job.series_uid, seg_uids={job.series_uid: job.seg_uid}))
        seg = next((p for p in written if p.name.endswith(SEG_SUFFIX)), None)
        if seg is None:
            result = "no foreground class predicted: no SEG to send"
        else:
            results = _results(seg, model, job, folder)
            _send(job, results, config, queue, stop, tls)
            others = f" and {len(results) - 1} more result(s)" if len(results) > 1 else ""
            result = f"SEG {job.seg_uid}{others} sent to {', '.join(d.name for d in config.destinations)}"
        if queue.finish(job, "sent", result=result):
            spool.remove(job.folder)
        log.info("%s: %s (%.1f s)", job.line(), result, time.perf_counter() - started)
    except Stopped:
        log.info("%s: stopped while waiting to send again; it runs again at the next start", job.line())
    except SendError as err:
        queue.finish(job, "failed", error=str(err))
        log.warning("%s: failed: %s", job.line(), err)
    except Exception as err:  # one job's failure (a damaged series, a bug) must not end the node
        problem = find_input_error(err)
        if problem is None:
            log.exception("%s: failed", job.line())
        else:
            log.warning("%s: failed: %s", job.line(), problem)
        queue.finish(job, "failed", error=str(problem) if problem is not None else f"{type(err).__name__}: {err}")


def quiet_pydicom() -> None:
    """pydicom's warnings about odd values, per instance received or read: a refused instance has
    its one line with the reason, and hospital data would flood the log otherwise."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"pydicom(\.|$)")


def _die_with_parent(parent: int) -> None:
    """Have the kernel end this process with SIGKILL when the node's process ends, however it
    ends (Linux's ``prctl(PR_SET_PDEATHSIG)``; elsewhere the loop of :func:`work` notices)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the node ended before the request took effect
        os._exit(1)


def _share_cpus(workers: int) -> None:
    """On the CPU, each of ``workers`` processes takes its share of the CPUs for torch's threads,
    unless the user set ``OMP_NUM_THREADS`` (hsmla-med's own setting is the whole machine's)."""
    import torch

    from hsmla_med.runtime import applied_variables, available_cpus

    if workers > 1 and ("OMP_NUM_THREADS" not in os.environ or "OMP_NUM_THREADS" in applied_variables()):
        torch.set_num_threads(max(1, available_cpus() // workers))


def work(config: NodeConfig, number: int, stop, ready, parent: int) -> None:
    """A worker process (``multiprocessing``'s spawn): load the routes' models, put ``None`` on
    ``ready`` (or the error that stops the node's start, in one line), then claim and run jobs
    until ``stop`` is set. SIGINT and SIGTERM are the node's to handle (a Ctrl-C or a service
    manager reaches the whole process group): the node's stop sets ``stop``, waits for the
    running job up to ``stop_grace_s``, then ends the process."""
    from hsmla_med.errors import find_input_error

    _die_with_parent(parent)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"hsmla-med: [worker {number}] %(message)s"))  # the command line's, and which worker
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    quiet_pydicom()
    try:
        _share_cpus(config.workers)
        models = load_models(config, number)
        tls = None
        if config.tls is not None:
            from hsmla_med.serve.tls import client_context

            tls = client_context(config.tls)
    except Exception as err:
        problem = find_input_error(err)
        ready.put(str(problem) if problem is not None else f"worker {number}: {type(err).__name__}: {err}")
        return
    ready.put(None)
    queue, spool = JobQueue(config.spool / QUEUE_FILE), Spool(config.spool)
    while not stop.is_set() and os.getppid() == parent:
        job = queue.claim()
        if job is None:
            stop.wait(POLL_S)
            continue
        run_job(job, models, config, spool, queue, stop, tls)
