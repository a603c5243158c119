#!/usr/bin/env bash
# One command from a fresh clone to a running kvproxy with simulated engines (no GPU, no Docker,
# no Redis). Installs only the runtime packages into .venv; the install's chatter goes to a log that
# is shown only if the install fails. Extra arguments go to `kvproxy demo` (e.g. --port 8080).
set -euo pipefail
cd "$(dirname "$0")/.."

log=$(mktemp "${TMPDIR:-/tmp}/kvproxy-setup.XXXXXX")
echo "kvproxy demo: installing kvproxy and its runtime packages into .venv ..."
if ! scripts/setup.sh --runtime >"$log" 2>&1; then
  cat "$log" >&2
  echo "kvproxy demo: the install failed (output above; kept in $log)" >&2
  exit 1
fi
rm -f "$log"
echo "kvproxy demo: starting the proxy and three simulated engines (Ctrl-C stops them)"
exec .venv/bin/kvproxy demo "$@"
