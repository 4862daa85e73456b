"""The ``hsmla-med`` parser, built from the command modules, and :func:`main`: one run of a
command, its input errors as one line (exit status 2), its interruptions as the shell's status."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from hsmla_med.cli import bench, calibrate, cross_validate, demo, evaluate, export, infer, report, serve, train, wsi_features, wsi_heatmap
from hsmla_med.cli.invocation import Invocation, first_process
from hsmla_med.cli.options import resolve_task

log = logging.getLogger("hsmla_med")

#: the command modules, in the order ``--help`` lists them; each has ``add_parser(sub)`` and ``run(args, invocation)``
COMMANDS = (train, cross_validate, infer, evaluate, calibrate, report, wsi_heatmap, wsi_features, export, serve, bench, demo)

_EPILOG = """examples:
  hsmla-med demo                                   # all four tasks on synthetic data, minutes on CPU
  hsmla-med train --task btcv --data-dir /data/BTCV --model b1 --max-steps 20000 --output runs/b1
  hsmla-med train --task btcv --output runs/b1 --resume --max-steps 40000
  hsmla-med train --task btcv --devices 4 --strategy ddp              # multi-GPU (Lightning DDP)
  hsmla-med infer --task btcv --checkpoint runs/b1/best.ckpt --input /data/BTCV/imagesTs --output preds
  hsmla-med evaluate --task btcv --checkpoint runs/b1/best.ckpt --data-dir /data/BTCV
  hsmla-med train --task camelyon16 --data-dir /data/CAMELYON16 --output runs/c16
  hsmla-med wsi-heatmap --checkpoint runs/c16/best.ckpt --slide /data/CAMELYON16/testing/images --output heatmaps
  hsmla-med wsi-features --checkpoint runs/c16/best.ckpt --slide /data/CAMELYON16/testing/images --output features/c16   # CLAM's h5_files/, pt_files/
  hsmla-med train --task luna16 --data-dir /data/LUNA16 --output runs/luna
  hsmla-med infer --task luna16 --checkpoint runs/luna/best.ckpt --input /data/LUNA16/subset9 --output luna_preds
  hsmla-med export --checkpoint runs/b1/best.ckpt --format onnx --output export/b1    # also torchscript | bundle
  hsmla-med calibrate --checkpoint runs/b1/best.ckpt --data-dir /data/BTCV --output runs/b1/calibrated   # temperature scaling
  hsmla-med bench --only models
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hsmla-med",
        description="HSMLA attention networks and medical imaging pipelines on MONAI and Lightning.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks for input errors too")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def _warnings_shown(debug: bool):
    """``warnings.showwarning`` for a command: a warning that hsmla-med's own code gives about the
    user's data (a slide without tissue, a volume without foreground) is one line like its other
    messages, ``hsmla-med: warning: ...``, not Python's two lines of file, line number and source
    line; other libraries' warnings, and every warning under ``--debug``, keep Python's format."""
    import os
    from importlib.util import find_spec

    import hsmla_med

    folders = list(hsmla_med.__path__)
    for sub in ("pipelines", "kernels"):  # (installed from folders of their own: pyproject.toml)
        folders += find_spec(f"hsmla_med.{sub}").submodule_search_locations or []
    ours = tuple(os.path.join(os.path.realpath(folder), "") for folder in folders)
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if not debug and os.path.realpath(filename).startswith(ours):
            log.warning("warning: %s", message)
        else:
            shown(message, category, filename, lineno, file, line)

    return show


@contextmanager
def interruptible() -> Iterator[list[int]]:
    """SIGINT and SIGTERM as ``KeyboardInterrupt`` in the main thread, for the duration of a
    command; yields the list that records the first signal's number.

    SIGTERM's default would end the process where it stands, with no ``finally`` run: temporaries
    left, no message. As a ``KeyboardInterrupt`` both unwind through the code's clean-up, and the
    libraries shut down as they do for Ctrl-C (DataLoader workers, which inherit the handler, end
    quietly). Lightning's loops catch it, tear down and end with ``sys.exit(1)``
    (``_call_and_handle_interrupt``), so :func:`main` recognises an interruption by the recorded
    signal, not by the exception that reaches it. A second signal during the clean-up is ignored,
    as Lightning ignores a second Ctrl-C. Outside the main thread (a notebook's worker thread)
    nothing is installed: Python allows handlers in the main thread only."""
    import threading

    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def interrupt(signum, frame):
        if not received:
            received.append(signum)
            raise KeyboardInterrupt

    previous = {signum: signal.signal(signum, interrupt) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for signum, handler in previous.items():  # also undoes Lightning's SIG_IGN for SIGINT
            if handler is not None:  # (None: a handler not set from Python, which cannot be set back)
                signal.signal(signum, handler)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    command = {c.__name__.rsplit(".", 1)[1].replace("_", "-"): c for c in COMMANDS}[args.command]
    if extra and not getattr(command, "PASSES_ARGUMENTS", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.args = extra
    invocation = Invocation(sys.argv[1:] if argv is None else argv)  # as command.json records it
    # a line at a time into a pipe (| tee) as into a terminal: block-buffered, stdout would hold
    # the per-case lines back until exit, behind the log lines on stderr that followed them
    if callable(getattr(sys.stdout, "reconfigure", None)):  # (a notebook's stream has no buffering to set)
        sys.stdout.reconfigure(line_buffering=True)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("hsmla-med: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    # Lightning's tips (loggers to install, GPU/TPU availability, num_workers advice) and a
    # deprecation inside Lightning itself are noise to our users; real warnings stay visible.
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    # its "Received SIGTERM" in every loop: the command's own line says it was interrupted
    logging.getLogger("lightning.pytorch.trainer.connectors.signal_connector").setLevel(logging.WARNING)
    # (the run folder holds config.yaml before Lightning's checkpoint callback looks at it)
    for message in (".*does not have many workers.*", ".*treespec, LeafSpec.*", ".*smaller than the logging interval.*",
                    "Checkpoint directory .* exists and is not empty"):
        warnings.filterwarnings("ignore", message=message)
    from hsmla_med.errors import find_input_error
    from hsmla_med.runtime import configure_cpu_threads, tune_cpu_allocator

    if "torch" not in sys.modules:  # (main() called again in one process, by tests or a notebook: too late)
        configure_cpu_threads()  # OpenMP's waiting and thread count, which it reads once, when torch loads

    shown, warnings.showwarning = warnings.showwarning, _warnings_shown(args.debug)
    try:
        with interruptible() as received:
            try:
                tune_cpu_allocator()  # a bad HSMLA_MED_MALLOC_TOP_PAD is an input error like any other
                resolve_task(args)
                result = command.run(args, invocation)
            except BaseException as err:
                # after a signal, whatever ends the command is the interruption: Lightning's
                # sys.exit(1), or an error of a library that saw its work cut short
                if not received and not isinstance(err, KeyboardInterrupt):
                    raise
                invocation.remove_empty_created()
                if "lightning" not in sys.modules or first_process():  # one line for all the processes of a run (Ctrl-C reaches each)
                    print("hsmla-med: interrupted", file=sys.stderr)
                return 128 + (received[0] if received else signal.SIGINT)  # the shell's status of a process the signal ended
    except Exception as err:
        invocation.remove_empty_created()
        problem = find_input_error(err)
        if problem is None or args.debug:
            raise
        print(f"hsmla-med: error: {problem}", file=sys.stderr)
        return 2
    finally:
        log.removeHandler(handler)  # main() may run again in this process (tests, notebooks)
        warnings.showwarning = shown
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
