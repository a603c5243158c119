"""A rolling speculation restart seen through the proxy: every stream finishes, none stalls.

Both engines of a pool restart one after the other with a new batch-size schedule (the
simulator's ``POST /admin/speculation``: drain, stay out ``restart_s``, reopen) while clients
stream through the proxy the whole time. The proxy must stop routing to the draining engine,
retry a request refused by a drain that began after the pick, and use the engine again once it
is back.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from integration.stack import Stack, StackFactory, chat_body

from engine_sidecar.sim.speculation import SimSpecConfig

# 100 simulated seconds at the stack's time scale: half a second out per engine, many scrapes.
SPEC = SimSpecConfig.build(restart_s=100.0)
NEW_SCHEDULE = [[1, 4, 2], [5, 256, 1]]
STALL_S = 3.0  # far above a request's time here; a stream stuck behind a drain would exceed it


async def _stream(stack: Stack, i: int) -> tuple[int, str, float]:
    started = time.monotonic()
    async with stack.http.post(stack.url + "/v1/chat/completions",
                               json=chat_body(f"rollout {i}", stream=True)) as resp:
        body = (await resp.read()).decode()
    return resp.status, body, time.monotonic() - started


async def _clients(stack: Stack, stop: asyncio.Event, out: list[tuple[int, str, float]]) -> None:
    async def one(worker: int) -> None:
        n = 0
        while not stop.is_set():
            out.append(await _stream(stack, worker * 10_000 + n))
            n += 1

    await asyncio.gather(*(one(w) for w in range(4)))


async def _restart(stack: Stack, name: str) -> None:
    url = stack.engine_url(name) + "/admin/speculation"
    async with stack.http.post(url, json={"num_speculative_tokens_per_batch_size":
                                          NEW_SCHEDULE}) as resp:
        assert resp.status == 202, await resp.text()

    async def back() -> bool:
        async with stack.http.get(url) as resp:
            state: dict[str, Any] = orjson.loads(await resp.read())
        return state["restarts"] == 1 and not state["draining"]

    await stack.wait_for(back, timeout_s=20.0)


async def test_streams_through_the_proxy_survive_a_rolling_restart(
        make_stack: StackFactory) -> None:
    stack = await make_stack(targets=2, engine_kw={"num_speculative_tokens": 4, "spec": SPEC})
    results: list[tuple[int, str, float]] = []
    stop = asyncio.Event()
    clients = asyncio.create_task(_clients(stack, stop, results))
    try:
        async with asyncio.timeout(60):
            await asyncio.sleep(0.3)
            before = len(results)
            for name in stack.names:  # one engine of the pool at a time
                await _restart(stack, name)
                await stack.wait_ready()
            during = len(results) - before
            await asyncio.sleep(0.3)
    finally:
        stop.set()
        await clients
    assert during > 10  # traffic kept flowing while each engine was out
    assert {status for status, _, _ in results} == {200}
    assert all(body.rstrip().endswith("data: [DONE]") for _, body, _ in results)
    assert max(seconds for _, _, seconds in results) < STALL_S
