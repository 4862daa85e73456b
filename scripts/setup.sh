#!/usr/bin/env bash
# Creates .venv beside the repository (once) and installs hsmla-med into it with the test and
# benchmark extras and the DICOM decoders. Re-runs only when pyproject.toml or this script changes.
#
# torch is installed first, so that nothing else resolves it. Which build:
# - no NVIDIA GPU here (no nvidia-smi, no /proc/driver/nvidia): the CPU build, from PyTorch's CPU
#   wheel index or a local wheel that pip is configured with; where neither has it, the package
#   index's build, which on Linux is the CUDA build with gigabytes of nvidia-* libraries (said in
#   one line);
# - an NVIDIA GPU: the package index's CUDA build.
# HSMLA_MED_TORCH=cpu or cuda chooses instead. A torch of the pinned version already in .venv
# stays: delete .venv to change the build. The last line names the build installed.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
torch_pin=torch==2.13.0
# timm's torchvision, built for that torch: from the CPU index with the CPU torch; elsewhere
# pyproject's requirement takes PyPI's (a CUDA build, whose C++ operators hsmla-med does without:
# hsmla_med/torchvision_ops.py)
torchvision_pin=torchvision==0.28.0
cpu_index=https://download.pytorch.org/whl/cpu
[ -x .venv/bin/python ] || "$python" -m venv .venv
stamp=.venv/.hsmla-med-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)

has_nvidia_gpu() { command -v nvidia-smi >/dev/null 2>&1 || [ -e /proc/driver/nvidia ]; }

install_torch() {
  local build=${HSMLA_MED_TORCH:-} why
  if [ -n "$build" ]; then
    why="HSMLA_MED_TORCH=$build"
  elif has_nvidia_gpu; then
    build=cuda why="NVIDIA GPU found"
  else
    build=cpu why="no NVIDIA GPU"
  fi
  case $build in
    cpu)
      # no retries and a short timeout: where the index is unreachable (offline, a firewall) this
      # attempt fails in seconds and the package index's build is installed below
      # (its errors are not shown: pip says "no matching distribution" or "conflicting
      # dependencies" for an index it could not reach, the line below says what happens instead)
      if .venv/bin/python -m pip install -q --retries 0 --timeout 15 --index-url "$cpu_index" "$torch_pin" "$torchvision_pin" >/dev/null 2>&1; then
        return
      fi
      echo "hsmla-med setup: $why, but pip reaches no CPU build of $torch_pin (PyTorch's CPU index $cpu_index, pip's local wheels): installing the package index's build" ;;
    cuda) echo "hsmla-med setup: $why: $torch_pin from the package index (its CUDA build)" ;;
    *) echo "hsmla-med setup: HSMLA_MED_TORCH=$build: use cpu or cuda" >&2; exit 2 ;;
  esac
  .venv/bin/python -m pip install -q "$torch_pin"
}

if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  install_torch
  .venv/bin/python -m pip install -q -e ".[test,bench,dicom-codecs]"
  # cuCIM, the optional fast slide-patch reader (hsmla_med/data/patch_readers.py), so that the
  # tests cover it: its wheel alone reads TIFF slides on the CPU; its dependencies (cupy and the
  # CUDA libraries, gigabytes) serve GPU decoding only
  .venv/bin/python -m pip install -q --no-deps cucim-cu12==26.10.0
  # a torchvision whose C++ operators cannot load beside this torch (PyPI's CUDA build): every
  # Python of .venv installs hsmla_med's import hook (hsmla_med/torchvision_ops.py) at start, so
  # that Lightning (torchmetrics imports torchvision) imports in a script that imports it first
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])
import hsmla_med
from torchvision import extension
if extension._has_ops(): raise SystemExit(1)' 2>/dev/null) || site=
  if [ -d "$site" ]; then
    echo "import hsmla_med.torchvision_ops as m; m.declare_missing_operators_on_import()" > "$site/hsmla_med_torchvision.pth"
  fi
  echo "$want" > "$stamp"
fi

# torch's version.py, run on its own: importing torch to ask would take seconds on every run
installed=$(.venv/bin/python -c 'import importlib.util, pathlib, runpy
v = runpy.run_path(str(pathlib.Path(importlib.util.find_spec("torch").origin).with_name("version.py")))
print(v["__version__"], v["cuda"] or "-")')
read -r version cuda <<<"$installed"
if [ "$cuda" = - ]; then
  build="CPU build"
elif has_nvidia_gpu; then
  build="CUDA $cuda build"
else
  build="CUDA $cuda build on a machine without an NVIDIA GPU: it runs on the CPU, its nvidia-* libraries unused"
fi
echo "hsmla-med setup: torch $version ($build) in .venv"
