#!/usr/bin/env bash
# Sets up .venv if needed and runs `hsmla-med demo`: synthetic BTCV-format data, a few minutes of
# CPU training, inference on the held-out cases, metrics and output paths (runs/demo/).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/hsmla-med demo "$@"
