#!/usr/bin/env bash
# Sets up .venv if needed and runs the whole test suite (CPU; Triton kernels under the interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# one pytest-xdist worker per CPU this process may use (cgroup quota and affinity, not the CPUs the
# machine shows: hsmla_med.runtime.available_cpus), each with its share of OpenMP threads
# (tests/conftest.py); whole files to a worker, so that a file's fixtures are built once; `-n 0`
# in the arguments runs serially
workers=$(.venv/bin/python -c 'from hsmla_med.runtime import available_cpus; print(available_cpus())')
exec .venv/bin/python -m pytest -q -n "$workers" --dist loadfile "$@"
