"""Engine sidecar: supervises a real vLLM server, or is itself a simulated vLLM engine."""
