"""One exposition for several workers, and the per-pool autoscaling gauges."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.observe.merge import merge_expositions
from proxy.observe.signals import PoolGauges, PoolRow


def _worker(requests: int, inflight: float, kv: float, live: float, age: float) -> str:
    r = CollectorRegistry()
    Counter("kvproxy_requests", "r", ["pool"], registry=r).labels("t").inc(requests)
    Histogram("kvproxy_ttfb_seconds", "h", buckets=(1.0,), registry=r).observe(0.5)
    Gauge("kvproxy_inflight_requests", "i", registry=r).set(inflight)
    Gauge("kvproxy_engine_kv_usage", "k", ["engine"], registry=r).labels("e").set(kv)
    Gauge("kvproxy_sharing_live", "l", registry=r).set(live)
    Gauge("kvproxy_engine_snapshot_age_seconds", "a", ["engine"], registry=r).labels("e").set(age)
    return generate_latest(r).decode()


def _values(text: bytes) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            if not s.name.endswith("_created"):
                out[s.name + str(sorted(s.labels.items()))] = s.value
    return out


def test_counters_add_up_and_gauges_merge_by_meaning() -> None:
    merged = _values(merge_expositions([_worker(3, 2, 0.5, 1, 0.1), _worker(4, 1, math.nan, 0,
                                                                            0.3)]))  # fmt: skip
    assert merged["kvproxy_requests_total[('pool', 't')]"] == 7
    assert merged["kvproxy_ttfb_seconds_count[]"] == 2
    assert merged["kvproxy_ttfb_seconds_bucket[('le', '1.0')]"] == 2
    assert merged["kvproxy_inflight_requests[]"] == 3
    assert merged["kvproxy_engine_kv_usage[('engine', 'e')]"] == 0.5  # NaN loses
    assert merged["kvproxy_sharing_live[]"] == 0  # live only if every worker shares
    assert merged["kvproxy_engine_snapshot_age_seconds[('engine', 'e')]"] == 0.1


def test_pool_gauges_measure_the_shed_rate_over_a_window() -> None:
    r = CollectorRegistry()
    sheds = Counter("kvproxy_shed", "s", ["pool", "class", "reason"], registry=r)
    gauges = PoolGauges(r)
    rows = [PoolRow("target", 7.0, 0.4), PoolRow("draft", 0.0, None)]
    gauges.refresh(rows, sheds, now=0.0)
    sheds.labels("target", "standard", "kv").inc(30)
    gauges.refresh(rows, sheds, now=10.0)
    values = _values(generate_latest(r))
    assert values["kvproxy_pool_shed_rate[('pool', 'target')]"] == 3.0
    assert values["kvproxy_pool_shed_rate[('pool', 'draft')]"] == 0.0
    assert values["kvproxy_pool_queue_length[('pool', 'target')]"] == 7.0
    assert math.isnan(values["kvproxy_pool_kv_usage[('pool', 'draft')]"])
    gauges.refresh(rows, sheds, now=200.0)  # nothing shed in the last minute
    assert _values(generate_latest(r))["kvproxy_pool_shed_rate[('pool', 'target')]"] == 0.0


def test_held_requests_add_up_and_created_times_keep_the_earliest() -> None:
    def worker(held: float, created: float) -> str:
        r = CollectorRegistry()
        Gauge("kvproxy_held_requests", "h", ["pool"], registry=r).labels("t").set(held)
        text = generate_latest(r).decode()
        # A counter's _created, as prometheus-client writes it: a gauge family of its own.
        return text + ("# HELP kvproxy_requests_created r\n# TYPE kvproxy_requests_created gauge\n"
                       f'kvproxy_requests_created{{pool="t"}} {created}\n')

    merged = merge_expositions([worker(3, 1_800_000_100.0), worker(2, 1_800_000_000.0)])
    samples = {s.name: s.value for f in text_string_to_metric_families(merged.decode())
               for s in f.samples}
    assert samples["kvproxy_held_requests"] == 5
    assert samples["kvproxy_requests_created"] == 1_800_000_000.0
