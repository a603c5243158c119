# kvproxy: the proxy (`kvproxy serve`) and the simulated engine (`kvproxy-sidecar sim`).
# Build from the repository root: docker build -f docker/kvproxy.Dockerfile -t kvproxy:local .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

# Runtime dependencies first (pinned, cached across source edits), then the package itself.
COPY requirements-runtime.txt pyproject.toml ./
RUN pip install -r requirements-runtime.txt
COPY proxy ./proxy
COPY engine_sidecar ./engine_sidecar
COPY profiles ./profiles
RUN pip install --no-deps . && useradd --system --uid 10001 kvproxy
USER kvproxy

EXPOSE 8000 8100
# Alone (`docker run -p 8000:8000 kvproxy:local`) the image runs the demo: the proxy in front of
# simulated engines. compose.yaml and the Kubernetes manifests run `kvproxy serve --config ...`.
CMD ["kvproxy", "demo", "--host", "0.0.0.0", "--port", "8000"]
