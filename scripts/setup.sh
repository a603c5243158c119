#!/usr/bin/env bash
# Creates .venv with kvproxy and pinned packages. Idempotent; safe to run again.
#   scripts/setup.sh               proxy + simulator + test tools (requirements-ci.txt, as CI)
#   scripts/setup.sh --runtime     proxy + simulator only (requirements-runtime.txt): the demo's needs
#   scripts/setup.sh --redis       also installs redis-server from Debian when it is missing
#   scripts/setup.sh --prometheus  also installs Debian's prometheus (for promtool) when missing
#   scripts/setup.sh --kubectl     also installs Debian's kubernetes-client (kubectl, for
#                                  `kubectl kustomize`) when kubectl is missing
#   scripts/setup.sh --haproxy     also installs Debian's haproxy (the replica benchmark's
#                                  balancer, bench/replicas.py) when it is missing
set -euo pipefail
cd "$(dirname "$0")/.."

requirements=requirements-ci.txt
# Debian packages the tests need, installed only when missing: redis-server (--redis) and
# Prometheus' promtool, which checks and unit-tests the alert rules (--prometheus), and kubectl,
# which renders the Kubernetes manifests (--kubectl; bookworm's 1.20 embeds kustomize v2.0.3, the
# oldest the manifests are written for; a newer kubectl already installed is used as it is), and
# HAProxy, the balancer in front of the replicas in the replica benchmark (--haproxy).
packages=()
for arg in "$@"; do
  case "$arg" in
    --runtime) requirements=requirements-runtime.txt ;;
    --redis) command -v redis-server >/dev/null 2>&1 || packages+=(redis-server) ;;
    --prometheus) command -v promtool >/dev/null 2>&1 || packages+=(prometheus) ;;
    --kubectl) command -v kubectl >/dev/null 2>&1 || packages+=(kubernetes-client) ;;
    # Looked for where the benchmark runs it: /usr/sbin is not on every user's PATH.
    --haproxy) [ -x /usr/sbin/haproxy ] || command -v haproxy >/dev/null 2>&1 || packages+=(haproxy) ;;
    *) echo "setup.sh: unknown option $arg (--runtime, --redis, --prometheus, --kubectl, --haproxy)" >&2; exit 2 ;;
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

if [ "${#packages[@]}" -gt 0 ]; then
  sudo_cmd=""
  [ "$(id -u)" = 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  # No recommends: promtool needs nothing else, and the server itself is never started here.
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends \
    "${packages[@]}" >/dev/null
fi
