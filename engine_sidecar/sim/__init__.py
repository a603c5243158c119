"""vLLM-compatible engine simulator: the ``sim`` backend of the engine sidecar.

Modules, from the core out: ``tokenizer`` (deterministic token rule and output words), ``kvcache``
(paged blocks, prefix hashes, LRU), ``scheduler`` (continuous batching, priority, preemption),
``profiles`` (step-time model), ``engine`` (the step loop), ``protocol``/``responses`` (OpenAI
shapes), ``streaming``/``server`` (HTTP), ``cluster`` (several engines in one process), ``main``
(the command line). See docs/simulator.md.
"""
