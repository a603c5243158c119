"""Holding on loopback: a sheddable or standard request refused only because this proxy's own
requests in flight have committed an engine's KV waits for room instead, and is served once the
room is there; one whose wait would exceed its bound (the class's, or the client's deadline) is
refused cleanly with 503 and Retry-After. Critical work is never held and standard work does not
wait behind sheddable work. A standard request that only the commitment forecast still refuses
when its hold is up is paced through, not refused, while the engine's own figures leave room.

The engine is the one of ``test_overcommit``'s commitment tests: 200 blocks of 16 tokens, KV usage
reported at 5 %, answers that stall after their first two tokens, so that six long answers in
flight commit the engine to 0.81 of its cache and a seventh sheddable one would cross the
sheddable mark (0.90).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
from integration.stack import Stack, StackFactory, chat_body

from proxy.core.config import ClassThreshold, PressureConfig

KV = "vllm:kv_cache_usage_perc"
LONG = {"max_tokens": 400, "ignore_eos": True}  # 400 + a few prompt tokens: 1/8 of the cache


async def committed_engine(make_stack: StackFactory, stall_s: float, **pressure: object) -> Stack:
    stack = await make_stack(targets=1, pressure=PressureConfig(hold_scrapes=50, **pressure),
                             engine_kw={"num_gpu_blocks": 200})
    await stack.faults("t0", metric_overrides={KV: 0.05}, stall_after_tokens=2, stall_s=stall_s)

    async def judged() -> bool:
        return bool((await stack.admin())["t0"]["snapshot"]["kv_usage"] == 0.05)

    await stack.wait_for(judged)
    return stack


async def send(stack: Stack, cls: str, tag: str, **headers: str) -> aiohttp.ClientResponse:
    return await stack.post("/v1/chat/completions", chat_body(f"{cls} {tag}", **LONG),
                            **{"X-Priority": cls, **headers})


@contextlib.asynccontextmanager
async def six_in_flight(stack: Stack) -> AsyncIterator[None]:
    """Six long sheddable answers in flight on t0 (stalled); cut when the block ends."""
    tasks = [asyncio.create_task(send(stack, "sheddable", f"bulk {i}")) for i in range(6)]

    async def six() -> bool:
        return bool((await stack.admin())["t0"]["inflight"] == 6)

    try:
        await stack.wait_for(six)
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def held(stack: Stack, count: int) -> None:
    async def check() -> bool:
        return await stack.metric("kvproxy_held_requests", pool="target") == count

    await stack.wait_for(check)


async def test_a_held_request_is_served_once_its_room_is_freed(make_stack: StackFactory) -> None:
    # The six stall 5 s: still in flight while the seventh is seen held.
    stack = await committed_engine(make_stack, stall_s=5.0, hold_sheddable_s=30.0)
    async with six_in_flight(stack):
        seventh = asyncio.create_task(send(stack, "sheddable", "seventh"))
        await held(stack, 1)  # waiting in the proxy, not refused
        assert not seventh.done()
        resp = await asyncio.wait_for(seventh, 25.0)  # the six end after their stall: room
    assert resp.status == 200
    assert resp.headers["X-Engine"] == "t0"
    assert await stack.metric("kvproxy_held_total", outcome="admitted",
                              **{"class": "sheddable"}) == 1
    assert await stack.metric("kvproxy_shed_total") == 0
    await held(stack, 0)


async def test_a_request_whose_wait_would_exceed_its_bound_is_refused_cleanly(
    make_stack: StackFactory,
) -> None:
    stack = await committed_engine(make_stack, stall_s=8.0, hold_sheddable_s=0.5)
    async with six_in_flight(stack):
        resp = await asyncio.wait_for(send(stack, "sheddable", "seventh"), 5.0)
        assert resp.status == 503
        assert resp.headers["X-Kvproxy-Shed-Reason"] == "kv_committed"
        assert 1 <= int(resp.headers["Retry-After"]) <= 60
        error = (await resp.json())["error"]
        assert error["type"] == "overloaded"
        assert "127.0.0.1" not in error["message"]
        assert await stack.metric("kvproxy_held_total", outcome="refused") == 1
        assert await stack.metric("kvproxy_shed_total", reason="kv_committed") == 1
        await held(stack, 0)


async def test_the_clients_deadline_bounds_the_hold(make_stack: StackFactory) -> None:
    stack = await committed_engine(make_stack, stall_s=8.0, hold_sheddable_s=60.0)
    async with six_in_flight(stack):
        # 1.3 s to live, 1 s of it kept to be answered in: held 0.3 s, then refused.
        resp = await asyncio.wait_for(
            send(stack, "sheddable", "seventh", **{"X-Request-Timeout": "1.3"}), 5.0)
        assert resp.status == 503
        assert resp.headers["X-Kvproxy-Shed-Reason"] == "kv_committed"
        assert await stack.metric("kvproxy_held_total", outcome="refused") == 1


async def test_standard_and_critical_work_do_not_wait_behind_held_sheddable_work(
    make_stack: StackFactory,
) -> None:
    stack = await committed_engine(make_stack, stall_s=1.5, hold_sheddable_s=30.0)
    async with six_in_flight(stack):
        seventh = asyncio.create_task(send(stack, "sheddable", "seventh"))
        await held(stack, 1)
        # Committed 0.81 + 0.13 is under standard's mark (1.00): admitted at once, and critical
        # work is never closed by commitments.
        standard = await send(stack, "standard", "now")
        critical = await send(stack, "critical", "now")
        assert (standard.status, critical.status) == (200, 200)
        for cls in ("standard", "critical"):  # neither waited in the queue
            assert await stack.metric("kvproxy_held_total", **{"class": cls}) == 0
        assert (await asyncio.wait_for(seventh, 20.0)).status == 200
        assert await stack.metric("kvproxy_held_total", outcome="admitted") == 1


async def test_a_client_that_leaves_while_held_leaves_the_queue(make_stack: StackFactory) -> None:
    stack = await committed_engine(make_stack, stall_s=8.0, hold_sheddable_s=30.0)
    async with six_in_flight(stack):
        seventh = asyncio.create_task(send(stack, "sheddable", "seventh"))
        await held(stack, 1)
        seventh.cancel()  # the client hangs up
        with contextlib.suppress(asyncio.CancelledError):
            await seventh
        await held(stack, 0)

        async def gone() -> bool:
            return await stack.metric("kvproxy_held_total", outcome="gone") == 1

        await stack.wait_for(gone)


# Standard work closed at committed 0.85: six answers in flight (0.81) and a seventh (0.13)
# cross it.
LOW_MARKS = {"committed_sheddable": ClassThreshold(0.85, 0.80),
             "committed_standard": ClassThreshold(0.85, 0.80)}


async def test_a_standard_request_only_the_forecast_refuses_is_paced_through(
    make_stack: StackFactory,
) -> None:
    # The six stall 2 s; the hold (0.3 s) is up long before they end and free any room.
    stack = await committed_engine(make_stack, stall_s=2.0, hold_standard_s=0.3,
                                   pace_standard=True, **LOW_MARKS)
    async with six_in_flight(stack):
        resp = await asyncio.wait_for(send(stack, "standard", "seventh"), 10.0)
        assert resp.status == 200
        assert resp.headers["X-Engine"] == "t0"
        assert await stack.metric("kvproxy_held_total", outcome="paced",
                                  **{"class": "standard"}) == 1
        assert await stack.metric("kvproxy_shed_total") == 0


async def test_without_pacing_the_same_request_is_refused(make_stack: StackFactory) -> None:
    stack = await committed_engine(make_stack, stall_s=2.0, hold_standard_s=0.3, **LOW_MARKS)
    async with six_in_flight(stack):
        resp = await asyncio.wait_for(send(stack, "standard", "seventh"), 5.0)
        assert resp.status == 503
        assert resp.headers["X-Kvproxy-Shed-Reason"] == "kv_committed"
        assert await stack.metric("kvproxy_held_total", outcome="refused") == 1
