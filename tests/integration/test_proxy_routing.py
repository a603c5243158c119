"""Routing with live telemetry: prefix affinity, spreading, and in-flight accounting in a burst."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

from openai.types.chat import ChatCompletionMessageParam

from .stack import TARGET_MODEL, Stack, StackFactory

SYSTEM = "You are a careful assistant. " * 250  # ~7 kB: several prefix blocks


def _words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "omega")) for _ in range(n))


async def _engine_for(
    stack: Stack, messages: list[ChatCompletionMessageParam], max_tokens: int = 4
) -> str:
    raw = await stack.client.chat.completions.with_raw_response.create(
        model=TARGET_MODEL,
        messages=messages,
        max_tokens=max_tokens,
    )
    return raw.headers["X-Engine"]


async def test_shared_long_prefix_sticks_to_one_engine(make_stack: StackFactory) -> None:
    stack = await make_stack(targets=3)
    engines = set()
    for i in range(10):
        messages: list[ChatCompletionMessageParam] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"question {i}: {_words(i, 5)}"},
        ]
        engines.add(await _engine_for(stack, messages))
        # Sequential traffic: let telemetry see the last request finish (at near-zero load a
        # single counted request already exceeds the load bound and would spill on purpose).
        await stack.wait_idle()
    assert len(engines) == 1


async def test_distinct_prefixes_spread_over_all_engines(make_stack: StackFactory) -> None:
    stack = await make_stack(targets=3)
    seen: Counter[str] = Counter()
    for i in range(24):
        content = _words(1000 + i, 900)  # distinct from the first block on
        seen[await _engine_for(stack, [{"role": "user", "content": content}])] += 1
        await stack.wait_idle()
    assert set(seen) == {"t0", "t1", "t2"}, seen


async def test_burst_does_not_pile_onto_one_engine(make_stack: StackFactory) -> None:
    """30 requests with one prefix at once: bounded load spills them before any scrape shows it."""
    slow = {"time_scale": 1.0, "stop_len_range": (64, 64)}
    stack = await make_stack(targets=3, engine_kw=slow)
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "same"},
    ]
    picks = await asyncio.gather(*(_engine_for(stack, messages, max_tokens=64) for _ in range(30)))
    counts = Counter(picks)
    assert set(counts) == {"t0", "t1", "t2"}, counts
    assert max(counts.values()) <= 18, counts
