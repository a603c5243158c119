"""Per-pool autoscaling signals: gauges meant for KEDA or an HPA, one series per pool.

Rules: refreshed right before each exposition, like the per-engine gauges. Queue length and KV
usage come from the engines' last scrapes as this proxy holds them (fresh engines only: a stale
figure would scale on the past). The expected wait is the routing cost model's
(``proxy.core.costmodel.expected_wait``) over the engines routing would consider, computed by the
fleet from the same views a request would be ranked on. The shed rate is measured over the last
``SHED_WINDOW_S`` from the proxy's own ``kvproxy_shed_total``, sampled at each exposition (so it
needs two expositions ``SHED_MIN_SPAN_S`` apart before it reads anything but 0). Merged over
workers, queue length, KV usage and the expected wait take the maximum (every worker scrapes the
same engines) and the shed rate adds up (``proxy.observe.merge``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

SHED_WINDOW_S = 60.0
SHED_MIN_SPAN_S = 1.0


@dataclass(frozen=True)
class PoolRow:
    pool: str
    waiting: float  # requests queued in the pool's fresh engines, plus those sent since
    kv_usage: float | None  # mean over the fresh engines; None: none is fresh
    # Seconds a typical new request would wait for its first token on the pool's best engine
    # (``proxy.core.costmodel.expected_wait``); None: no engine is routable.
    expected_wait_s: float | None = None


class PoolGauges:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.queue = Gauge(
            "kvproxy_pool_queue_length",
            "Requests waiting in the pool's engines (last scrape, plus those sent since)",
            ["pool"], registry=registry,
        )  # fmt: skip
        self.kv_usage = Gauge(
            "kvproxy_pool_kv_usage", "Mean KV-cache usage (0-1) of the pool's fresh engines",
            ["pool"], registry=registry,
        )  # fmt: skip
        self.shed_rate = Gauge(
            "kvproxy_pool_shed_rate",
            "Requests per second refused with 503 for this pool over the last minute",
            ["pool"], registry=registry,
        )  # fmt: skip
        self.expected_wait = Gauge(
            "kvproxy_pool_expected_wait_seconds",
            "Seconds a typical new request (the pool's mean prompt, nothing cached) would wait "
            "for its first token on the pool's best engine, from the routing cost model",
            ["pool"], registry=registry,
        )  # fmt: skip
        self._samples: dict[str, deque[tuple[float, float]]] = {}

    def refresh(self, rows: Iterable[PoolRow], sheds: Counter, now: float) -> None:
        totals = _shed_totals(sheds)
        for row in rows:
            self.queue.labels(row.pool).set(row.waiting)
            self.kv_usage.labels(row.pool).set(
                float("nan") if row.kv_usage is None else row.kv_usage
            )
            self.expected_wait.labels(row.pool).set(
                float("nan") if row.expected_wait_s is None else row.expected_wait_s
            )
            self.shed_rate.labels(row.pool).set(self._rate(row.pool, totals.get(row.pool, 0.0),
                                                           now))  # fmt: skip

    def _rate(self, pool: str, total: float, now: float) -> float:
        samples = self._samples.setdefault(pool, deque())
        samples.append((now, total))
        while len(samples) > 2 and now - samples[1][0] >= SHED_WINDOW_S:
            samples.popleft()
        start, first = samples[0]
        span = now - start
        return 0.0 if span < SHED_MIN_SPAN_S else max(0.0, total - first) / span


def _shed_totals(sheds: Counter) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in sheds.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                pool = sample.labels.get("pool", "")
                out[pool] = out.get(pool, 0.0) + sample.value
    return out
