"""The pool outlier detector: who is ejected, for how long, and who never is."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core.breaker import Breaker, Outcome
from proxy.core.config import BreakerConfig, Config, OutlierConfig
from proxy.core.errors import ConfigError
from proxy.core.fleet_config import EngineConfig, PoolConfig
from proxy.core.outlier import (
    FAILURES,
    REASON_CONSECUTIVE,
    REASON_PROBE,
    REASON_SUCCESS_RATE,
    TRANSITIONS,
    Ejection,
    IllegalTransition,
    OutlierDetector,
    OutlierEvent,
    OutlierState,
    Result,
)
from proxy.fleet.engines import Fleet

CFG = OutlierConfig(
    consecutive_failures=3,
    base_ejection_s=10.0,
    max_ejection_s=25.0,
    success_rate_min_requests=10,
    success_rate_min_engines=5,
    interval_s=0.0,
)


def pool(n: int, cfg: OutlierConfig = CFG) -> OutlierDetector:
    detector = OutlierDetector(cfg, "target")
    for i in range(n):
        detector.add(f"e{i}")
    return detector


def rounds(
    d: OutlierDetector,
    n: int,
    start: float = 0.0,
    failing: tuple[str, ...] = ("e0",),
    result: Result = Result.TIMEOUT,
) -> list[Ejection]:
    """``n`` rounds, one a second: each engine of the pool gets one result, the ``failing`` ones
    (first) ``result``, the others a success. Returns the ejections, in order."""
    out: list[Ejection] = []
    names = list(failing) + sorted(set(d._members) - set(failing))
    for i in range(n):
        for name in names:
            out += d.record(name, result if name in failing else Result.SUCCESS, start + i)
    return out


def state(d: OutlierDetector, engine: str, now: float) -> OutlierState:
    return d.state(engine, now)


# --- the state machine ---------------------------------------------------------------------------


def test_transition_table_is_closed_and_illegal_moves_raise() -> None:
    d = pool(1)
    member = d._members["e0"]
    for (start, event), end in TRANSITIONS.items():
        assert isinstance(start, OutlierState) and isinstance(end, OutlierState)
        assert isinstance(event, OutlierEvent)
    with pytest.raises(IllegalTransition, match="restore from active"):
        d._move(member, OutlierEvent.RESTORE)
    with pytest.raises(IllegalTransition, match="cool from active"):
        d._move(member, OutlierEvent.COOL)
    member.state = OutlierState.EJECTED
    with pytest.raises(IllegalTransition, match="eject from ejected"):
        d._move(member, OutlierEvent.EJECT)


# --- consecutive failures ------------------------------------------------------------------------


@pytest.mark.parametrize("result", sorted(FAILURES, key=lambda r: r.value))
def test_an_engine_failing_where_its_pool_succeeds_is_ejected(result: Result) -> None:
    d = pool(3)
    assert rounds(d, 2, result=result) == []
    [ejection] = rounds(d, 1, start=2.0, result=result)
    assert (ejection.engine, ejection.reason, ejection.duration_s) == ("e0", REASON_CONSECUTIVE, 10)
    assert (ejection.pool, ejection.times) == ("target", 1)
    assert state(d, "e0", 2.0) is OutlierState.EJECTED
    assert not d.peek("e0", 2.0) and not d.allows("e0", 2.0)
    assert d.peek("e1", 2.0)
    assert d.describe("e0", 3.0) == {
        "state": "ejected", "ejections": 1, "reason": REASON_CONSECUTIVE, "back_in_s": 9.0
    }


def test_a_pool_that_fails_alike_is_never_ejected() -> None:
    """A hot fleet: every engine times out, none is an outlier."""
    d = pool(3)
    assert rounds(d, 20, failing=("e0", "e1", "e2")) == []
    assert d.ejected(20.0) == 0


def test_a_pool_that_just_turned_hot_is_not_ejected() -> None:
    """Long healthy, then every engine times out: the others' old successes do not make the
    first engine to reach the streak an outlier."""
    d = pool(3)
    rounds(d, 50, failing=())
    assert rounds(d, 10, start=50.0, failing=("e0", "e1", "e2")) == []


def test_a_mostly_failing_pool_is_not_ejected_either() -> None:
    d = pool(3)
    for i in range(10):
        d.record("e0", Result.TIMEOUT, i)
        for name in ("e1", "e2"):
            d.record(name, Result.SUCCESS if i % 2 else Result.TIMEOUT, i)
    assert d.ejected(10.0) == 0


def test_no_ejection_without_evidence_that_the_pool_works() -> None:
    d = pool(3)
    for i in range(5):  # the others are idle: nothing says the pool works
        assert d.record("e0", Result.TIMEOUT, i) == []
    for _ in range(2):
        d.record("e1", Result.SUCCESS, 5.0)
    assert d.record("e0", Result.TIMEOUT, 5.0) == []  # 2 results: fewer than the streak
    d.record("e1", Result.SUCCESS, 5.0)
    assert [e.engine for e in d.record("e0", Result.TIMEOUT, 5.0)] == ["e0"]


def test_busy_and_neutral_results_neither_count_nor_break_a_streak() -> None:
    d = pool(3)
    rounds(d, 2)
    for result in (Result.BUSY, Result.NEUTRAL, Result.BUSY):
        assert d.record("e0", result, 2.0) == []
    assert len(rounds(d, 1, start=2.0)) == 1


def test_a_success_breaks_the_streak() -> None:
    d = pool(3)
    rounds(d, 2)
    d.record("e0", Result.SUCCESS, 2.0)
    assert rounds(d, 2, start=3.0) == []


def test_disabled_detector_never_ejects() -> None:
    d = pool(3, dataclasses.replace(CFG, enabled=False))
    assert rounds(d, 10) == []
    assert d.peek("e0", 10.0)


# --- how many, how long --------------------------------------------------------------------------


def test_never_more_than_the_cap_and_never_the_last_engine() -> None:
    d = pool(4, dataclasses.replace(CFG, max_ejection_percent=50))
    assert [e.engine for e in rounds(d, 3, failing=("e0", "e1"))] == ["e0", "e1"]
    assert rounds(d, 10, start=3.0, failing=("e2",)) == []  # 2 of 4 out already
    assert rounds(pool(1), 10) == []


def test_two_engines_of_a_pair_one_hung() -> None:
    d = pool(2)
    assert rounds(d, 3) == []  # the other engine has answered only twice since the streak began
    assert [e.engine for e in rounds(d, 1, start=3.0)] == ["e0"]


def test_at_least_one_engine_may_go_whatever_the_percentage() -> None:
    d = pool(4, dataclasses.replace(CFG, max_ejection_percent=1))
    assert [e.engine for e in rounds(d, 5, failing=("e0", "e1"))] == ["e0"]


def test_ejection_time_grows_with_each_ejection_up_to_the_cap() -> None:
    d = pool(3)
    [first] = rounds(d, 3)
    durations = [first.duration_s]
    now = 2.0
    for _ in range(3):
        now += durations[-1]
        assert state(d, "e0", now) is OutlierState.PROBATION
        assert d.allows("e0", now)
        [again] = d.record("e0", Result.TIMEOUT, now, sent_at=now)
        assert (again.reason, again.times) == (REASON_PROBE, len(durations) + 1)
        durations.append(again.duration_s)
    assert durations == [10.0, 20.0, 25.0, 25.0]


def test_time_in_service_forgives_earlier_ejections() -> None:
    d = pool(3)
    rounds(d, 3)  # ejected at 2 s, for 10 s
    assert d.allows("e0", 12.0)
    d.record("e0", Result.SUCCESS, 12.0, sent_at=12.0)
    assert state(d, "e0", 12.0) is OutlierState.ACTIVE
    [later] = rounds(d, 3, start=60.0)  # 48 s in service: more than one max_ejection_s
    assert (later.times, later.duration_s) == (1, 10.0)


# --- probation -----------------------------------------------------------------------------------


def ejected_pool() -> OutlierDetector:
    d = pool(3)
    assert len(rounds(d, 3)) == 1  # e0 out at 2 s, back on probation at 12 s
    return d


def test_probation_lets_one_probe_through_and_its_success_restores() -> None:
    d = ejected_pool()
    assert not d.peek("e0", 11.9)
    assert d.peek("e0", 12.0) and d.peek("e0", 12.0)  # peeking takes no slot
    assert d.allows("e0", 12.0)
    assert not d.peek("e0", 12.0) and not d.allows("e0", 12.0)
    assert d.ejected(12.0) == 1  # on probation still counts as out
    assert d.describe("e0", 12.0) == {
        "state": "probation", "ejections": 1, "reason": REASON_CONSECUTIVE
    }
    assert d.record("e0", Result.SUCCESS, 13.0, sent_at=12.0) == []
    assert state(d, "e0", 13.0) is OutlierState.ACTIVE
    assert d.describe("e0", 13.0) == {"state": "active", "ejections": 1}
    # A clean record: two failures do not finish a streak begun before the ejection.
    assert rounds(d, 2, start=14.0) == []


def test_a_neutral_probe_frees_the_slot() -> None:
    d = ejected_pool()
    assert d.allows("e0", 12.0)
    assert d.record("e0", Result.NEUTRAL, 12.5, sent_at=12.0) == []
    assert state(d, "e0", 12.5) is OutlierState.PROBATION
    assert d.allows("e0", 12.5)


def test_results_sent_before_the_ejection_decide_nothing() -> None:
    """A hung engine's old requests time out during its probation: not the probe's verdict."""
    d = ejected_pool()
    assert d.allows("e0", 12.0)
    assert d.record("e0", Result.TIMEOUT, 12.2, sent_at=1.0) == []
    assert state(d, "e0", 12.2) is OutlierState.PROBATION
    assert d.record("e0", Result.SUCCESS, 12.3, sent_at=12.0) == []
    assert state(d, "e0", 12.3) is OutlierState.ACTIVE


def test_removed_engines_are_forgotten() -> None:
    d = ejected_pool()
    d.remove("e0")
    assert d.ejected(3.0) == 0
    assert d.peek("e0", 3.0)
    assert d.record("e0", Result.TIMEOUT, 3.0) == []


# --- success rate --------------------------------------------------------------------------------

RATE_CFG = dataclasses.replace(CFG, consecutive_failures=3, success_rate_min_requests=20)


def rated(n: int, failing_every: dict[str, int], count: int = 40) -> list[Ejection]:
    """A pool of ``n`` whose engine e fails one result in ``failing_every[e]`` (never twice in
    a row, so no streak decides), one round a second."""
    d = pool(n, RATE_CFG)
    out: list[Ejection] = []
    for i in range(count):
        for j in range(n):
            every = failing_every.get(f"e{j}", 0)
            failed = every > 0 and i % every == 0
            out += d.record(f"e{j}", Result.ERROR if failed else Result.SUCCESS, i)
    return out


def test_success_rate_below_the_pool_is_ejected() -> None:
    ejections = rated(6, {"e0": 2, "e1": 20, "e2": 20})
    assert [(e.engine, e.reason) for e in ejections] == [("e0", REASON_SUCCESS_RATE)]


def test_success_rate_needs_enough_engines_and_requests() -> None:
    assert rated(4, {"e0": 2}) == []  # fewer engines than success_rate_min_engines
    assert rated(6, {"e0": 2}, count=19) == []  # fewer results than success_rate_min_requests


def test_success_rate_noise_is_not_an_outlier() -> None:
    """One engine two deviations low, but still above the pool's working floor."""
    assert rated(6, {"e0": 6, "e1": 40, "e2": 40}) == []


def test_success_rate_in_a_uniformly_failing_pool_ejects_nobody() -> None:
    d = pool(6, RATE_CFG)
    for i in range(40):
        for j in range(6):
            failed = j == 0 or i % 10 != 0  # e0 always fails, the rest 90 % of the time
            assert d.record(f"e{j}", Result.TIMEOUT if failed else Result.SUCCESS, i) == []


# --- properties ----------------------------------------------------------------------------------


@given(
    n=st.integers(min_value=1, max_value=8),
    failures=st.lists(st.booleans(), max_size=60),
)
def test_uniform_results_never_eject(n: int, failures: list[bool]) -> None:
    """Engines that fare alike (each round fails or succeeds on every engine) are never
    outliers, whatever the sequence."""
    cfg = dataclasses.replace(CFG, success_rate_min_engines=1, success_rate_min_requests=5)
    d = pool(n, cfg)
    for i, failed in enumerate(failures):
        for j in range(n):
            assert d.record(f"e{j}", Result.TIMEOUT if failed else Result.SUCCESS, i) == []


@given(
    n=st.integers(min_value=1, max_value=10),
    percent=st.integers(min_value=1, max_value=100),
    script=st.lists(st.tuples(st.integers(0, 9), st.booleans(), st.floats(0, 5)), max_size=200),
)
def test_the_cap_holds_whatever_happens(
    n: int, percent: int, script: list[tuple[int, bool, float]]
) -> None:
    d = pool(n, dataclasses.replace(CFG, max_ejection_percent=percent, min_pool_success_rate=0.0))
    cap = min(n - 1, max(1, n * percent // 100))
    now = 0.0
    for engine, failed, step in script:
        now += step
        name = f"e{engine % n}"
        d.allows(name, now)
        d.record(name, Result.CONNECT if failed else Result.SUCCESS, now, sent_at=now)
        assert d.ejected(now) <= cap


# --- in the fleet and the config -----------------------------------------------------------------


def test_fleet_engines_of_a_pool_share_one_detector_and_views_honour_it() -> None:
    engines = tuple(EngineConfig(f"e{i}", f"http://127.0.0.1:{9 + i}") for i in range(3))
    cfg = Config(pools=(PoolConfig("target", "m", engines),), outlier=CFG,
                 breaker=BreakerConfig(failure_threshold=100))
    fleet = Fleet(cfg)
    e0, e1, e2 = (fleet.get(f"e{i}") for i in range(3))
    assert e0.outliers is e1.outliers is e2.outliers
    for e in (e1, e2):
        for _ in range(3):
            e.record(Outcome.SUCCESS, 0.0)
    for _ in range(2):
        assert e0.record(Outcome.BACKPRESSURE, 0.0, Result.TIMEOUT) == []
    [ejection] = e0.record(Outcome.BACKPRESSURE, 0.0, Result.TIMEOUT)
    assert ejection.pool == "target"
    assert isinstance(e0.breaker, Breaker) and e0.breaker.peek(0.0)  # the breaker saw busy
    assert not e0.allows(1.0)
    row = {r["name"]: r for r in fleet.admin_view(1.0)}["e0"]
    assert row["outlier"]["state"] == "ejected"
    assert {r.engine: r.outlier for r in fleet.gauge_rows(1.0)}["e0"] == "ejected"
    fleet.remove("e0")
    assert e1.outliers.ejected(1.0) == 0


def test_engine_full_at_its_connection_limit() -> None:
    pool_cfg = PoolConfig("target", "m", (EngineConfig("e0", "http://127.0.0.1:9"),))
    engine = Fleet(Config(pools=(pool_cfg,))).get("e0")
    assert not engine.full(2)
    engine.state.on_dispatch()
    engine.state.on_dispatch()
    assert engine.full(2)
    engine.state.on_settle()
    assert not engine.full(2)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"consecutive_failures": 0}, "consecutive_failures"),
        ({"min_pool_success_rate": 1.5}, "min_pool_success_rate"),
        ({"base_ejection_s": 10.0, "max_ejection_s": 5.0}, "max_ejection_s"),
        ({"max_ejection_percent": 0}, "max_ejection_percent"),
        ({"window_requests": 0}, "window_requests"),
    ],
)
def test_config_validation_names_the_field(kw: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        OutlierConfig(**kw)  # type: ignore[arg-type]
    assert err.value.field == field
