"""The proxy's one Redis connection pool, and the rule that Redis trouble never reaches a client.

Rules:
- ``[redis] url`` empty means no Redis: every feature keeps working in-process (per replica).
- Every operation runs under ``op_timeout_s``; redis-py's own retries are off, because a retry loop
  inside one client request is exactly the latency Redis trouble must not add.
- A failed or timed-out operation (whatever the type of the exception the client raised) raises
  ``RedisUnavailable`` and puts the link in back-off for ``retry_after_failure_s``: during
  back-off calls fail at once instead of each paying the timeout.
  A command the server refused (a key of another type, a script's error: one key's trouble, which
  anyone with access to Redis can cause) fails only itself (errors ``kind="refused"``); refusals
  that say the server cannot serve (read-only, out of memory, loading, busy) back off as failures.
  Callers turn ``RedisUnavailable`` into their fallback (a cache miss, a local limit) and a metric.
- Keys are all under ``key_prefix``; per-tenant keys carry a ``{tenant}`` hash tag, so one tenant's
  keys share a Redis Cluster slot and a Lua script may touch all of them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeAlias, TypeVar

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import OutOfMemoryError, ReadOnlyError, ResponseError
from redis.maint_notifications import MaintNotificationsConfig

from proxy.core.door_config import RedisConfig

T = TypeVar("T")
RedisClient: TypeAlias = aioredis.Redis
log = logging.getLogger("kvproxy.redis")


class RedisUnavailable(Exception):
    """Redis failed, timed out, or is in back-off after a recent failure (``kind``: "error",
    "timeout" or "backoff")."""

    def __init__(self, message: str, kind: str = "error") -> None:
        super().__init__(message)
        self.kind = kind


class RedisMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.errors = Counter(
            "kvproxy_redis_errors",
            "Redis operations that failed or timed out (the caller fell back), by operation",
            ["op", "kind"],
            registry=registry,
        )


class RedisLink:
    """A redis.asyncio client with per-operation timeouts and failure back-off."""

    def __init__(
        self,
        cfg: RedisConfig,
        *,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        # A blocking pool: past ``max_connections`` operations open at once, an operation waits
        # for a connection (within its own timeout) instead of failing, so a burst of requests
        # is never read as Redis being down (which would put the whole link in back-off).
        pool = aioredis.BlockingConnectionPool.from_url(
            cfg.url,
            timeout=cfg.op_timeout_s,
            socket_timeout=cfg.op_timeout_s,
            socket_connect_timeout=cfg.connect_timeout_s,
            max_connections=cfg.max_connections,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
            # Cluster maintenance push messages: one more failing round trip per connection on a
            # plain Redis, and nothing the proxy would act on.
            maint_notifications_config=MaintNotificationsConfig(enabled=False),
        )
        self.client: aioredis.Redis = aioredis.Redis.from_pool(pool)
        self.metrics = RedisMetrics(registry or CollectorRegistry())
        self._clock = clock
        self._down_until = 0.0

    def key(self, *parts: str) -> str:
        return self.cfg.key_prefix + ":".join(parts)

    def tenant_key(self, tenant: str, *parts: str) -> str:
        # Braces in a tenant name would move the hash tag; names are config-checked, this is belt
        # and braces for names that came from Redis.
        safe = tenant.replace("{", "(").replace("}", ")")
        return self.key("t", "{" + safe + "}", *parts)

    @property
    def available(self) -> bool:
        return self._clock() >= self._down_until

    async def run(self, op: str, call: Callable[[aioredis.Redis], Awaitable[T]]) -> T:
        """Run ``call(client)`` under the op timeout; any failure is ``RedisUnavailable``."""
        if not self.available:
            self.metrics.errors.labels(op, "backoff").inc()
            raise RedisUnavailable(f"redis {op}: in back-off after a recent failure", "backoff")
        try:
            async with asyncio.timeout(self.cfg.op_timeout_s):
                return await call(self.client)
        except ResponseError as exc:
            if _server_wide(exc):
                self._failed(op, exc)
                raise RedisUnavailable(f"redis {op}: {type(exc).__name__}", "error") from None
            # The server refused this command (a key of the wrong type, a script's error): this
            # operation fails, as a miss or a local decision; Redis itself is fine for the rest.
            self.metrics.errors.labels(op, "refused").inc()
            raise RedisUnavailable(f"redis {op}: the command was refused", "refused") from None
        except Exception as exc:  # not BaseException: CancelledError passes through
            # Not only RedisError, OSError and TimeoutError: redis-py raises other types too (a
            # TypeError from a connection option its connection class refuses, a ValueError from
            # a reply it cannot parse). Still Redis trouble: the same back-off and one line per
            # episode, never a traceback per call from every loop and request.
            self._failed(op, exc)
            kind = "timeout" if isinstance(exc, TimeoutError) else "error"
            raise RedisUnavailable(f"redis {op}: {type(exc).__name__}", kind) from None

    def _failed(self, op: str, exc: BaseException) -> None:
        kind = "timeout" if isinstance(exc, TimeoutError) else "error"
        self.metrics.errors.labels(op, kind).inc()
        if self.available:
            log.warning("redis %s failed (%s: %s); falling back for %.1f s", op, kind,
                        type(exc).__name__, self.cfg.retry_after_failure_s)  # fmt: skip
        self._down_until = self._clock() + self.cfg.retry_after_failure_s

    async def close(self) -> None:
        await self.client.aclose()


# Replies that say the server, not one key, cannot serve: read-only, out of memory, busy with a
# script, loading, no master.
_SERVER_WIDE = ("BUSY", "LOADING", "MASTERDOWN", "READONLY", "OOM", "NOREPLICAS", "TRYAGAIN")


def _server_wide(exc: ResponseError) -> bool:
    if isinstance(exc, ReadOnlyError | OutOfMemoryError):
        return True
    return str(exc).split(" ", 1)[0].upper() in _SERVER_WIDE
