"""Routing decisions serialised through Redis: replicas deciding at one instant see each other."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry
from proxystack import KEYS, MODEL, door_config, proxy_config, scrape, sim
from redisproc import RedisFactory, RedisServer

from engine_sidecar.sim.cluster import SimCluster, start_cluster
from proxy.core.claims import Claimable, choose_claimed
from proxy.core.config import Config, RoutingConfig, SharingConfig
from proxy.core.costmodel import ExpectedTTFT
from proxy.core.routeview import EngineView, RouteKey
from proxy.core.sharing import Backlog
from proxy.server.app import build_app
from proxy.server.lifecycle import ProxyServer
from proxy.tenancy.redis_link import RedisLink
from proxy.tenancy.shared_decision import MAX_LIVE, SharedDecider

AUTH = {"Authorization": f"Bearer {KEYS['acme']}"}
PENDING, LIVE = "kvproxy:{claims}:pending", "kvproxy:{claims}:live"


class Decider(SharedDecider):
    registry: CollectorRegistry


def decider(link: RedisLink, replica: str, *, ttl_s: float = 2.0) -> Decider:
    registry = CollectorRegistry()
    d = Decider(link, ttl_s=ttl_s, timeout_s=2.0, tolerance=0.1, registry=registry,
                replica=replica, peers=lambda: 1)
    d.registry = registry
    return d


def two(cost: float = 1.0, tokens: float = 2000.0) -> list[Claimable]:
    return [Claimable(n, cost, 1e-3, 0.0, tokens) for n in ("t0", "t1")]


def outcome(d: Decider, outcome: str, reason: str = "") -> float:
    value = d.registry.get_sample_value(
        "kvproxy_shared_decisions_total", {"outcome": outcome, "reason": reason})
    return value or 0.0


async def redis_ms(link: RedisLink) -> int:
    secs, micros = await link.client.time()
    return int(secs) * 1000 + int(micros) // 1000


# --- decisions at one instant ------------------------------------------------------------------


def _idle(name: str) -> EngineView:
    return EngineView(name, routable=True, fresh=True, load=0.0, kv_usage=0.1)


def _keys_with_one_local_pick(policy: ExpectedTTFT, views: list[EngineView]) -> list[RouteKey]:
    """Two different prompts that a replica deciding alone sends to the same idle engine."""
    rng = random.Random(7)
    by_pick: dict[str, RouteKey] = {}
    while True:
        key = RouteKey(chain=(rng.getrandbits(63),), prompt_tokens=3000.0)
        first = policy.rank(key, views)[0]
        if first in by_pick:
            return [by_pick[first], key]
        by_pick[first] = key


async def test_two_replicas_deciding_at_one_instant_pick_different_engines(
    link: RedisLink,
) -> None:
    views = [_idle(f"t{i}") for i in range(4)]
    policies = [ExpectedTTFT(RoutingConfig()) for _ in range(2)]
    keys = _keys_with_one_local_pick(policies[0], views)
    # Alone, each replica sends its request to the same engine: the herd.
    local = [p.rank(k, views)[0] for p, k in zip(policies, keys, strict=True)]
    assert local[0] == local[1]
    a, b = decider(link, "a" * 16), decider(link, "b" * 16)
    decisions = [p.decide(k, views, claims=True) for p, k in zip(policies, keys, strict=True)]
    picks = await asyncio.gather(*(d.decide(x.claimable) for d, x in
                                   zip((a, b), decisions, strict=True)))
    names = {x.claimable[i].name for x, i in zip(decisions, picks, strict=True) if i is not None}
    assert len(names) == 2, names
    assert outcome(a, "shared") == outcome(b, "shared") == 1.0


async def test_one_replicas_concurrent_decisions_see_each_other(link: RedisLink) -> None:
    # Two decisions of one replica whose answers are both still on the way.
    a = decider(link, "a" * 16)
    picks = await asyncio.gather(a.decide(two()), a.decide(two()))
    assert sorted(p for p in picks if p is not None) == [0, 1]


async def test_the_script_decides_as_the_reference_does(link: RedisLink) -> None:
    rng = random.Random(3)
    now = await redis_ms(link)
    # Live for 30 s: within four times the deciders' ttl, as the script requires.
    await link.client.hset(LIVE, mapping={"p" * 16: now + 30_000, "q" * 16: now + 30_000})
    a = decider(link, "a" * 16, ttl_s=10.0)  # its own earlier claims are in its ledger: count 0
    for trial in range(30):
        cands = [Claimable(f"e{i}", rng.uniform(0.5, 2.0), rng.uniform(1e-4, 1e-3),
                           rng.choice((0.0, 64.0)), rng.uniform(0, 4000)) for i in range(5)]
        others = [0.0] * 5
        for i in range(5):
            for peer in ("p" * 16, "q" * 16):
                tokens = rng.choice((0.0, rng.uniform(0, 3000)))
                await link.client.hset(PENDING, f"{peer}|e{i}", repr(tokens))
                others[i] += tokens
        pick = await a.decide(cands)
        assert pick == choose_claimed(cands, others, 0.1), (trial, cands, others)


# --- hostile contents, expiry, Redis trouble ----------------------------------------------------


async def test_hostile_claims_and_live_entries_are_ignored(link: RedisLink) -> None:
    now = await redis_ms(link)
    peer, unreadable, far = "p" * 16, "q" * 16, "f" * 16
    # ``far`` lies further ahead than four times the ttl (2 s): not believed.
    await link.client.hset(LIVE, mapping={peer: now + 6_000, unreadable: "soon",
                                          far: now + 10**12})
    await link.client.hset(PENDING, mapping={
        f"{peer}|t0": "nan", f"{peer}|t0x": "1", f"{unreadable}|t0": "5000",
        f"{far}|t0": "5000",
    })
    cases = ["nan", "-5000", "1e300", "inf", "abc", "9" * 40]
    a = decider(link, "a" * 16)
    for bad in cases:
        await link.client.hset(PENDING, f"{peer}|t0", bad)
        assert await a.decide(two()) == 0, bad  # as if nothing were claimed there
        await link.client.hdel(PENDING, f"{'a' * 16}|t0")
        a.ledger.claimed.clear()
    # A readable claim does move the pick: the garbage above was ignored, not the peer.
    await link.client.hset(PENDING, f"{peer}|t0", "5000")
    assert await a.decide(two()) == 1
    # The unreadable live entry is gone; its claims with it.
    assert not await link.client.hexists(LIVE, unreadable)
    assert not await link.client.hexists(PENDING, f"{unreadable}|t0")


async def test_too_many_live_entries_are_refused_not_read(link: RedisLink) -> None:
    await link.client.hset(LIVE, mapping={f"r{i:015d}": "1" for i in range(MAX_LIVE + 1)})
    a = decider(link, "a" * 16)
    assert await a.decide(two()) is None
    assert outcome(a, "local", "bad_state") == 1.0


async def test_a_killed_replicas_claims_expire(link: RedisLink) -> None:
    killed, b = decider(link, "k" * 16, ttl_s=3.0), decider(link, "b" * 16, ttl_s=3.0)
    assert await killed.decide(two(tokens=1e6)) == 0
    assert await b.decide(two(tokens=0.0)) == 1  # the claim at t0 counts
    # The killed replica renews nothing from now on: its claims stop counting by themselves.
    async with asyncio.timeout(15):
        while await b.decide(two(tokens=0.0)) != 0:  # noqa: ASYNC110 - polls the decision
            await asyncio.sleep(0.05)
    assert await b.decide(two(tokens=0.0)) == 0
    assert not await link.client.hexists(PENDING, f"{'k' * 16}|t0")
    assert not await link.client.hexists(LIVE, "k" * 16)


async def test_a_flushed_script_is_loaded_again(link: RedisLink) -> None:
    a = decider(link, "a" * 16)
    assert await a.decide(two()) == 0
    await link.client.script_flush()
    assert await a.decide(two()) is not None
    assert outcome(a, "shared") == 2.0


async def test_a_late_answer_still_reaches_the_ledger(link: RedisLink) -> None:
    a = decider(link, "a" * 16)
    a.timeout_s = 1e-9  # the request stops waiting at once; the call runs on
    assert await a.decide(two(tokens=2000.0)) is None
    assert outcome(a, "local", "timeout") == 1.0
    for _ in range(100):
        if a.ledger.claimed:
            break
        await asyncio.sleep(0.02)
    assert a.ledger.claimed == {"t0": 2000.0} and not a.ledger.dirty
    assert float(await link.client.hget(PENDING, f"{'a' * 16}|t0")) == 2000.0


class _State:
    def __init__(self, name: str, tokens: float) -> None:
        self.name = name
        self.backlog = Backlog(tokens, 1.0 if tokens else 0.0, 0.0)


async def test_claims_follow_the_backlog_each_round(link: RedisLink) -> None:
    a = decider(link, "a" * 16)
    assert await a.decide(two(tokens=2000.0)) == 0
    assert float(await link.client.hget(PENDING, f"{'a' * 16}|t0")) == 2000.0
    # The request had its first byte; another was sent to t1 without a decision.
    await a.refresh([_State("t0", 0.0), _State("t1", 700.0)])
    assert await link.client.hget(PENDING, f"{'a' * 16}|t0") is None
    assert float(await link.client.hget(PENDING, f"{'a' * 16}|t1")) == 700.0
    assert a.ledger.claimed == {"t1": 700.0}


async def test_an_unsure_store_is_set_absolutely(link: RedisLink) -> None:
    a = decider(link, "a" * 16)
    await link.client.hset(PENDING, f"{'a' * 16}|t0", "123456")  # a claim whose answer was lost
    a.ledger.lost()
    await a.refresh([_State("t0", 10.0)])
    assert float(await link.client.hget(PENDING, f"{'a' * 16}|t0")) == 10.0
    assert not a.ledger.dirty


# --- replicas ----------------------------------------------------------------------------------


@pytest.fixture
async def cluster() -> AsyncIterator[SimCluster]:
    c = await start_cluster([sim(f"t{i}", seed=i) for i in range(4)], host="127.0.0.1", port=0)
    try:
        yield c
    finally:
        await c.close()


Replicas = Callable[..., Awaitable[list[ProxyServer]]]


@pytest.fixture
async def replicas(cluster: SimCluster) -> AsyncIterator[Replicas]:
    started: list[ProxyServer] = []

    async def make(redis_url: str, n: int = 2, **sharing: Any) -> list[ProxyServer]:
        cfg: Config = proxy_config(cluster.urls, [e.name for e in cluster.engines], [MODEL] * 4)
        # A round every second: what the replicas decide within one cannot be seen through the
        # asynchronous sharing, only through the decisions themselves.
        base = {"interval_s": 1.0, "ttl_s": 10.0, "spread": False, "decision_timeout_s": 1.0}
        cfg = dataclasses.replace(cfg, sharing=SharingConfig(**{**base, **sharing}))
        door = door_config(redis_url=redis_url, redis={"retry_after_failure_s": 0.3})
        for _ in range(n):
            server = ProxyServer(cfg, build_app(cfg, door=door))
            await server.start()
            started.append(server)
        return started[-n:]

    yield make
    for server in started:
        await server.stop()


async def wait_for(check: Callable[[], Awaitable[bool]], timeout_s: float = 8.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not await check():  # noqa: ASYNC110 (polled over HTTP, no event to wait on)
            await asyncio.sleep(0.05)


async def _peers(http: aiohttp.ClientSession, server: ProxyServer) -> bool:
    return await scrape(http, server.url + "/metrics", "kvproxy_sharing_peers") >= 1.0


def _body(i: int) -> dict[str, Any]:
    words = " ".join(f"burst{i} document {j}" for j in range(1200))
    return {"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": 8}


async def _burst(http: aiohttp.ClientSession, servers: list[ProxyServer]) -> dict[str, int]:
    sent = [http.post(s.url + "/v1/chat/completions", json=_body(i))
            for i, s in enumerate(servers * 2)]
    used: dict[str, int] = {}
    for resp in await asyncio.gather(*sent):
        assert resp.status == 200, await resp.text()
        used[resp.headers["X-Engine"]] = used.get(resp.headers["X-Engine"], 0) + 1
        resp.release()
    return used


async def _hold_first_bytes(http: aiohttp.ClientSession, cluster: SimCluster) -> None:
    # No first byte for a second: the burst's prompts all wait to be computed at once (the
    # simulated engines would otherwise answer one before the client has sent the next).
    for url in cluster.urls:
        async with http.post(url + "/admin/faults", json={"header_delay_s": 1.0}) as r:
            assert r.status == 200


async def test_a_burst_at_two_replicas_spreads_as_one_router_would(
    replicas: Replicas, redis_server: RedisServer, cluster: SimCluster
) -> None:
    servers = await replicas(redis_server.url)
    async with aiohttp.ClientSession(headers=AUTH) as http:
        for server in servers:
            await wait_for(lambda s=server: _peers(http, s))
        await _hold_first_bytes(http, cluster)
        used = await _burst(http, servers)
        shared = [await scrape(http, s.url + "/metrics", "kvproxy_shared_decisions_total",
                               outcome="shared") for s in servers]
        local = [await scrape(http, s.url + "/metrics", "kvproxy_shared_decisions_total",
                              outcome="local") for s in servers]
    # Four requests at one instant, two per replica, four idle engines: one each.
    assert used == {f"t{i}": 1 for i in range(4)}, (used, shared, local)
    assert shared == [2.0, 2.0]


async def test_a_replica_alone_makes_no_redis_call_on_the_request_path(
    replicas: Replicas, redis_server: RedisServer
) -> None:
    (server,) = await replicas(redis_server.url, n=1)
    async with aiohttp.ClientSession(headers=AUTH) as http:
        await asyncio.sleep(1.2)  # a sharing round has run: Redis is up, no peer heard
        for i in range(3):
            async with http.post(server.url + "/v1/chat/completions", json=_body(i)) as resp:
                assert resp.status == 200, await resp.text()
        calls = await scrape(http, server.url + "/metrics", "kvproxy_shared_decision_seconds_count")
        decided = await scrape(http, server.url + "/metrics", "kvproxy_shared_decisions_total")
    assert calls == 0.0 and decided == 0.0


async def test_redis_stopping_mid_run_falls_back_to_local_decisions(
    replicas: Replicas, redis_factory: RedisFactory
) -> None:
    redis = redis_factory.start()
    servers = await replicas(redis.url)
    a = servers[0]
    async with aiohttp.ClientSession(headers=AUTH) as http:
        for server in servers:
            await wait_for(lambda s=server: _peers(http, s))
        async with http.post(a.url + "/v1/chat/completions", json=_body(0)) as resp:
            assert resp.status == 200
        redis.stop()
        for i in range(1, 4):  # the peer's figures hold for ttl_s: it still counts as live
            async with http.post(a.url + "/v1/chat/completions", json=_body(i)) as resp:
                assert resp.status == 200, await resp.text()
        metrics = a.url + "/metrics"
        shared = await scrape(http, metrics, "kvproxy_shared_decisions_total", outcome="shared")
        local = await scrape(http, metrics, "kvproxy_shared_decisions_total", outcome="local")
    assert shared == 1.0
    assert local == 3.0


@pytest.mark.parametrize("broken", [PENDING, LIVE])
async def test_a_claims_key_of_another_type_is_cleared_not_kept_alive(
    link: RedisLink, broken: str
) -> None:
    # Someone wrote a string where a claims hash lives: the next script clears it and decides,
    # instead of failing on it for as long as the replicas keep renewing it.
    await link.client.set(broken, "not a hash", px=60_000)
    a = decider(link, "a" * 16)
    assert await a.decide(two()) is not None
    assert await link.client.type(broken) in (b"hash", b"none")
