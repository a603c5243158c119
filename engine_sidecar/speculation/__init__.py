"""Adaptive speculative decoding: the schedule, the goodput policy, the rollout and its shell.

Shared by both sidecar backends: the vLLM sidecar restarts a real engine with a new
``num_speculative_tokens_per_batch_size``, the simulator reconfigures a simulated one the same way.
"""
