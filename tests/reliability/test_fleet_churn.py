"""Engines leaving the fleet (discovery) while requests are on their way: a retry ranked before
the departure never reaches a departed engine and never fails inside the proxy, and a departed
engine's figures leave ``/metrics``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
from integration.stack import TARGET_MODEL, chat_body, proxy_config

from proxy.core.config import RoutingConfig
from proxy.core.fleet_config import EngineConfig
from proxy.fleet.engines import Fleet
from proxy.server.app import build_app
from proxy.server.keys import SHELL
from proxy.server.lifecycle import ProxyServer

from .rogue import RogueEngine
from .test_telemetry_trust import until

COMPLETIONS = "/v1/chat/completions"


async def test_a_retry_never_goes_to_engines_that_left_the_fleet() -> None:
    a, b, c = RogueEngine(TARGET_MODEL), RogueEngine(TARGET_MODEL), RogueEngine(TARGET_MODEL)
    for engine in (a, b, c):
        await engine.start()
    cfg = proxy_config([a.url, b.url, c.url], ["a", "b", "c"], ["target"] * 3,
                       routing=RoutingConfig(policy="round_robin"))
    server = ProxyServer(cfg, app=build_app(cfg))
    try:
        await server.start()
        a.behaviour.completions = "hold"  # requests sent to a wait, then fail with a 500
        async with aiohttp.ClientSession() as http:

            async def ask(i: int) -> tuple[int, bytes]:
                async with http.post(server.url + COMPLETIONS,
                                     json=chat_body(f"question {i}")) as r:
                    return r.status, await r.read()

            tasks = [asyncio.create_task(ask(i)) for i in range(9)]
            # Every request has reached its first engine (round robin: three each) before any
            # engine leaves: those sent to b and c before it are theirs to answer.
            await until(lambda: sum(len(e.requests_to(COMPLETIONS)) for e in (a, b, c)) == 9)
            held = len(a.requests_to(COMPLETIONS))
            assert held == 3
            seen = len(b.requests_to(COMPLETIONS)), len(c.requests_to(COMPLETIONS))
            fleet = server.app[SHELL].fleet
            fleet.remove("b")  # two engines leave in one registry round
            fleet.remove("c")
            a.behaviour.completions, a.behaviour.completion_status = "status", 500
            a.release.set()
            results = await asyncio.gather(*tasks)
        statuses = sorted(status for status, _ in results)
        assert statuses.count(200) == 9 - held
        assert all(s in (200, 502, 503) for s in statuses), results  # never the proxy's 500
        assert (len(b.requests_to(COMPLETIONS)), len(c.requests_to(COMPLETIONS))) == seen
    finally:
        await server.stop()
        for engine in (a, b, c):
            await engine.stop()


@dataclass
class _Churn:
    """A proxy over engines ``a`` and ``b`` (its fleet: the first ``present`` of them), and a
    client."""

    server: ProxyServer
    http: aiohttp.ClientSession
    a: RogueEngine
    b: RogueEngine

    @property
    def fleet(self) -> Fleet:
        return self.server.app[SHELL].fleet

    async def metrics(self) -> str:
        async with self.http.get(self.server.url + "/metrics") as r:
            return await r.text()

    async def ask(self, i: int, stream: bool = False) -> int:
        async with self.http.post(self.server.url + COMPLETIONS,
                                  json=chat_body(f"question {i}", stream=stream)) as r:
            await r.read()
            return r.status


@contextlib.asynccontextmanager
async def _churn(present: int = 2) -> AsyncIterator[_Churn]:
    a, b = RogueEngine(TARGET_MODEL), RogueEngine(TARGET_MODEL)
    for engine in (a, b):
        await engine.start()
    engines = [(a.url, "a"), (b.url, "b")][:present]
    cfg = proxy_config([u for u, _ in engines], [n for _, n in engines], ["target"] * present,
                       routing=RoutingConfig(policy="round_robin"))
    server = ProxyServer(cfg, app=build_app(cfg))
    try:
        await server.start()
        async with aiohttp.ClientSession() as http:
            yield _Churn(server, http, a, b)
    finally:
        await server.stop()
        for engine in (a, b):
            await engine.stop()


def _of_b(text: str) -> list[str]:
    return [line for line in text.splitlines() if 'engine="b"' in line]


async def test_a_departed_engines_figures_leave_metrics() -> None:
    async with _churn() as c:
        before = await c.metrics()
        assert 'kvproxy_engine_kv_usage{engine="b",pool="target"}' in before
        assert 'kvproxy_scrape_duration_seconds_count{engine="b"}' in before
        c.fleet.remove("b")
        await asyncio.sleep(0.3)  # a scrape round or two without b
        after = await c.metrics()
    assert _of_b(after) == []
    assert 'kvproxy_engine_kv_usage{engine="a",pool="target"}' in after


async def test_a_departed_engines_request_counts_leave_metrics_late_answers_included() -> None:
    """Engines that come and go leave no series behind: a departed engine's request counters
    go with it, and an answer it finishes after it left is not counted under it."""
    async with _churn() as c:
        assert [await c.ask(i) for i in range(2)] == [200, 200]  # one each
        assert any(line.startswith("kvproxy_requests_total") for line in _of_b(await c.metrics()))
        c.b.behaviour.chunk_delay_s, c.b.behaviour.tokens = 0.05, 20  # a second's stream
        late = [asyncio.create_task(c.ask(i, stream=True)) for i in range(2, 4)]
        await until(lambda: len(c.b.requests_to(COMPLETIONS)) == 2)
        await asyncio.sleep(0.1)  # its first bytes are out
        c.fleet.remove("b")
        assert _of_b(await c.metrics()) == []  # b's series leave at once...
        assert await asyncio.gather(*late) == [200, 200]  # ...before its answer ended
        after = await c.metrics()
    assert _of_b(after) == []
    assert 'kvproxy_requests_total{class="standard",engine="a"' in after


async def test_an_engine_that_comes_and_goes_between_two_renders_leaves_nothing() -> None:
    """An engine's series go when it leaves, not at the next render of ``/metrics``: one that
    was scraped and served requests, and left before anyone read ``/metrics``, leaves none."""
    async with _churn(present=1) as c:
        await c.metrics()  # a render before b exists
        c.fleet.add("target", EngineConfig("b", c.b.url))
        await until(lambda: len(c.b.requests_to("/metrics")) >= 2)  # scraped
        assert [await c.ask(i) for i in range(4)] == [200] * 4  # round robin: two to b
        assert len(c.b.requests_to(COMPLETIONS)) == 2
        c.fleet.remove("b")
        after = await c.metrics()
    assert _of_b(after) == []
    assert 'kvproxy_requests_total{class="standard",engine="a"' in after
