"""The saturation benchmark's pure parts: arrivals, the steps' figures, where TTFT p50 doubles."""

from __future__ import annotations

import itertools
import math
import random

from bench.saturation import (
    Step,
    markdown,
    rejudge,
    saturation,
    step_of,
    verdicts,
)
from bench.stats import RequestRecord
from bench.workloads import poisson_arrivals


def _step(rate: float, p50: float, *, failed: int = 0, tokens: float | None = None,
          cpu_ms: float | None = None) -> Step:
    return Step(rate=rate, ttft_p50_s=p50, ttft_p90_s=p50 * 2, judged=100, failed=failed,
                tokens_per_s=16 * rate if tokens is None else tokens, cpu_ms_per_request=cpu_ms,
                sent_per_s=rate)


def test_poisson_arrivals_have_the_rate_asked_for() -> None:
    offsets = poisson_arrivals(random.Random(3), 200.0, 50.0)
    assert all(0 <= a < b < 50.0 for a, b in itertools.pairwise(offsets))
    assert abs(len(offsets) / 50.0 - 200.0) < 10.0  # 10,000 expected, sd 100
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    cv = (sum((g - 1 / 200) ** 2 for g in gaps) / len(gaps)) ** 0.5 * 200
    assert 0.9 < cv < 1.1  # exponential gaps, not a metronome


def test_a_step_judges_only_what_was_sent_after_the_warm_up() -> None:
    def rec(sent: float, ttft: float | None, status: int = 200) -> RequestRecord:
        r = RequestRecord(index=0, target="x", sent_at=sent, status=status, ttft=ttft,
                          output_tokens=16)
        r.e2e = 0.1
        return r

    records = [rec(0.5, 9.0), rec(2.5, 0.010), rec(3.0, 0.020), rec(3.5, 0.030),
               rec(4.0, None, status=503)]
    step = step_of(100.0, records, warm_s=2.0, window_s=4.0, cpu_s=0.010)
    assert step.judged == 4 and step.failed == 1
    assert step.ttft_p50_s == 0.020  # the warm-up's 9 s is not in it
    assert step.tokens_per_s == 3 * 16 / 4.0
    assert step.cpu_ms_per_request == 10.0 / 5  # CPU over every request the step sent
    assert step.sent_per_s == 4 / 4.0


def test_saturation_is_where_the_p50_ratio_crosses_two_in_log_rate() -> None:
    steps = [_step(50, 0.010), _step(100, 0.015), _step(200, 0.025)]
    got = saturation(steps)
    assert got["reached"] and got["at_step"] == 200
    # 1.5 -> 2.5 crosses 2.0 halfway: the geometric mean of 100 and 200.
    assert math.isclose(float(str(got["rate"])), math.sqrt(100 * 200), rel_tol=1e-9)
    assert math.isclose(float(str(got["tokens_per_s"])), 16 * 150, rel_tol=1e-9)


def test_failures_saturate_at_the_rate_below_and_a_path_that_never_doubles_is_a_bound() -> None:
    failing = saturation([_step(50, 0.010), _step(100, 0.011), _step(200, 0.012, failed=5)])
    assert failing["reached"] and failing["rate"] == 100
    never = saturation([_step(50, 0.010), _step(100, 0.012), _step(200, 0.019)])
    assert not never["reached"] and never["rate"] == 200


def test_verdicts_compare_each_round_with_direct_s_and_read_the_router_s_cpu() -> None:
    direct = saturation([_step(50, 0.01), _step(400, 0.01)])
    busy = saturation([_step(50, 0.01, cpu_ms=1.0), _step(100, 0.015, cpu_ms=1.0),
                       _step(200, 0.025, cpu_ms=4.5)])  # 0.9 of a core at 200/s
    idle = saturation([_step(50, 0.01, cpu_ms=0.3), _step(100, 0.015, cpu_ms=0.3),
                       _step(200, 0.025, cpu_ms=0.3)])  # 0.06 of a core
    v = verdicts([{"direct": direct, "kvproxy/expected_ttft": busy, "vllm-router/x": idle}])
    assert not v["direct"]["all_reached"]
    kv = v["kvproxy/expected_ttft"]
    assert kv["all_reached"] and math.isclose(kv["over_direct"][0], math.sqrt(2e4) / 400)
    assert kv["reading"] == "the router saturated first (its cores busy)"
    assert v["vllm-router/x"]["reading"].startswith("below direct with its cores 0.06 busy")
    # On two cores the same CPU is half as busy.
    two = verdicts([{"direct": direct, "kvproxy/expected_ttft": busy}], router_cores=2)
    assert two["kvproxy/expected_ttft"]["busy_share"] == [0.45]
    text = markdown({"command": "x", "started_at": "t", "settings": {}, "verdicts": v,
                     "machine": {"cpu_model": "c", "nproc": 2, "python": "3",
                                 "load_avg_at_start": [0.1, 0.2, 0.3]}})
    assert "| `direct` | ≥ 400 |" in text
    row = ("| `kvproxy/expected_ttft` | 141 | 141 | 2400 | 0.35 | 0.90 | the router saturated "
           "first (its cores busy) |")
    assert row in text


def test_a_results_file_is_judged_again_from_its_steps() -> None:
    steps = [_step(50, 0.01, cpu_ms=1.0), _step(100, 0.015, cpu_ms=1.0),
             _step(200, 0.025, cpu_ms=4.5)]
    written = [dict(s.__dict__) for s in steps]
    written[0]["sent_per_s"] = None  # how a NaN comes back from JSON
    result: dict[str, object] = {"settings": {"router_cores": "0"},
                                 "rounds": [{"kvproxy/expected_ttft": written}]}
    again = rejudge(result)
    assert again["saturation"] == [{"kvproxy/expected_ttft": saturation(steps)}]
    assert again["verdicts"]["kvproxy/expected_ttft"]["busy_share"] == [0.9]  # type: ignore[index]
