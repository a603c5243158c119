#!/usr/bin/env bash
# Install the peer routers compared in the benchmarks, each in its own virtual environment under
# .venv-peers/<name>, so their dependencies never touch the project's .venv.
# Usage: bench/install-peers.sh [vllm-router] [sglang-router] [litellm]   (default: all three)
# Versions are pinned; a peer that fails to install is reported and skipped, never fatal.
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
ROOT=".venv-peers"
declare -A PINS=(
  [vllm-router]="vllm-router==0.1.17"
  [sglang-router]="sglang-router==0.3.2"
  [litellm]="litellm[proxy]==1.106.2"
)
peers=("$@")
[ ${#peers[@]} -eq 0 ] && peers=(vllm-router sglang-router litellm)
mkdir -p "$ROOT"
status=0
for name in "${peers[@]}"; do
  spec="${PINS[$name]:-}"
  if [ -z "$spec" ]; then echo "unknown peer: $name" >&2; status=1; continue; fi
  venv="$ROOT/$name"
  echo "== $name: $spec -> $venv"
  if [ ! -x "$venv/bin/python" ]; then "$PY" -m venv "$venv" || { status=1; continue; }; fi
  if "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$spec" \
      >"$ROOT/$name.install.log" 2>&1; then
    echo "$spec" >"$venv/PINNED"
    echo "   ok"
  else
    echo "   FAILED (see $ROOT/$name.install.log)" >&2
    tail -5 "$ROOT/$name.install.log" >&2
    status=1
  fi
done
exit $status
