"""The front door of a proxied request: whose it is, whether it may run now, and whether the
response cache answers it. One object per application; the request path calls it in that order.

Rules:
- ``identify`` (401 / 503) comes first; ``enter`` then takes a limit lease (429) and looks the
  request up in the cache. A hit is answered by ``replay`` in the shape the client asked for; a miss
  or bypass goes to an engine with the visit's ``recorder`` seeing every byte relayed. A request
  the cache policy bypasses outright (every sampled one) costs no lookup: no request object, no
  key, no fill.
- ``leave`` (the caller's ``finally``) settles everything exactly once, however the request
  ended: the cache fill is finished (stored only if the answer completed normally), and the lease
  is settled with the tokens used (``usage`` when the answer carries it, else about four
  characters per token; a hit uses none). A plain pair of calls, not a context manager: the
  request path pays no generator, and nothing of the visit's lookup (the parsed body) outlives
  it in a suspended frame.
- Redis, when configured, is opened here and closed on shutdown; its background work (lease renewal,
  shared breakers) runs in named tasks owned by this object.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.core.cache_entry import CachedResponse, replay_sse, usage_tokens
from proxy.core.door_config import DoorConfig
from proxy.core.recording import Recording
from proxy.tenancy.cache import CacheRequest, Fill, ResponseCache, is_chat, make_cache
from proxy.tenancy.ratelimit import Lease, RequestGate
from proxy.tenancy.redis_link import RedisLink
from proxy.tenancy.shared_pressure import HasPressure, SharedPressure
from proxy.tenancy.shared_state import EngineRecord, HasBreaker, RegistryWatcher, SharedBreakers
from proxy.tenancy.tenants import TenantDirectory

CHARS_PER_TOKEN = 4


@dataclass
class Visit:
    tenant: str
    chat: bool
    prompt_chars: int
    entry: CachedResponse | None = None
    x_cache: str = "BYPASS"
    recorder: Recording | Fill | None = None
    # The tenant's limits lease while it has something to settle (None: unlimited traffic).
    lease: Lease | None = None
    # The request's deadline passed while it waited for an identical request's answer.
    late: bool = False

    @property
    def hit(self) -> bool:
        return self.entry is not None

    def discard(self) -> None:
        """Do not cache this answer (served by another pool than the one the model names)."""
        if isinstance(self.recorder, Fill):
            self.recorder.discard()

    async def release(self) -> None:
        """Do not cache this answer, and let identical requests waiting for it go now: an answer
        assembled by the proxy (drafted) is never stored, so they would wait for nothing."""
        self.discard()
        if isinstance(self.recorder, Fill):
            await self.recorder.close(completed=False)

    def tokens(self, used: int | None = None) -> int:
        """Tokens to charge: none for a cache hit; the engine's usage as the relay read it
        (``used``), else as the recording holds it; else an estimate from the bytes."""
        if self.entry is not None:
            return 0
        if used is not None:
            return used
        recording = self.recorder.recording if isinstance(self.recorder, Fill) else self.recorder
        response = None if recording is None else recording.response()
        counted = None if response is None else usage_tokens(response)
        if counted is not None:
            return counted
        seen = 0 if recording is None else recording.bytes_seen
        # Without usage: the prompt plus what was relayed (JSON/SSE framing makes this generous).
        return (self.prompt_chars + seen // 2) // CHARS_PER_TOKEN


class FrontDoor:
    def __init__(self, cfg: DoorConfig, *, registry: CollectorRegistry | None = None) -> None:
        self.cfg = cfg
        registry = registry or CollectorRegistry()
        self.link = RedisLink(cfg.redis, registry=registry) if cfg.redis.enabled else None
        self.tenants = TenantDirectory(cfg.auth, self.link, registry=registry)
        self.gate = RequestGate(cfg.limits, self.link, registry=registry)
        self.cache: ResponseCache = make_cache(cfg.cache, self.link, registry=registry)
        # With engines discovered in Redis: set once the registry's first read has ended, so that
        # the proxy's first scrape round (and its listening) covers them (``Scraper.first_after``).
        discovers = self.link is not None and cfg.redis.discover_engines
        self.registry_read: asyncio.Event | None = asyncio.Event() if discovers else None
        self.shared: SharedBreakers | None = None
        self.pressure: SharedPressure | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def start(
        self,
        engines: Callable[[], Iterable[HasBreaker]],
        *,
        open_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_registry: Callable[[list[EngineRecord]], None] | None = None,
        pressure: Callable[[], Iterable[HasPressure]] | None = None,
        pressure_hold_s: float = 2.0,
    ) -> None:
        """Start the background work (call from the app's startup, inside the event loop).
        ``on_registry`` receives the engines registered in Redis whenever they change (only with
        ``redis.discover_engines``); ``pressure``: the engines whose overcommit-guard levels are
        shared with the other replicas (None: the guard is off)."""
        self.gate.start()
        if self.registry_read is not None and on_registry is None:
            self.registry_read.set()  # nothing will read the registry: nothing to wait for
        if self.link is None:
            return
        self.shared = SharedBreakers(self.link, engines, open_s=open_s, clock=clock)
        self._spawn(self.shared.run(), "kvproxy-shared-breakers")
        if pressure is not None:
            self.pressure = SharedPressure(self.link, pressure, hold_s=pressure_hold_s, clock=clock)
            self._spawn(self.pressure.run(), "kvproxy-shared-pressure")
        if on_registry is not None and self.cfg.redis.discover_engines:
            watcher = RegistryWatcher(self.link, on_registry,
                                      empty_grace_s=self.cfg.redis.registry_empty_grace_s,
                                      first_read=self.registry_read)
            self._spawn(watcher.run(), "kvproxy-engine-registry")

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        self._tasks.append(asyncio.create_task(work, name=name))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        await self.gate.close()
        if self.link is not None:
            await self.link.close()

    async def identify(self, headers: Mapping[str, str]) -> str:
        return await self.tenants.identify(headers.get("Authorization"))

    async def enter(
        self,
        tenant: str,
        *,
        endpoint: str,
        model: str,
        body: Mapping[str, Any],
        cache_control: str | None,
        prompt_chars: int,
        wait_s: float | None = None,
    ) -> Visit:
        """Admit (429 when over a limit) and look the request up in the cache. The caller must
        ``leave`` the visit exactly once, however the request ends (``try``/``finally``)."""
        lease = await self.gate.admit(tenant) if self.gate.cfg.enabled else None
        visit = Visit(tenant, is_chat(endpoint), prompt_chars,
                      lease=lease if lease is not None and lease.pending else None)
        policy = self.cache.policy_for(body, cache_control)
        if policy.bypass:
            # Nothing to look up or store (every sampled request): no request object, no key.
            self.cache.count_bypass(policy)
        else:
            req = CacheRequest(tenant, model, endpoint, body, cache_control)
            try:
                lookup = await self.cache.lookup(req, policy, wait_s=wait_s)
            except BaseException:
                await self._settle(visit, engine_asked=False, used=None)
                raise
            visit.entry, visit.x_cache, visit.recorder = lookup.entry, lookup.status, lookup.fill
            visit.late = lookup.late
        if visit.recorder is None and visit.entry is None and self.cfg.limits.enabled:
            limit = self.cfg.cache.max_entry_bytes
            visit.recorder = Recording(chat=visit.chat, max_bytes=limit)
        return visit

    async def leave(self, visit: Visit, *, completed: bool, engine_asked: bool = True,
                    used: int | None = None) -> None:
        """Settle a visit once: the cache fill finished (the answer stored only if the request
        ``completed``), then the lease settled with the tokens used (``used``: the engine's
        usage, when the relay read one; a recording too long to keep has lost it): none when
        no engine was asked (refused, shed or held out by the proxy itself)."""
        try:
            if isinstance(visit.recorder, Fill):
                await visit.recorder.close(completed=completed)
        finally:
            await self._settle(visit, engine_asked, used)

    async def _settle(self, visit: Visit, engine_asked: bool, used: int | None) -> None:
        # Shielded, so a cancelled request still settles; a shield costs a task, and unlimited
        # traffic (limits off, the default) has no lease to settle.
        lease, visit.lease = visit.lease, None
        if lease is not None and lease.pending:
            await asyncio.shield(lease.settle(visit.tokens(used) if engine_asked else 0))


DOOR = web.AppKey("front_door", FrontDoor)


async def replay(
    request: web.Request,
    entry: CachedResponse,
    *,
    stream: bool,
    include_usage: bool,
    headers: Mapping[str, str],
    request_id: str,
) -> web.StreamResponse:
    """Answer from a cache entry, as JSON or as an SSE stream, under the id the engine would
    have given this request (vLLM builds it from the request id the proxy sends it)."""
    entry = entry.renamed(request_id, int(time.time()))
    out_headers = {**headers, "X-Cache": "HIT"}
    if not stream:
        return web.Response(
            body=entry.json_body(), content_type="application/json", headers=out_headers
        )
    out_headers["Cache-Control"] = "no-cache"
    # The whole body first: once the head is out, nothing may fail to write it.
    body = replay_sse(entry, include_usage=include_usage)
    out = web.StreamResponse(headers=out_headers)
    out.content_type = "text/event-stream"
    out.charset = "utf-8"  # as vLLM labels a stream: a replay reads like the relayed answer
    await out.prepare(request)
    with contextlib.suppress(ConnectionResetError):
        await out.write(body)
        await out.write_eof()
    return out

