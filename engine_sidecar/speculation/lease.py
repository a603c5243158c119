"""Who may take an engine out of its pool: at most ``max_out`` engines at once.

Rules:
- ``RedisLease`` coordinates the sidecars of a pool through the Redis they already register in:
  slot keys ``kvproxy:spec:rollout:<pool>:<i>`` set with NX and a TTL (a crashed holder frees its
  slot by expiry), deleted only by their holder. Redis being unreachable means no lease: an
  engine that cannot coordinate does not go out.
- A held slot is renewed every third of its TTL by a named task until it is released: how long
  an engine stays out (a slow drain, start, warm-up, a rollback's second start, a failed rollback
  waiting for the supervisor) has no bound the TTL could be chosen from; the TTL only bounds how
  long a crashed holder blocks the pool. ``close`` releases what is still held.
- ``LocalLease`` does the same for engines of one process (the simulator, the benchmark).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)
KEY_PREFIX = "kvproxy:spec:rollout:"
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
return 0
"""


class Lease(Protocol):
    async def acquire(self, holder: str) -> bool: ...

    async def release(self, holder: str) -> None: ...

    async def close(self) -> None: ...


class LocalLease:
    def __init__(self, max_out: int = 1) -> None:
        if max_out < 1:
            raise ValueError("max_out must be >= 1")
        self.max_out = max_out
        self.holders: set[str] = set()

    async def acquire(self, holder: str) -> bool:
        if holder in self.holders:
            return True
        if len(self.holders) >= self.max_out:
            return False
        self.holders.add(holder)
        return True

    async def release(self, holder: str) -> None:
        self.holders.discard(holder)

    async def close(self) -> None:
        self.holders.clear()


class RedisLease:
    def __init__(self, redis_url: str, pool: str, *, max_out: int = 1, ttl_s: float = 1800.0
                 ) -> None:
        if max_out < 1:
            raise ValueError("max_out must be >= 1")
        # Bounded: a Redis that stops answering must not hold a rollout (or its release) for ever.
        self._client = aioredis.from_url(redis_url, socket_timeout=5.0, socket_connect_timeout=5.0)
        self._stop = asyncio.Event()
        self.pool, self.max_out, self.ttl_s = pool, max_out, ttl_s
        self._held: str | None = None
        self._holder = ""
        self._renewal: asyncio.Task[None] | None = None

    def _slot(self, i: int) -> str:
        return f"{KEY_PREFIX}{self.pool}:{i}"

    async def acquire(self, holder: str) -> bool:
        try:
            for i in range(self.max_out):
                if await self._client.set(self._slot(i), holder, nx=True,
                                          px=int(self.ttl_s * 1000)):
                    self._hold(self._slot(i), holder)
                    return True
                if await self._client.get(self._slot(i)) == holder.encode():
                    self._hold(self._slot(i), holder)
                    return True
        except (RedisError, OSError) as exc:
            log.warning("speculation lease: Redis unreachable (%s); not rolling out", exc)
        return False

    def _hold(self, key: str, holder: str) -> None:
        self._held, self._holder = key, holder
        if self._renewal is None or self._renewal.done():
            self._stop = asyncio.Event()
            self._renewal = asyncio.create_task(self._renew(key, holder),
                                                name=f"speculation-lease-renewal:{key}")

    async def _renew(self, key: str, holder: str) -> None:
        ttl_ms = int(self.ttl_s * 1000)
        while True:
            # Stopped between renewals, never cancelled inside one: a command cancelled half-way
            # can leave the client's connection waiting on a reply that never comes.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.ttl_s / 3)
            if self._stop.is_set():
                return
            try:
                if not await self._client.eval(_RENEW, 1, key, holder, ttl_ms):
                    log.error("speculation lease %s: lost (expired or taken by another "
                              "holder); another engine of the pool may be out too", key)
                    return
            except (RedisError, OSError) as exc:
                # Two more tries before it expires; nothing better to do than try again.
                log.warning("speculation lease %s: renewal failed (%s)", key, exc)

    async def _stop_renewal(self) -> None:
        task, self._renewal = self._renewal, None
        self._stop.set()
        if task is not None and not task.done():
            await task  # ends at once, or once a renewal under way has its answer (bounded)

    async def release(self, holder: str) -> None:
        await self._stop_renewal()
        key, self._held = self._held, None
        if key is None:
            return
        try:
            await self._client.eval(_RELEASE, 1, key, holder)
        except (RedisError, OSError) as exc:
            log.warning("speculation lease: release failed (%s); it expires by TTL", exc)

    async def close(self) -> None:
        await self.release(self._holder)
        await self._client.aclose()
