"""One scrape round over several engines: each answer is applied the moment it arrives, however
long another engine of the round takes (the round has one timeout, not one wait per engine)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from integration.stack import proxy_config

from proxy.core.config import TelemetryConfig
from proxy.core.engine_state import Health
from proxy.fleet.metrics_client import PROXY_SHORT, FetchError, MetricsClient
from proxy.fleet.scraper import Scraper
from proxy.server.app import build_app
from proxy.server.context import ShellContext
from proxy.server.keys import SCRAPER_TASK, SHELL
from proxy.server.lifecycle import ProxyServer

from .rogue import RogueEngine
from .shell import proxy_for
from .test_telemetry_trust import until


async def _own_scraper(server: ProxyServer) -> tuple[ShellContext, Scraper]:
    """The proxy's context and a scraper of its fleet whose rounds the test runs (the proxy's
    own scraping task is stopped)."""
    task = server.app[SCRAPER_TASK]
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    ctx = server.app[SHELL]
    assert ctx.scrape_session is not None
    return ctx, Scraper(ctx.fleet, ctx.scrape_session, ctx.cfg.telemetry, ctx.metrics, ctx.clock)


async def test_a_slow_engine_delays_no_other_engines_snapshot() -> None:
    fast, slow = RogueEngine(), RogueEngine()
    await fast.start()
    await slow.start()
    telemetry = TelemetryConfig(interval_s=5.0, timeout_s=4.0, stale_after_s=5.0)
    cfg = proxy_config([fast.url, slow.url], ["fast", "slow"], ["target", "target"],
                       telemetry=telemetry)
    server = ProxyServer(cfg, app=build_app(cfg))
    try:
        await server.start()
        slow.behaviour.metrics_hold = True
        ctx, scraper = await _own_scraper(server)
        fast_state, slow_state = ctx.fleet.get("fast").state, ctx.fleet.get("slow").state
        fast_state.snapshot = slow_state.snapshot = None
        round_ = asyncio.ensure_future(scraper.scrape_all())
        await until(lambda: bool(slow.requests_to("/metrics")))
        await until(lambda: fast_state.snapshot is not None)
        assert not round_.done() and slow_state.snapshot is None  # the slow answer is still due
        slow.release.set()
        await asyncio.wait_for(round_, 5.0)
        assert slow_state.snapshot is not None
        scraper.close()
    finally:
        await server.stop()
        await fast.stop()
        await slow.stop()


async def test_a_scrape_the_proxy_could_not_open_is_no_failure_of_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def no_descriptor(*args: object, **kwargs: object) -> object:
        raise FetchError(PROXY_SHORT, "the proxy cannot open a connection")

    engine = RogueEngine()
    await engine.start()
    telemetry = TelemetryConfig(interval_s=5.0, timeout_s=4.0, stale_after_s=5.0)
    cfg = proxy_config([engine.url], ["e0"], ["target"], telemetry=telemetry)
    server = ProxyServer(cfg, app=build_app(cfg))
    try:
        await server.start()
        ctx, scraper = await _own_scraper(server)
        monkeypatch.setattr(MetricsClient, "_connect", no_descriptor)
        state = ctx.fleet.get("e0").state
        for _ in range(5):
            await asyncio.wait_for(scraper.scrape_all(), 5.0)
        assert state.consecutive_failures == 0  # the engine was never asked: no verdict
        failures = ctx.metrics.scrape_failures.labels("e0", PROXY_SHORT)._value.get()
        assert failures == 5
        scraper.close()
    finally:
        await server.stop()
        await engine.stop()


async def _watch_health(delay_s: float, seconds: float, stale_after_s: float = 0.6
                        ) -> tuple[list[Health], float, int, int]:
    """An engine answering ``/metrics`` ``delay_s`` after each ask, scraped by the proxy's own
    task (every 0.1 s, timeout 0.09 s, stale after ``stale_after_s``) for ``seconds``: the health
    seen every 20 ms, the oldest snapshot age seen once it had one, the most answers ever due at
    once, and the scrapes it got."""
    engine = RogueEngine()
    await engine.start()
    telemetry = TelemetryConfig(interval_s=0.1, timeout_s=0.09, stale_after_s=stale_after_s)
    try:
        async with proxy_for(engine, telemetry=telemetry) as server:
            return await _watched(engine, server, delay_s, seconds)
    finally:
        await engine.stop()


async def _watched(engine: RogueEngine, server: ProxyServer, delay_s: float,
                   seconds: float) -> tuple[list[Health], float, int, int]:
    ctx = server.app[SHELL]
    state = ctx.fleet.get("rogue0").state
    engine.behaviour.metrics_delay_s = delay_s
    await asyncio.sleep(1.0)  # past the answers the engine gave without the delay
    seen, oldest = [], 0.0
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    asked = len(engine.requests_to("/metrics"))
    while loop.time() < end:
        seen.append(state.health)
        if state.snapshot is not None:
            oldest = max(oldest, ctx.clock() - state.snapshot.taken_at)
        await asyncio.sleep(0.02)
    return seen, oldest, engine.metrics_open_max, len(engine.requests_to("/metrics")) - asked


async def test_an_engine_answering_past_the_timeout_keeps_a_fresh_snapshot() -> None:
    # 0.25 s per answer: every round's timeout (0.09 s) passes first, yet each answer lands
    # 0.25 s after its ask, and a snapshot is about 0.55 s old at worst. A scrape given up at
    # the round's timeout would land none: the last snapshot, from before the delay, is over
    # 4 s old by the end, past stale_after_s (2 s).
    seen, oldest, most_open, asked = await _watch_health(0.25, 3.0, stale_after_s=2.0)
    assert Health.STALE not in seen and Health.UNHEALTHY not in seen
    assert set(seen) == {Health.HEALTHY}
    assert oldest < 2.0
    assert most_open == 1  # one scrape open per engine, never one per round
    assert asked <= 3.0 / 0.25 + 2  # about one ask per answer, not one per 0.1 s round


async def test_an_engine_answering_later_than_stale_after_still_goes_stale() -> None:
    # 0.9 s per answer: each scrape is given up at 0.6 s, so no answer ever lands.
    seen, _, most_open, _ = await _watch_health(0.9, 2.5)
    assert Health.STALE in seen
    assert most_open <= 2  # a given-up scrape's connection closes; the engine may still sleep
