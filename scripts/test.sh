#!/usr/bin/env bash
# Sets up .venv if needed and runs the whole test suite (CPU; Triton kernels under the interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# one pytest-xdist worker per CPU (tests/conftest.py gives each its share of OpenMP threads), whole
# files to a worker so that a file's fixtures are built once; `-n 0` in the arguments runs serially
exec .venv/bin/python -m pytest -q -n auto --dist loadfile "$@"
