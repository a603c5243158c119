"""Percentiles, run summaries, shares and ratios."""

import math

import pytest

from bench.stats import (
    RequestRecord,
    bootstrap_ci,
    engine_counts,
    percentile,
    ratio,
    share_max_over_mean,
    summarize,
    tokens_between,
)


def test_percentile_interpolates_like_numpy_linear():
    data = [1.0, 2.0, 3.0, 4.0]
    assert percentile(data, 50) == 2.5
    assert percentile(data, 90) == pytest.approx(3.7)
    assert percentile(data, 0) == 1.0
    assert percentile(data, 100) == 4.0
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def _rec(i, ttft, itl, tokens=3, status=200, error=None, engine="e0"):
    return RequestRecord(index=i, status=status, ttft=ttft, itl=itl, e2e=ttft + sum(itl),
                         output_tokens=tokens, engine=engine, error=error)


def test_summary_scales_latencies_and_throughput_to_trace_time():
    recs = [_rec(0, 0.1, [0.01, 0.03]), _rec(1, 0.3, [0.02])]
    s = summarize(recs, duration_s=2.0, time_scale=10.0)
    assert s["ttft_p50"] == pytest.approx(2.0)
    assert s["itl_p50"] == pytest.approx(0.2)
    assert s["throughput_tok_s"] == pytest.approx(6 / 20)
    assert s["completed"] == 2


def test_summary_counts_sheds_and_failures_apart():
    recs = [
        _rec(0, 0.1, []),
        RequestRecord(index=1, status=503, error="overloaded"),
        RequestRecord(index=2, status=429, error="rate"),
        RequestRecord(index=3, status=0, error="ClientConnectorError"),
        _rec(4, 0.1, [], error="stream ended without [DONE]"),
    ]
    s = summarize(recs, duration_s=1.0)
    assert (s["completed"], s["shed"], s["rate_limited"], s["failed"]) == (1, 1, 1, 2)


def test_summary_of_nothing_is_nan_not_an_error():
    s = summarize([], duration_s=0.0)
    assert math.isnan(s["ttft_p50"]) and math.isnan(s["throughput_tok_s"])


def test_share_max_over_mean_counts_idle_engines():
    assert share_max_over_mean({"a": 3.0, "b": 1.0}) == 1.5
    assert share_max_over_mean({"a": 4.0}, engines=["a", "b", "c", "d"]) == 4.0
    assert math.isnan(share_max_over_mean({}))


def test_engine_counts_ignore_unknown_engines():
    recs = [_rec(0, 0.1, [], engine="a"), _rec(1, 0.1, [], engine=None),
            _rec(2, 0.1, [], engine="a")]
    assert engine_counts(recs) == {"a": 2.0}


def test_ratio_handles_nan_and_zero():
    assert ratio(2.0, 4.0) == 0.5
    assert math.isnan(ratio(1.0, 0.0))
    assert math.isnan(ratio(float("nan"), 1.0))


def test_bootstrap_interval_brackets_the_statistic():
    values = [float(i) for i in range(1000)]
    lo, hi = bootstrap_ci(values, 90, resamples=200, seed=1)
    assert lo < percentile(values, 90) < hi
    assert hi - lo < 60
    assert all(math.isnan(v) for v in bootstrap_ci([], 90))


def test_tokens_between_counts_each_event_where_it_arrived():
    # First token at 1.0 + 0.5, then events 0.5 apart: 1.5, 2.0, 2.5, 3.0 (4 events, 8 tokens).
    two_per_event = RequestRecord(index=0, sent_at=1.0, status=200, ttft=0.5,
                                  itl=[0.5, 0.5, 0.5], output_tokens=8)
    one_per_event = RequestRecord(index=1, sent_at=0.0, status=200, ttft=2.2, itl=[1.0],
                                  output_tokens=2)  # events at 2.2 and 3.2
    failed = RequestRecord(index=2, sent_at=0.0, status=502, ttft=None)
    records = [two_per_event, one_per_event, failed]
    assert tokens_between(records, 2.0, 3.0) == 2 * 2 + 1  # 2.0 and 2.5; 2.2; 3.0 is outside
    assert tokens_between(records, 0.0, 10.0) == 8 + 2
    assert tokens_between(records, 3.5, 10.0) == 0
