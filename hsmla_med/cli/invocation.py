"""What one run of a command keeps and the output checks every command shares: the command line
as given (``command.json``), the output folders it created (removed again if it fails and they
stayed empty), and the process that reports."""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

log = logging.getLogger("hsmla_med")

#: folder levels below an output folder where commands write (cross-validate's deepest:
#: fold_K/validation/.provenance/lesions), swept of killed runs' temporaries
OUTPUT_DEPTH = 4


class Invocation:
    """One run of a command: its arguments, as ``command.json`` records them, and the output
    folders it created. A new one per :func:`~hsmla_med.cli.main.main` call, so that calls in one
    process (tests, notebooks) share nothing.

    Args:
        argv: the command's arguments, without the program name.
    """

    def __init__(self, argv: list[str]) -> None:
        self.argv = list(argv)
        self.created: list[Path] = []

    def writable_folder(self, path: str | Path, option: str) -> Path:
        """``path`` as a folder that exists and can be written, checked before any work is done,
        and rid of the temporaries that killed runs left in it (``kill -9`` ends a write before its
        rename: :func:`~hsmla_med.io.remove_stale_temporaries`, only those of processes that no
        longer run). The outermost folder this creates is remembered: a command that then fails
        leaves no empty folders behind (:meth:`remove_empty_created`)."""
        import os

        from hsmla_med.errors import InputError
        from hsmla_med.io import remove_stale_temporaries

        path = Path(path)
        if path.exists() and not path.is_dir():
            raise InputError(f"{option} {path}: exists and is not a folder")
        missing = [folder for folder in (path, *path.parents) if not folder.exists()]
        try:
            path.mkdir(parents=True, exist_ok=True)
            if missing:
                self.created.append(missing[-1])
        except OSError as err:
            raise InputError(f"{option} {path}: cannot create the folder ({err.strerror})") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise InputError(f"{option} {path}: folder is not writable")
        removed = remove_stale_temporaries(path, below=OUTPUT_DEPTH)
        if removed:
            log.info("%s: removed %d temporary file(s) that killed runs left (%s)", path, len(removed),
                     ", ".join(str(p.relative_to(path)) for p in removed[:3]) + (", ..." if len(removed) > 3 else ""))
        return path

    def remove_empty_created(self) -> None:
        """Remove the folders :meth:`writable_folder` created in this command that hold no file
        (after a failure: an export or a run that stopped before writing anything), or only the
        provenance records of a prediction that wrote no output."""
        import os
        import shutil

        from hsmla_med.engine.prediction import PROVENANCE, RECORDS

        def record(folder: str, name: str) -> bool:
            return name == PROVENANCE or RECORDS in Path(folder).relative_to(top).parts

        for top in reversed(self.created):
            if top.is_dir() and all(record(folder, name) for folder, _, files in os.walk(top) for name in files):
                shutil.rmtree(top)
        self.created.clear()

    def write_html_report(self, folder: Path) -> None:
        """``folder/command.json`` (the command line and the versions that ran it: the report's
        provenance) and ``folder/report.html`` at the end of a command, by the first process; a
        report that cannot be written is a warning, not a failure: the command's results are
        already on disk."""
        import os
        import platform
        from importlib.metadata import PackageNotFoundError, version

        from hsmla_med.errors import InputError
        from hsmla_med.io import write_json
        from hsmla_med.report import write_report

        if not first_process():
            return
        versions = {"python": platform.python_version()}
        for package in ("hsmla-med", "torch", "monai", "lightning", "numpy"):
            try:
                versions[package] = version(package)
            except PackageNotFoundError:
                versions[package] = None
        # the working folder: the command's relative names (a checkpoint given as run/best.ckpt) resolve against it
        write_json(folder / "command.json", {"command": shlex.join(["hsmla-med", *self.argv]), "cwd": os.getcwd(), "versions": versions})
        try:
            print(f"report: {write_report(folder)}")
        except InputError as err:
            log.warning("warning: no report.html: %s", err)


def first_process() -> bool:
    """Whether this is the first process (global rank 0) of the run, the one that reports and
    writes summaries; the rank is set by Lightning's DDP set-up, or by torchrun/SLURM."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return rank_zero_only.rank == 0


def report(line: str) -> None:
    """Printed by the first process only (the others of a DDP prediction have their own lines)."""
    if first_process():
        print(line)


def apart(inputs: str, output: str, option: str) -> None:
    """Refuse an ``--output`` that is the input folder itself: predictions would mix with the
    inputs (and be read as inputs by the next run); an output file that would be its own input
    is refused case by case (:func:`hsmla_med.pipelines.task.predict_cases`)."""
    from hsmla_med.errors import InputError

    if Path(inputs).resolve() == Path(output).resolve():
        raise InputError(f"--output {output}: is the {option} itself; give a folder apart from the inputs")
