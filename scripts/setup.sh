#!/usr/bin/env bash
# Creates .venv beside the repository (once) and installs hsmla-med into it with the test and
# benchmark extras. Re-runs only when pyproject.toml changes. torch is installed first at the
# pinned CPU build so that nothing resolves it to a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
stamp=.venv/.hsmla-med-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -e ".[test,bench]"
  echo "$want" > "$stamp"
fi
