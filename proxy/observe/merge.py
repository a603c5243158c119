"""One exposition for the whole proxy out of its workers' expositions (``--workers N``).

Rules:
- Counters, histograms and summaries add up per label set (each worker counts its own requests);
  their ``_created`` samples keep the earliest.
- Gauges merge by what they mean, per family name (``GAUGE_MERGE``): counts of things open in each
  worker add up (``sum``); whether sharing works holds only if it does in every worker (``min``);
  snapshot ages are the freshest worker's (``min``); everything else describes the engines or the
  whole proxy the same way in every worker (scraped figures, breaker and health states, draining),
  and the ``max`` over workers is taken. NaN (never scraped) loses to any number.
- Families and label sets appear in the order the first worker to report them used.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

GAUGE_MERGE: dict[str, str] = {
    "kvproxy_inflight_requests": "sum",
    "kvproxy_held_requests": "sum",
    "kvproxy_engine_inflight": "sum",
    "kvproxy_sharing_live": "min",
    "kvproxy_sharing_peers": "min",
    "kvproxy_engine_snapshot_age_seconds": "min",
    "kvproxy_pool_shed_rate": "sum",
    "kvproxy_client_connections": "sum",
    "kvproxy_client_connections_limit": "sum",
}


def _pick(rule: str, a: float, b: float) -> float:
    if math.isnan(a):
        return b
    if math.isnan(b):
        return a
    if rule == "sum":
        return a + b
    return min(a, b) if rule == "min" else max(a, b)


def _rule(family: Metric, sample: str) -> str:
    # prometheus-client writes a counter's ``_created`` as a gauge family of its own.
    if sample.endswith("_created") or family.name.endswith("_created"):
        return "min"
    if family.type == "gauge":
        return GAUGE_MERGE.get(family.name, "max")
    return "sum"


@dataclass
class _Family:
    metric: Metric
    values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)


def merge_expositions(texts: Iterable[str]) -> bytes:
    """The Prometheus text exposition of all of ``texts`` merged."""
    families: dict[str, _Family] = {}
    for text in texts:
        for metric in text_string_to_metric_families(text):
            fam = families.setdefault(metric.name, _Family(metric))
            for s in metric.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                old = fam.values.get(key)
                fam.values[key] = s.value if old is None else _pick(_rule(metric, s.name), old,
                                                                      s.value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(families.values())))
    return generate_latest(registry)


class _Merged:
    def __init__(self, families: list[_Family]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        for fam in self._families:
            out = Metric(fam.metric.name, fam.metric.documentation, fam.metric.type)
            for (name, labels), value in fam.values.items():
                out.add_sample(name, dict(labels), value)
            yield out
