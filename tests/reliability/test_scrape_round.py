"""One scrape round over several engines: each answer is applied the moment it arrives, however
long another engine of the round takes (the round has one timeout, not one wait per engine)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from integration.stack import proxy_config

from proxy.core.config import TelemetryConfig
from proxy.fleet.metrics_client import PROXY_SHORT, FetchError, MetricsClient
from proxy.fleet.scraper import Scraper
from proxy.server.app import build_app
from proxy.server.context import ShellContext
from proxy.server.keys import SCRAPER_TASK, SHELL
from proxy.server.lifecycle import ProxyServer

from .rogue import RogueEngine
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
