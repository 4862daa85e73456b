"""``hsmla-med serve``: run a DICOM node (:mod:`hsmla_med.serve`) until SIGTERM or Ctrl-C, or
look at its queue (``status``) and queue a failed job again (``retry JOB``)."""

from __future__ import annotations

import logging
import time

from hsmla_med.cli.invocation import Invocation

log = logging.getLogger("hsmla_med")

ACTIONS = ("run", "status", "retry")
_SHOWN_ERRORS = 5  # failed jobs that status lists


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="a DICOM node: series from a PACS in, DICOM SEG results back",
                       description="A DICOM node (C-ECHO, C-STORE) that a PACS sends image series to: each series that stops growing "
                       "goes to the model of the first route that matches it, and the DICOM SEG it predicts is sent to the destinations. "
                       "Without ACTION it runs until SIGTERM or Ctrl-C (a running job ends, or runs again at the next start); status: "
                       "the jobs by state and the last errors; retry JOB: queue a failed job again.")
    p.add_argument("action", nargs="?", choices=ACTIONS, default="run", metavar="ACTION", help="run (default), status, or retry JOB")
    p.add_argument("job", nargs="?", type=int, metavar="JOB", help="with retry: the job's number (serve status lists them)")
    p.add_argument("--config", required=True, metavar="NODE_YAML", help="the node's configuration (AE title, port, accepted peers, spool, "
                   "routes, destinations; docs/node.yaml is a commented example)")


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def status(config) -> None:
    """The queue's jobs by state, the series waiting in the spool, the last failed jobs."""
    from hsmla_med.serve.queue import QUEUE_FILE, JobQueue
    from hsmla_med.serve.spool import Spool

    queue = JobQueue(config.spool / QUEUE_FILE, create=False)
    counts = queue.counts()
    print(f"spool {config.spool}: " + ", ".join(f"{n} {state}" for state, n in counts.items())
          + f"; {len(Spool(config.spool).series_folders())} series being received or without a route")
    for job in queue.jobs("failed", _SHOWN_ERRORS):
        print(f"  job {job.id} failed {_when(job.updated)} after {job.attempts} attempt(s), route {job.route}, series {job.series_uid} "
              f"(accession {job.accession or '-'}): {job.last_error}")
    if counts["failed"] > _SHOWN_ERRORS:
        print(f"  ... and {counts['failed'] - _SHOWN_ERRORS} more failed job(s)")


def serve(config) -> None:
    """Run the node until a signal (``main`` turns SIGTERM and SIGINT into ``KeyboardInterrupt``)."""
    from hsmla_med.serve.node import Node

    node = Node(config)
    try:
        node.start()
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        log.info("stopping: up to %g s for the running job(s) to end", config.stop_grace_s)
    finally:
        node.stop()


def run(args, invocation: Invocation) -> int:
    from hsmla_med.errors import InputError
    from hsmla_med.serve.config import load_node_config

    if (args.action == "retry") != (args.job is not None):
        raise InputError("serve retry JOB: give the job's number (serve status lists the failed ones)" if args.action == "retry"
                         else f"serve {args.action}: takes no JOB (serve retry JOB queues a job again)")
    config = load_node_config(args.config)
    if args.action == "status":
        status(config)
    elif args.action == "retry":
        from hsmla_med.serve.queue import QUEUE_FILE, JobQueue

        job = JobQueue(config.spool / QUEUE_FILE, create=False).retry(args.job)
        print(f"{job.line()}: queued again (route {job.route}; last error: {job.last_error})")
    else:
        serve(config)
    return 0
