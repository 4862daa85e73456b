#!/usr/bin/env bash
# Sets up .venv if needed and runs the whole test suite (CPU; Triton kernels under the interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
