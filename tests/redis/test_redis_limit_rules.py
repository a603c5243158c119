"""Limit arithmetic and the in-process limit store (pure, clock passed in)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.door_config import LimitsConfig
from proxy.core.errors import ConfigError
from proxy.core.limit_rules import Limits, LocalLimits, bucket_level, retry_after_header, wait_until


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@settings(deadline=None)
@given(st.floats(-1000, 1000), st.floats(0, 100), st.floats(0, 1000), st.integers(1, 10_000))
def test_bucket_refills_linearly_up_to_capacity(
    level: float, updated: float, elapsed: float, per_min: int
) -> None:
    now = updated + elapsed
    got = bucket_level(level, updated, now, per_min)
    assert got <= per_min
    assert got == pytest.approx(min(per_min, level + elapsed * per_min / 60))
    assert bucket_level(None, updated, now, per_min) == per_min


@settings(deadline=None)
@given(st.floats(-1000, 1000), st.floats(0.5, 100), st.integers(1, 10_000))
def test_wait_until_is_the_refill_inverse(level: float, need: float, per_min: int) -> None:
    wait = wait_until(level, need, per_min)
    if level >= need:
        assert wait == 0
    else:
        assert bucket_level(level, 0.0, wait, per_min) == pytest.approx(min(per_min, need))


def test_retry_after_is_whole_and_positive() -> None:
    assert retry_after_header(0) == 1
    assert retry_after_header(0.01) == 1
    assert retry_after_header(1.2) == 2


def test_requests_per_minute() -> None:
    clock = Clock()
    store = LocalLimits(clock)
    limits = Limits(requests_per_min=3)
    verdicts = [store.admit("t", limits, f"l{i}", 30) for i in range(4)]
    assert [v.allowed for v in verdicts] == [True, True, True, False]
    assert verdicts[-1].limit == "requests_per_min"
    assert verdicts[-1].retry_after_s == pytest.approx(20.0)
    clock.now += 20
    assert store.admit("t", limits, "l5", 30).allowed
    assert store.admit("other", limits, "l6", 30).allowed  # tenants are separate


def test_tokens_per_minute_charges_on_settle_and_allows_debt() -> None:
    clock = Clock()
    store = LocalLimits(clock)
    limits = Limits(tokens_per_min=600)
    assert store.admit("t", limits, "a", 30).allowed
    store.settle("t", limits, "a", 900)  # overshoot: bucket at -300
    verdict = store.admit("t", limits, "b", 30)
    assert not verdict.allowed and verdict.limit == "tokens_per_min"
    assert verdict.retry_after_s == pytest.approx(301 * 60 / 600)
    clock.now += verdict.retry_after_s
    assert store.admit("t", limits, "c", 30).allowed


def test_concurrent_streams_and_lease_expiry() -> None:
    clock = Clock()
    store = LocalLimits(clock)
    limits = Limits(concurrent_streams=2)
    assert store.admit("t", limits, "a", 30).allowed
    assert store.admit("t", limits, "b", 30).allowed
    refused = store.admit("t", limits, "c", 30)
    assert not refused.allowed and refused.limit == "concurrent_streams"
    store.settle("t", limits, "a", 0)
    assert store.admit("t", limits, "c", 30).allowed
    clock.now += 20
    store.renew("t", ["b"], 30)
    clock.now += 15  # "c" expired (a dead replica's lease), "b" was renewed
    assert store.streams("t") == 2
    assert store.admit("t", limits, "d", 30).allowed
    assert store.streams("t") == 2


def test_a_refusal_takes_nothing() -> None:
    clock = Clock()
    store = LocalLimits(clock)
    limits = Limits(requests_per_min=1, concurrent_streams=1)
    assert store.admit("t", limits, "a", 300).allowed
    clock.now += 60  # request bucket full again, but the stream slot is taken
    assert not store.admit("t", limits, "b", 300).allowed
    store.settle("t", limits, "a", 0)
    assert store.admit("t", limits, "c", 300).allowed


def test_limits_config_overrides_per_tenant() -> None:
    cfg = LimitsConfig.from_mapping(
        {"enabled": True, "requests_per_min": 10,
         "tenants": [{"name": "big", "requests_per_min": 0, "concurrent_streams": 4}]},
        "limits",
    )  # fmt: skip
    assert cfg.for_tenant("small") == Limits(10, 0, 0)
    assert cfg.for_tenant("big") == Limits(0, 0, 4)
    with pytest.raises(ConfigError) as exc:
        LimitsConfig.from_mapping({"tenants": [{"name": "x", "tokens_per_min": -1}]}, "limits")
    assert exc.value.field == "limits.tenants[0].tokens_per_min"
    # The overrides' index is the class's own state, not a setting.
    with pytest.raises(ConfigError) as exc:
        LimitsConfig.from_mapping({"_by_name": {}}, "limits")
    assert exc.value.field == "limits._by_name"
