"""The KV overcommit guard's pure core: projection, preemption rate, hysteresis, staleness."""

import pytest

from proxy.core.config import AdmissionConfig, Config, PressureConfig
from proxy.core.errors import ConfigError
from proxy.core.fleet_config import EngineConfig, PoolConfig
from proxy.core.pressure import (
    REASON_OVERCOMMIT,
    REASON_PREEMPTING,
    Level,
    PressureTracker,
    counter_delta,
    slope,
)
from proxy.core.telemetry import EngineSnapshot
from proxy.fleet.engines import Fleet

DT = 0.2  # scrape interval
ADM = AdmissionConfig()  # sheddable 0.85/0.75, standard 0.95/0.90


def tracker(**kw: object) -> PressureTracker:
    cfg = PressureConfig(**kw)  # type: ignore[arg-type]
    return PressureTracker(cfg, sheddable=ADM.sheddable, standard=ADM.standard, interval_s=DT,
                           stale_after_s=1.0)


def feed(t: PressureTracker, kvs: list[float], preempt: list[float] | None = None,
         start: float = 0.0) -> float:
    """Feed one snapshot per interval; returns the time of the last one."""
    counts = preempt if preempt is not None else [0.0] * len(kvs)
    at = start
    for i, (kv, p) in enumerate(zip(kvs, counts, strict=True)):
        at = start + i * DT
        t.observe(at, kv, p)
    return at


def test_slope_and_counter_delta() -> None:
    assert slope([(0.0, 0.1), (1.0, 0.3), (2.0, 0.5)]) == pytest.approx(0.2)
    assert slope([(0.0, 0.5)]) == 0.0
    assert slope([(1.0, 0.5), (1.0, 0.7)]) == 0.0
    assert counter_delta(10, 13) == 3
    assert counter_delta(10, 2) == 2  # reset: counted from zero again


def test_growth_projected_over_the_horizon_closes_sheddable_before_the_threshold() -> None:
    t = tracker()
    # 0.60 -> 0.76 in 0.8 s: 0.2/s, three intervals ahead adds 0.12 -> 0.88 >= 0.85.
    now = feed(t, [0.60, 0.64, 0.68, 0.72, 0.76])
    p = t.pressure(now)
    assert p.level is Level.SHEDDABLE
    assert p.reason == REASON_OVERCOMMIT
    assert p.projected_kv == pytest.approx(0.88)


def test_growth_that_this_proxys_commitments_explain_closes_nothing_twice() -> None:
    t = tracker()
    now = feed(t, [0.60, 0.64, 0.68, 0.72, 0.76])  # projected 0.88, as above
    # What this proxy's requests in flight still owe takes the engine to 0.89: the growth is
    # theirs, already judged against the committed marks (0.89 < sheddable's 0.90): open.
    t.commit(0.89, 16_000)
    assert t.pressure(now).level is Level.OPEN
    # They owe less than the engine is growing by: someone else's work, the projection closes.
    t.commit(0.80, 16_000)
    p = t.pressure(now)
    assert (p.level, p.reason) == (Level.SHEDDABLE, REASON_OVERCOMMIT)
    t.commit(None)  # commitments unknown: the projection alone, as without them
    assert t.pressure(now).reason == REASON_OVERCOMMIT


def test_flat_kv_below_threshold_stays_open() -> None:
    t = tracker()
    now = feed(t, [0.80] * 6)
    assert t.pressure(now).level is Level.OPEN


def test_falling_kv_earns_no_credit() -> None:
    t = tracker()
    now = feed(t, [0.99, 0.97, 0.96])
    p = t.pressure(now)
    assert p.projected_kv == pytest.approx(0.96)
    assert p.level is Level.STANDARD  # 0.96 >= standard's 0.95


def test_fast_growth_closes_standard_too() -> None:
    t = tracker()
    now = feed(t, [0.50, 0.60, 0.70, 0.80])
    assert t.pressure(now).level is Level.STANDARD


def test_zero_horizon_judges_current_usage_only() -> None:
    t = tracker(horizon_scrapes=0)
    now = feed(t, [0.50, 0.60, 0.70, 0.80])
    assert t.pressure(now).level is Level.OPEN


def test_kv_hysteresis_opens_only_below_admit_below() -> None:
    t = tracker()
    now = feed(t, [0.86, 0.86])
    assert t.pressure(now).level is Level.SHEDDABLE
    now = feed(t, [0.80, 0.80, 0.80, 0.80, 0.80, 0.80, 0.80], start=now + DT)
    assert t.pressure(now).level is Level.SHEDDABLE  # between 0.75 and 0.85: still closed
    now = feed(t, [0.70, 0.70, 0.70, 0.70, 0.70, 0.70], start=now + DT)
    assert t.pressure(now).level is Level.OPEN


def test_first_preemption_closes_sheddable_sustained_ones_standard() -> None:
    t = tracker()
    now = feed(t, [0.5, 0.5, 0.5], [7, 7, 8])
    p = t.pressure(now)
    assert (p.level, p.reason) == (Level.SHEDDABLE, REASON_PREEMPTING)
    assert p.preemptions_per_s == pytest.approx(1 / 0.4)
    now = feed(t, [0.5], [9], start=now + DT)
    assert t.pressure(now).level is Level.STANDARD


def test_preemption_closing_holds_then_lapses() -> None:
    t = tracker(hold_scrapes=3)
    now = feed(t, [0.5, 0.5], [0, 1])
    assert t.pressure(now).level is Level.SHEDDABLE
    assert t.pressure(now + 2.5 * DT).level is Level.SHEDDABLE
    assert t.pressure(now + 3.5 * DT).level is Level.OPEN  # hold ran out between snapshots
    # New snapshots without preemptions: the window forgets the old one, the hold ends.
    later = feed(t, [0.5] * 16, [1] * 16, start=now + DT)
    assert t.pressure(later).level is Level.OPEN


def test_counter_reset_is_not_a_negative_rate_and_counts_what_happened_since() -> None:
    t = tracker()
    now = feed(t, [0.5, 0.5, 0.5], [40, 40, 0])
    assert t.pressure(now).level is Level.OPEN  # restarted at 0: nothing happened since
    t2 = tracker()
    now = feed(t2, [0.5, 0.5, 0.5], [40, 40, 2])
    p = t2.pressure(now)
    assert p.level is Level.SHEDDABLE and p.reason == REASON_PREEMPTING
    assert p.preemptions_per_s >= 0


def test_stale_snapshot_never_counts() -> None:
    t = tracker()
    now = feed(t, [0.9, 0.95, 0.99], [0, 5, 9])
    assert t.pressure(now).level is Level.STANDARD
    assert t.pressure(now + 1.01).level is Level.OPEN  # last snapshot older than stale_after_s


def test_gap_restarts_the_window() -> None:
    t = tracker()
    feed(t, [0.10, 0.10], [0, 0])
    # 5 s later: neither the KV jump nor the counter's rise is measured across the blind spot.
    t.observe(5.0, 0.60, 50)
    p = t.pressure(5.0)
    assert p.level is Level.OPEN
    assert p.projected_kv == pytest.approx(0.60)


def test_old_or_repeated_snapshots_are_ignored() -> None:
    t = tracker()
    now = feed(t, [0.5, 0.5, 0.5], [0, 0, 0])
    t.observe(now, 0.5, 99)  # same time: no news
    t.observe(now - 0.1, 0.5, 99)  # older
    assert t.pressure(now).level is Level.OPEN


def test_remote_level_merges_by_maximum_until_it_expires() -> None:
    t = tracker()
    now = feed(t, [0.5, 0.5], [0, 0])
    t.apply_remote(Level.STANDARD, REASON_PREEMPTING, expires_at=now + 0.5)
    p = t.pressure(now)
    assert (p.level, p.reason, p.remote) == (Level.STANDARD, REASON_PREEMPTING, True)
    assert t.local(now).level is Level.OPEN  # never republished as our own
    assert t.pressure(now + 0.6).level is Level.OPEN
    t.apply_remote(Level.OPEN, "", expires_at=now + 5)
    assert t.pressure(now).level is Level.OPEN


@pytest.mark.parametrize(
    ("field", "value"),
    [("horizon_scrapes", -1), ("window_scrapes", 1), ("escalate_scrapes", 0),
     ("escalate_scrapes", 9), ("hold_scrapes", -1)],
)
def test_config_validation_names_the_field(field: str, value: int) -> None:
    with pytest.raises(ConfigError) as info:
        PressureConfig(**{field: value})  # type: ignore[arg-type]
    assert info.value.field == field


def test_fleet_views_carry_the_guard_and_admin_shows_why() -> None:
    pool = PoolConfig("target", "m", (EngineConfig("e", "http://127.0.0.1:9"),))
    fleet = Fleet(Config(pools=(pool,)))
    engine = fleet.get("e")
    for i, preempted in enumerate([0, 0, 3]):
        snap = EngineSnapshot(taken_at=i * DT, kv_usage=0.5, running=1, waiting=0,
                              preemptions=preempted)
        engine.state.on_scrape_ok(snap, i * DT)
        fleet.tick(i * DT, 1.0)
    view = fleet.views("target", 2 * DT)[0]
    assert view.pressure.level is Level.SHEDDABLE
    row = fleet.admin_view(2 * DT)[0]["pressure"]
    assert row["closed_to"] == ["sheddable"] and row["reason"] == REASON_PREEMPTING
    assert fleet.gauge_rows(2 * DT)[0].pressure == 1
    off = Fleet(Config(pools=(pool,), pressure=PressureConfig(enabled=False)))
    assert off.get("e").pressure is None


def test_the_local_judgement_carries_the_snapshot_figures_and_the_commitments() -> None:
    # Built field by field rather than copied from the snapshot's judgement: nothing may be lost.
    t = tracker()
    at = feed(t, [0.60, 0.64, 0.68, 0.72, 0.76], preempt=[0, 0, 2, 2, 5])
    t.commit(0.9712345, 64_000)
    p = t.local(at)
    judged = t._state
    assert (p.projected_kv, p.preemptions_per_s) == (judged.projected_kv, judged.preemptions_per_s)
    assert p.projected_kv is not None and p.projected_kv > 0.76 and p.preemptions_per_s > 0
    assert (p.level, p.reason, p.evidence) == (Level.STANDARD, REASON_PREEMPTING, Level.STANDARD)
    assert (p.committed_kv, p.capacity_tokens, p.remote) == (0.9712, 64_000, False)
    assert t.local(at) is p  # nothing changed: the same object
