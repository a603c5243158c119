"""vLLM backend of the engine sidecar: profiles, supervision and derived metrics."""
