"""Watching kvproxy from outside while it is under load: its event-loop lag and its telemetry's age.

Rules:
- Read only what kvproxy exports on ``/metrics``: ``kvproxy_event_loop_lag_seconds`` (a
  histogram: the lag p99 of a slice comes from the difference of its buckets before and after),
  ``kvproxy_engine_snapshot_age_seconds`` and ``kvproxy_engine_health`` (sampled every
  ``SAMPLE_S`` during the slice: the age of every engine's snapshot, and whether any is stale).
- A sample that does not answer within ``SAMPLE_TIMEOUT_S`` is recorded as such (a starved proxy
  is a finding, not an error of the benchmark).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.stats import percentile

SAMPLE_S = 0.25
SAMPLE_TIMEOUT_S = 2.0
LAG = "kvproxy_event_loop_lag_seconds"


def lag_buckets(text: str) -> dict[float, float]:
    """Cumulative counts of the lag histogram by upper bound (``inf`` included)."""
    out: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != LAG:
            continue
        for sample in family.samples:
            if sample.name == LAG + "_bucket":
                out[float(sample.labels["le"])] = sample.value
    return out


def histogram_quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float:
    """The q-quantile (0-1) of the observations between two readings, interpolated in buckets
    the way Prometheus does; NaN without observations."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return math.nan
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if math.isinf(bound):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 0.0)
        lower, below = bound, count
    return lower


@dataclass
class Watch:
    """Samples taken during one slice."""

    ages: list[float] = field(default_factory=list)
    stale_samples: int = 0
    samples: int = 0
    missed: int = 0
    latencies: list[float] = field(default_factory=list)

    def sample(self, text: str) -> None:
        self.samples += 1
        stale = False
        for family in text_string_to_metric_families(text):
            if family.name == "kvproxy_engine_snapshot_age_seconds":
                self.ages += [s.value for s in family.samples]
            elif family.name == "kvproxy_engine_health":
                stale |= any(s.labels.get("state") == "stale" and s.value > 0
                             for s in family.samples)
        self.stale_samples += int(stale)

    def summary(self) -> dict[str, float]:
        return {"scrape_age_p99_s": percentile(self.ages, 99),
                "scrape_age_max_s": max(self.ages, default=math.nan),
                "stale_samples": float(self.stale_samples), "samples": float(self.samples),
                "missed_samples": float(self.missed),
                "metrics_latency_p99_s": percentile(self.latencies, 99)}


async def metrics_text(session: aiohttp.ClientSession, base_url: str) -> str:
    async with asyncio.timeout(SAMPLE_TIMEOUT_S), session.get(base_url + "/metrics") as resp:
        return await resp.text()


async def watch(session: aiohttp.ClientSession, base_url: str, into: Watch,
                stop: asyncio.Event) -> None:
    """Sample ``/metrics`` every ``SAMPLE_S`` until ``stop`` is set."""
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            into.sample(await metrics_text(session, base_url))
            into.latencies.append(time.perf_counter() - t0)
        except (TimeoutError, aiohttp.ClientError):
            into.missed += 1
        try:
            async with asyncio.timeout(SAMPLE_S):
                await stop.wait()
        except TimeoutError:
            pass
