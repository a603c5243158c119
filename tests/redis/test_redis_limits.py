"""Per-tenant limits through the request gate, in Redis and in-process."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry
from redisproc import SLOW_OK, RedisFactory, RedisServer

from proxy.core.door_config import LimitsConfig, RedisConfig
from proxy.core.errors import RateLimited
from proxy.core.limit_rules import Limits, LocalLimits, retry_after_header
from proxy.tenancy.hub import BusDown
from proxy.tenancy.ratelimit import RedisLimits, RequestGate
from proxy.tenancy.redis_link import RedisLink
from proxy.tenancy.shared_routing import _CHECK_AFTER_EMPTY, RedisStreamBus


def gate_cfg(**limits: int) -> LimitsConfig:
    return LimitsConfig(enabled=True, **limits)


async def admit_all(gates: list[RequestGate], tenant: str, n: int) -> tuple[int, list[RateLimited]]:
    async def one(i: int) -> RateLimited | None:
        try:
            await gates[i % len(gates)].admit(tenant)
        except RateLimited as exc:
            return exc
        return None

    results = await asyncio.gather(*(one(i) for i in range(n)))
    refused = [r for r in results if r is not None]
    return n - len(refused), refused


async def test_requests_per_minute_hold_across_replicas(redis_server: RedisServer) -> None:
    links = [RedisLink(RedisConfig(url=redis_server.url, **SLOW_OK)) for _ in range(2)]
    gates = [RequestGate(gate_cfg(requests_per_min=10), lk) for lk in links]
    try:
        admitted, refused = await admit_all(gates, "acme", 30)
        assert admitted == 10
        assert {r.code for r in refused} == {"requests_per_min"}
        assert all(int(r.headers()["Retry-After"]) >= 1 for r in refused)
        assert refused[0].status == 429
        # Another tenant is unaffected.
        await gates[0].admit("other")
    finally:
        for lk in links:
            await lk.close()


async def test_concurrent_streams_across_replicas(redis_server: RedisServer) -> None:
    links = [RedisLink(RedisConfig(url=redis_server.url, **SLOW_OK)) for _ in range(2)]
    gates = [RequestGate(gate_cfg(concurrent_streams=3), lk) for lk in links]
    try:
        leases = [await gates[i % 2].admit("acme") for i in range(3)]
        with pytest.raises(RateLimited) as exc:
            await gates[1].admit("acme")
        assert exc.value.code == "concurrent_streams"
        assert leases[0].pending
        await leases[0].settle(0)
        assert not leases[0].pending
        await leases[0].settle(0)  # idempotent
        lease = await gates[1].admit("acme")
        assert gates[1].open_leases == 2 and gates[0].open_leases == 1
        await lease.settle(0)
    finally:
        for lk in links:
            await lk.close()


async def test_tokens_per_minute_debt(redis_server: RedisServer) -> None:
    link = RedisLink(RedisConfig(url=redis_server.url, **SLOW_OK))
    registry = CollectorRegistry()
    gate = RequestGate(gate_cfg(tokens_per_min=1000), link, registry=registry)
    try:
        lease = await gate.admit("acme")
        await lease.settle(5000)
        with pytest.raises(RateLimited) as exc:
            await gate.admit("acme")
        assert exc.value.code == "tokens_per_min"
        # 4001 tokens of debt at 1000/min: about 4 minutes.
        assert 230 <= exc.value.retry_after_s <= 242
        sample = registry.get_sample_value(
            "kvproxy_ratelimit_rejections_total", {"tenant": "acme", "limit": "tokens_per_min"}
        )
        assert sample == 1
    finally:
        await link.close()


async def test_lua_and_local_arithmetic_agree(redis_server: RedisServer) -> None:
    link = RedisLink(RedisConfig(url=redis_server.url, **SLOW_OK))
    store = RedisLimits(link)
    local = LocalLimits(lambda: 0.0)  # no time passes locally; Redis' clock moves by microseconds
    limits = Limits(requests_per_min=5, tokens_per_min=100, concurrent_streams=4)
    try:
        for i in range(8):
            lease_id = f"l{i}"
            remote = await store.admit("t", limits, lease_id, 30)
            here = local.admit("t", limits, lease_id, 30)
            assert (remote.allowed, remote.limit) == (here.allowed, here.limit), i
            assert remote.retry_after_s == pytest.approx(here.retry_after_s, abs=0.01)
            if i in (1, 3):
                await store.settle("t", limits, lease_id, 60)
                local.settle("t", limits, lease_id, 60)
    finally:
        await link.close()


async def test_leases_of_a_dead_replica_expire(redis_server: RedisServer) -> None:
    link = RedisLink(RedisConfig(url=redis_server.url, **SLOW_OK))
    cfg = LimitsConfig(enabled=True, concurrent_streams=1, lease_ttl_s=3)
    dead, alive = RequestGate(cfg, link), RequestGate(cfg, link)
    try:
        await dead.admit("acme")  # never settled, never renewed
        with pytest.raises(RateLimited):
            await alive.admit("acme")
        # Renewal keeps a live lease; expiry frees a dead one (fast-forward Redis' view of it).
        zset = link.tenant_key("acme", "streams")
        members = await link.client.zrange(zset, 0, -1, withscores=True)
        await link.client.zadd(zset, {members[0][0]: 1.0})
        lease = await alive.admit("acme")
        score_before = (await link.client.zrange(zset, 0, -1, withscores=True))[0][1]
        await asyncio.sleep(0.01)
        await alive.renew()
        score_after = (await link.client.zrange(zset, 0, -1, withscores=True))[0][1]
        assert score_after > score_before
        await lease.settle(0)
    finally:
        await link.close()


async def test_redis_down_falls_back_to_local_limits(redis_factory: RedisFactory) -> None:
    server = redis_factory.start()
    registry = CollectorRegistry()
    link = RedisLink(RedisConfig(url=server.url, **SLOW_OK))
    gate = RequestGate(gate_cfg(requests_per_min=3), link, registry=registry)
    try:
        lease = await gate.admit("acme")
        server.stop()
        await lease.settle(10)  # settle falls back too, without an error
        admitted, refused = await admit_all([gate], "acme", 5)
        assert admitted == 3 and len(refused) == 2  # limits now hold per replica
        fallbacks = registry.get_sample_value("kvproxy_ratelimit_fallbacks_total", {"op": "admit"})
        assert fallbacks is not None and fallbacks >= 1
    finally:
        await link.close()


async def test_disabled_or_unlimited_costs_nothing() -> None:
    gate = RequestGate(LimitsConfig(enabled=False, requests_per_min=1))
    for _ in range(5):
        await (await gate.admit("acme")).settle(100)
    gate = RequestGate(LimitsConfig(enabled=True))
    lease = await gate.admit("acme")
    assert gate.open_leases == 0
    await lease.settle(1)


async def test_renewer_task_lifecycle() -> None:
    # Started, it renews the open leases every third of their time to live; closed, it is gone.
    gate = RequestGate(LimitsConfig(enabled=True, concurrent_streams=1, lease_ttl_s=3))
    renewals = 0
    renew = gate.renew

    async def counted() -> None:
        nonlocal renewals
        renewals += 1
        await renew()

    gate.renew = counted  # type: ignore[method-assign]
    gate.start()
    lease = await gate.admit("acme")
    await asyncio.sleep(1.3)  # one renewal a second at a 3 s lease
    assert renewals >= 1
    assert any(t.get_name() == "kvproxy-lease-renewer" for t in asyncio.all_tasks())
    await gate.close()
    assert not any(t.get_name() == "kvproxy-lease-renewer" for t in asyncio.all_tasks())
    await lease.settle(0)


async def test_unlimited_traffic_has_no_lease_to_settle() -> None:
    # Limits off (the default): the front door skips settling, and its shield, entirely.
    lease = await RequestGate(LimitsConfig(), None).admit("acme")
    assert not lease.pending
    unlimited = await RequestGate(gate_cfg(), None).admit("acme")  # on, but every limit 0
    assert not unlimited.pending


@pytest.mark.parametrize(("level", "updated"), [
    ("-inf", "now"), ("inf", "now"), ("nan", "now"), ("-inf", "1"), ("0.5", "1e300"),
    # A finite debt is a bucket's state, kept to an hour of refill: an old one is paid back.
    ("-1e300", "1"),
])
async def test_a_tampered_bucket_is_forgotten_not_a_500_nor_a_refusal_for_ever(
    redis_server: RedisServer, level: str, updated: str,
) -> None:
    # Whatever another process wrote into a tenant's bucket, the gate answers: the bucket is
    # read as full (a value no script of the proxy writes), never as an endless wait. Updated
    # "now": no refill since could pay a debt back (one written in 1970 would be refilled).
    link = RedisLink(RedisConfig(url=redis_server.url, **SLOW_OK))
    gate = RequestGate(gate_cfg(requests_per_min=60, tokens_per_min=1000), link)
    stamp = str(time.time()) if updated == "now" else updated
    try:
        for name in ("requests", "tokens"):
            await link.client.hset(link.tenant_key("acme", name),
                                   mapping={"level": level, "updated": stamp})
        lease = await gate.admit("acme")
        await lease.settle(10)
    finally:
        await link.close()


def test_retry_after_stays_a_header_a_client_can_use() -> None:
    assert retry_after_header(float("inf")) == 1 and retry_after_header(float("nan")) == 1
    assert retry_after_header(1e300) == 3600 and retry_after_header(-5.0) == 1


async def test_one_key_of_the_wrong_type_fails_only_its_own_operation(
    redis_server: RedisServer,
) -> None:
    # Someone wrote a string where acme's bucket hash lives: acme's limits fall back to this
    # replica, and Redis stays in use for every other tenant and feature (no link-wide back-off).
    link = RedisLink(RedisConfig(url=redis_server.url, **SLOW_OK))
    registry = CollectorRegistry()
    gate = RequestGate(gate_cfg(requests_per_min=60), link, registry=registry)
    try:
        await link.client.set(link.tenant_key("acme", "requests"), "garbage")
        for _ in range(3):
            await (await gate.admit("acme")).settle(0)
        assert link.available
        assert registry.get_sample_value("kvproxy_ratelimit_fallbacks_total", {"op": "admit"}) == 3
        await (await gate.admit("other")).settle(0)
        assert await link.client.exists(link.tenant_key("other", "requests"))
        errors = link.metrics.errors.labels("limits_admit", "refused")._value.get()
        assert errors == 3
    finally:
        await link.close()


@pytest.fixture
async def stream_link(redis_server: RedisServer) -> AsyncIterator[RedisLink]:
    """A link for the routing stream's tests (its key: ``link.key("routing")``)."""
    link = RedisLink(RedisConfig(url=redis_server.url, **SLOW_OK))
    yield link
    await link.close()


async def test_a_routing_stream_that_cannot_take_an_append_is_not_kept_alive(
    stream_link: RedisLink,
) -> None:
    # The stream's key holds another type: the publish fails, and does not renew the key's
    # lifetime, so it expires and the next replica to publish starts a fresh stream.
    link, key = stream_link, stream_link.key("routing")
    bus = RedisStreamBus(link, maxlen=100, ttl_s=30.0)
    await link.client.set(key, "not a stream", px=400)
    with contextlib.suppress(BusDown):
        await bus.publish(b"x")
    assert 0 < await link.client.pttl(key) <= 400
    await asyncio.sleep(0.5)
    await bus.publish(b"y")
    assert await link.client.xlen(key) == 1 and await link.client.pttl(key) > 29_000


async def test_a_reader_follows_a_stream_made_anew_behind_its_cursor(
    stream_link: RedisLink,
) -> None:
    # An entry far in the future moved every reader's cursor there; the key then went. Without
    # following the stream back, the replicas would never hear each other again.
    link, key = stream_link, stream_link.key("routing")
    reader = RedisStreamBus(link, maxlen=100, ttl_s=30.0)
    writer = RedisStreamBus(link, maxlen=100, ttl_s=30.0)
    await link.client.xadd(key, {"m": b"junk"}, id="99999999999999-0")
    assert await reader.fetch() == []  # the cursor starts at the newest: the junk
    await link.client.delete(key)
    await writer.publish(b"hello")
    heard: list[bytes] = []
    for _ in range(_CHECK_AFTER_EMPTY + 2):
        heard += await reader.fetch()
        if heard:
            break
    await writer.publish(b"again")
    heard += await reader.fetch()
    assert heard == [b"again"]


async def test_a_debt_at_its_floor_is_decided_in_redis_and_waits_at_most_an_hour(
    redis_server: RedisServer,
) -> None:
    link = RedisLink(RedisConfig(url=redis_server.url, **SLOW_OK))
    registry = CollectorRegistry()
    gate = RequestGate(gate_cfg(tokens_per_min=10), link, registry=registry)
    try:
        lease = await gate.admit("acme")
        await lease.settle(1010)  # past the hour of refill a debt is kept to
        for _ in range(3):
            with pytest.raises(RateLimited) as exc:
                await gate.admit("acme")
            assert exc.value.code == "tokens_per_min"
            assert 3590 <= exc.value.retry_after_s <= 3600
        fallbacks = registry.get_sample_value("kvproxy_ratelimit_fallbacks_total",
                                              {"op": "admit"})
        assert not fallbacks  # Redis answered every time: the verdicts are shared ones
    finally:
        await link.close()


async def test_rejections_are_counted_under_the_bounded_tenant_label() -> None:
    registry = CollectorRegistry()
    gate = RequestGate(gate_cfg(requests_per_min=1), registry=registry)
    gate.tenant_label = lambda tenant: tenant if tenant == "acme" else "other"
    for tenant in ("acme", "t1", "t2", "t3"):
        await gate.admit(tenant)
        with pytest.raises(RateLimited):
            await gate.admit(tenant)
    def rejected(tenant: str) -> float | None:
        return registry.get_sample_value("kvproxy_ratelimit_rejections_total",
                                         {"tenant": tenant, "limit": "requests_per_min"})
    assert rejected("acme") == 1 and rejected("other") == 3 and rejected("t1") is None
