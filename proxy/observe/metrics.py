"""The proxy's own Prometheus metrics.

Rules: every series is named ``kvproxy_*`` (never ``vllm:*``, never ``kvproxy_sidecar_*``) and lives
in this process's own ``CollectorRegistry``, so several proxies in one test process never collide.
Per-engine gauges are refreshed from the engine states right before each exposition, so snapshot
ages are true at the moment Prometheus reads them. Every label set is bounded: tenant labels are the
configured tenants plus at most ``MAX_DYNAMIC_TENANTS`` more (from Redis); anything else is
``other``. Series touched by every request are reached through ``Children`` (a label set's child
looked up once: prometheus-client's ``labels`` validates and locks on every call).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from proxy.observe.kvmetrics import KvEventMetrics
from proxy.observe.signals import PoolGauges

__all__ = ["CONTENT_TYPE", "Children", "EngineGaugeRow", "ProxyMetrics", "TenantLabels"]

MAX_DYNAMIC_TENANTS = 200
OTHER_TENANT = "other"

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
# The proxy's own part of a request is milliseconds; seconds only when admission holds it.
_DISPATCH_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
_SCRAPE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# A young collection takes tens of microseconds to a few milliseconds, an old one tens of them.
_GC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)

# Engines that left the fleet whose late counts are still dropped (the most recent ones).
_DEPARTED_KEPT = 1024

BREAKER_VALUES = {"closed": 0.0, "half_open": 1.0, "open": 2.0}
OUTLIER_VALUES = {"active": 0.0, "probation": 1.0, "ejected": 2.0}


@dataclass(frozen=True)
class EngineGaugeRow:
    """One engine's figures at exposition time (None: no snapshot yet)."""

    engine: str
    pool: str
    kv_usage: float | None
    running: float | None
    waiting: float | None
    snapshot_age_s: float | None
    inflight: int
    breaker: str
    health: str
    outlier: str = "active"
    pressure: int = 0  # KV overcommit guard: 0 open, 1 closed to sheddable, 2 to standard too


class TenantLabels:
    """The tenant label for a tenant name: configured names as they are, the first
    ``MAX_DYNAMIC_TENANTS`` others (tenants known only to Redis) too, then ``other``."""

    def __init__(self, max_dynamic: int = MAX_DYNAMIC_TENANTS) -> None:
        self._known: set[str] = set()
        self._dynamic: set[str] = set()
        self._max_dynamic = max_dynamic

    def know(self, names: Iterable[str]) -> None:
        self._known.update(names)

    def __call__(self, tenant: str) -> str:
        if tenant in self._known or tenant in self._dynamic:
            return tenant
        if not tenant or len(self._dynamic) >= self._max_dynamic:
            return OTHER_TENANT
        self._dynamic.add(tenant)
        return tenant


M = TypeVar("M", Counter, Histogram)
K = TypeVar("K", str, tuple[str, str])


class Children(Generic[M]):
    """A labelled metric's children by label values, each looked up in the metric once. Label
    sets are bounded by the module's rules; past ``limit`` of them, lookups are simply not kept.
    ``departed`` (looked at only when a label set is new) names the label sets of engines that
    left the fleet: a late count for one (a request that was still open when it left) goes to a
    child no registry exports, so engines that come and go leave no series behind."""

    def __init__(self, metric: M, limit: int = 4096,
                 departed: Callable[[tuple[str, ...]], bool] | None = None) -> None:
        self._metric: M = metric
        self._limit = limit
        self._departed = departed
        self._children: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            if self._departed is not None and self._departed(values):
                return _unexported(self._metric, values)
            child = self._metric.labels(*values)
            if len(self._children) < self._limit:
                self._children[values] = child
        return child

    def forget(self, match: Callable[[tuple[str, ...]], bool]) -> None:
        """Drop the kept children whose label values ``match`` (their series were removed)."""
        for values in [v for v in self._children if match(v)]:
            del self._children[values]


def _unexported(metric: M, values: tuple[str, ...]) -> M:
    """A child of a metric shaped like ``metric`` in no registry: what it counts is dropped."""
    shadow: M = type(metric)(metric._name, "unexported", metric._labelnames, registry=None)
    return shadow.labels(*values)


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvproxy_requests", "Requests answered, by pool, engine, priority class and status",
            ["pool", "engine", "class", "status"], registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "kvproxy_time_to_first_byte_seconds",
            "Time from request arrival to the first response byte relayed to the client",
            ["pool"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.dispatch = Histogram(
            "kvproxy_dispatch_seconds",
            "Time from request arrival to its dispatch to an engine (the proxy's own part of the "
            "first-token time: reading the body, admission and any hold, routing)",
            ["pool"], buckets=_DISPATCH_BUCKETS, registry=r,
        )  # fmt: skip
        self.duration = Histogram(
            "kvproxy_request_duration_seconds", "Total time a proxied request took",
            ["pool", "status"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.sheds = Counter(
            "kvproxy_shed", "Requests refused with 503 before any response byte, by reason",
            ["pool", "class", "reason"], registry=r,
        )  # fmt: skip
        self.held = Counter(
            "kvproxy_held", "Requests held for room before admission, by how the hold ended "
            "(admitted, paced: let through on evidence, refused, gone: the client left)",
            ["pool", "class", "outcome"], registry=r,
        )  # fmt: skip
        self.held_now = Gauge(
            "kvproxy_held_requests", "Requests held for room now", ["pool"], registry=r,
        )  # fmt: skip
        self.degraded = Counter(
            "kvproxy_degraded", "Requests served by another pool than asked for (tiering)",
            ["from_pool", "to_pool"], registry=r,
        )  # fmt: skip
        self.stale_fail_open = Counter(
            "kvproxy_stale_fail_open", "Requests admitted while every engine's telemetry was stale",
            ["pool"], registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "kvproxy_retries", "Requests retried on another engine before the first byte",
            ["pool", "reason"], registry=r,
        )  # fmt: skip
        self.upstream_errors = Counter(
            "kvproxy_upstream_errors", "Failed engine exchanges, by kind",
            ["engine", "kind"], registry=r,
        )  # fmt: skip
        self.outlier_ejections = Counter(
            "kvproxy_outlier_ejections", "Engines ejected by outlier detection, by reason",
            ["pool", "engine", "reason"], registry=r,
        )  # fmt: skip
        self.client_disconnects = Counter(
            "kvproxy_client_disconnects", "Requests whose client went away before the end",
            ["pool"], registry=r,
        )  # fmt: skip
        self.scrape_duration = Histogram(
            "kvproxy_scrape_duration_seconds", "Time one engine metrics scrape took",
            ["engine"], buckets=_SCRAPE_BUCKETS, registry=r,
        )  # fmt: skip
        self.scrape_failures = Counter(
            "kvproxy_scrape_failures", "Engine metrics scrapes that failed, by reason",
            ["engine", "reason"], registry=r,
        )  # fmt: skip
        self.scrape_relayed = Counter(
            "kvproxy_scrape_relayed",
            "Scrape outcomes relayed between the workers of one proxy, by result (sent, unsent; "
            "applied, ignored, invalid: received)",
            ["result"], registry=r,
        )  # fmt: skip
        self.inflight_total = Gauge(
            "kvproxy_inflight_requests", "Proxied requests currently open", registry=r
        )
        self.draining = Gauge(
            "kvproxy_draining", "1 while the proxy drains for shutdown", registry=r
        )
        self._loop_metrics(r)
        self._engine_gauges(r)
        self._tenant_counters(r)
        # Every request observes these; see ``Children``.
        # Engines that left the fleet, as (engine, pool): their counted series are removed, and
        # late counts for them dropped (``Children``). Bounded: the oldest are let go.
        self._departed: dict[tuple[str, str], None] = {}
        self._departed_names: dict[str, None] = {}  # those in no pool any more
        departed, names = self._departed, self._departed_names
        self.requests_by = Children(self.requests, departed=lambda v: (v[1], v[0]) in departed)
        self.upstream_errors_by = Children(self.upstream_errors, departed=lambda v: v[0] in names)
        self.outlier_ejections_by = Children(
            self.outlier_ejections, departed=lambda v: (v[1], v[0]) in departed)
        self.duration_by = Children(self.duration)
        self.ttft_by = Children(self.ttft)
        self.dispatch_by = Children(self.dispatch)
        self.tenant_requests_by = Children(self.tenant_requests)
        self.tenant_tokens_by = Children(self.tenant_tokens)
        self.pools = PoolGauges(r)
        self.kv_events = KvEventMetrics(r)

    def _loop_metrics(self, r: CollectorRegistry) -> None:
        self.loop_lag = Histogram(
            "kvproxy_event_loop_lag_seconds",
            "How late the event loop ran a periodic probe (time it could not attend to anything)",
            buckets=_LAG_BUCKETS, registry=r,
        )  # fmt: skip
        self.gc_pause = Histogram(
            "kvproxy_gc_pause_seconds",
            "How long each garbage collection stopped the process, by generation",
            ["generation"], buckets=_GC_BUCKETS, registry=r,
        )  # fmt: skip
        self.proxy_short = Counter(
            "kvproxy_proxy_short",
            "Requests refused because the proxy could not open a connection to an engine for "
            "want of its own resources (file descriptors, buffers, memory), not the engine's",
            registry=r,
        )  # fmt: skip
        self.client_connections = Gauge(
            "kvproxy_client_connections", "Client connections open", registry=r
        )
        self.client_connections_limit = Gauge(
            "kvproxy_client_connections_limit",
            "Client connections the proxy keeps open at once (server.max_connections; +Inf: none)",
            registry=r,
        )  # fmt: skip
        self.client_connections_refused = Counter(
            "kvproxy_client_connections_refused",
            "Proxied requests answered 503 because their connection opened past "
            "server.max_connections", registry=r,
        )  # fmt: skip
        self.client_connections_dropped = Counter(
            "kvproxy_client_connections_dropped",
            "Client connections closed as soon as accepted: past server.max_connections and "
            "its grace", registry=r,
        )  # fmt: skip
        self.relay_pauses = Counter(
            "kvproxy_relay_pauses",
            "Times a stream's engine reading paused because its client's buffer was full",
            registry=r,
        )  # fmt: skip
        self.relay_raw = Counter(
            "kvproxy_relay_raw_streams",
            "Streamed answers whose engine reads went on to the client as they came, chunk "
            "framing included (both sides chunked)",
            registry=r,
        )  # fmt: skip

    def _tenant_counters(self, r: CollectorRegistry) -> None:
        self.tenant_labels = TenantLabels()
        self.tenant_requests = Counter(
            "kvproxy_tenant_requests", "Proxied requests, by tenant, pool and status",
            ["tenant", "pool", "status"], registry=r,
        )  # fmt: skip
        self.tenant_tokens = Counter(
            "kvproxy_tenant_tokens",
            "Tokens engines reported in usage, by tenant, pool and kind (prompt, completion, "
            "cached: prompt tokens served from the prefix cache)",
            ["tenant", "pool", "kind"], registry=r,
        )  # fmt: skip

    def _engine_gauges(self, r: CollectorRegistry) -> None:
        labels = ["engine", "pool"]
        self.kv_usage = Gauge(
            "kvproxy_engine_kv_usage", "Last scraped KV-cache usage (0-1)", labels, registry=r
        )
        self.running = Gauge(
            "kvproxy_engine_running", "Last scraped running requests", labels, registry=r
        )
        self.waiting = Gauge(
            "kvproxy_engine_waiting", "Last scraped waiting (queued) requests", labels, registry=r
        )
        self.snapshot_age = Gauge(
            "kvproxy_engine_snapshot_age_seconds", "Age of the last good snapshot", labels,
            registry=r,
        )  # fmt: skip
        self.engine_inflight = Gauge(
            "kvproxy_engine_inflight", "Requests open at this engine through this proxy", labels,
            registry=r,
        )  # fmt: skip
        self.breaker = Gauge(
            "kvproxy_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open", labels,
            registry=r,
        )  # fmt: skip
        self.outlier = Gauge(
            "kvproxy_engine_outlier_state",
            "Outlier detection: 0 active, 1 on probation, 2 ejected", labels, registry=r,
        )  # fmt: skip
        self.outliers_ejected = Gauge(
            "kvproxy_outlier_ejected_engines",
            "Engines out of their pool by outlier detection (ejected or on probation)", ["pool"],
            registry=r,
        )  # fmt: skip
        self.pressure = Gauge(
            "kvproxy_engine_pressure",
            "KV overcommit guard: 0 open, 1 closed to sheddable, 2 to standard and sheddable",
            labels, registry=r,
        )  # fmt: skip
        self.health = Gauge(
            "kvproxy_engine_health", "1 for the engine's current health state", [*labels, "state"],
            registry=r,
        )  # fmt: skip

    def refresh_engines(self, rows: Iterable[EngineGaugeRow], health_states: Iterable[str]) -> None:
        """Set every engine's gauges (an engine that left the fleet lost its series when it left:
        ``forget_engine``)."""
        states = tuple(health_states)
        out: dict[str, int] = {}
        for row in rows:
            key = (row.engine, row.pool)
            _set_optional(self.kv_usage, key, row.kv_usage)
            _set_optional(self.running, key, row.running)
            _set_optional(self.waiting, key, row.waiting)
            _set_optional(self.snapshot_age, key, row.snapshot_age_s)
            self.engine_inflight.labels(*key).set(row.inflight)
            self.breaker.labels(*key).set(BREAKER_VALUES.get(row.breaker, -1.0))
            self.outlier.labels(*key).set(OUTLIER_VALUES.get(row.outlier, -1.0))
            out[row.pool] = out.get(row.pool, 0) + (row.outlier != "active")
            self.pressure.labels(*key).set(row.pressure)
            for state in states:
                self.health.labels(*key, state).set(1.0 if state == row.health else 0.0)
        for pool, count in out.items():
            self.outliers_ejected.labels(pool).set(count)

    def engine_back(self, engine: str, pool: str) -> None:
        """``engine`` of ``pool`` joined the fleet (again): it is counted from now on."""
        self._departed.pop((engine, pool), None)
        self._departed_names.pop(engine, None)

    def forget_engine(self, engine: str, pool: str) -> None:
        """``engine`` of ``pool`` left the fleet (the fleet tells, ``Fleet``'s ``on_remove``):
        its series go now, not at the next render (an engine that comes and goes between two
        renders would leave them for good), and late counts for it are dropped (``Children``).
        Engine names are unique across the fleet's pools, so its scrape and error series go
        too."""
        key = (engine, pool)
        for gauge in (self.kv_usage, self.running, self.waiting, self.snapshot_age,
                      self.engine_inflight, self.breaker, self.outlier, self.pressure,
                      self.health):
            gauge.remove_by_labels({"engine": engine, "pool": pool})
        self.requests.remove_by_labels({"engine": engine, "pool": pool})
        self.requests_by.forget(_pool_engine(pool, engine))
        self.outlier_ejections.remove_by_labels({"engine": engine, "pool": pool})
        self.outlier_ejections_by.forget(_pool_engine(pool, engine))
        self.scrape_duration.remove_by_labels({"engine": engine})
        self.scrape_failures.remove_by_labels({"engine": engine})
        self.upstream_errors.remove_by_labels({"engine": engine})
        self.upstream_errors_by.forget(_pool_engine(None, engine))
        _remember(self._departed_names, engine)
        _remember(self._departed, key)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _pool_engine(pool: str | None, engine: str) -> Callable[[tuple[str, ...]], bool]:
    """Matches label values that start (pool, engine), or (engine) when ``pool`` is None."""
    def match(values: tuple[str, ...]) -> bool:
        if pool is None:
            return values[0] == engine
        return values[0] == pool and values[1] == engine
    return match


def _remember(departed: dict[K, None], key: K) -> None:
    departed[key] = None
    while len(departed) > _DEPARTED_KEPT:  # the oldest departures are let go
        del departed[next(iter(departed))]


def _set_optional(gauge: Gauge, key: tuple[str, str], value: float | None) -> None:
    # NaN says "never scraped" without inventing a zero that would read as idle.
    gauge.labels(*key).set(float("nan") if value is None else value)
