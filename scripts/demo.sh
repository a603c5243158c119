#!/usr/bin/env bash
# One command from a fresh clone to a running kvproxy with simulated engines (no GPU, no Docker,
# no Redis). Extra arguments go to `kvproxy demo` (e.g. --port 8080).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/kvproxy demo "$@"
