"""cuCIM without its CUDA probing on machines without CUDA.

Loading cuCIM's C++ library (any ``import cucim``) starts NVIDIA's cuFile (GPUDirect Storage)
where the process holds ``libcufile``, which PyTorch's CUDA build loads at ``import torch``. On a
machine without the CUDA driver cuFile then prints ``dlopen error libcuda.so.1 ...``, ``missing
cuda symbols while dynamic loading`` and ``cuFile initialization failed`` on the C-level standard
output, and appends them to ``cufile.log`` in the working directory; opening the first slide
loads cuCIM's slide plugin, which does it again (in every loader worker). cuCIM reads slides on
the CPU all the same.

- :func:`cuimage` imports ``CuImage`` for the cuCIM patch reader and :func:`quiet_cuda_probe`
  wraps its slide opening: those three lines are dropped from standard output and error (anything
  else is passed on), and cuFile's log goes to the temporary directory
  (``CUFILE_LOGFILE_PATH``, unless set), not into the user's folder.
- :func:`keep_monai_from_loading_cucim`, applied when ``hsmla_med`` is imported: MONAI's Hausdorff
  and surface distances and ``KeepLargestConnectedComponent`` try ``cucim.skimage`` at every
  call, which loads cuCIM even for a NIfTI ``evaluate``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from contextlib import contextmanager

__all__ = ["cuimage", "quiet_cuda_probe", "keep_monai_from_loading_cucim"]

# what cuFile prints when it cannot load the CUDA driver (lines stripped of surrounding spaces)
_PROBE_LINES = (b"missing cuda symbols while dynamic loading", b"cuFile initialization failed")
_PROBE_PREFIX = b"dlopen error libcuda.so"
_lock = threading.Lock()  # one redirection of the process's output at a time


def keep_monai_from_loading_cucim() -> None:
    """Marks cuCIM's CuPy subpackages absent where CuPy is not installed.

    ``cucim.skimage`` and ``cucim.core`` are CuPy code and cannot import without it, but MONAI's
    ``optional_import`` of them loads the ``cucim`` package (and its C++ library) first, every
    time. A ``None`` entry in ``sys.modules`` makes that import fail at once, the answer MONAI
    would get anyway, which it takes as "use scikit-image / SciPy" (as it does for every CPU
    tensor). ``import cucim`` itself, for the patch reader, is untouched.
    """
    if importlib.util.find_spec("cupy") is None:
        for name in ("cucim.skimage", "cucim.core"):
            sys.modules.setdefault(name, None)


def _is_probe(line: bytes) -> bool:
    line = line.strip()
    return line in _PROBE_LINES or line.startswith(_PROBE_PREFIX)


@contextmanager
def quiet_cuda_probe():
    """Runs the block with the process's standard output and error (file descriptors 1 and 2)
    captured, then passes on all but cuFile's CUDA-probing lines; cuFile logs into the temporary
    directory unless ``CUFILE_LOGFILE_PATH`` says otherwise.

    cuFile writes from C through its own buffered stream, beyond ``sys.stdout``'s reach: hence
    the descriptors, and C's buffers flushed before they are put back."""
    import ctypes
    import tempfile

    os.environ.setdefault("CUFILE_LOGFILE_PATH", os.path.join(tempfile.gettempdir(), f"cufile-{os.getuid()}.log"))
    libc = ctypes.CDLL(None)
    with _lock:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        libc.fflush(None)
        captures = {fd: tempfile.TemporaryFile() for fd in (1, 2)}
        saved = {fd: os.dup(fd) for fd in captures}
        for fd, capture in captures.items():
            os.dup2(capture.fileno(), fd)
        try:
            yield
        finally:
            for stream in (sys.stdout, sys.stderr):
                if stream is not None:
                    stream.flush()
            libc.fflush(None)
            for fd, capture in captures.items():
                os.dup2(saved[fd], fd)
                os.close(saved[fd])
                capture.seek(0)
                kept = b"".join(line for line in capture.read().splitlines(keepends=True) if not _is_probe(line))
                capture.close()
                with open(fd, "wb", closefd=False) as out:
                    out.write(kept)


def cuimage():
    """cuCIM's ``CuImage`` class, imported quietly (:func:`quiet_cuda_probe`).

    Raises:
        ImportError: where cuCIM is not installed.
    """
    with quiet_cuda_probe():
        from cucim import CuImage
    return CuImage
