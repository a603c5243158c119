"""Scrapes that time out prove an engine slow, not gone: it goes STALE (still routable) and is
called UNHEALTHY only after a long silence; errors it answers still count at once."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proxy.core.engine_state import EngineState, Health
from proxy.core.telemetry import EngineSnapshot


def snap(at: float) -> EngineSnapshot:
    return EngineSnapshot(taken_at=at, kv_usage=0.1, running=1.0, waiting=0.0)


def health(s: EngineState) -> Health:
    return s.health  # read through a call, so the type checker does not narrow across moves


def state() -> EngineState:
    # silent limit: 3 failures x 1.0 s stale period = 3.0 s
    return EngineState("e0", "target", "http://e0", stale_after_s=1.0, unhealthy_after_failures=3)


def test_timeouts_in_a_row_leave_a_recently_heard_engine_routable() -> None:
    s = state()
    s.on_scrape_ok(snap(0.0), 0.0)
    for now in (0.2, 0.4, 0.6, 0.8):
        s.on_scrape_failed(now, "scrape timed out", unanswered=True)
    assert health(s) is Health.HEALTHY and s.consecutive_failures == 4
    s.on_scrape_failed(1.2, "scrape timed out", unanswered=True)
    view = s.view(1.2, True)
    assert health(s) is Health.STALE and view.routable and not view.fresh
    assert s.health_reason == "no successful scrape recently: scrape timed out"
    s.on_scrape_ok(snap(1.4), 1.4)
    assert health(s) is Health.HEALTHY and s.consecutive_failures == 0


def test_an_engine_silent_past_the_limit_is_unhealthy() -> None:
    s = state()
    s.on_scrape_ok(snap(0.0), 0.0)
    assert s.silent_limit_s == 3.0
    for now in (0.5, 1.0, 2.0, 2.9):
        s.on_scrape_failed(now, "scrape timed out", unanswered=True)
    assert health(s) is Health.STALE
    s.on_scrape_failed(3.0, "scrape timed out", unanswered=True)
    assert health(s) is Health.UNHEALTHY and not s.view(3.0, True).routable
    assert s.health_reason == "scrape timed out"


def test_an_engine_never_heard_from_fails_after_the_usual_count() -> None:
    s = state()
    for now in (0.1, 0.2):
        s.on_scrape_failed(now, "scrape timed out", unanswered=True)
    assert health(s) is Health.UNKNOWN
    s.on_scrape_failed(0.3, "scrape timed out", unanswered=True)
    assert health(s) is Health.UNHEALTHY


def test_errors_the_engine_answers_still_fail_it_at_once() -> None:
    s = state()
    s.on_scrape_ok(snap(0.0), 0.0)
    s.on_scrape_failed(0.2, "scrape timed out", unanswered=True)
    s.on_scrape_failed(0.4, "scrape timed out", unanswered=True)
    s.on_scrape_failed(0.6, "metrics answered HTTP 500")
    assert health(s) is Health.UNHEALTHY and s.last_error == "metrics answered HTTP 500"


@given(st.lists(st.floats(min_value=0.01, max_value=0.5), min_size=1, max_size=40))
def test_timeouts_never_fail_an_engine_heard_from_within_the_limit(gaps: list[float]) -> None:
    s = state()
    s.on_scrape_ok(snap(0.0), 0.0)
    now = 0.0
    for gap in gaps:
        now += gap
        s.on_scrape_failed(now, "scrape timed out", unanswered=True)
        routable = s.view(now, True).routable
        assert (now < s.silent_limit_s) <= routable
        assert (health(s) is Health.UNHEALTHY) == (now >= s.silent_limit_s)


def test_answers_on_the_data_plane_keep_an_engine_with_late_metrics_from_failing() -> None:
    s = state()
    s.on_scrape_ok(snap(0.0), 0.0)
    now = 0.0
    while now < 10.0:  # metrics late for three silent limits, answers every 0.5 s
        now += 0.5
        s.on_answering(now)
        s.on_scrape_failed(now + 0.1, "scrape timed out", unanswered=True)
        assert health(s) is not Health.UNHEALTHY and s.view(now + 0.1, True).routable
    assert health(s) is Health.STALE  # its metrics are old: not fresh, still routable
    # Then it answers nothing: failed once silent for the limit since its last answer.
    s.on_scrape_failed(now + 2.9, "scrape timed out", unanswered=True)
    assert health(s) is Health.STALE
    s.on_scrape_failed(now + 3.0, "scrape timed out", unanswered=True)
    assert health(s) is Health.UNHEALTHY


def test_a_whole_answer_counts_as_an_answer_but_not_errors() -> None:
    s = state()
    s.on_scrape_ok(snap(0.0), 0.0)
    ticket = s.on_dispatch(0.5)
    s.on_complete(ticket, 2.5)
    s.on_settle(ticket)
    assert s.silence(4.0) == 1.5
    for now in (3.0, 4.0, 5.0):
        s.on_scrape_failed(now, "scrape timed out", unanswered=True)
    assert health(s) is Health.STALE
    s.on_scrape_failed(5.1, "metrics answered HTTP 500")  # an error still fails it at once
    assert health(s) is Health.UNHEALTHY
