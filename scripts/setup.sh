#!/usr/bin/env bash
# Creates .venv with kvproxy and pinned packages. Idempotent; safe to run again.
#   scripts/setup.sh             proxy + simulator + test tools (requirements-ci.txt, as CI)
#   scripts/setup.sh --runtime   proxy + simulator only (requirements-runtime.txt): the demo's needs
#   scripts/setup.sh --redis     also installs redis-server from Debian when it is missing
set -euo pipefail
cd "$(dirname "$0")/.."

requirements=requirements-ci.txt
redis=""
for arg in "$@"; do
  case "$arg" in
    --runtime) requirements=requirements-runtime.txt ;;
    --redis) redis=1 ;;
    *) echo "setup.sh: unknown option $arg (--runtime, --redis)" >&2; exit 2 ;;
  esac
done

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" --upgrade pip
"${pip[@]}" -r "$requirements"
"${pip[@]}" --no-deps -e .

if [ -n "$redis" ] && ! command -v redis-server >/dev/null 2>&1; then
  sudo_cmd=""
  [ "$(id -u)" = 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq redis-server >/dev/null
fi
