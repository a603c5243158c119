"""kvproxy's garbage collections during a slice, read from its ``/metrics``.

Rules:
- Read only ``kvproxy_gc_pause_seconds{generation}`` (a histogram fed by the collector's
  callbacks): a slice's collections are the difference of its buckets before and after, summed
  over the slices of one router; a proxy that does not export it yields an empty tally.
- Report per generation: collections per second of the slices' span, the pause p50/p99
  (interpolated in buckets) and the total pause per second (from the histogram's sum).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from bench.proxywatch import histogram_quantile

GC = "kvproxy_gc_pause_seconds"

Buckets = dict[float, float]


def gc_buckets(text: str) -> dict[str, tuple[Buckets, float]]:
    """Per generation: cumulative bucket counts by upper bound and the sum of pauses."""
    out: dict[str, tuple[Buckets, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != GC:
            continue
        for sample in family.samples:
            buckets, _ = out.setdefault(sample.labels["generation"], ({}, 0.0))
            if sample.name == GC + "_bucket":
                buckets[float(sample.labels["le"])] = sample.value
            elif sample.name == GC + "_sum":
                out[sample.labels["generation"]] = (buckets, sample.value)
    return out


@dataclass
class Tally:
    """One router's collections over its slices."""

    buckets: dict[str, Buckets] = field(default_factory=dict)
    sums: dict[str, float] = field(default_factory=dict)

    def add(self, before: str, after: str) -> None:
        start, end = gc_buckets(before), gc_buckets(after)
        for gen, (bounds, total) in end.items():
            first, first_total = start.get(gen, ({}, 0.0))
            into = self.buckets.setdefault(gen, {})
            for bound, count in bounds.items():
                into[bound] = into.get(bound, 0.0) + count - first.get(bound, 0.0)
            self.sums[gen] = self.sums.get(gen, 0.0) + total - first_total

    def summary(self, seconds: float) -> dict[str, dict[str, float]]:
        out = {}
        for gen, bounds in sorted(self.buckets.items()):
            count = bounds.get(float("inf"), 0.0)
            out[gen] = {"per_s": count / seconds if seconds > 0 else 0.0,
                        "pause_p50_s": histogram_quantile(0.5, {}, bounds),
                        "pause_p99_s": histogram_quantile(0.99, {}, bounds),
                        "pause_s_per_s": self.sums.get(gen, 0.0) / seconds if seconds else 0.0}
        return out
