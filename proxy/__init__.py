"""kvproxy: KV-cache-aware OpenAI-compatible routing proxy for vLLM fleets."""
