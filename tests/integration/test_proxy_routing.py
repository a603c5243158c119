"""Routing with live telemetry: prefix affinity, spreading, and in-flight accounting in a burst."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Awaitable, Callable

from openai.types.chat import ChatCompletionMessageParam

from engine_sidecar.sim.config import FaultConfig
from proxy.core.prefix import canonical_chat

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
    """30 requests with one prefix at once: the prompt work queued behind the first opens more
    homes before any scrape or first byte shows it.

    The engines hold every answer back long enough for the whole burst to be routed, so "at once"
    holds however slowly the client sends: a request routed after earlier ones had their first
    byte meets an empty prefill queue, and joining that engine's batch is then the right call.
    """
    slow = {"time_scale": 1.0, "stop_len_range": (64, 64),
            "faults": FaultConfig(header_delay_s=2.0)}
    stack = await make_stack(targets=3, engine_kw=slow)
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "same"},
    ]
    picks = await asyncio.gather(*(_engine_for(stack, messages, max_tokens=64) for _ in range(30)))
    counts = Counter(picks)
    assert set(counts) == {"t0", "t1", "t2"}, counts
    assert max(counts.values()) <= 18, counts


async def test_prompt_work_counts_as_pending_until_the_first_byte(make_stack: StackFactory) -> None:
    """Routing sees an engine's prefill backlog: the prompt blocks of requests sent to it that
    have not had their first byte. It must appear while the engine holds the answer back and be
    gone once the answer starts, or new conversations would avoid that engine forever."""
    stack = await make_stack(targets=1)
    await stack.faults("t0", header_delay_s=1.5)
    prompt = _words(7, 400)  # ~2.6 kB: ten full prefix blocks of 256 characters
    text = canonical_chat([{"role": "user", "content": prompt}])
    blocks = len(text) // 256

    async def pending() -> float:
        return float((await stack.admin())["t0"]["prefill_pending_tokens"])

    task = asyncio.create_task(_engine_for(stack, [{"role": "user", "content": prompt}]))
    await stack.wait_for(lambda: _at_least(pending, 1), what="pending prefill")
    assert await pending() == len(text) / 4  # the whole prompt, in tokens (4 characters each)
    assert await task == "t0"
    assert await pending() == 0
    await stack.clear_faults("t0")
    # Once served, the prompt is held: its next turn adds only what is new.
    longer = prompt + " " + _words(8, 60)
    await stack.faults("t0", header_delay_s=1.5)
    task = asyncio.create_task(_engine_for(stack, [{"role": "user", "content": longer}]))
    await stack.wait_for(lambda: _at_least(pending, 1), what="pending prefill")
    grown = len(canonical_chat([{"role": "user", "content": longer}]))
    assert await pending() == (grown - blocks * 256) / 4  # less the blocks the engine holds
    await task


async def test_burst_sharing_a_new_prefix_follows_its_first_request(
        make_stack: StackFactory) -> None:
    """8 requests sharing a new 1.5k-word prefix, sent at once to 4 idle engines, before any scrape
    can show them: the first request's provisional entry in the prefix index and the proxy's own
    queue counts keep the burst on one or two engines instead of all four."""
    slow = {"time_scale": 1.0, "stop_len_range": (8, 8)}
    stack = await make_stack(targets=4, engine_kw=slow)
    document = _words(99, 1500)

    def ask(i: int) -> Awaitable[str]:
        return _engine_for(stack, [{"role": "system", "content": document},
                                   {"role": "user", "content": f"question {i}?"}], max_tokens=8)

    counts = Counter(await asyncio.gather(*(ask(i) for i in range(8))))
    assert len(counts) <= 2, counts


async def _at_least(read: Callable[[], Awaitable[float]], n: float) -> bool:
    return await read() >= n
