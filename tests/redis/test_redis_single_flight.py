"""Single flight through the proxy when the first answer cannot be kept.

Identical concurrent requests wait for the first one only while it may produce an answer to share.
When it does not (too large, an engine error) the waiters go to the engines side by side, and
requests whose streamed answers could never be stored do not wait at all. Every engine answer is
delayed (the simulator's ``header_delay_s`` fault), so "side by side" and "one after another" differ
by whole seconds: the test compares the batch against one request timed in the same test.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson
import pytest
from conftest import StackFactory
from proxystack import Stack, chat, door_config
from redisproc import RedisServer

DELAY_S = 0.8  # per engine answer; generation itself takes milliseconds at the sims' time scale
CLIENTS = 6  # one after another would take CLIENTS x one request
# Side by side: the first request, then everyone else at once, about 2x one request.
WITHIN = 4.0  # well short of CLIENTS, with room for a busy machine


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest, redis_server: RedisServer) -> dict[str, Any]:
    if request.param == "memory":
        return {}
    return {"backend": "redis", "redis_url": redis_server.url}


async def timed(
    stack: Stack, body: dict[str, Any], clients: int
) -> tuple[float, list[tuple[aiohttp.ClientResponse, bytes]]]:
    started = time.monotonic()
    results = await asyncio.gather(*(stack.post(body) for _ in range(clients)))
    return time.monotonic() - started, results


async def test_answers_too_large_to_store_do_not_queue_identical_requests(
    make_stack: StackFactory, backend: dict[str, Any]
) -> None:
    stack = await make_stack(door_config(**backend, cache={"max_entry_bytes": 64}))
    await stack.faults(header_delay_s=DELAY_S)
    one, _ = await timed(stack, chat("A warm-up question, asked once."), 1)
    body = chat("Everyone asks this, and it is too long to keep.")
    total, results = await timed(stack, body, CLIENTS)
    assert all(r.status == 200 for r, _ in results)
    assert [r.headers["X-Cache"] for r, _ in results] == ["MISS"] * CLIENTS
    assert all(orjson.loads(raw)["choices"][0]["message"]["content"] for _, raw in results)
    assert total < WITHIN * one, f"{CLIENTS} requests took {total:.2f}s, one took {one:.2f}s"
    released = await stack.metric("kvproxy_cache_coalesced_waits_total", outcome="released")
    assert released == CLIENTS - 1
    assert await stack.metric("kvproxy_cache_coalesced_waits_total", outcome="retry") == 0
    assert await stack.engine_requests() == CLIENTS + 1


async def test_engine_errors_do_not_queue_identical_requests(make_stack: StackFactory) -> None:
    stack = await make_stack(door_config())
    await stack.faults(header_delay_s=DELAY_S)
    one, _ = await timed(stack, chat("A warm-up question, asked once."), 1)
    # A 4xx from the engine: relayed as is, not retried, and no concern of the breakers.
    await stack.faults(error_rate=1.0, error_status=400)
    body = chat("Everyone asks this and the engine refuses.")
    total, results = await timed(stack, body, CLIENTS)
    assert [r.status for r, _ in results] == [400] * CLIENTS
    assert total < WITHIN * one, f"{CLIENTS} requests took {total:.2f}s, one took {one:.2f}s"
    released = await stack.metric("kvproxy_cache_coalesced_waits_total", outcome="released")
    assert released == CLIENTS - 1
    # Once the engine answers again, the answer is cached as usual.
    await stack.clear_faults()
    first, _ = await stack.post(body)
    second, _ = await stack.post(body)
    assert (first.status, first.headers["X-Cache"]) == (200, "MISS")
    assert (second.status, second.headers["X-Cache"]) == (200, "HIT")


async def test_streamed_logprobs_bypass_the_cache_and_never_wait(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(door_config())
    await stack.faults(header_delay_s=DELAY_S)
    one, _ = await timed(stack, chat("A warm-up question, asked once."), 1)
    body = chat("Which tokens were likely?", stream=True, logprobs=True, top_logprobs=2)
    total, results = await timed(stack, body, CLIENTS)
    assert all(r.status == 200 and raw.endswith(b"data: [DONE]\n\n") for r, raw in results)
    assert [r.headers["X-Cache"] for r, _ in results] == ["BYPASS"] * CLIENTS
    assert total < WITHIN * one, f"{CLIENTS} requests took {total:.2f}s, one took {one:.2f}s"
    assert await stack.metric("kvproxy_cache_bypass_total", reason="logprobs") == CLIENTS
    assert await stack.metric("kvproxy_cache_coalesced_waits_total") == 0
    # Asked as JSON, the same request is cached: the whole answer, logprobs included, is kept.
    await stack.clear_faults()
    json_body = {**body, "stream": False}
    first, raw_first = await stack.post(json_body)
    second, raw_second = await stack.post(json_body)
    assert (first.headers["X-Cache"], second.headers["X-Cache"]) == ("MISS", "HIT")
    logprobs = orjson.loads(raw_second)["choices"][0]["logprobs"]
    assert logprobs == orjson.loads(raw_first)["choices"][0]["logprobs"] and logprobs["content"]


async def test_streamed_tool_requests_bypass_the_cache(make_stack: StackFactory) -> None:
    stack = await make_stack(door_config(), engines=1)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    body = chat("Call a tool, maybe.", stream=True, tools=tools)
    resp, _ = await stack.post(body)
    assert resp.status == 200 and resp.headers["X-Cache"] == "BYPASS"
    resp, _ = await stack.post({**body, "tool_choice": "none"})
    assert resp.status == 200 and resp.headers["X-Cache"] == "MISS"


async def test_a_waiter_keeps_its_own_deadline(make_stack: StackFactory) -> None:
    # The leader's answer takes DELAY_S x 3; an identical request with a one-second deadline
    # must not wait for it: it ends in its own timeout (504), not in the leader's answer.
    stack = await make_stack(door_config(), engines=1)
    await stack.faults(header_delay_s=DELAY_S * 3)
    body = chat("A slow answer everyone asks for.")
    leader = asyncio.create_task(stack.post(body))
    for _ in range(100):  # until the leader's flight is on (its engine request has started)
        if await stack.metric("kvproxy_inflight_requests") >= 1:
            break
        await asyncio.sleep(0.02)
    started = time.monotonic()
    resp, raw = await stack.post(body, **{"X-Request-Timeout": "1"})
    waited = time.monotonic() - started
    assert resp.status == 504 and orjson.loads(raw)["error"]["type"] == "timeout"
    assert 0.9 <= waited < DELAY_S * 3 - 0.3, waited
    assert await stack.metric("kvproxy_cache_coalesced_waits_total", outcome="deadline") == 1
    assert resp.headers["X-Cache"] == "MISS"  # looked up and waited: not a BYPASS
    first, _ = await leader
    assert (first.status, first.headers["X-Cache"]) == (200, "MISS")
    assert await stack.engine_requests() == 1  # the late waiter never reached an engine


async def test_a_stream_relayed_past_max_entry_bytes_counts_as_too_large(
    make_stack: StackFactory,
) -> None:
    # The stream's events pass the limit (one event per token, ~200 bytes each) long before the
    # answer they make would: kept as relayed, it is not stored, and counted as too large.
    stack = await make_stack(door_config(cache={"max_entry_bytes": 2048}), engines=1)
    body = chat("A long streamed answer.", stream=True, max_tokens=40, ignore_eos=True)
    first, raw = await stack.post(body)
    assert first.status == 200 and raw.rstrip().endswith(b"data: [DONE]") and len(raw) > 2048
    assert await stack.metric("kvproxy_cache_stores_total", outcome="too_large") == 1
    assert await stack.metric("kvproxy_cache_stores_total", outcome="incomplete") == 0
    again, _ = await stack.post(body)
    assert again.headers["X-Cache"] == "MISS"
