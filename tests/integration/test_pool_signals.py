"""The per-pool autoscaling signals end to end: the expected-wait gauge in ``/metrics`` on the
loopback stack, small while the pool is idle and rising while requests queue."""

from __future__ import annotations

import asyncio
import math

from .stack import Stack, StackFactory, chat_body

GAUGE = "kvproxy_pool_expected_wait_seconds"
# Slow engines with two sequences each: a burst queues in the engines for seconds.
SLOW = {"time_scale": 1.0, "max_num_seqs": 2, "stop_len_range": (400, 400)}
PROMPT = "a long document paragraph to prefill " * 400  # ~3,600 tokens at 4 chars a token


async def wait_gauge(stack: Stack) -> float:
    return await stack.metric(GAUGE, pool="target")


async def test_expected_wait_is_small_when_idle_and_rises_under_load(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(targets=2, engine_kw=SLOW)
    idle = await wait_gauge(stack)
    assert not math.isnan(idle)
    assert 0.0 < idle < 0.5  # one typical prompt's own prefill and a step, nothing queued

    burst = [
        asyncio.create_task(stack.post("/v1/chat/completions",
                                       chat_body(PROMPT + str(i), max_tokens=400)))
        for i in range(16)
    ]
    try:
        peak = idle

        async def risen() -> bool:
            nonlocal peak
            peak = max(peak, await wait_gauge(stack))
            return peak > 4 * idle

        await stack.wait_for(risen, timeout_s=10.0, what="the expected wait to rise")
        assert peak > 4 * idle, (idle, peak)
    finally:
        for task in burst:
            task.cancel()
        await asyncio.gather(*burst, return_exceptions=True)
