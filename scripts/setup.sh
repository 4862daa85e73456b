#!/usr/bin/env bash
# Creates .venv beside the repository (once) and installs hsmla-med into it with the test and
# benchmark extras and the DICOM decoders. Re-runs only when pyproject.toml or this script changes. torch is installed
# first at the pinned CPU build so that nothing resolves it to a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
stamp=.venv/.hsmla-med-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -e ".[test,bench,dicom-codecs]"
  # cuCIM, the optional fast slide-patch reader (hsmla_med/data/patch_readers.py), so that the
  # tests cover it: its wheel alone reads TIFF slides on the CPU; its dependencies (cupy and the
  # CUDA libraries, gigabytes) serve GPU decoding only
  .venv/bin/python -m pip install -q --no-deps cucim-cu12==26.10.0
  echo "$want" > "$stamp"
fi
