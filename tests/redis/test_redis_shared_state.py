"""Breaker openings shared across replicas, and the engine registry."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from redisproc import SLOW_OK, RedisFactory, RedisServer

from engine_sidecar.vllm import registry as sidecar_registry
from proxy.core.breaker import Breaker, BreakerState, Outcome
from proxy.core.config import BreakerConfig
from proxy.core.door_config import RedisConfig
from proxy.core.fleet_config import EngineConfig
from proxy.tenancy.redis_link import RedisLink, RedisUnavailable
from proxy.tenancy.registry_index import INDEX, MAX_RECORDS, IndexedReader, scan_keys
from proxy.tenancy.shared_state import (
    EngineRecord,
    RegistrySync,
    RegistryWatcher,
    SharedBreakers,
    deregister_engine,
    heartbeat_engine,
    list_engines,
    read_registry,
    record_key,
    register_engine,
    trip,
)

CFG = BreakerConfig(failure_threshold=3, open_s=5.0)


@dataclass
class FakeEngine:
    name: str
    breaker: Breaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_trip_opens_from_any_state() -> None:
    breaker = Breaker(CFG)
    trip(breaker, 1.0)
    assert breaker.state is BreakerState.OPEN and breaker.opened_at == 1.0
    trip(breaker, 2.0)  # already open: unchanged
    assert breaker.opened_at == 1.0
    assert breaker.allows(1.0 + CFG.open_s)  # half-open probe
    trip(breaker, 7.0)
    assert breaker.state is BreakerState.OPEN and breaker.opened_at == 7.0


async def test_breaker_opening_reaches_other_replicas(redis_server: RedisServer) -> None:
    clock = Clock()
    replicas = []
    links = [RedisLink(RedisConfig(url=redis_server.url, **SLOW_OK)) for _ in range(3)]
    for lk in links:
        engines = [FakeEngine("e0", Breaker(CFG)), FakeEngine("e1", Breaker(CFG))]
        shared = SharedBreakers(lk, lambda e=engines: e, open_s=CFG.open_s, clock=clock)
        replicas.append((engines, shared))
    try:
        a_engines = replicas[0][0]
        for _ in range(CFG.failure_threshold):
            a_engines[1].breaker.record(Outcome.FAILURE, clock.now)
        for _, shared in replicas:
            await shared.sync()
        for _, shared in replicas:
            await shared.sync()  # a second round must not echo anything
        states = [[e.breaker.state for e in engines] for engines, _ in replicas]
        assert states == [[BreakerState.CLOSED, BreakerState.OPEN]] * 3
        assert [s.published for _, s in replicas] == [1, 0, 0]
        assert [s.applied for _, s in replicas] == [0, 1, 1]
        ttl = await links[0].client.pttl(links[0].key("breaker", "e1"))
        assert 0 < ttl <= CFG.open_s * 1000
    finally:
        for lk in links:
            await lk.close()


async def test_breaker_polling_loop_carries_an_opening_to_another_replica(
    redis_server: RedisServer,
) -> None:
    links = [RedisLink(RedisConfig(url=redis_server.url, **SLOW_OK)) for _ in range(2)]
    loop = asyncio.get_running_loop()
    a = [FakeEngine("e0", Breaker(CFG))]
    b = [FakeEngine("e0", Breaker(CFG))]
    sa = SharedBreakers(links[0], lambda: a, open_s=CFG.open_s, clock=loop.time)
    sb = SharedBreakers(links[1], lambda: b, open_s=CFG.open_s, clock=loop.time)
    tasks = [
        asyncio.create_task(s.run(), name=f"shared-breakers-{i}") for i, s in enumerate((sa, sb))
    ]
    try:
        trip(a[0].breaker, loop.time())
        # The loops run on their own: b's breaker opens only if a's opening reaches it.
        async with asyncio.timeout(10.0):
            while b[0].breaker.state is not BreakerState.OPEN:  # noqa: ASYNC110 - polled state
                await asyncio.sleep(0.02)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for lk in links:
            await lk.close()


async def test_registry_heartbeat_and_expiry(redis_server: RedisServer) -> None:
    link = RedisLink(RedisConfig(url=redis_server.url, **SLOW_OK))
    seen: list[list[str]] = []
    watcher = RegistryWatcher(link, lambda records: seen.append([r.name for r in records]),
                              empty_grace_s=0.0)
    record = EngineRecord("t0", "target", "llama", "http://127.0.0.1:9000")
    stop = asyncio.Event()
    try:
        # Beats every 2 s against a 6 s TTL: t0 stays registered throughout.
        beat = asyncio.create_task(heartbeat_engine(link, record, ttl_s=6, stop=stop))
        async with asyncio.timeout(10.0):
            while await list_engines(link) != [record]:  # noqa: ASYNC110 - polled Redis
                await asyncio.sleep(0.02)
        short = EngineRecord("t1", "target", "llama", "http://h:1")
        await register_engine(link, short, ttl_s=2.0)
        await watcher.poll()
        # t1 never beats: its record expires by its TTL alone (each poll reports changes only).
        async with asyncio.timeout(10.0):
            while seen[-1] != ["t0"]:
                await asyncio.sleep(0.05)
                await watcher.poll()
        await watcher.poll()  # unchanged: no call
        stop.set()
        await beat  # deregisters on the way out
        await watcher.poll()
        assert seen == [["t0", "t1"], ["t0"], []]
        await link.client.set(link.key("engine", "junk"), b"not json")
        assert await list_engines(link) == []
    finally:
        await link.close()


async def test_an_empty_registry_on_a_restarted_redis_is_believed_only_after_its_grace(
    redis_factory: RedisFactory,
) -> None:
    # A Redis restarted empty reads like every sidecar gone, until the sidecars renew; the same
    # server reading empty means they did go.
    server = redis_factory.start()
    link = RedisLink(RedisConfig(url=server.url, **SLOW_OK))
    now, seen = [0.0], []
    watcher = RegistryWatcher(link, lambda records: seen.append([r.name for r in records]),
                              empty_grace_s=10.0, clock=lambda: now[0])
    record = EngineRecord("g0", "target", "llama", "http://127.0.0.1:9100")
    try:
        await register_engine(link, record, ttl_s=30)
        await watcher.poll()
        server.stop()
        server.start()  # restarted, empty
        for t in (0.5, 9.0):
            now[0] = t
            await _poll_through_reconnect(watcher, link)
        assert seen == [["g0"]]  # held
        await register_engine(link, record, ttl_s=30)  # the sidecar renews its key
        now[0] = 12.0
        await watcher.poll()
        assert seen == [["g0"]]  # never dropped
        await deregister_engine(link, record)  # the sidecar leaves: the same server, believed
        now[0] = 12.5
        await watcher.poll()
        assert seen == [["g0"], []]
        await register_engine(link, record, ttl_s=30)
        now[0] = 13.0
        await watcher.poll()
        server.stop()
        server.start()
        now[0] = 14.0
        await _poll_through_reconnect(watcher, link)
        now[0] = 24.5  # nobody renewed within the grace: believed
        await watcher.poll()
        assert seen == [["g0"], [], ["g0"], []]
    finally:
        await link.close()


async def _poll_through_reconnect(watcher: RegistryWatcher, link: RedisLink) -> None:
    """Poll once the link reads again (it may be in its back-off after the restart)."""
    for _ in range(100):
        try:
            await read_registry(link)
            break
        except RedisUnavailable:
            await asyncio.sleep(0.05)
    await watcher.poll()


async def test_registry_reads_the_vllm_sidecar_heartbeat(redis_server: RedisServer) -> None:
    link = RedisLink(RedisConfig(url=redis_server.url, **SLOW_OK))
    try:
        doc = {"profile": "target-70b", "role": "target", "model": "llama-70b",
               "engine_url": "http://10.0.0.5:8000", "ready": True, "draining": False}  # fmt: skip
        # The key and document the vLLM sidecar writes (engine_sidecar/vllm/registry.py).
        await link.client.set("kvproxy:engine:target:http://10.0.0.5:8000", orjson.dumps(doc))
        (record,) = await list_engines(link)
        assert (record.pool, record.model, record.url) == ("target", "llama-70b", doc["engine_url"])
        assert record.name == "target@10.0.0.5:8000" and record.ready and not record.draining
    finally:
        await link.close()


class FakeFleet:
    def __init__(self, names: list[str]) -> None:
        self.engines: dict[str, tuple[str, str]] = {n: ("target", "static") for n in names}

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter([FakeEngine(n, Breaker(CFG)) for n in self.engines])

    def add(self, pool: str, engine: EngineConfig) -> None:
        assert engine.name not in self.engines
        self.engines[engine.name] = (pool, engine.url)

    def remove(self, name: str) -> None:
        del self.engines[name]


def test_registry_sync_adds_and_removes_discovered_engines_only() -> None:
    fleet = FakeFleet(["t0"])
    sync = RegistrySync(fleet, {"target": "llama", "draft": "tiny"})
    r1 = EngineRecord("t1", "target", "llama", "http://h:1")
    sync(
        [
            EngineRecord("t0", "target", "llama", "http://elsewhere:1"),  # a configured name
            r1,
            EngineRecord("d1", "draft", "tiny", "http://h:2", ready=False),
            EngineRecord("x1", "target", "other-model", "http://h:3"),
            EngineRecord("bad", "target", "llama", "ftp://h:4"),
        ]
    )
    assert fleet.engines == {"t0": ("target", "static"), "t1": ("target", "http://h:1")}
    sync([EngineRecord("t1", "target", "llama", "http://h:9")])  # moved: replaced
    assert fleet.engines["t1"] == ("target", "http://h:9")
    sync([EngineRecord("t1", "target", "llama", "http://h:9", draining=True)])
    assert fleet.engines == {"t0": ("target", "static")}
    sync([])
    assert fleet.engines == {"t0": ("target", "static")}


def test_a_record_whose_fields_are_not_plain_names_is_not_a_record() -> None:
    # Its name becomes a header value, a metric label, a log line and what replicas exchange.
    def doc(**fields: object) -> bytes:
        base = {"name": "target@10.0.0.5:8000", "role": "target", "model": "meta/llama-3.1",
                "engine_url": "http://10.0.0.5:8000"}
        return orjson.dumps(base | fields)

    assert EngineRecord.decode(doc()) is not None
    assert EngineRecord.decode(doc(name=None, engine_url="http://[::1]:8000")) is not None
    for bad in ({"name": "bad\r\nX-Evil: 1"}, {"name": "x" * 300}, {"name": {"x": 1}},
                {"name": "a b"}, {"role": "no such\npool"}, {"model": "m\x00"},
                {"engine_url": "http://h:1/\r\n"}, {"metrics_url": "http://h:1/\nx"}):
        assert EngineRecord.decode(doc(**bad)) is None, bad


def test_a_tenant_name_with_a_newline_after_it_is_not_a_name() -> None:
    from proxy.core.door_config import TENANT_NAME  # noqa: PLC0415

    assert TENANT_NAME.match("acme") and not TENANT_NAME.match("acme\n")


def test_a_record_no_pool_can_take_is_named_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    # A sidecar set up with the wrong model or pool name is not silently left out.
    sync = RegistrySync(FakeFleet([]), {"target": "llama"})
    with caplog.at_level(logging.WARNING, logger="kvproxy.shared"):
        sync([EngineRecord("x1", "target", "Llama", "http://h:3"),
              EngineRecord("x2", "targets", "llama", "http://h:4")])
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "ignoring registered engine 'x1': it serves 'Llama', the target pool 'llama'",
        "ignoring registered engine 'x2': no pool 'targets' is configured",
    ]


def _counting(link: RedisLink, ops: list[str]) -> Any:
    async def run(op: str, call: Any) -> Any:
        ops.append(op)
        return await link.run(op, call)

    return run


async def test_the_registry_is_read_through_its_index_not_by_walking_the_keyspace(
    redis_factory: RedisFactory,
) -> None:
    # The response cache's keys share the database: a walk of it per read would not scale.
    server = redis_factory.start()
    link = RedisLink(RedisConfig(url=server.url, **SLOW_OK))
    try:
        async with link.client.pipeline(transaction=False) as pipe:
            for i in range(20_000):
                pipe.set(f"kvproxy:cache:k{i}", b"x")
            await pipe.execute()
        first = EngineRecord("i0", "target", "llama", "http://127.0.0.1:9200")
        await register_engine(link, first, ttl_s=30)
        reader, ops = IndexedReader(scan_every=1000), []
        index, pattern = link.key(INDEX), link.key("engine", "*")
        assert await reader.live_keys(_counting(link, ops), index, pattern) == [
            b"kvproxy:engine:target:http://127.0.0.1:9200"]
        assert "registry_scan" in ops  # the first read walks once (writers without the index)
        ops.clear()
        second = EngineRecord("i1", "target", "llama", "http://127.0.0.1:9201")
        await register_engine(link, second, ttl_s=30)
        assert len(await reader.live_keys(_counting(link, ops), index, pattern)) == 2
        await deregister_engine(link, first)  # its key stays in the walk's set, valueless
        assert await link.client.zscore(index, record_key(link, "target", first.url)) is None
        records, _ = await read_registry(link, reader)
        assert [r.name for r in records] == ["i1"]
        assert "registry_scan" not in ops  # not one walk after the first
    finally:
        await link.close()


async def test_records_written_without_the_index_are_found_by_the_walks(
    redis_server: RedisServer,
) -> None:
    link = RedisLink(RedisConfig(url=redis_server.url, **SLOW_OK))
    old = EngineRecord("o0", "target", "llama", "http://127.0.0.1:9300")
    new = EngineRecord("n0", "target", "llama", "http://127.0.0.1:9301")
    old_key = link.key("engine", "target", old.url)
    try:
        await register_engine(link, new, ttl_s=30)
        await link.client.set(old_key, old.encode(), px=30_000)  # an older sidecar: no index
        reader = IndexedReader(scan_every=3)
        for _ in range(3):  # the walk of the first read is kept until the next walk
            names = [r.name for r in (await read_registry(link, reader))[0]]
            assert sorted(n for n in names if n in ("o0", "n0")) == ["n0", "o0"]
        await link.client.delete(old_key)  # it deregisters: gone at once, walk or not
        names = [r.name for r in (await read_registry(link, reader))[0]]
        assert "o0" not in names and "n0" in names
    finally:
        await deregister_engine(link, new)
        await link.client.delete(old_key)
        await link.close()


async def test_the_vllm_sidecars_heartbeat_enters_and_leaves_the_index(
    redis_server: RedisServer,
) -> None:
    link = RedisLink(RedisConfig(url=redis_server.url, **SLOW_OK))
    key = sidecar_registry.registry_key("target", "http://10.0.0.9:8000")
    doc = {"role": "target", "model": "llama", "engine_url": "http://10.0.0.9:8000",
           "ready": True, "draining": False}
    beat = asyncio.create_task(sidecar_registry.heartbeat(redis_server.url, key, lambda: doc, 30))
    try:
        for _ in range(100):
            if await link.client.zscore(sidecar_registry.INDEX_KEY, key) is not None:
                break
            await asyncio.sleep(0.02)
        records, _ = await read_registry(link, IndexedReader(scan_every=1000))
        assert "target@10.0.0.9:8000" in [r.name for r in records]
        beat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beat
        assert await link.client.zscore(sidecar_registry.INDEX_KEY, key) is None
        assert await link.client.exists(key) == 0
    finally:
        beat.cancel()
        await link.close()


async def test_a_flooded_registry_costs_a_bounded_read(redis_factory: RedisFactory) -> None:
    # Redis' contents are not trusted: an index and a keyspace flooded with registry keys give
    # a read of MAX_RECORDS keys from each, not all of them.
    server = redis_factory.start()
    link = RedisLink(RedisConfig(url=server.url, **SLOW_OK))
    index, pattern = link.key(INDEX), link.key("engine", "*")
    try:
        far = 2**50
        async with link.client.pipeline(transaction=False) as pipe:
            for i in range(3 * MAX_RECORDS):
                pipe.zadd(index, {f"kvproxy:engine:flood:{i}": far})
                pipe.set(f"kvproxy:engine:walk:{i}", b"{}")
            await pipe.execute()
        keys = await IndexedReader().live_keys(link.run, index, pattern)
        assert MAX_RECORDS <= len(keys) <= 2 * MAX_RECORDS
        assert len(await scan_keys(link.run, pattern)) == MAX_RECORDS
        records, _ = await read_registry(link)
        assert records == []  # none of them is a record
    finally:
        await link.close()
