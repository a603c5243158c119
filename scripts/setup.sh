#!/usr/bin/env bash
# Creates .venv with kvproxy and the pinned packages CI uses. Idempotent; safe to run again.
#   scripts/setup.sh            proxy + simulator + test tools
#   scripts/setup.sh --redis    also installs redis-server from Debian when it is missing
#   scripts/setup.sh --prometheus  also installs Debian's prometheus (for promtool) when missing
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements-ci.txt
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -e .

# Debian packages the tests need, installed only when missing: redis-server (--redis) and
# Prometheus' promtool, which checks and unit-tests the alert rules (--prometheus).
packages=()
for arg in "$@"; do
  case "$arg" in
    --redis) command -v redis-server >/dev/null 2>&1 || packages+=(redis-server) ;;
    --prometheus) command -v promtool >/dev/null 2>&1 || packages+=(prometheus) ;;
    *) echo "setup.sh: unknown option $arg" >&2; exit 2 ;;
  esac
done
if [ "${#packages[@]}" -gt 0 ]; then
  sudo_cmd=""
  [ "$(id -u)" = 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  # No recommends: promtool needs nothing else, and the server itself is never started here.
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends \
    "${packages[@]}" >/dev/null
fi
