"""Replicas that route as one: dispatches and in-flight counts shared through a Redis stream."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from proxystack import KEYS, MODEL, door_config, proxy_config, scrape, sim
from redisproc import RedisFactory, RedisServer

from engine_sidecar.sim.cluster import SimCluster, start_cluster
from proxy.core.config import RoutingConfig, SharingConfig
from proxy.core.costmodel import ExpectedTTFT
from proxy.core.holdings import ApproxHoldings
from proxy.server.app import build_app
from proxy.server.keys import SHELL
from proxy.server.lifecycle import ProxyServer

AUTH = {"Authorization": f"Bearer {KEYS['acme']}"}
# Eight blocks of a prompt no test sent before: a new prefix every replica must learn.
PREFIX = "".join(f"shared document paragraph {i:04d} " * 8 for i in range(64))


@pytest.fixture
async def cluster() -> AsyncIterator[SimCluster]:
    # Slow enough that a stream asked to ignore EOS stays open for seconds.
    engines = [sim(f"t{i}", seed=i, time_scale=5.0) for i in range(4)]
    c = await start_cluster(engines, host="127.0.0.1", port=0)
    try:
        yield c
    finally:
        await c.close()


Replicas = Callable[..., Awaitable[list[ProxyServer]]]


@pytest.fixture
async def replicas(cluster: SimCluster) -> AsyncIterator[Replicas]:
    started: list[ProxyServer] = []

    async def make(
        redis_url: str, n: int = 2, share: bool = True, **redis: Any
    ) -> list[ProxyServer]:
        cfg = proxy_config(cluster.urls, [e.name for e in cluster.engines], [MODEL] * 4)
        # A bound no burst here reaches: these tests are about what replicas know, not spilling.
        cfg = dataclasses.replace(cfg, routing=RoutingConfig(min_load_bound=16),
                                  sharing=SharingConfig(enabled=share))
        door = door_config(redis_url=redis_url, redis=redis)
        for _ in range(n):
            server = ProxyServer(cfg, build_app(cfg, door=door))
            await server.start()
            started.append(server)
        return started[-n:]

    yield make
    for server in started:
        await server.stop()


def body(suffix: str, **extra: Any) -> dict[str, Any]:
    content = PREFIX + suffix
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 8, **extra}


async def engines_used(http: aiohttp.ClientSession, servers: list[ProxyServer]) -> dict[str, float]:
    used: dict[str, float] = {}
    for server in servers:
        async with http.get(server.url + "/admin/engines") as resp:
            names = [row["name"] for row in (await resp.json())["engines"]]
        for name in names:
            n = await scrape(http, server.url + "/metrics", "kvproxy_requests_total",
                             engine=name, status="200")
            if n:
                used[name] = used.get(name, 0.0) + n
    return used


async def wait_for(check: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not await check():  # noqa: ASYNC110 (polled over HTTP, no event to wait on)
            await asyncio.sleep(0.02)


async def _load_seen(http: aiohttp.ClientSession, url: str, engine: str) -> bool:
    async with http.get(url + "/admin/engines") as resp:
        rows = (await resp.json())["engines"]
    return any(r["name"] == engine and r["load"] >= 1 for r in rows)


async def _burst_lands_on(replicas: Replicas, redis_url: str, *, share: bool) -> dict[str, float]:
    a, b = await replicas(redis_url, share=share)
    async with aiohttp.ClientSession(headers=AUTH) as http:
        for server in (a, b):
            await wait_for(lambda s=server: _ready(http, s.url))
        # A long stream on replica A: the first request of the new prefix, still open.
        stream = await http.post(a.url + "/v1/chat/completions",
                                 json=body(" first", stream=True, max_tokens=400, ignore_eos=True))
        assert stream.status == 200
        await stream.content.readline()
        home = next(iter(await _open_at(http, a.url)))
        # B has seen the engine busy (through sharing, or at the latest through its scrape).
        await wait_for(lambda: _load_seen(http, b.url, home))
        burst = [http.post(s.url + "/v1/chat/completions", json=body(f" question {i}"))
                 for i, s in enumerate([a, b] * 4)]
        for resp in await asyncio.gather(*burst):
            assert resp.status == 200, await resp.text()
            resp.release()
        stream.close()
        used = await engines_used(http, [a, b])
    return used


async def _ready(http: aiohttp.ClientSession, url: str) -> bool:
    async with http.get(url + "/ready") as resp:
        return resp.status == 200


async def _open_at(http: aiohttp.ClientSession, url: str) -> set[str]:
    async with http.get(url + "/admin/engines") as resp:
        return {r["name"] for r in (await resp.json())["engines"] if r["inflight"]}


async def test_two_replicas_send_a_new_prefix_to_one_engine(
    replicas: Replicas, redis_server: RedisServer
) -> None:
    used = await _burst_lands_on(replicas, redis_server.url, share=True)
    assert len(used) == 1, f"the burst was split across engines: {used}"
    assert sum(used.values()) == 8


async def test_without_sharing_each_replica_picks_its_own_engine(
    replicas: Replicas, redis_server: RedisServer
) -> None:
    # The same burst with sharing off: what the test above would see without it.
    used = await _burst_lands_on(replicas, redis_server.url, share=False)
    assert len(used) == 2, used


async def test_a_replica_that_loses_redis_routes_alone_and_says_so(
    replicas: Replicas, redis_factory: RedisFactory
) -> None:
    server = redis_factory.start()
    a, b = await replicas(server.url, op_timeout_s=0.2, retry_after_failure_s=0.3)
    async with aiohttp.ClientSession(headers=AUTH) as http:
        live = lambda url: scrape(http, url + "/metrics", "kvproxy_sharing_live")  # noqa: E731
        await wait_for(lambda: _is(live(a.url), 1.0))
        await wait_for(lambda: _is(scrape(http, b.url + "/metrics", "kvproxy_sharing_peers"), 1.0))
        server.stop()
        await wait_for(lambda: _is(live(a.url), 0.0))
        for i in range(3):
            async with http.post(a.url + "/v1/chat/completions", json=body(f" alone {i}")) as r:
                assert r.status == 200, await r.text()
        errors = await scrape(http, a.url + "/metrics", "kvproxy_redis_errors_total")
        assert errors > 0
        # The other replica's figures expire: A counts no one else's requests any more.
        await wait_for(lambda: _is(scrape(http, a.url + "/metrics", "kvproxy_sharing_peers"), 0.0))


async def _is(value: Awaitable[float], want: float) -> bool:
    return await value == want


async def _prefill_seen(http: aiohttp.ClientSession, url: str, engine: str) -> float:
    async with http.get(url + "/admin/engines") as resp:
        rows = (await resp.json())["engines"]
    return float(next(r["prefill_pending_tokens"] for r in rows if r["name"] == engine))


async def test_a_prompt_one_replica_sent_is_queued_work_at_the_other(
    replicas: Replicas, redis_server: RedisServer, cluster: SimCluster
) -> None:
    a, b = await replicas(redis_server.url)
    async with aiohttp.ClientSession(headers=AUTH) as http:
        for server in (a, b):
            await wait_for(lambda s=server: _ready(http, s.url))
        for url in cluster.urls:  # no first byte for seconds: the prompt waits to be computed
            async with http.post(url + "/admin/faults", json={"header_delay_s": 5.0}) as r:
                assert r.status == 200
        sent = asyncio.create_task(http.post(a.url + "/v1/chat/completions", json=body(" long")))
        try:
            await wait_for(lambda: _has_open(http, a.url))
            home = next(iter(await _open_at(http, a.url)))
            # Hold A's snapshot of the engine where it was: the prompt stays "sent since".
            url = cluster.urls[[e.name for e in cluster.engines].index(home)]
            async with http.post(url + "/admin/faults", json={"metrics_status": 500}) as r:
                assert r.status == 200
            mine = await _prefill_seen(http, a.url, home)
            assert mine > 1000  # the prompt's tokens, as A counts them
            # B sent nothing there, yet counts A's prompt as work queued ahead of its requests.
            await wait_for(lambda: _is_at_least(_prefill_seen(http, b.url, home), mine))
            assert not await _open_at(http, b.url)
        finally:
            sent.cancel()
            await asyncio.gather(sent, return_exceptions=True)
            for url in cluster.urls:
                async with http.delete(url + "/admin/faults") as r:
                    assert r.status == 200


async def _has_open(http: aiohttp.ClientSession, url: str) -> bool:
    return bool(await _open_at(http, url))


async def _is_at_least(value: Awaitable[float], want: float) -> bool:
    return await value >= want


async def test_a_replica_learns_how_many_peer_dispatches_come_with_its_own(
    replicas: Replicas, redis_server: RedisServer
) -> None:
    a, b = await replicas(redis_server.url)
    blind = b.app[SHELL].blindness["target"]
    async with aiohttp.ClientSession(headers=AUTH) as http:
        for server in (a, b):
            await wait_for(lambda s=server: _ready(http, s.url))
        assert blind.expected == 0.0  # nothing merged from A yet

        async def burst(n: int) -> bool:
            sent = [http.post(s.url + "/v1/chat/completions", json=body(f" burst {n} {i}"))
                    for i, s in enumerate([a, b] * 3)]
            for resp in await asyncio.gather(*sent):
                assert resp.status == 200, await resp.text()
                resp.release()
            await asyncio.sleep(0.1)  # B's next rounds merge A's share of the burst
            return blind.expected > 0.0

        # Each of B's decisions came with some of A's dispatches: B expects them from now on.
        for n in range(20):
            if await burst(n):
                break
        assert blind.expected > 0.0
        assert blind.unseen() == blind.expected


async def test_a_prompt_one_replica_served_is_settled_at_the_other(
    replicas: Replicas, redis_server: RedisServer
) -> None:
    """A's first byte reaches B with A's dispatch (``proxy.core.sharing``): B settles the prompt
    where A's request was answered, as A does, instead of holding it provisionally for ever."""
    a, b = await replicas(redis_server.url)
    policies = [s.app[SHELL].policies["target"] for s in (a, b)]
    async with aiohttp.ClientSession(headers=AUTH) as http:
        for server in (a, b):
            await wait_for(lambda s=server: _ready(http, s.url))
        for server in (a, b):  # each reads the stream: A's dispatch below reaches B
            await wait_for(lambda s=server: _is(
                scrape(http, s.url + "/metrics", "kvproxy_sharing_peers"), 1.0))
        async with http.post(a.url + "/v1/chat/completions", json=body(" settle me")) as r:
            assert r.status == 200, await r.text()
        await wait_for(lambda: _is_at_least(scrape(
            http, b.url + "/metrics", "kvproxy_sharing_merged_total", kind="confirmations"), 1))
        home = next(iter(await engines_used(http, [a])))
    for policy in policies:
        assert isinstance(policy, ExpectedTTFT) and isinstance(policy.holdings, ApproxHoldings)
    # The prompt's blocks are settled at its engine in B as in A (none were before confirmations).
    settled = [p.holdings.settled.size(home) for p in policies]
    assert settled[0] > 0 and settled[1] == settled[0], settled
