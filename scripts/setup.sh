#!/usr/bin/env bash
# Creates .venv with kvproxy and the pinned packages CI uses. Idempotent; safe to run again.
#   scripts/setup.sh            proxy + simulator + test tools
#   scripts/setup.sh --redis    also installs redis-server from Debian when it is missing
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements-ci.txt
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -e .

if [ "${1:-}" = "--redis" ] && ! command -v redis-server >/dev/null 2>&1; then
  sudo_cmd=""
  [ "$(id -u)" = 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq redis-server >/dev/null
fi
