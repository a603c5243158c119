"""KV overcommit guard on loopback: an engine that starts preempting is closed to sheddable work
first, then to standard work, never to critical work; the reason is visible to the client (shed
header), in the admin view and in the proxy's metrics.

Preemptions are injected through the simulator's ``metric_overrides`` fault (the counter
``vllm:num_preemptions_total`` is raised between scrapes), so the test does not depend on how fast
a burst fills a real simulated KV cache on a loaded machine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from integration.stack import Stack, StackFactory, chat_body

from proxy.core.config import PressureConfig

PREEMPT = "vllm:num_preemptions_total"
# Long holds: a test that takes a second more on a loaded machine still sees the closing.
GUARD = PressureConfig(hold_scrapes=50)


async def preempt_once(stack: Stack, name: str, count: float) -> None:
    """Raise ``name``'s preemption counter to ``count`` and wait until the proxy judged it."""
    await stack.faults(name, metric_overrides={PREEMPT: count})

    async def judged() -> bool:
        return bool((await stack.admin())[name]["pressure"]["reason"] == "preempting")

    await stack.wait_for(judged)


@contextlib.asynccontextmanager
async def preempting(stack: Stack, name: str) -> AsyncIterator[None]:
    """Keep ``name``'s preemption counter rising (every half scrape interval)."""

    async def bump() -> None:
        count = 100.0
        while True:
            count += 1
            await stack.faults(name, metric_overrides={PREEMPT: count})
            await asyncio.sleep(0.05)

    task = asyncio.create_task(bump(), name=f"preempt-{name}")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def send(stack: Stack, cls: str, n: int = 1) -> list[tuple[int, str | None, str | None]]:
    """(status, serving engine, shed reason) of ``n`` requests of class ``cls``."""
    out = []
    for i in range(n):
        resp = await stack.post("/v1/chat/completions", chat_body(f"{cls} {i}"),
                                **{"X-Priority": cls})
        out.append((resp.status, resp.headers.get("X-Engine"),
                    resp.headers.get("X-Kvproxy-Shed-Reason")))
    return out


async def test_preempting_engine_is_closed_to_sheddable_work_first(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(targets=2, pressure=GUARD)
    await preempt_once(stack, "t0", 5.0)  # one rise: preemptions have started
    row = (await stack.admin())["t0"]["pressure"]
    assert row["closed_to"] == ["sheddable"]
    assert row["preemptions_per_s"] > 0
    assert await stack.metric("kvproxy_engine_pressure", engine="t0") == 1
    assert await stack.metric("kvproxy_engine_pressure", engine="t1") == 0

    sheddable = await send(stack, "sheddable", 12)
    assert {engine for _, engine, _ in sheddable} == {"t1"}  # steered away, not shed
    assert all(status == 200 for status, _, _ in sheddable)
    standard = await send(stack, "standard", 12)
    assert all(status == 200 for status, _, _ in standard)
    assert "t0" in {engine for _, engine, _ in standard}  # still open to standard work


async def test_whole_pool_preempting_sheds_sheddable_then_standard_never_critical(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(targets=2, pressure=GUARD)
    for name in ("t0", "t1"):
        await preempt_once(stack, name, 3.0)
    [(status, _, reason)] = await send(stack, "sheddable")
    assert (status, reason) == (503, "preempting")
    resp = await stack.post("/v1/chat/completions", chat_body("x"), **{"X-Priority": "sheddable"})
    assert int(resp.headers["Retry-After"]) >= 1
    assert (await resp.json())["error"]["type"] == "overloaded"
    assert all(s == 200 for s, _, _ in await send(stack, "standard", 3))

    async with preempting(stack, "t0"), preempting(stack, "t1"):

        async def standard_closed() -> bool:
            rows = await stack.admin()
            return all(rows[n]["pressure"]["closed_to"] == ["sheddable", "standard"]
                       for n in ("t0", "t1"))

        await stack.wait_for(standard_closed)
        [(status, _, reason)] = await send(stack, "standard")
        assert (status, reason) == (503, "preempting")
        assert all(s == 200 for s, _, _ in await send(stack, "critical", 3))
    shed = await stack.metric("kvproxy_shed_total", reason="preempting", **{"class": "standard"})
    assert shed == 1


async def test_stale_engine_preemptions_do_not_count(make_stack: StackFactory) -> None:
    stack = await make_stack(targets=2, pressure=GUARD)
    # The counter rises, but the engine's metrics freeze: what it said last is never news again.
    await stack.faults("t0", metric_overrides={PREEMPT: 50.0}, metrics_status=500)

    async def unhealthy() -> bool:
        row = (await stack.admin())["t0"]
        return bool(row["health"] != "healthy")

    await stack.wait_for(unhealthy)
    assert (await stack.admin())["t0"]["pressure"]["level"] == "open"


async def test_guard_off_keeps_routing_to_a_preempting_engine(make_stack: StackFactory) -> None:
    stack = await make_stack(targets=2, pressure=PressureConfig(enabled=False))
    for count in (5.0, 9.0, 13.0):
        await stack.faults("t0", metric_overrides={PREEMPT: count})
        await asyncio.sleep(0.15)
    engines = {engine for _, engine, _ in await send(stack, "sheddable", 12)}
    assert "t0" in engines
    assert (await stack.admin())["t0"]["pressure"]["level"] == "open"


# --- commitments: a burst is held back by what it will take, before the engine reports it -------

KV = "vllm:kv_cache_usage_perc"
LONG = {"max_tokens": 400, "ignore_eos": True}  # 400 + a few prompt tokens: 1/8 of the cache


async def burst(stack: Stack, cls: str, n: int) -> list[tuple[int, str | None]]:
    """(status, shed reason) of ``n`` concurrent long-output requests of class ``cls``."""

    async def one(i: int) -> tuple[int, str | None]:
        resp = await stack.post("/v1/chat/completions", chat_body(f"{cls} {i}", **LONG),
                                **{"X-Priority": cls})
        await resp.read()
        return resp.status, resp.headers.get("X-Kvproxy-Shed-Reason")

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def reporting_low_usage(stack: Stack, **pressure: object) -> Stack:
    """One engine of 200 blocks x 16 tokens whose answers stall after their first tokens (so a
    burst stays in flight) and whose reported KV usage stays at 5 %: the burst's output is still
    to come, as it is right after an engine admitted it on its prompts."""
    for name in stack.names:
        await stack.faults(name, metric_overrides={KV: 0.05}, stall_after_tokens=2, stall_s=1.5)

    async def judged() -> bool:
        return all(r["snapshot"]["kv_usage"] == 0.05 for r in (await stack.admin()).values())

    await stack.wait_for(judged)
    return stack


async def test_a_long_output_burst_is_held_back_by_what_it_will_take(
    make_stack: StackFactory,
) -> None:
    # Holding off: what is measured here is the refusal itself (held requests: test_holding.py).
    refusing = PressureConfig(hold_scrapes=50, hold_sheddable_s=0.0)
    stack = await reporting_low_usage(
        await make_stack(targets=1, pressure=refusing, engine_kw={"num_gpu_blocks": 200}))
    sending = asyncio.create_task(burst(stack, "sheddable", 12))

    async def six_in_flight() -> bool:
        return bool((await stack.admin())["t0"]["inflight"] == 6)

    await stack.wait_for(six_in_flight)  # the rest are refused at once; these six stall
    critical = await burst(stack, "critical", 1)
    sheddable = await sending
    admitted = [s for s, _ in sheddable if s == 200]
    shed = [reason for s, reason in sheddable if s == 503]
    # 0.05 reported + six requests of ~0.127 each = 0.81; a seventh would cross sheddable's
    # committed mark, 0.90.
    assert len(admitted) == 6
    assert shed and set(shed) == {"kv_committed"}
    assert critical == [(200, None)]  # never closed by commitments (7 x 26 blocks fit in 200)
    assert await stack.metric("kvproxy_shed_total", reason="kv_committed",
                              **{"class": "sheddable"}) == len(shed)

    async def settled() -> bool:
        pressure = (await stack.admin())["t0"]["pressure"]
        return bool(pressure["committed_kv"] == 0.05 and pressure["level"] == "open")

    await stack.wait_for(settled)  # answered: nothing owed any more, the engine opens again
    assert all(s == 200 for s, _ in await burst(stack, "sheddable", 3))


async def test_without_reservation_the_same_burst_is_all_admitted(
    make_stack: StackFactory,
) -> None:
    off = PressureConfig(hold_scrapes=50, reserve_output=False)
    stack = await reporting_low_usage(
        await make_stack(targets=1, pressure=off, engine_kw={"num_gpu_blocks": 200}))
    assert all(s == 200 for s, _ in await burst(stack, "sheddable", 12))
