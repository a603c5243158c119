import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core.breaker import (
    TRANSITIONS,
    Breaker,
    BreakerEvent,
    BreakerState,
    IllegalTransition,
    Outcome,
    classify_status,
)
from proxy.core.config import BreakerConfig

CFG = BreakerConfig(failure_threshold=3, open_s=5.0, half_open_probes=1)


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (200, Outcome.SUCCESS),
        (204, Outcome.SUCCESS),
        (400, Outcome.CLIENT_ERROR),
        (404, Outcome.CLIENT_ERROR),
        (429, Outcome.BACKPRESSURE),
        (503, Outcome.BACKPRESSURE),
        (500, Outcome.FAILURE),
        (502, Outcome.FAILURE),
        (504, Outcome.FAILURE),
    ],
)
def test_classify_status(status: int, outcome: Outcome) -> None:
    assert classify_status(status) is outcome


def state(b: Breaker) -> BreakerState:
    return b.state  # read through a call, so the type checker does not narrow across moves


def trip(b: Breaker, now: float = 0.0) -> None:
    for _ in range(CFG.failure_threshold):
        assert b.allows(now)
        b.record(Outcome.FAILURE, now)


def test_opens_after_consecutive_failures() -> None:
    b = Breaker(CFG)
    b.record(Outcome.FAILURE, 0)
    b.record(Outcome.FAILURE, 0)
    b.record(Outcome.SUCCESS, 0)  # resets the count
    b.record(Outcome.FAILURE, 0)
    b.record(Outcome.FAILURE, 0)
    assert state(b) is BreakerState.CLOSED
    b.record(Outcome.FAILURE, 0)
    assert state(b) is BreakerState.OPEN
    assert not b.allows(1.0)
    assert not b.peek(4.9)


@pytest.mark.parametrize("outcome", [Outcome.BACKPRESSURE, Outcome.CLIENT_ERROR])
def test_backpressure_and_client_errors_never_open(outcome: Outcome) -> None:
    b = Breaker(CFG)
    for _ in range(50):
        b.record(outcome, 0)
    assert state(b) is BreakerState.CLOSED and b.allows(0)


def test_half_open_probe_success_closes() -> None:
    b = Breaker(CFG)
    trip(b)
    assert b.peek(5.0) and state(b) is BreakerState.HALF_OPEN
    assert b.peek(5.0)  # peeking takes no slot
    assert b.allows(5.0)  # the probe
    assert not b.allows(5.1)  # only one probe in flight
    b.record(Outcome.SUCCESS, 5.2)
    assert state(b) is BreakerState.CLOSED and b.allows(5.3)


def test_half_open_probe_failure_reopens() -> None:
    b = Breaker(CFG)
    trip(b)
    assert b.allows(6.0)
    b.record(Outcome.FAILURE, 6.0)
    assert state(b) is BreakerState.OPEN
    assert not b.allows(10.9)
    assert b.allows(11.0)


def test_neutral_outcome_frees_probe_slot() -> None:
    b = Breaker(CFG)
    trip(b)
    assert b.allows(5.0)
    b.record(Outcome.BACKPRESSURE, 5.0)
    assert state(b) is BreakerState.HALF_OPEN
    assert b.allows(5.0)


def test_several_probes() -> None:
    b = Breaker(BreakerConfig(failure_threshold=1, open_s=1.0, half_open_probes=2))
    b.record(Outcome.FAILURE, 0)
    assert [b.allows(1.0) for _ in range(3)] == [True, True, False]


def test_illegal_transition() -> None:
    b = Breaker(CFG)
    with pytest.raises(IllegalTransition):
        b._move(BreakerEvent.RECOVER, 0)
    assert (BreakerState.OPEN, BreakerEvent.TRIP) not in TRANSITIONS


@given(st.lists(st.tuples(st.sampled_from(list(Outcome)), st.floats(0, 3)), max_size=60))
def test_random_sequences(steps: list[tuple[Outcome, float]]) -> None:
    b = Breaker(CFG)
    now = 0.0
    streak = 0
    for outcome, dt in steps:
        now += dt
        was = b.state
        if b.allows(now):
            b.record(outcome, now)
        if outcome is Outcome.FAILURE:
            streak += 1
        elif outcome is Outcome.SUCCESS:
            streak = 0
        if state(b) is BreakerState.OPEN and was is BreakerState.CLOSED:
            # Only failures open it, and only after threshold of them in a row.
            assert outcome is Outcome.FAILURE and streak >= CFG.failure_threshold
        if outcome is not Outcome.FAILURE:
            assert not (was is not BreakerState.OPEN and state(b) is BreakerState.OPEN)
