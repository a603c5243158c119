# The vLLM engine under the kvproxy sidecar (`kvproxy-sidecar vllm`), for NVIDIA GPUs.
# vLLM keeps its own interpreter and packages (the base image); the sidecar lives in a separate
# virtual environment so neither dependency set constrains the other.
# Build from the repository root: docker build -f docker/vllm-sidecar.Dockerfile .
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

# The image's python3 has vLLM: the sidecar starts vLLM with it (KVPROXY_VLLM_PYTHON below).
RUN python3 -c "import vllm" \
    && python3 -m pip install uv \
    && uv venv --python "$(command -v python3)" /opt/kvproxy

COPY requirements-runtime.txt pyproject.toml ./
RUN uv pip install --python /opt/kvproxy/bin/python -r requirements-runtime.txt
COPY proxy ./proxy
COPY engine_sidecar ./engine_sidecar
COPY profiles ./profiles
RUN uv pip install --python /opt/kvproxy/bin/python --no-deps . \
    && ln -s /opt/kvproxy/bin/kvproxy-sidecar /usr/local/bin/kvproxy-sidecar

ENV KVPROXY_VLLM_PYTHON=python3
# vLLM's own entrypoint is replaced: the sidecar starts vLLM itself.
ENTRYPOINT []
EXPOSE 8000 8100
CMD ["kvproxy-sidecar", "vllm", "--profile", "/app/profiles/target.toml"]
