"""An engine whose metrics come late while it answers requests is alive, not gone.

An engine's HTTP server saturated by its own streams (a fast source, a busy vLLM API process)
answers a scrape last. The scrapes time out, so the engine is STALE; but it keeps answering this
proxy's requests, so it must never be failed for silence while it does. Once it answers neither
(a hung engine), it is failed as before. The stack's telemetry: every 0.1 s, timeout 0.09 s,
stale after 0.6 s, unhealthy after 3 failures, so an engine silent for 1.8 s counts as gone.
"""

from __future__ import annotations

import asyncio

import aiohttp

from .rogue import RogueEngine
from .shell import CHAT, chat, proxy_for

SILENT_LIMIT_S = 1.8


async def _health(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url + "/admin/engines") as resp:
        body = await resp.json()
    (row,) = body["engines"]
    return str(row["health"])


async def _until_health(http: aiohttp.ClientSession, url: str, health: str) -> None:
    async with asyncio.timeout(10):
        while await _health(http, url) != health:  # noqa: ASYNC110 (polls the proxy over HTTP)
            await asyncio.sleep(0.05)


async def test_requests_answered_keep_an_engine_with_late_metrics_routable() -> None:
    engine = RogueEngine()
    await engine.start()
    engine.behaviour.tokens = 4
    engine.behaviour.chunk_delay_s = 0.05  # each answer streams for about 0.2 s
    loop = asyncio.get_running_loop()
    try:
        async with proxy_for(engine) as proxy, aiohttp.ClientSession() as http:
            engine.behaviour.metrics_hold = True  # no scrape is answered from now on
            statuses: list[int] = []
            end = loop.time() + 2 * SILENT_LIMIT_S
            while loop.time() < end:
                async with http.post(proxy.url + CHAT, json=chat(stream=True)) as resp:
                    await resp.read()
                    statuses.append(resp.status)
            assert statuses and set(statuses) == {200}, statuses
            assert await _health(http, proxy.url) == "stale"
            # Answering nothing more, the engine is failed once silent for the limit.
            started = loop.time()
            await _until_health(http, proxy.url, "unhealthy")
            assert loop.time() - started >= SILENT_LIMIT_S - 0.5
    finally:
        engine.release.set()
        await engine.stop()


async def test_one_long_stream_keeps_its_engine_alive() -> None:
    """No request starts or ends for longer than the limit; the stream's bytes are the sign."""
    engine = RogueEngine()
    await engine.start()
    engine.behaviour.tokens = 60
    engine.behaviour.chunk_delay_s = 0.06  # one answer of about 3.6 s, two silent limits
    try:
        async with proxy_for(engine) as proxy, aiohttp.ClientSession() as http:
            engine.behaviour.metrics_hold = True
            async with http.post(proxy.url + CHAT, json=chat(stream=True)) as resp:
                assert resp.status == 200
                seen = set()
                async for _ in resp.content.iter_any():
                    seen.add(await _health(http, proxy.url))
            assert "unhealthy" not in seen, seen
            engine.behaviour.tokens = 2
            async with http.post(proxy.url + CHAT, json=chat(stream=True)) as resp:
                assert resp.status == 200, await resp.text()
    finally:
        engine.release.set()
        await engine.stop()
