"""Per-tenant limits: requests per minute, tokens per minute, concurrent streams.

Rules:
- Rates are token buckets that refill continuously (capacity = the per-minute figure, so a tenant
  can burst up to one minute's allowance). A request takes 1 from the request bucket when admitted;
  its tokens are charged to the token bucket when it settles, because only then are they known. The
  token bucket may go into debt; while it is empty or in debt, the tenant's new requests are
  refused.
- Every in-flight request holds a lease on one of the tenant's concurrent-stream slots until it
  settles. Leases expire after ``lease_ttl_s`` unless renewed, so a replica that dies cannot hold
  slots forever; the gate renews the leases it holds from one background task.
- With Redis, one Lua script per decision makes it atomic across replicas, and Redis' own clock
  (``TIME``) is the clock, so replicas with skewed clocks agree. The same arithmetic runs in-process
  (``bucket_level``) for the memory backend and when Redis is unavailable: limits then hold per
  replica instead of failing closed. Refusals are 429 with ``Retry-After``.
- 0 means unlimited; ``[[limits.tenants]]`` overrides the defaults for one tenant.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter

from proxy.core.door_config import LimitsConfig
from proxy.core.errors import RateLimited
from proxy.core.limit_rules import Limits, LocalLimits, Verdict, retry_after_header
from proxy.fleet.periodic import every
from proxy.tenancy.redis_link import RedisLink, RedisUnavailable

log = logging.getLogger("kvproxy.ratelimit")


# --- Redis store: the same arithmetic as limit_rules, atomically, on Redis' clock ----------------

_LUA_COMMON = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function level(key, per_min)
  local v = redis.call('HMGET', key, 'level', 'updated')
  local lv, up = tonumber(v[1]), tonumber(v[2])
  -- What is not a bucket this script wrote (missing, not finite, or updated in the future) is
  -- forgotten: a full bucket. A debt is kept to an hour of refill.
  if not lv or not up or lv ~= lv or up ~= up or lv == math.huge or lv == -math.huge
      or up > now + 1 then
    return per_min
  end
  lv = math.max(lv, -60 * per_min)
  return math.min(per_min, lv + math.max(0, now - up) * per_min / 60)
end
-- Seconds until ``short`` more units refill, never past the hour a debt is kept to (a debt at
-- its floor would otherwise ask for an hour and one unit).
local function wait(short, per_min)
  return math.min(3600, short * 60 / per_min)
end
local function put(key, value, per_min)
  redis.call('HSET', key, 'level', tostring(value), 'updated', tostring(now))
  -- Kept while it is not yet full again (debt included); a full bucket needs no key.
  redis.call('EXPIRE', key, math.ceil(60 + math.max(0, -value) * 60 / per_min) + 60)
end
"""
# KEYS: requests bucket, tokens bucket, lease zset.
# ARGV: requests_per_min, tokens_per_min, concurrent_streams, lease id, lease ttl (s).
_LUA_ADMIT = (
    _LUA_COMMON
    + """
local rpm, tpm, streams = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local ttl = tonumber(ARGV[5])
if streams > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= streams then return {0, 'concurrent_streams', '1'} end
end
local req = 0
if rpm > 0 then
  req = level(KEYS[1], rpm)
  if req < 1 then return {0, 'requests_per_min', tostring(wait(1 - req, rpm))} end
end
if tpm > 0 then
  local tok = level(KEYS[2], tpm)
  if tok <= 0 then return {0, 'tokens_per_min', tostring(wait(1 - tok, tpm))} end
end
if rpm > 0 then put(KEYS[1], req - 1, rpm) end
if streams > 0 then
  redis.call('ZADD', KEYS[3], now + ttl, ARGV[4])
  redis.call('EXPIRE', KEYS[3], math.ceil(ttl) + 60)
end
return {1, '', '0'}
"""
)
# KEYS: tokens bucket, lease zset. ARGV: tokens_per_min, tokens used, lease id.
_LUA_SETTLE = (
    _LUA_COMMON
    + """
redis.call('ZREM', KEYS[2], ARGV[3])
local tpm, used = tonumber(ARGV[1]), tonumber(ARGV[2])
if tpm > 0 and used > 0 then put(KEYS[1], level(KEYS[1], tpm) - used, tpm) end
return 1
"""
)
# KEYS: lease zset. ARGV: lease ttl (s), lease ids...
_LUA_RENEW = (
    _LUA_COMMON
    + """
local ttl = tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now + ttl, ARGV[i]) end
redis.call('EXPIRE', KEYS[1], math.ceil(ttl) + 60)
return 1
"""
)


class RedisLimits:
    """Limit state in Redis; each decision is one Lua script (atomic across replicas)."""

    def __init__(self, link: RedisLink) -> None:
        self._link = link
        self._admit = link.client.register_script(_LUA_ADMIT)
        self._settle = link.client.register_script(_LUA_SETTLE)
        self._renew = link.client.register_script(_LUA_RENEW)

    def _keys(self, tenant: str) -> tuple[str, str, str]:
        k = self._link.tenant_key
        return k(tenant, "requests"), k(tenant, "tokens"), k(tenant, "streams")

    async def admit(self, tenant: str, limits: Limits, lease_id: str, ttl_s: float) -> Verdict:
        args: list[str | float] = [
            limits.requests_per_min,
            limits.tokens_per_min,
            limits.concurrent_streams,
            lease_id,
            ttl_s,
        ]
        keys = list(self._keys(tenant))
        raw = await self._link.run("limits_admit", lambda r: self._admit(keys, args, client=r))
        return _verdict(raw)

    async def settle(self, tenant: str, limits: Limits, lease_id: str, tokens: int) -> None:
        _, tokens_key, streams_key = self._keys(tenant)
        args: list[str | float] = [limits.tokens_per_min, tokens, lease_id]
        await self._link.run(
            "limits_settle", lambda r: self._settle([tokens_key, streams_key], args, client=r)
        )

    async def renew(self, tenant: str, lease_ids: list[str], ttl_s: float) -> None:
        streams_key = self._keys(tenant)[2]
        args: list[str | float] = [ttl_s, *lease_ids]
        await self._link.run("limits_renew", lambda r: self._renew([streams_key], args, client=r))


# The longest wait a limit can ask for: a token debt is kept to an hour of refill.
MAX_WAIT_S = 3600.0


def _verdict(raw: object) -> Verdict:
    try:
        assert isinstance(raw, list) and len(raw) == 3
        allowed, limit, wait = raw
        name = limit.decode() if isinstance(limit, bytes) else str(limit)
        seconds = float(wait)
        assert 0.0 <= seconds <= MAX_WAIT_S  # NaN and infinities included
        return Verdict(bool(int(allowed)), name, seconds)
    except (AssertionError, ValueError, TypeError):
        raise RedisUnavailable(f"unexpected limits reply {raw!r:.80}") from None


# --- the gate (async) -----------------------------------------------------------------------------


class LimitMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.rejections = Counter(
            "kvproxy_ratelimit_rejections", "Requests refused with 429, by tenant and limit",
            ["tenant", "limit"], registry=registry,
        )  # fmt: skip
        self.fallbacks = Counter(
            "kvproxy_ratelimit_fallbacks", "Limit decisions made per replica because Redis failed",
            ["op"], registry=registry,
        )  # fmt: skip


class Lease:
    """One admitted request's hold on its tenant's limits; ``settle`` exactly once (idempotent)."""

    def __init__(self, gate: RequestGate | None, tenant: str, lease_id: str, local: bool) -> None:
        self._gate = gate
        self.tenant = tenant
        self.lease_id = lease_id
        self.local = local
        self.settled = False

    @property
    def pending(self) -> bool:
        """Whether ``settle`` has anything to do (a lease of unlimited traffic has not)."""
        return not self.settled and self._gate is not None

    async def settle(self, tokens: int) -> None:
        if self.settled:
            return
        self.settled = True
        if self._gate is not None:
            await self._gate._settle(self, max(0, tokens))


class RequestGate:
    """Admits or refuses a tenant's request; holds the leases of admitted ones."""

    def __init__(
        self,
        cfg: LimitsConfig,
        link: RedisLink | None = None,
        *,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.metrics = LimitMetrics(registry or CollectorRegistry())
        self._local = LocalLimits(clock)
        self._redis = RedisLimits(link) if link is not None else None
        self._open: dict[str, Lease] = {}
        self._renewer: asyncio.Task[None] | None = None
        # The tenant's metric label (the proxy's bounded set, ``TenantLabels``, once it is set).
        self.tenant_label: Callable[[str], str] = lambda tenant: tenant

    async def admit(self, tenant: str) -> Lease:
        """A lease for this request, or ``RateLimited`` (429 + Retry-After)."""
        limits = self.cfg.for_tenant(tenant)
        if not self.cfg.enabled or limits.unlimited:
            return Lease(None, tenant, "", local=True)
        lease_id = uuid.uuid4().hex
        verdict, local = await self._decide(tenant, limits, lease_id)
        if not verdict.allowed:
            self.metrics.rejections.labels(self.tenant_label(tenant), verdict.limit).inc()
            raise RateLimited(
                f"tenant {tenant!r} is over its {verdict.limit.replace('_', ' ')} limit",
                retry_after_s=float(retry_after_header(verdict.retry_after_s)),
                code=verdict.limit,
            )
        lease = Lease(self, tenant, lease_id, local)
        self._open[lease_id] = lease
        return lease

    async def _decide(self, tenant: str, limits: Limits, lease_id: str) -> tuple[Verdict, bool]:
        if self._redis is not None:
            try:
                return await self._redis.admit(
                    tenant, limits, lease_id, self.cfg.lease_ttl_s
                ), False
            except RedisUnavailable:
                self.metrics.fallbacks.labels("admit").inc()
        return self._local.admit(tenant, limits, lease_id, self.cfg.lease_ttl_s), True

    async def _settle(self, lease: Lease, tokens: int) -> None:
        self._open.pop(lease.lease_id, None)
        limits = self.cfg.for_tenant(lease.tenant)
        if not lease.local and self._redis is not None:
            try:
                await self._redis.settle(lease.tenant, limits, lease.lease_id, tokens)
                return
            except RedisUnavailable:
                self.metrics.fallbacks.labels("settle").inc()
        self._local.settle(lease.tenant, limits, lease.lease_id, tokens)

    # Lease renewal: one named task per gate, started and cancelled by the app's lifecycle.

    def start(self) -> None:
        if self._renewer is None and self.cfg.enabled:
            self._renewer = asyncio.create_task(self._renew_loop(), name="kvproxy-lease-renewer")

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
            self._renewer = None

    async def _renew_loop(self) -> None:
        await every(self.cfg.lease_ttl_s / 3, self.renew, "renewing stream leases")

    async def renew(self) -> None:
        """Extend every open lease this replica holds (they expire if it dies)."""
        by_tenant: dict[str, list[Lease]] = {}
        for lease in self._open.values():
            by_tenant.setdefault(lease.tenant, []).append(lease)
        for tenant, leases in by_tenant.items():
            ids = [le.lease_id for le in leases if not le.local]
            self._local.renew(
                tenant, [le.lease_id for le in leases if le.local], self.cfg.lease_ttl_s
            )
            if ids and self._redis is not None:
                try:
                    await self._redis.renew(tenant, ids, self.cfg.lease_ttl_s)
                except RedisUnavailable:
                    self.metrics.fallbacks.labels("renew").inc()

    @property
    def open_leases(self) -> int:
        return len(self._open)
