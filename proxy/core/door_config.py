"""Settings of the request front door: ``[auth]``, ``[redis]``, ``[limits]`` (and ``[cache]``,
defined with the cache rules in ``cache_key``).

Rules: pure and typed like the rest of the configuration: frozen dataclasses that the config loader
builds from TOML, environment variables and ``--set``; each checks itself in ``__post_init__`` and
raises ``ConfigError`` naming the field, which the loader places under its dotted path. API keys
given in clear are never part of a ``repr``.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from proxy.core.cache_key import CacheConfig
from proxy.core.config_checks import at_least_zero, positive
from proxy.core.errors import ConfigError
from proxy.core.limit_rules import Limits
from proxy.core.redis_url import check_redis_url

TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")  # \Z: no newline after it
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
SECTIONS = ("auth", "cache", "redis", "limits")


def key_digest(key: str) -> str:
    """SHA-256 hex digest of an API key: the only form in which keys are kept. A header's bytes
    that are not UTF-8 reach here as surrogates: they are hashed as the bytes the client sent
    (such a key matches no configured one; it must not fail the request)."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


@dataclass(frozen=True)
class TenantConfig:
    name: str
    keys: tuple[str, ...] = field(default=(), repr=False)
    key_sha256: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not TENANT_NAME.match(self.name):
            raise ConfigError("name", "must be 1-64 of A-Z a-z 0-9 _ . - (starting alphanumeric)")
        for i, digest in enumerate(self.key_sha256):
            if not _HEX64.match(digest):
                raise ConfigError(f"key_sha256[{i}]", "must be 64 lowercase hex digits (SHA-256)")
        for i, key in enumerate(self.keys):
            if len(key) < 8:
                raise ConfigError(f"keys[{i}]", "must be at least 8 characters")

    def digests(self) -> tuple[str, ...]:
        return self.key_sha256 + tuple(key_digest(k) for k in self.keys)


@dataclass(frozen=True)
class AuthConfig:
    """``[auth]`` and ``[[auth.tenants]]``."""

    required: bool = False
    default_tenant: str = "default"
    tenants: tuple[TenantConfig, ...] = ()
    redis_keys: bool = False
    redis_cache_s: float = 30.0
    # Name of the environment variable holding the key that ``/admin/*`` then requires.
    admin_key_env: str | None = None

    def __post_init__(self) -> None:
        if self.admin_key_env is not None and not self.admin_key_env.strip():
            raise ConfigError("admin_key_env", "must name an environment variable")
        if not TENANT_NAME.match(self.default_tenant):
            raise ConfigError("default_tenant", "must be a valid tenant name")
        at_least_zero(self, "redis_cache_s")
        owner: dict[str, str] = {}
        for i, tenant in enumerate(self.tenants):
            for digest in tenant.digests():
                if owner.setdefault(digest, tenant.name) != tenant.name:
                    raise ConfigError(f"tenants[{i}]", "a key is listed for two tenants")
        if self.required and not self.tenants and not self.redis_keys:
            raise ConfigError("required", "needs [[auth.tenants]] or redis_keys = true")

    @classmethod
    def from_mapping(cls, raw: Mapping[str, object], field_prefix: str) -> AuthConfig:
        from proxy.core.configload import build  # noqa: PLC0415

        return build(cls, dict(raw), field_prefix)


@dataclass(frozen=True)
class RedisConfig:
    """``[redis]``: where shared state lives. Empty ``url``: nothing is shared."""

    url: str = ""
    op_timeout_s: float = 0.25
    connect_timeout_s: float = 0.5
    max_connections: int = 128
    key_prefix: str = "kvproxy:"
    retry_after_failure_s: float = 1.0
    # Also route to engines that sidecars register in Redis (next to the configured ones).
    discover_engines: bool = False
    # A registry read that finds no engine at all, where engines were registered, on a Redis
    # server other than theirs (restarted empty, failed over), is believed only after this long.
    registry_empty_grace_s: float = 10.0

    def __post_init__(self) -> None:
        check_redis_url(self.url)
        positive(self, "op_timeout_s", "connect_timeout_s")
        at_least_zero(self, "registry_empty_grace_s")
        if self.max_connections < 1:
            raise ConfigError("max_connections", "must be >= 1")
        at_least_zero(self, "retry_after_failure_s")

    @property
    def enabled(self) -> bool:
        return bool(self.url)

    @property
    def first_read_bound_s(self) -> float:
        """How long start-up waits for the engine registry's first read: a connection and a
        few operations (the index, the records, a walk of the keys)."""
        return self.connect_timeout_s + 4 * self.op_timeout_s if self.discover_engines else 0.0

    @classmethod
    def from_mapping(cls, raw: Mapping[str, object], field_prefix: str) -> RedisConfig:
        from proxy.core.configload import build  # noqa: PLC0415

        return build(cls, dict(raw), field_prefix)


@dataclass(frozen=True)
class TenantLimitConfig:
    name: str
    requests_per_min: int | None = None
    tokens_per_min: int | None = None
    concurrent_streams: int | None = None

    def __post_init__(self) -> None:
        if not TENANT_NAME.match(self.name):
            raise ConfigError("name", "must be a valid tenant name")
        _non_negative(self, ("requests_per_min", "tokens_per_min", "concurrent_streams"))


@dataclass(frozen=True)
class LimitsConfig:
    """``[limits]`` (defaults for every tenant) and ``[[limits.tenants]]`` (overrides)."""

    enabled: bool = False
    requests_per_min: int = 0
    tokens_per_min: int = 0
    concurrent_streams: int = 0
    lease_ttl_s: float = 30.0
    tenants: tuple[TenantLimitConfig, ...] = ()
    # The overrides by tenant name: one lookup per request, however many are configured.
    _by_name: dict[str, TenantLimitConfig] = field(default_factory=dict, init=False, repr=False,
                                                   compare=False)

    def __post_init__(self) -> None:
        _non_negative(self, ("requests_per_min", "tokens_per_min", "concurrent_streams"))
        if not (self.lease_ttl_s >= 3 and math.isfinite(self.lease_ttl_s)):  # NaN fails too
            raise ConfigError("lease_ttl_s", "must be a finite number >= 3 (leases are renewed "
                                             "every third of it)")
        by_name: dict[str, TenantLimitConfig] = {}
        for i, override in enumerate(self.tenants):
            if override.name in by_name:
                raise ConfigError(f"tenants[{i}].name", f"duplicate tenant {override.name!r}")
            by_name[override.name] = override
        object.__setattr__(self, "_by_name", by_name)

    def for_tenant(self, tenant: str) -> Limits:
        override = self._by_name.get(tenant)

        def pick(name: str) -> int:
            value = getattr(override, name, None) if override else None
            return int(getattr(self, name) if value is None else value)

        return Limits(pick("requests_per_min"), pick("tokens_per_min"), pick("concurrent_streams"))

    @classmethod
    def from_mapping(cls, raw: Mapping[str, object], field_prefix: str) -> LimitsConfig:
        from proxy.core.configload import build  # noqa: PLC0415

        return build(cls, dict(raw), field_prefix)


def _non_negative(obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and not (value >= 0 and math.isfinite(value)):  # NaN fails too
            raise ConfigError(name, "must be a finite number >= 0 (0 = unlimited)")


@dataclass(frozen=True)
class DoorConfig:
    auth: AuthConfig = field(default_factory=AuthConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)

    @classmethod
    def of(cls, cfg: object) -> DoorConfig:
        """The sections of a proxy ``Config`` that this object needs (defaults where absent)."""
        return cls(**{name: getattr(cfg, name) for name in SECTIONS if hasattr(cfg, name)})
