"""API keys to tenants, from config and optionally from Redis.

Rules:
- A key is never kept, compared or logged in clear: it is hashed (SHA-256) on arrival, and the
  digest is looked up among the configured digests (a dictionary: one lookup however many
  tenants and keys are configured). Timing can then tell at most how a presented key's digest
  compares with a configured one's, which says nothing about the configured key itself (finding
  a key from its digest is a SHA-256 preimage), unlike a comparison of keys.
- Config may list keys in clear (``keys``, hashed at start-up, never printed) or as SHA-256 hex
  digests (``key_sha256``, preferred). Redis may add keys: hash ``<prefix>apikeys`` maps a digest to
  a tenant name; answers are remembered for ``redis_cache_s`` (unknown keys for a few seconds).
- ``required = false`` (the demo): a request without a known key is tenant ``default_tenant``; a
  known key still names its tenant. ``required = true``: no known key is 401.
- Redis trouble never turns a key that worked into a 401: a remembered tenant stays valid while
  Redis is down, and a key that cannot be checked at all is a 503 (retry), not "invalid key",
  whether keys are required or not (never the default tenant: it could be another tenant's key).
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter

from proxy.core.door_config import TENANT_NAME, AuthConfig, key_digest
from proxy.core.errors import ConfigError, NoCapacity, Unauthorized
from proxy.tenancy.redis_link import RedisLink, RedisUnavailable

log = logging.getLogger("kvproxy.tenants")
_NEGATIVE_CACHE_S = 5.0
_REMEMBERED_MAX = 10_000
_V = TypeVar("_V")


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class TenantDirectory:
    """Resolves the ``Authorization`` header of a request to a tenant name."""

    def __init__(
        self,
        cfg: AuthConfig,
        link: RedisLink | None = None,
        *,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self._static = {bytes.fromhex(d): t.name for t in cfg.tenants for d in t.digests()}
        self._link = link if cfg.redis_keys else None
        # Keys Redis named a tenant for, and keys it did not, kept apart (each bounded): a flood
        # of bad keys must not push out the good keys that carry a Redis outage.
        self._remembered: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._refused: OrderedDict[str, float] = OrderedDict()
        self._clock = clock
        self.failures = Counter(
            "kvproxy_auth_failures", "Requests refused for their API key, by reason",
            ["reason"], registry=registry or CollectorRegistry(),
        )  # fmt: skip
        self._admin: bytes | None = None
        if cfg.admin_key_env is not None:
            admin = os.environ.get(cfg.admin_key_env)
            if not admin:
                raise ConfigError("auth.admin_key_env",
                                  f"environment variable {cfg.admin_key_env} is not set")
            self._admin = bytes.fromhex(key_digest(admin))

    def check_admin(self, authorization: str | None) -> None:
        """Unauthorized unless the admin key is presented (or none is configured)."""
        if self._admin is None:
            return
        token = bearer_token(authorization)
        presented = bytes.fromhex(key_digest(token or ""))
        if token is None or not hmac.compare_digest(presented, self._admin):
            self.failures.labels("admin").inc()
            raise Unauthorized("the admin endpoints need the admin key (Authorization: Bearer ...)")

    async def identify(self, authorization: str | None) -> str:
        """The tenant for this header; Unauthorized or NoCapacity when there is none."""
        token = bearer_token(authorization)
        tenant = None if token is None else await self._resolve(key_digest(token))
        if tenant is not None:
            return tenant
        if not self.cfg.required:
            return self.cfg.default_tenant
        reason = "missing" if token is None else "invalid"
        self.failures.labels(reason).inc()
        raise Unauthorized(
            "missing API key (Authorization: Bearer ...)" if token is None else "invalid API key"
        )

    def static_tenant(self, digest: str) -> str | None:
        return self._static.get(bytes.fromhex(digest))

    async def _resolve(self, digest: str) -> str | None:
        tenant = self.static_tenant(digest)
        if tenant is not None or self._link is None:
            return tenant
        remembered = self._remembered.get(digest)
        refused_at = self._refused.get(digest)
        now = self._clock()
        if remembered is not None and now - remembered[1] < self._ttl(remembered[0]):
            return remembered[0]
        if refused_at is not None and now - refused_at < self._ttl(None):
            return None
        try:
            tenant = await self._fetch(self._link, digest)
        except RedisUnavailable:
            if remembered is not None:
                return remembered[0]
            # Also when keys are not required: the key may be a tenant's, and served as the
            # default tenant its answers would reach the response cache and the engines' cache
            # scope that clients without a key share.
            self.failures.labels("unavailable").inc()
            raise NoCapacity(
                "API key cannot be checked right now", reason="auth_unavailable"
            ) from None
        self._remember(digest, tenant, now)
        return tenant

    def _ttl(self, tenant: str | None) -> float:
        return (
            self.cfg.redis_cache_s
            if tenant is not None
            else min(_NEGATIVE_CACHE_S, self.cfg.redis_cache_s)
        )

    async def _fetch(self, link: RedisLink, digest: str) -> str | None:
        raw = await link.run("apikey_get", lambda r: r.hget(link.key("apikeys"), digest))
        if raw is None:
            return None
        name = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        if not TENANT_NAME.match(name):
            log.warning("ignoring an API key in redis with an invalid tenant name %r", name[:80])
            return None
        return name

    def _remember(self, digest: str, tenant: str | None, now: float) -> None:
        if tenant is None:
            self._remembered.pop(digest, None)  # revoked: not accepted through an outage either
            _keep(self._refused, digest, now)
        else:
            self._refused.pop(digest, None)
            _keep(self._remembered, digest, (tenant, now))


def _keep(kept: OrderedDict[str, _V], digest: str, value: _V) -> None:
    """Remember ``value`` for ``digest`` as the newest entry; the oldest go past the bound."""
    kept[digest] = value
    kept.move_to_end(digest)
    while len(kept) > _REMEMBERED_MAX:
        kept.popitem(last=False)


async def register_key(link: RedisLink, key: str, tenant: str) -> None:
    """Add an API key for ``tenant`` to Redis (stored as its digest only)."""
    if not TENANT_NAME.match(tenant):
        raise ValueError(f"invalid tenant name {tenant!r}")
    await link.run("apikey_set", lambda r: r.hset(link.key("apikeys"), key_digest(key), tenant))


async def revoke_key(link: RedisLink, key: str) -> None:
    await link.run("apikey_del", lambda r: r.hdel(link.key("apikeys"), key_digest(key)))
