"""Statistics over per-request records: percentiles, summaries, engine shares, ratios.

Rules:
- Pure functions over plain data; no numpy (the benchmarks run in the project's own venv).
- Percentiles interpolate linearly between order statistics (numpy's default, "linear").
- A summary of an empty set is made of NaNs, never an exception: a run where every request failed
  must still produce a report that says so.
- ``time_scale`` multiplies every latency, so that a replay compressed in time reports trace time.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

NAN = float("nan")


@dataclass
class RequestRecord:
    """What the load generator observed for one request (seconds of wall-clock time)."""

    index: int
    target: str = ""  # which endpoint served it: "direct", "kvproxy", a peer's name...
    sent_at: float = 0.0  # relative to the start of the run
    status: int = 0  # HTTP status; 0 when the connection failed
    ttft: float | None = None  # to the first token-bearing event
    itl: list[float] = field(default_factory=list)  # gaps between token-bearing events
    e2e: float | None = None
    output_tokens: int = 0  # usage.completion_tokens when reported, else token events
    engine: str | None = None  # serving engine, from a response header when there is one
    error: str | None = None  # transport or stream error; None when the stream completed
    retry_after_s: float | None = None  # a refusal's ``Retry-After``, in seconds
    retries: int = 0  # refusals retried before this record's attempt (``bench.clients``)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.ttft is not None


def percentile(values: Sequence[float], q: float) -> float:
    """q in [0, 100]; NaN for no values."""
    if not values:
        return NAN
    data = sorted(values)
    if len(data) == 1:
        return data[0]
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else NAN


def summarize(
    records: Sequence[RequestRecord], *, duration_s: float, time_scale: float = 1.0
) -> dict[str, float]:
    """Latency percentiles (scaled), throughput and failure counts of one run or slice.

    ``duration_s`` is the wall-clock span the throughput is measured over; throughput is reported
    per *scaled* second, i.e. in trace time for a compressed replay.
    """
    ok = [r for r in records if r.ok]
    ttft = [r.ttft * time_scale for r in ok if r.ttft is not None]
    itl = [gap * time_scale for r in ok for gap in r.itl]
    e2e = [r.e2e * time_scale for r in ok if r.e2e is not None]
    tokens = sum(r.output_tokens for r in ok)
    scaled = duration_s * time_scale
    return {
        "requests": float(len(records)),
        "completed": float(len(ok)),
        "shed": float(sum(1 for r in records if r.status == 503)),
        "rate_limited": float(sum(1 for r in records if r.status == 429)),
        "failed": float(sum(1 for r in records if not r.ok and r.status not in (429, 503))),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p90": percentile(ttft, 90),
        "ttft_p99": percentile(ttft, 99),
        "itl_p50": percentile(itl, 50),
        "itl_p99": percentile(itl, 99),
        "e2e_p50": percentile(e2e, 50),
        "e2e_p99": percentile(e2e, 99),
        "output_tokens": float(tokens),
        "throughput_tok_s": tokens / scaled if scaled > 0 else NAN,
        "throughput_req_s": len(ok) / scaled if scaled > 0 else NAN,
    }


def tokens_between(records: Iterable[RequestRecord], lo: float, hi: float) -> float:
    """Output tokens that reached the client in ``[lo, hi)`` (seconds since the run's start).

    Each token-bearing event of a completed request arrived at ``sent_at + ttft`` plus the gaps
    before it; each counts its request's tokens per event (one, unless an event carries several,
    as with speculative decoding)."""
    total = 0.0
    for r in records:
        if not r.ok or r.ttft is None:
            continue
        events = 1 + len(r.itl)
        per_event = r.output_tokens / events if r.output_tokens else 1.0
        at = r.sent_at + r.ttft
        inside = 1 if lo <= at < hi else 0
        for gap in r.itl:
            at += gap
            if at >= hi:
                break
            if at >= lo:
                inside += 1
        total += inside * per_event
    return total


def share_max_over_mean(counts: Mapping[str, float], engines: Iterable[str] = ()) -> float:
    """Busiest engine's request count over the mean; engines with no requests count as 0."""
    merged = dict.fromkeys(engines, 0.0)
    merged.update(counts)
    if not merged:
        return NAN
    avg = sum(merged.values()) / len(merged)
    return max(merged.values()) / avg if avg > 0 else NAN


def engine_counts(records: Iterable[RequestRecord]) -> dict[str, float]:
    return {k: float(v) for k, v in Counter(r.engine for r in records if r.engine).items()}


def ratio(value: float, reference: float) -> float:
    if math.isnan(value) or math.isnan(reference) or reference == 0:
        return NAN
    return value / reference


def hit_rate_from_deltas(hits: float, queries: float) -> float:
    return hits / queries if queries > 0 else NAN


def bootstrap_ci(
    values: Sequence[float], q: float, *, resamples: int = 400, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Bootstrap interval of the q-th percentile: the sampling noise of one run's figure."""
    if not values:
        return NAN, NAN
    rng = random.Random(seed)
    n = len(values)
    stats = sorted(
        percentile([values[rng.randrange(n)] for _ in range(n)], q) for _ in range(resamples)
    )
    tail = (1.0 - level) / 2.0 * 100.0
    return percentile(stats, tail), percentile(stats, 100.0 - tail)
