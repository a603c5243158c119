"""The response cache: lookups, single flight, and the fill protocol the relay follows (entries
live in a backend: ``proxy.tenancy.cache_store``).

Rules:
- ``lookup`` answers HIT (an entry to replay), BYPASS (policy says no; nothing to do) or MISS with a
  ``Fill`` when the answer may be stored. The holder of a ``Fill`` must call ``finish`` exactly once
  (``async with`` does it); only a fill whose recorder saw a normally completed answer stores it.
- Identical concurrent misses in this process coalesce: the first is the leader and goes to an
  engine, the others wait (up to ``single_flight_timeout_s``, or what is left of the request's own
  deadline when that is less: it then ends in the client's timeout) and are answered from its
  result. If
  the leader ends without an answer to keep (an error, a cut stream, an answer too large or not
  mergeable, one from another pool), every waiter goes to an engine at once, each on its own: they
  form no new flight, since an answer that could not be kept once is likely not to be kept again,
  and waiting in turn would run them one after another. Their answers are still stored if they can
  be. Requests the policy knows in advance to be unstorable are bypassed and never wait.
- Backend trouble (Redis down, slow, garbage, or a value for another tenant) is a miss plus a
  metric, never an error the client sees.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from proxy.core.cache_entry import CachedResponse, EntryError, decode_entry, streamable
from proxy.core.cache_key import CacheConfig, CachePolicy, KeyMaker, decide
from proxy.core.recording import Recording
from proxy.core.usage import asks_for_usage
from proxy.observe.metrics import Children
from proxy.tenancy.cache_store import CacheBackend, MemoryBackend, RedisBackend
from proxy.tenancy.redis_link import RedisLink, RedisUnavailable

log = logging.getLogger("kvproxy.cache")
ENTRY_OVERHEAD_BYTES = 4096


class CacheMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.lookups = Counter(
            "kvproxy_cache_lookups", "Response cache outcomes per request (hit, miss, bypass)",
            ["result"], registry=registry,
        )  # fmt: skip
        self.bypass_reasons = Counter(
            "kvproxy_cache_bypass", "Requests the cache did not answer, by reason",
            ["reason"], registry=registry,
        )  # fmt: skip
        self.errors = Counter(
            "kvproxy_cache_errors", "Cache backend failures and invalid entries (served as a miss)",
            ["op"], registry=registry,
        )  # fmt: skip
        self.coalesced = Counter(
            "kvproxy_cache_coalesced_waits", "Misses that waited for an identical in-flight miss",
            ["outcome"], registry=registry,
        )  # fmt: skip
        self.stores = Counter(
            "kvproxy_cache_stores", "Answers offered to the cache after a miss, by outcome",
            ["outcome"], registry=registry,
        )  # fmt: skip
        # Every cacheable request counts a lookup and a store: their children looked up once.
        self.lookups_by = Children(self.lookups)
        self.stores_by = Children(self.stores)
        self.bypass_by = Children(self.bypass_reasons)  # the policy's reasons: a fixed set


@dataclass(frozen=True)
class CacheRequest:
    tenant: str
    model: str
    endpoint: str  # "/v1/chat/completions" or "/v1/completions"
    body: Mapping[str, Any]
    cache_control: str | None = None

    @property
    def chat(self) -> bool:
        return is_chat(self.endpoint)


def is_chat(endpoint: str) -> bool:
    """Whether ``endpoint`` answers in the chat shape (else the completions shape)."""
    return endpoint.endswith("chat/completions")


@dataclass
class Lookup:
    """``status`` is the X-Cache header value: HIT, MISS or BYPASS."""

    status: str
    entry: CachedResponse | None = None
    fill: Fill | None = None
    coalesced: bool = False
    # The request's own deadline passed while it waited for an identical request's answer.
    late: bool = False


@dataclass
class _Flight:
    """A miss being answered; requests for the same key wait for it. The event is made only when
    one does: a flight lives as long as its stream, and most have no waiter."""

    started: float
    entry: CachedResponse | None = None
    finished: bool = False
    _event: asyncio.Event | None = None

    def finish(self, entry: CachedResponse | None) -> None:
        self.entry, self.finished = entry, True
        if self._event is not None:
            self._event.set()

    async def wait(self) -> None:
        if self._event is None:
            self._event = asyncio.Event()
            if self.finished:
                self._event.set()
        await self._event.wait()


class ResponseCache:
    def __init__(
        self,
        cfg: CacheConfig,
        backend: CacheBackend,
        *,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.backend = backend
        self.metrics = CacheMetrics(registry or CollectorRegistry())
        self._keys = KeyMaker(cfg.secret.encode() if cfg.secret else secrets.token_bytes(32))
        self._flights: dict[str, _Flight] = {}
        self._clock = clock

    def policy(self, req: CacheRequest) -> CachePolicy:
        return self.policy_for(req.body, req.cache_control)

    def policy_for(self, body: Mapping[str, Any], cache_control: str | None) -> CachePolicy:
        return decide(body, cache_control, enabled=self.cfg.enabled)

    def key(self, req: CacheRequest) -> str:
        return self._keys.key(tenant=req.tenant, model=req.model, endpoint=req.endpoint,
                              body=req.body)  # fmt: skip

    def count_bypass(self, policy: CachePolicy) -> None:
        """A request the cache does not answer (``policy``: its reason), counted."""
        self.metrics.lookups_by("bypass").inc()
        self.metrics.bypass_by(policy.reason).inc()

    async def lookup(self, req: CacheRequest, policy: CachePolicy | None = None, *,
                     wait_s: float | None = None) -> Lookup:
        """HIT, MISS or BYPASS for ``req``; ``policy``: its policy when the caller has it;
        ``wait_s``: what is left of the request's own deadline, which bounds a wait for an
        identical request's answer (``Lookup.late`` when it ran out there)."""
        if policy is None:
            policy = self.policy(req)
        if policy.bypass or not policy.read:
            self.count_bypass(policy)
            fill = Fill(self, req, self.key(req), None) if policy.write else None
            return Lookup("BYPASS", fill=fill)
        result = await self._lookup(req, self.key(req), wait_s)
        self.metrics.lookups_by("hit" if result.entry else "miss").inc()
        return result

    async def _lookup(self, req: CacheRequest, key: str, wait_s: float | None) -> Lookup:
        limit = self.cfg.single_flight_timeout_s
        wait = limit if wait_s is None else min(limit, max(0.0, wait_s))
        late_first = wait < limit  # the client's deadline ends first
        deadline = self._clock() + wait
        waited = False
        while True:
            flight = self._flights.get(key)
            if flight is not None and flight.finished:
                entry = _usable(req, flight.entry)
                if entry is not None:
                    return self._hit(entry, waited)
            if not self._live(flight):
                entry = _usable(req, await self._read(req, key))
                if entry is not None:
                    return self._hit(entry, waited)
                if self._live(self._flights.get(key)):
                    continue  # another request started the flight while we read: wait for it
                if waited:
                    self.metrics.coalesced.labels("retry").inc()
                flight = self._flights[key] = _Flight(self._clock())
                return Lookup("MISS", fill=Fill(self, req, key, flight), coalesced=waited)
            assert flight is not None
            waited = True
            if not await self._wait(flight, deadline):
                self.metrics.coalesced.labels("deadline" if late_first else "timeout").inc()
                return Lookup("MISS", coalesced=True, late=late_first)
            # Answered from the flight itself: the leader may have landed already, and its store
            # may have failed (Redis down) without that making this a miss.
            entry = _usable(req, flight.entry)
            if entry is not None:
                return self._hit(entry, waited)
            if flight.entry is None:
                return await self._released(req, key)
            # An answer this request cannot use (no usage figures): look up again, and wait for or
            # lead a flight of the requests that can.

    async def _released(self, req: CacheRequest, key: str) -> Lookup:
        """A waiter whose leader kept nothing: go now, side by side with the other waiters."""
        entry = _usable(req, await self._read(req, key))  # stored meanwhile by another request
        if entry is not None:
            return self._hit(entry, True)
        self.metrics.coalesced.labels("released").inc()
        # No flight: its answer is still stored if good, but nobody waits for it.
        return Lookup("MISS", fill=Fill(self, req, key, None), coalesced=True)

    def _hit(self, entry: CachedResponse, waited: bool) -> Lookup:
        if waited:
            self.metrics.coalesced.labels("hit").inc()
        return Lookup("HIT", entry=entry, coalesced=waited)

    def _live(self, flight: _Flight | None) -> bool:
        """A flight still running; one older than the timeout counts as abandoned, so a leader
        that never finished cannot make every later request wait."""
        if flight is None or flight.finished:
            return False
        return self._clock() - flight.started <= self.cfg.single_flight_timeout_s

    async def _wait(self, flight: _Flight, deadline: float) -> bool:
        try:
            async with asyncio.timeout(max(0.0, deadline - self._clock())):
                await flight.wait()
        except TimeoutError:
            return False
        return True

    async def _read(self, req: CacheRequest, key: str) -> CachedResponse | None:
        try:
            raw = await self.backend.get(key)
            return None if raw is None else decode_entry(raw, tenant=req.tenant, model=req.model)
        except RedisUnavailable:
            self.metrics.errors.labels("get").inc()
        except EntryError as exc:
            self.metrics.errors.labels("decode").inc()
            log.warning("cache entry ignored: %s", exc)
        except Exception as exc:  # a backend's own bug: still a miss, not the client's 500
            self.metrics.errors.labels("get").inc()
            log.warning("cache read failed (%s): served as a miss", type(exc).__name__)
        return None

    async def _store(self, key: str, value: bytes) -> None:
        try:
            await self.backend.set(key, value, self.cfg.ttl_s)
        except RedisUnavailable:
            self.metrics.errors.labels("set").inc()
            return
        except Exception as exc:  # a backend's own bug: the answer is not stored, nothing more
            self.metrics.errors.labels("set").inc()
            log.warning("cache store failed (%s): not stored", type(exc).__name__)
            return
        self.metrics.stores_by("stored").inc()

    def _wake(self, flight: _Flight | None, entry: CachedResponse | None) -> None:
        if flight is not None:
            flight.finish(entry)

    def _land(self, key: str, flight: _Flight | None) -> None:
        # Removed only after the store, so a request arriving meanwhile still finds the answer here.
        if flight is not None and self._flights.get(key) is flight:
            del self._flights[key]


def _usable(req: CacheRequest, entry: CachedResponse | None) -> CachedResponse | None:
    """The entry, if it can answer ``req``: an answer relayed as a stream without usage figures
    cannot answer a client that wants them (JSON clients always do), and a stream cannot carry
    every answer (``streamable``); that client refreshes it."""
    if entry is None:
        return None
    stream = req.body.get("stream") is True
    if stream and not streamable(entry.response):
        return None
    if entry.response.get("usage") is not None:
        return entry
    return entry if stream and not asks_for_usage(req.body) else None


class Fill:
    """A miss's obligation: record what was relayed, then ``finish`` (store, wake waiters)."""

    def __init__(
        self, cache: ResponseCache, req: CacheRequest, key: str, flight: _Flight | None
    ) -> None:
        self._cache = cache
        # Only what the stored entry names, not the request: its parsed body (the whole prompt)
        # would otherwise live as long as the stream.
        self._owner = (req.tenant, req.model, req.chat)
        self._key = key
        self._flight = flight
        self.recording = Recording(chat=req.chat, max_bytes=cache.cfg.max_entry_bytes)
        self._finished = False
        self._discarded = False

    def discard(self) -> None:
        """Never store this answer (e.g. it came from another pool than the model asked for)."""
        self._discarded = True

    def start(self, status: int, *, streamed: bool) -> None:
        self.recording.start(status, streamed=streamed)

    @property
    def max_bytes(self) -> int:
        return self.recording.max_bytes

    def feed(self, data: bytes) -> None:
        self.recording.feed(data)

    def skipped(self, size: int) -> None:
        self.recording.skipped(size)

    def result(self) -> CachedResponse | None:
        """The complete answer relayed so far, if any."""
        response = self.recording.response()
        if response is None:
            return None
        return CachedResponse(*self._owner, response)

    async def finish(self, *, completed: bool = True) -> None:
        """Store the answer if it completed normally; always wake the waiters. Idempotent."""
        if self._finished:
            return
        self._finished = True
        entry = self.result() if completed and not self._discarded else None
        value = None if entry is None else entry.encode()
        # Too large: the entry, or the bytes relayed for it (a stream is kept as relayed, up to
        # max_entry_bytes of its SSE events, and assembled only at its end).
        too_large = (value is not None and len(value) > self._cache.cfg.max_entry_bytes) or (
            completed and not self._discarded and self.recording.overflowed)
        # An answer too large to store is not handed to the waiters either, whatever size the
        # relayed bytes were: they go to the engines themselves, the same for every such answer.
        self._cache._wake(self._flight, None if too_large else entry)
        try:
            if too_large:
                self._cache.metrics.stores_by("too_large").inc()
            elif value is None:
                self._cache.metrics.stores_by("incomplete").inc()
            else:
                await self._cache._store(self._key, value)
        finally:
            self._cache._land(self._key, self._flight)

    async def close(self, *, completed: bool) -> None:
        """``finish``, shielded from a cancelled request where the store may suspend."""
        if self._cache.backend.suspends:
            await asyncio.shield(self.finish(completed=completed))
        else:  # no await inside suspends, so no cancellation can cut it short
            await self.finish(completed=completed)

    async def __aenter__(self) -> Fill:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close(completed=exc_type is None)


def make_cache(
    cfg: CacheConfig, link: RedisLink | None, *, registry: CollectorRegistry | None = None
) -> ResponseCache:
    """The configured cache; the Redis backend only when configured and a Redis link exists."""
    backend: CacheBackend
    if cfg.backend == "redis" and link is not None:
        # An entry wraps an answer of at most max_entry_bytes in a few fields of its own.
        backend = RedisBackend(link, cfg.max_entry_bytes + ENTRY_OVERHEAD_BYTES)
    else:
        if cfg.backend == "redis":
            log.warning("cache.backend = 'redis' but no [redis] url: using the in-process cache")
        backend = MemoryBackend(max_entries=cfg.max_entries, max_bytes=cfg.max_bytes)
    return ResponseCache(cfg, backend, registry=registry)
