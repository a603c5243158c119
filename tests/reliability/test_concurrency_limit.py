"""The per-engine connection limit is a routing rule: past it a request is refused at once with a
reason, never queued inside the proxy until it times out."""

from __future__ import annotations

import asyncio

import aiohttp
from integration.stack import Stack, StackFactory, chat_body

from proxy.core.config import UpstreamConfig

LIMIT = 2
ENGINES = 2
# Long enough that the requests within the limit are still open while the others are refused;
# far inside the first-byte timeout, so the ones within the limit finish.
HELD_S = 3.0
UPSTREAM = UpstreamConfig(
    connect_timeout_s=1.0, first_byte_timeout_s=20.0, response_timeout_s=20.0,
    idle_timeout_s=20.0, max_connections_per_engine=LIMIT,
)


async def post(stack: Stack, content: str) -> aiohttp.ClientResponse:
    return await stack.post("/v1/chat/completions", chat_body(content, stream=True))


async def test_requests_past_the_limit_are_refused_at_once(make_stack: StackFactory) -> None:
    stack = await make_stack(targets=ENGINES, upstream=UPSTREAM)
    for name in stack.names:
        await stack.faults(name, header_delay_s=HELD_S)
    within = [asyncio.create_task(post(stack, f"within {i}")) for i in range(LIMIT * ENGINES)]

    async def all_open() -> bool:
        return all(row["inflight"] == LIMIT for row in (await stack.admin()).values())

    await stack.wait_for(all_open, timeout_s=5.0)
    beyond = [await post(stack, f"beyond {i}") for i in range(3)]
    # Answered while every request within the limit is still waiting for its engine: nothing
    # of the refused ones waited in a queue.
    assert not any(task.done() for task in within)
    for resp in beyond:
        assert resp.status == 503
        assert resp.headers["X-Kvproxy-Shed-Reason"] == "engine_connections_full"
        assert int(resp.headers["Retry-After"]) >= 1
        error = (await resp.json())["error"]
        assert error["type"] == "overloaded"
        assert "127.0.0.1" not in error["message"]
    assert await stack.metric("kvproxy_shed_total", reason="engine_connections_full") == 3
    done = await asyncio.gather(*within)
    assert [resp.status for resp in done] == [200] * (LIMIT * ENGINES)
    assert {resp.headers["X-Engine"] for resp in done} == set(stack.names)
    # Room again once they finished.
    await stack.wait_idle()
    assert (await post(stack, "after")).status == 200
