#!/usr/bin/env bash
# Sets up .venv if needed and runs the CPU model benchmark (tables on stdout, CSV + PNG in bench_out/).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/hsmla-med bench --out bench_out "$@"
