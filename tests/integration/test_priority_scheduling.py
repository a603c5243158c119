"""The priority class reaches engines that run priority scheduling and changes what they run first.

One simulated engine with ``scheduling_policy="priority"`` and ``max_num_seqs=1``: a long standard
request occupies the only slot, a sheddable and then a critical request queue behind it, and the
blocker is abandoned so the engine picks the next one. The engine orders its queue only by the
``priority`` in the body it received, so the finish order shows what the proxy sent: with
``priority_scheduling = true`` on the pool the critical request (-10) overtakes the sheddable one
(10); with it off the proxy sends no priority and the engine serves them first come, first served.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest

from engine_sidecar.sim.cluster import start_cluster
from proxy.server.lifecycle import ProxyServer

from .stack import TARGET_MODEL, Stack, proxy_config, sim

# Real-time engine (a decode step is milliseconds) whose requests run 4000 tokens unless capped:
# the blocker would hold the slot for many seconds; the queued requests are capped at 8 tokens.
ENGINE = {
    "scheduling_policy": "priority",
    "max_num_seqs": 1,
    "time_scale": 1.0,
    "stop_len_range": (4000, 4000),
}


@contextlib.asynccontextmanager
async def _one_engine_stack(priority_scheduling: bool) -> AsyncIterator[Stack]:
    cluster = await start_cluster([sim(TARGET_MODEL, "t0", **ENGINE)], host="127.0.0.1", port=0)
    try:
        cfg = proxy_config(cluster.urls, ["t0"], ["target"])
        pools = tuple(
            dataclasses.replace(p, priority_scheduling=priority_scheduling) for p in cfg.pools
        )
        server = ProxyServer(dataclasses.replace(cfg, pools=pools))
        await server.start()
        try:
            async with aiohttp.ClientSession() as http:
                client = openai.AsyncOpenAI(
                    base_url=server.url + "/v1", api_key="sk-test", max_retries=0, timeout=20.0
                )
                try:
                    stack = Stack(cluster, server, http, client, ["t0"])
                    await stack.wait_ready()
                    yield stack
                finally:
                    await client.close()
        finally:
            await server.stop()
    finally:
        await cluster.close()


async def _hold_slot(stack: Stack, started: asyncio.Event) -> None:
    """A streamed standard request that keeps the engine's only slot until cancelled."""
    stream = await stack.client.chat.completions.create(
        model=TARGET_MODEL,
        messages=[{"role": "user", "content": "blocker"}],
        max_tokens=4000,
        stream=True,
        extra_headers={"X-Priority": "standard", "X-Request-Id": "blocker"},
    )
    async with stream:
        async for _ in stream:
            started.set()
    raise AssertionError("the blocker finished before it was abandoned")


async def _queued(stack: Stack, cls: str, finished: list[str]) -> None:
    answer = await stack.client.chat.completions.create(
        model=TARGET_MODEL,
        messages=[{"role": "user", "content": f"a {cls} question"}],
        max_tokens=8,
        extra_headers={"X-Priority": cls, "X-Request-Id": cls},
    )
    assert answer.choices[0].message.content
    finished.append(cls)


async def _wait_engine(stack: Stack, running: int, waiting: int) -> None:
    async def check() -> bool:
        state = await stack.engine_state("t0")
        return bool(state["running"] == running and state["waiting"] == waiting)

    await stack.wait_for(check, timeout_s=10.0)


@pytest.mark.parametrize(
    ("priority_scheduling", "order"),
    [(True, ["critical", "sheddable"]), (False, ["sheddable", "critical"])],
    ids=["priority-pool", "fcfs-pool"],
)
async def test_engine_serves_by_the_priority_the_proxy_sends(
    priority_scheduling: bool, order: list[str]
) -> None:
    async with _one_engine_stack(priority_scheduling) as stack:
        finished: list[str] = []
        started = asyncio.Event()
        tasks: list[asyncio.Task[None]] = []
        try:
            blocker = asyncio.create_task(_hold_slot(stack, started))
            tasks.append(blocker)
            async with asyncio.timeout(10.0):
                await started.wait()
            await _wait_engine(stack, running=1, waiting=0)
            # Sheddable arrives first, critical second; both wait behind the blocker.
            tasks.append(asyncio.create_task(_queued(stack, "sheddable", finished)))
            await _wait_engine(stack, running=1, waiting=1)
            tasks.append(asyncio.create_task(_queued(stack, "critical", finished)))
            await _wait_engine(stack, running=1, waiting=2)  # so the blocker still runs
            blocker.cancel()  # the client leaves: the engine aborts it and frees the slot
            with contextlib.suppress(asyncio.CancelledError):
                await blocker
            async with asyncio.timeout(15.0):
                await asyncio.gather(*tasks[1:])
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        assert finished == order
        state = await stack.engine_state("t0")
        assert "blocker" in state["aborted_request_ids"]
        assert state["preemptions"] == 0  # the order came from the queue, not from preemption
