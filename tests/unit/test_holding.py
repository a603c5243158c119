"""Holding (``proxy.core.holding``): which refusals wait for room, for how long, in what order, and
the Retry-After of one that waited in vain (pure: no sockets, no clock)."""

import pytest

from proxy.core.admission import REASON_KV, Priority
from proxy.core.config import ClassThreshold, PressureConfig
from proxy.core.configload import load_config
from proxy.core.errors import ConfigError
from proxy.core.holding import (
    DEADLINE_MARGIN_S,
    MAX_RETRY_AFTER_S,
    REASON_HOLD_FULL,
    DrainRate,
    Hold,
    HoldQueue,
    Refuse,
    committed_mark,
    holdable,
    retry_after,
    room_short,
)
from proxy.core.pressure import REASON_COMMITTED, REASON_OVERCOMMIT, REASON_PREEMPTING, Pressure
from proxy.core.routing import EngineView

STD, SHED, CRIT = Priority.STANDARD, Priority.SHEDDABLE, Priority.CRITICAL
CFG = PressureConfig(hold_standard_s=4.0, hold_sheddable_s=15.0, hold_max_requests=3)


def test_defaults_hold_standard_briefly_and_sheddable_a_little_longer() -> None:
    cfg = PressureConfig()
    assert (cfg.hold_standard_s, cfg.hold_sheddable_s, cfg.hold_max_requests) == (1.0, 4.0, 256)


def test_a_committed_refusal_is_held_for_its_class_bound() -> None:
    q = HoldQueue(CFG)
    assert q.offer(1, STD, REASON_COMMITTED, now=100.0, in_flight=1) == Hold(104.0)
    assert q.offer(2, SHED, REASON_COMMITTED, now=100.0, in_flight=1) == Hold(115.0)
    assert len(q) == 2


@pytest.mark.parametrize("reason", [REASON_COMMITTED, REASON_OVERCOMMIT, REASON_KV,
                                    REASON_PREEMPTING])
def test_refusals_for_load_are_held_while_this_proxys_answers_can_free_room(reason: str) -> None:
    q = HoldQueue(CFG)
    assert isinstance(q.offer(1, SHED, reason, now=0.0, in_flight=3), Hold)
    # Nothing of this proxy's in flight: the load is someone else's and nothing says when it
    # ends, so the request is refused now.
    assert q.offer(2, SHED, reason, now=0.0, in_flight=0) == Refuse(reason)
    assert len(q) == 1
    assert holdable(reason, 1) and not holdable(reason, 0)


@pytest.mark.parametrize("reason", ["telemetry_stale", "no_routable_engine",
                                    "engine_connections_full"])
def test_refusals_for_anything_but_load_are_not_held(reason: str) -> None:
    q = HoldQueue(CFG)
    assert q.offer(1, SHED, reason, now=0.0, in_flight=3) == Refuse(reason)
    assert len(q) == 0
    assert not holdable(reason, 3)


def test_critical_and_zero_bound_classes_are_never_held() -> None:
    q = HoldQueue(PressureConfig(hold_sheddable_s=0.0))
    assert q.offer(1, SHED, REASON_COMMITTED, now=0.0, in_flight=1) == Refuse(REASON_COMMITTED)
    assert q.offer(2, CRIT, REASON_COMMITTED, now=0.0, in_flight=1) == Refuse(REASON_COMMITTED)
    assert isinstance(q.offer(3, STD, REASON_COMMITTED, now=0.0, in_flight=1), Hold)


def test_a_full_queue_refuses_at_once() -> None:
    q = HoldQueue(CFG)
    for ticket in (1, 2, 3):
        assert isinstance(q.offer(ticket, SHED, REASON_COMMITTED, now=0.0, in_flight=1), Hold)
    assert q.offer(4, STD, REASON_COMMITTED, now=0.0, in_flight=1) == Refuse(REASON_HOLD_FULL)
    q.remove(2)
    assert isinstance(q.offer(4, STD, REASON_COMMITTED, now=0.0, in_flight=1), Hold)


def test_the_clients_deadline_shortens_the_hold_and_leaves_time_to_answer() -> None:
    q = HoldQueue(CFG)
    assert q.offer(1, SHED, REASON_COMMITTED, now=10.0, in_flight=1, deadline=13.0) == Hold(
        13.0 - DEADLINE_MARGIN_S)
    assert q.offer(2, SHED, REASON_COMMITTED, now=10.0, in_flight=1, deadline=60.0) == Hold(25.0)
    # No time left to wait and still be answered: refused now, not held in vain.
    late = q.offer(3, SHED, REASON_COMMITTED, now=10.0, in_flight=1, deadline=10.5)
    assert late == Refuse(REASON_COMMITTED)


def test_fifo_within_a_class_and_standard_before_sheddable() -> None:
    q = HoldQueue(PressureConfig())
    for ticket, cls in [(1, SHED), (2, STD), (3, SHED), (4, STD)]:
        q.offer(ticket, cls, REASON_COMMITTED, now=float(ticket), in_flight=1)
    assert q.heads() == [2, 1]
    assert (q.head(STD), q.head(SHED), q.head(CRIT)) == (2, 1, None)
    q.remove(2)
    q.remove(1)
    assert q.heads() == [4, 3]


def test_new_work_queues_behind_held_work_of_its_class_or_a_higher_one() -> None:
    q = HoldQueue(PressureConfig())
    assert not any(q.must_queue(c) for c in (CRIT, STD, SHED))
    q.offer(1, SHED, REASON_COMMITTED, now=0.0, in_flight=1)
    assert (q.must_queue(CRIT), q.must_queue(STD), q.must_queue(SHED)) == (False, False, True)
    q.offer(2, STD, REASON_COMMITTED, now=0.0, in_flight=1)
    assert (q.must_queue(CRIT), q.must_queue(STD), q.must_queue(SHED)) == (False, True, True)
    q.remove(1)
    q.remove(2)
    assert not any(q.must_queue(c) for c in (CRIT, STD, SHED))


def view(committed: float | None, capacity: int | None = 10_000, *, fresh: bool = True,
         routable: bool = True, usage: float = 0.5) -> EngineView:
    return EngineView(name="e", routable=routable, fresh=fresh, load=0.0, kv_usage=usage,
                      pressure=Pressure(committed_kv=committed, capacity_tokens=capacity))


def test_room_short_is_what_the_emptiest_fresh_engine_must_free() -> None:
    views = [view(0.95), view(0.92), view(0.10, fresh=False), view(0.10, routable=False)]
    # 0.92 of 10 000 against a 0.90 mark: 200 over, plus the 500 the request needs.
    assert room_short(views, 0.90, 500.0) == pytest.approx(700.0)
    assert room_short([view(0.50)], 0.90, 500.0) == 0.0  # it fits
    assert room_short([view(None), view(0.5, capacity=None)], 0.90, 500.0) is None


def test_a_refusal_for_reported_usage_waits_for_the_usage_to_fall_under_its_mark() -> None:
    # Commitments show room, the reported usage does not: 0.93 against a 0.75 re-admission mark
    # is 1 800 of 10 000 tokens to free on the emptier engine (the fuller one needs more).
    views = [view(0.40, usage=0.93), view(0.40, usage=0.97)]
    assert room_short(views, 0.90, 500.0) == 0.0
    assert room_short(views, 0.90, 500.0, usage_mark=0.75) == pytest.approx(1_800.0)
    assert room_short(views, None, 500.0, usage_mark=0.75) == pytest.approx(1_800.0)
    # Whichever is further from its mark on an engine is what it must free.
    assert room_short([view(0.95, usage=0.80)], 0.90, 500.0, usage_mark=0.75) == pytest.approx(
        1_000.0)


def test_committed_marks_by_class() -> None:
    cfg = PressureConfig(committed_sheddable=ClassThreshold(0.8, 0.7))
    assert committed_mark(cfg, SHED) == 0.8
    assert committed_mark(cfg, STD) == cfg.committed_standard.shed_above
    assert committed_mark(cfg, CRIT) is None


def test_drain_rate_is_tokens_freed_per_second_over_its_window() -> None:
    d = DrainRate(window_s=10.0)
    assert d.seconds_for(1000.0, now=0.0) is None  # nothing ended yet: unknown
    for t in range(10):
        d.ended(float(t), 500.0)  # 500 tokens a second
    assert d.seconds_for(1000.0, now=10.0) == pytest.approx(2.0)
    # Answers that ended longer ago than the window no longer count.
    assert d.seconds_for(1000.0, now=30.0) is None
    d.ended(30.0, 0.0)  # nothing freed: ignored
    assert d.seconds_for(1000.0, now=30.0) is None


def test_a_young_drain_rate_is_not_inflated_by_its_short_history() -> None:
    d = DrainRate(window_s=10.0)
    d.ended(5.0, 400.0)
    # One answer a moment ago: measured over at least a second, not over no time at all.
    assert d.seconds_for(400.0, now=5.0) == pytest.approx(1.0)


def test_the_drain_rate_after_a_quiet_spell_reads_as_in_a_fresh_process() -> None:
    # The same recent answers give the same rate whatever came (and went) long before them.
    old, fresh = DrainRate(window_s=10.0), DrainRate(window_s=10.0)
    old.ended(0.0, 1000.0)
    for d in (old, fresh):
        d.ended(300.0, 1000.0)
    assert old.seconds_for(2000.0, now=300.5) == fresh.seconds_for(2000.0, now=300.5)
    assert fresh.seconds_for(2000.0, now=300.5) == pytest.approx(2.0)


@pytest.mark.parametrize(("drain_s", "expected"), [
    (None, 2), (float("inf"), 2), (0.0, 1), (0.2, 1), (3.1, 4), (1e9, MAX_RETRY_AFTER_S)])
def test_retry_after_is_the_drain_time_in_whole_bounded_seconds(
    drain_s: float | None, expected: int
) -> None:
    assert retry_after(drain_s, fallback_s=2) == expected


@pytest.mark.parametrize(("key", "value"), [("hold_standard_s", -1.0),
                                            ("hold_sheddable_s", 301.0),
                                            ("hold_sheddable_s", float("nan")),
                                            ("hold_max_requests", -1)])
def test_hold_settings_are_validated_by_name(key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=key):
        PressureConfig(**{key: value})


def test_hold_settings_load_from_env_and_overrides() -> None:
    cfg = load_config(None, {"KVPROXY_PRESSURE_HOLD_SHEDDABLE_S": "30"},
                      ["pressure.hold_standard_s=0", "pressure.hold_max_requests=8"])
    assert (cfg.pressure.hold_standard_s, cfg.pressure.hold_sheddable_s,
            cfg.pressure.hold_max_requests) == (0.0, 30.0, 8)
