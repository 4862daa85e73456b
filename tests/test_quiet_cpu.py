"""Nothing about CUDA on a machine without it: cuCIM's cuFile probing (``dlopen error libcuda.so.1``,
``missing cuda symbols while dynamic loading``, ``cuFile initialization failed`` and a
``cufile.log`` in the working directory) neither comes from scoring segmentations (MONAI's
distances try ``cucim.skimage``) nor from reading a slide with the cuCIM reader.

This machine's cuCIM stays quiet: cuFile starts only where the process holds ``libcufile``, as
with PyTorch's CUDA build. So a stand-in ``cucim`` package, first on the path, does what cuFile
does there (the probing lines through C's buffered stdout, the log appended to
``CUFILE_LOGFILE_PATH`` or ./cufile.log) at import and at the first slide opened (cuCIM's slide
plugin), and otherwise is the installed cuCIM."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from hsmla_med.io.tiff import write_pyramidal_tiff
from hsmla_med.metrics.segmentation import case_scores
from tests.test_slides import synthetic_rgb

cucim_spec = importlib.util.find_spec("cucim")
pytestmark = pytest.mark.skipif(cucim_spec is None, reason="cuCIM is not installed")

PROBE = ("dlopen error libcuda.so.1: cannot open shared object file: No such file or directory\\n"
         " missing cuda symbols while dynamic loading\\n cuFile initialization failed\\n")

STAND_IN = f'''
import ctypes, os

_libc = ctypes.CDLL(None)


def _probe():
    _libc.printf(b"{PROBE}")
    _libc.printf(b"another line of cuCIM's\\n")
    with open(os.environ.get("CUFILE_LOGFILE_PATH", "cufile.log"), "a") as log:
        log.write("ERROR cufio_core:1104 cuFile initialization failed\\n")


_probe()
__path__.append({list(cucim_spec.submodule_search_locations)[0]!r})  # the installed package's modules
from .clara import CuImage as _CuImage


class CuImage(_CuImage):
    _plugin_loaded = False

    def __init__(self, *args):
        if not CuImage._plugin_loaded:
            CuImage._plugin_loaded = True
            _probe()
        super().__init__(*args)
'''

SCRIPT = """
import importlib, sys
import hsmla_med
try:  # what MONAI's Hausdorff and surface distances try at every call
    importlib.import_module("cucim.skimage.morphology")
except ImportError:
    pass
print("cucim loaded", "cucim" in sys.modules, flush=True)
from hsmla_med.data.patch_readers import CuCIMPatches
patches = CuCIMPatches(sys.argv[1])
print("patch", patches.read(64, 32, 0, 16).shape, flush=True)
patches.close()
"""


def test_monai_distances_run_without_loading_cucim(monkeypatch):
    """A NIfTI ``evaluate``'s scores: MONAI's HD95 tries ``cucim.skimage``, which would load cuCIM."""
    for name, module in list(sys.modules.items()):
        if (name == "cucim" or name.startswith("cucim.")) and module is not None:
            monkeypatch.delitem(sys.modules, name)
    truth = torch.zeros(1, 1, 12, 12, 6, dtype=torch.long)
    truth[..., 3:8, 3:8, 1:4] = 1
    moved = torch.roll(truth, 2, dims=2)
    dice, hd95 = case_scores(moved, truth, 2)
    assert float(hd95) == 2.0 and 0 < float(dice) < 1  # the mask moved by 2 voxels
    assert "cucim" not in sys.modules


def test_cucim_slide_reading_says_nothing_of_cuda_and_leaves_no_cufile_log(tmp_path):
    stand_in = tmp_path / "stand_in" / "cucim"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text(STAND_IN)
    slide = write_pyramidal_tiff(tmp_path / "slide.tif", synthetic_rgb(2)[:256, :384], mpp=0.5, tile=128, compression="jpeg", min_size=100)
    cwd, temp = tmp_path / "cwd", tmp_path / "temp"
    cwd.mkdir()
    temp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CUFILE_LOGFILE_PATH"}
    env.update(PYTHONPATH=str(stand_in.parent), TMPDIR=str(temp), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(slide)], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    output = done.stdout + done.stderr
    assert "cucim loaded False" in output
    assert "patch (16, 16, 3)" in output
    for probe in ("libcuda", "cuda symbols", "cuFile"):
        assert probe not in output
    assert output.count("another line of cuCIM's") == 2  # what is not cuFile's probing passes
    assert list(cwd.iterdir()) == []
    assert [p.name for p in temp.glob("cufile*.log")] == [f"cufile-{os.getuid()}.log"]
