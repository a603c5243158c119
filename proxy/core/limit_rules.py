"""Limit arithmetic: token buckets and stream leases, as pure code with the clock passed in.

Rules: no I/O. ``LocalLimits`` is the in-process store (one replica's view); the Redis store runs
the same arithmetic in Lua (see ``ratelimit``), and the tests hold the two to the same answers.
Order of checks: concurrent streams, then requests per minute, then tokens per minute; nothing is
taken from any bucket unless every check passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Limits:
    """One tenant's limits; 0 = unlimited."""

    requests_per_min: int = 0
    tokens_per_min: int = 0
    concurrent_streams: int = 0

    @property
    def unlimited(self) -> bool:
        return not (self.requests_per_min or self.tokens_per_min or self.concurrent_streams)


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    limit: str = ""  # which limit refused: requests_per_min | tokens_per_min | concurrent_streams
    retry_after_s: float = 0.0


# A full stream slot frees when some stream ends, which nobody can predict: ask for a short wait.
STREAM_RETRY_AFTER_S = 1.0


def bucket_level(level: float | None, updated: float, now: float, per_min: int) -> float:
    """A bucket's level at ``now``: refilled at ``per_min``/60 per second, capped at ``per_min``."""
    if level is None:
        return float(per_min)
    return min(float(per_min), level + max(0.0, now - updated) * per_min / 60.0)


def wait_until(level: float, need: float, per_min: int) -> float:
    """Seconds until a bucket at ``level`` holds ``need`` (0 if it already does)."""
    missing = need - level
    return 0.0 if missing <= 0 else missing * 60.0 / per_min


def retry_after_header(seconds: float) -> int:
    """Whole seconds for ``Retry-After``, 1 to 3600; never 0, which clients read as "retry at
    once", and never a figure no client should wait for (what is not finite counts as 1)."""
    if not math.isfinite(seconds):
        return 1
    return min(3600, max(1, math.ceil(seconds)))


@dataclass
class _Bucket:
    level: float | None = None
    updated: float = 0.0

    def at(self, now: float, per_min: int) -> float:
        return bucket_level(self.level, self.updated, now, per_min)

    def put(self, level: float, now: float) -> None:
        self.level, self.updated = level, now


@dataclass
class _TenantState:
    requests: _Bucket = field(default_factory=_Bucket)
    tokens: _Bucket = field(default_factory=_Bucket)
    leases: dict[str, float] = field(default_factory=dict)  # lease id -> expiry


class LocalLimits:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._tenants: dict[str, _TenantState] = {}

    def _state(self, tenant: str) -> _TenantState:
        return self._tenants.setdefault(tenant, _TenantState())

    def admit(self, tenant: str, limits: Limits, lease_id: str, lease_ttl_s: float) -> Verdict:
        now = self._clock()
        st = self._state(tenant)
        st.leases = {k: exp for k, exp in st.leases.items() if exp > now}
        verdict, requests_left = check(st, limits, now)
        if verdict.allowed:
            if limits.requests_per_min:
                st.requests.put(requests_left, now)
            if limits.concurrent_streams:
                st.leases[lease_id] = now + lease_ttl_s
        return verdict

    def settle(self, tenant: str, limits: Limits, lease_id: str, tokens: int) -> None:
        now = self._clock()
        st = self._state(tenant)
        st.leases.pop(lease_id, None)
        if limits.tokens_per_min and tokens:
            st.tokens.put(st.tokens.at(now, limits.tokens_per_min) - tokens, now)

    def renew(self, tenant: str, lease_ids: Iterable[str], lease_ttl_s: float) -> None:
        now = self._clock()
        st = self._state(tenant)
        for lease_id in lease_ids:
            if lease_id in st.leases:
                st.leases[lease_id] = now + lease_ttl_s

    def streams(self, tenant: str) -> int:
        return len(self._state(tenant).leases)


def check(st: _TenantState, limits: Limits, now: float) -> tuple[Verdict, float]:
    """The verdict, and the request bucket's level after taking this request."""
    if limits.concurrent_streams and len(st.leases) >= limits.concurrent_streams:
        return Verdict(False, "concurrent_streams", STREAM_RETRY_AFTER_S), 0.0
    requests = 0.0
    if limits.requests_per_min:
        requests = st.requests.at(now, limits.requests_per_min)
        if requests < 1:
            wait = wait_until(requests, 1, limits.requests_per_min)
            return Verdict(False, "requests_per_min", wait), 0.0
    if limits.tokens_per_min:
        tokens = st.tokens.at(now, limits.tokens_per_min)
        if tokens <= 0:
            # Out of debt and one token to spare: the smallest balance a request may start with.
            return Verdict(
                False, "tokens_per_min", wait_until(tokens, 1, limits.tokens_per_min)
            ), 0.0
    return Verdict(True), requests - 1
