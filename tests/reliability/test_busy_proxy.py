"""A proxy too busy to read its sockets on time does not blame its engines for it."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

from .rogue import RogueEngine
from .shell import proxy_for


async def _metric_sum(url: str, name: str, **labels: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_a_stalled_event_loop_marks_no_engine_stale_or_failed(
    rogue: RogueEngine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="proxy.fleet.scraper")
    # telemetry: every 0.1 s, timeout 0.09 s, stale after 0.6 s (the stack's settings)
    async with proxy_for(rogue) as proxy:
        scrapes = len(rogue.requests_to("/metrics"))
        rogue.behaviour.metrics_block_s = 0.8  # the process stalls in the middle of each scrape
        async with asyncio.timeout(10):
            while len(rogue.requests_to("/metrics")) < scrapes + 3:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        rogue.behaviour.metrics_block_s = 0.0
        await asyncio.sleep(0.3)
        assert await _metric_sum(proxy.url, "kvproxy_scrape_failures_total", reason="timeout") == 0
        lag = await _metric_sum(proxy.url, "kvproxy_event_loop_lag_seconds_bucket", le="0.5")
        total = await _metric_sum(proxy.url, "kvproxy_event_loop_lag_seconds_bucket", le="+Inf")
        assert total - lag >= 3  # the probe saw each stall
    assert not [r for r in caplog.records if "is stale" in r.getMessage()]
