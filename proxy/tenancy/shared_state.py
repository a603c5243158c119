"""State that proxy replicas share through Redis: breaker openings and the engine registry.

Rules:
- Breakers: when a replica's breaker for an engine opens, it writes a short-lived key (TTL = the
  breaker's ``open_s``) naming that opening. Every replica polls the keys of its engines every
  ``poll_s`` (default 0.25 s, so others follow within a second) and opens its own breaker for each
  opening it has not seen yet, by reporting failures to it through its ordinary ``record`` API. An
  opening applied from Redis is never published again, so replicas do not echo each other. Each
  replica still probes a half-open engine itself.
- Pressure (KV overcommit guard) is shared the same way, in ``proxy.tenancy.shared_pressure``.
- Registry: a sidecar writes its engine's record to ``<prefix>engine:<pool>:<url>`` with a TTL and
  renews it every third of the TTL (the vLLM sidecar's heartbeat writes the same key and fields).
  An engine that stops heartbeating disappears with its key; readers find the live ones by SCAN.
- Without Redis none of this runs; static config keeps working. Redis trouble skips a round, never
  changes a breaker, and never reaches a client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import orjson
from redis.exceptions import RedisError

from proxy.core.breaker import Breaker, BreakerState, Outcome
from proxy.core.errors import ConfigError
from proxy.core.fleet_config import POOL_NAME, EngineConfig
from proxy.core.jsondoc import json_object
from proxy.fleet.periodic import every
from proxy.tenancy.redis_link import RedisClient, RedisLink, RedisUnavailable
from proxy.tenancy.registry_index import DEREGISTER, INDEX, REGISTER, IndexedReader

log = logging.getLogger("kvproxy.shared")


class HasBreaker(Protocol):
    @property
    def name(self) -> str: ...

    breaker: Breaker


def trip(breaker: Breaker, now: float) -> None:
    """Open ``breaker`` as if it had seen enough failures itself (no-op when already open)."""
    breaker.peek(now)
    if breaker.state is BreakerState.HALF_OPEN:
        breaker.record(Outcome.FAILURE, now)
    while breaker.state is BreakerState.CLOSED:
        breaker.record(Outcome.FAILURE, now)


class SharedBreakers:
    """Publishes this replica's breaker openings and applies the other replicas' ones."""

    def __init__(
        self,
        link: RedisLink,
        engines: Callable[[], Iterable[HasBreaker]],
        *,
        open_s: float,
        clock: Callable[[], float],
        poll_s: float = 0.25,
    ) -> None:
        self._link = link
        self._engines = engines
        self._open_ms = max(1, int(open_s * 1000))
        self._clock = clock
        self.poll_s = poll_s
        self.replica = uuid.uuid4().hex[:12]
        self._seq = 0
        self._seen_open: dict[str, float] = {}  # engine -> opened_at already handled
        self._applied: set[bytes] = set()  # remote opening tokens already applied
        self.published = 0
        self.applied = 0

    def _key(self, engine: str) -> str:
        return self._link.key("breaker", engine)

    async def sync(self) -> None:
        """One round: publish new local openings, then apply remote ones."""
        engines = list(self._engines())
        try:
            await self._publish(engines)
            await self._apply(engines)
        except RedisUnavailable:
            return

    async def _publish(self, engines: list[HasBreaker]) -> None:
        now = self._clock()
        for engine in engines:
            breaker = engine.breaker
            breaker.peek(now)
            if breaker.state is not BreakerState.OPEN:
                continue
            if self._seen_open.get(engine.name) == breaker.opened_at:
                continue
            self._seen_open[engine.name] = breaker.opened_at
            self._seq += 1
            token = f"{self.replica}:{self._seq}".encode()
            self._applied.add(token)
            await self._set(self._key(engine.name), token)
            self.published += 1

    async def _set(self, key: str, token: bytes) -> None:
        px = self._open_ms
        await self._link.run("breaker_publish", lambda r: r.set(key, token, px=px))

    async def _apply(self, engines: list[HasBreaker]) -> None:
        if not engines:
            return
        keys = [self._key(e.name) for e in engines]
        values = await self._link.run("breaker_poll", lambda r: r.mget(keys))
        now = self._clock()
        for engine, token in zip(engines, values, strict=True):
            if not isinstance(token, bytes) or token in self._applied:
                continue
            self._applied.add(token)
            trip(engine.breaker, now)
            self._seen_open[engine.name] = engine.breaker.opened_at
            self.applied += 1
            log.info("breaker for engine %s opened by another replica", engine.name)
        if len(self._applied) > 10_000:
            self._applied = {v for v in values if isinstance(v, bytes)}

    async def run(self) -> None:
        """The polling loop; run it as one named task owned by the app."""
        await every(self.poll_s, self.sync, "sharing breaker state")


# --- engine registry ------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineRecord:
    """What a sidecar advertises: enough for a proxy to route to and scrape the engine."""

    name: str
    pool: str
    model: str
    url: str
    metrics_url: str | None = None
    ready: bool = True
    draining: bool = False

    def encode(self) -> bytes:
        # Field names shared with the vLLM sidecar's own heartbeat (role, engine_url).
        doc: dict[str, object] = {"name": self.name, "role": self.pool, "model": self.model}
        doc["engine_url"] = self.url
        doc |= {"metrics_url": self.metrics_url, "ready": self.ready, "draining": self.draining}
        return orjson.dumps(doc)

    @classmethod
    def decode(cls, raw: bytes) -> EngineRecord | None:
        doc = json_object(raw)
        if doc is None:
            return None
        pool, model, url = doc.get("role"), doc.get("model"), doc.get("engine_url")
        if not all(isinstance(v, str) and v for v in (pool, model, url)):
            return None
        name = doc.get("name") or f"{pool}@{str(url).split('://', 1)[-1]}"
        metrics_url = doc.get("metrics_url")
        if not isinstance(metrics_url, str):
            metrics_url = None
        # A record's fields become header values, metric labels, log lines and the names other
        # replicas exchange: what is not a short, plain name or URL is not a record.
        if not (isinstance(name, str) and _RECORD_NAME.fullmatch(name)
                and POOL_NAME.fullmatch(str(pool)) and _plain(str(model), 256)
                and _plain(str(url), 2048) and (metrics_url is None or _plain(metrics_url, 2048))):
            return None
        return cls(name, str(pool), str(model), str(url), metrics_url,
                   doc.get("ready") is not False, doc.get("draining") is True)  # fmt: skip


# An engine's name, as a sidecar advertises it (``pool@host:port`` by default, IPv6 included).
_RECORD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@\[\]-]{0,127}")


def _plain(value: str, limit: int) -> bool:
    """Printable, no spaces, at most ``limit`` characters."""
    return 0 < len(value) <= limit and value.isprintable() and " " not in value


def record_key(link: RedisLink, pool: str, url: str) -> str:
    """``<prefix>engine:<pool>:<url>``, the key the vLLM sidecar's heartbeat writes too."""
    return link.key("engine", pool, url)


async def register_engine(link: RedisLink, record: EngineRecord, ttl_s: float) -> None:
    """Write ``record`` with its TTL, and its key in the registry's index (``registry_index``)."""
    key, raw, px = record_key(link, record.pool, record.url), record.encode(), int(ttl_s * 1000)
    index = link.key(INDEX)
    await link.run("registry_write", lambda r: r.eval(REGISTER, 2, key, index, raw, max(1, px)))


async def deregister_engine(link: RedisLink, record: EngineRecord) -> None:
    key, index = record_key(link, record.pool, record.url), link.key(INDEX)
    await link.run("registry_delete", lambda r: r.eval(DEREGISTER, 2, key, index))


async def heartbeat_engine(
    link: RedisLink, record: EngineRecord, *, ttl_s: float, stop: asyncio.Event
) -> None:
    """The sidecar's side: keep ``record`` registered until ``stop`` is set, then remove it."""
    try:
        while not stop.is_set():
            try:
                await register_engine(link, record, ttl_s)
            except RedisUnavailable:
                log.warning("engine registry heartbeat for %s failed; retrying", record.name)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(ttl_s / 3):
                    await stop.wait()
    finally:
        # On failure the TTL removes the record soon enough.
        with contextlib.suppress(RedisUnavailable):
            await asyncio.shield(deregister_engine(link, record))


async def list_engines(link: RedisLink) -> list[EngineRecord]:
    """The engines registered now (expired heartbeats are simply gone), sorted by name."""
    return (await read_registry(link))[0]


async def read_registry(
    link: RedisLink, reader: IndexedReader | None = None
) -> tuple[list[EngineRecord], str | None]:
    """``list_engines`` (through ``reader``'s index and walks; a new one walks the keyspace), and
    the Redis server's ``run_id`` (new at each start: a restarted or failed-over server says so;
    None where the server does not tell)."""
    reader = IndexedReader() if reader is None else reader
    keys = await reader.live_keys(link.run, link.key(INDEX), link.key("engine", "*"))

    async def scan(r: RedisClient) -> tuple[list[bytes], str | None]:
        values = await r.mget(keys) if keys else []
        try:
            run_id = (await r.info("server")).get("run_id")
        except RedisError:  # a proxy or managed service that refuses INFO
            run_id = None
        return [v for v in values if isinstance(v, bytes)], run_id if isinstance(run_id, str) \
            else None

    values, run_id = await link.run("registry_read", scan)
    records = (EngineRecord.decode(v) for v in values)
    return sorted((r for r in records if r is not None), key=lambda r: r.name), run_id


class FleetLike(Protocol):
    """What registry discovery needs from the proxy's set of engines."""

    def __iter__(self) -> Iterator[HasBreaker]: ...

    def add(self, pool: str, engine: EngineConfig) -> None: ...

    def remove(self, name: str) -> None: ...


def routable_records(
    records: Iterable[EngineRecord], pools: Mapping[str, str]
) -> dict[str, tuple[str, EngineConfig]]:
    """The registered engines a proxy should route to: ready, not draining, and serving the model
    of a configured pool (``pools``: pool name -> model). Keyed by engine name."""
    out: dict[str, tuple[str, EngineConfig]] = {}
    for record in records:
        if not record.ready or record.draining:
            continue
        served = pools.get(record.pool)
        if served != record.model:
            # Called only when the registry's records change: a line per change, not per poll.
            why = (f"no pool {record.pool!r} is configured" if served is None else
                   f"it serves {record.model!r}, the {record.pool} pool {served!r}")
            log.warning("ignoring registered engine %r: %s", record.name, why)
            continue
        try:
            out[record.name] = (
                record.pool,
                EngineConfig(record.name, record.url, record.metrics_url),
            )
        except ConfigError:
            log.warning("ignoring registered engine %r with an invalid URL", record.name)
    return out


class RegistrySync:
    """Keeps the engines discovered in the registry in the fleet; configured engines are never
    touched. A registered engine with a configured engine's name, or at an engine's URL that a
    configured or an already discovered engine has (``static_urls``: the configured ones), is
    ignored with one warning: one engine counted twice would get twice its share of traffic,
    under two breakers and two in-flight counts."""

    def __init__(self, fleet: FleetLike, pools: Mapping[str, str],
                 static_urls: Iterable[str] = ()) -> None:
        self._fleet = fleet
        self._pools = dict(pools)
        self._static = {e.name for e in fleet}
        self._static_urls = {_same_url(u) for u in static_urls}
        self.discovered: dict[str, tuple[str, EngineConfig]] = {}
        self._doubles: set[str] = set()  # names warned about, while they stay registered

    def __call__(self, records: list[EngineRecord]) -> None:
        routable = routable_records(records, self._pools)
        # Engines already discovered keep their URL first; then by name, so that every proxy
        # process picks the same one of two records naming one URL.
        order = sorted(routable, key=lambda name: (name not in self.discovered, name))
        taken = set(self._static_urls)
        wanted: dict[str, tuple[str, EngineConfig]] = {}
        doubles: set[str] = set()
        for name in order:
            if name in self._static:
                continue
            url = _same_url(routable[name][1].url)
            if url in taken:
                doubles.add(name)
                if name not in self._doubles:
                    log.warning("ignoring registered engine %r: another engine is already "
                                "routed to at %s", name, routable[name][1].url)
                continue
            taken.add(url)
            wanted[name] = routable[name]
        self._doubles = doubles
        for name, entry in list(self.discovered.items()):
            if wanted.get(name) != entry:
                self._fleet.remove(name)
                del self.discovered[name]
                log.info("engine %s left the registry", name)
        for name, (pool, engine) in wanted.items():
            if name not in self.discovered:
                self._fleet.add(pool, engine)
                self.discovered[name] = (pool, engine)
                log.info(
                    "engine %s (%s pool, %s) discovered in the registry", name, pool, engine.url
                )


def _same_url(url: str) -> str:
    """An engine URL as compared for "the same engine" (scheme and host are case-blind)."""
    scheme, sep, rest = url.rstrip("/").partition("://")
    host, slash, path = rest.partition("/")
    return f"{scheme.lower()}{sep}{host.lower()}{slash}{path}"


class RegistryWatcher:
    """Polls the registry and calls ``on_change`` with the full list whenever it changes."""

    def __init__(
        self,
        link: RedisLink,
        on_change: Callable[[list[EngineRecord]], None],
        *,
        poll_s: float = 1.0,
        empty_grace_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        first_read: asyncio.Event | None = None,
    ) -> None:
        self._link = link
        self._on_change = on_change
        self.poll_s = poll_s
        # Set once the first read has ended, however it went (Redis down included): the proxy's
        # first scrape round, and so its listening, waits for it (bounded).
        self.first_read = first_read if first_read is not None else asyncio.Event()
        self.current: list[EngineRecord] | None = None
        # A read with no record at all, where there were some, from a Redis server that is not
        # the one those were read from (restarted empty, or failed over), is believed only after
        # this long: until the sidecars renew their keys it reads like every sidecar gone, and
        # taking every discovered engine out would pile all traffic on the configured ones. The
        # same server reading empty is believed at once (the sidecars left).
        self._empty_grace_s = empty_grace_s
        self._empty_since: float | None = None
        self._run_id: str | None = None  # of the server the current records were read from
        self._reader = IndexedReader()
        self._clock = clock

    async def poll(self) -> None:
        try:
            await self._poll()
        finally:
            self.first_read.set()

    async def _poll(self) -> None:
        try:
            records, run_id = await read_registry(self._link, self._reader)
        except RedisUnavailable:
            return  # keep the engines we know; a Redis outage is not an engine outage
        if self._held(records, run_id):
            return
        self._empty_since = None
        if records:
            self._run_id = run_id
        if records != self.current:
            self.current = records
            self._on_change(records)

    def _held(self, records: list[EngineRecord], run_id: str | None) -> bool:
        """Whether this read is an empty registry on a new server, within its grace."""
        restarted = None not in (run_id, self._run_id) and run_id != self._run_id
        if records or not self.current or not restarted:
            return False
        now = self._clock()
        if self._empty_since is None:
            self._empty_since = now
            log.warning("the engine registry reads empty on a restarted Redis; keeping its %d "
                        "engines for up to %.0fs while the sidecars renew their keys",
                        len(self.current), self._empty_grace_s)
        return now - self._empty_since < self._empty_grace_s

    async def run(self) -> None:
        await every(self.poll_s, self.poll, "engine registry sync")
