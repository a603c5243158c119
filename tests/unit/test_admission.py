import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core.admission import (
    Admission,
    Admit,
    Priority,
    Shed,
    closed_to,
    engine_priority,
    parse_priority,
)
from proxy.core.config import AdmissionConfig
from proxy.core.errors import BadRequest
from proxy.core.pressure import Level, Pressure
from proxy.core.routing import EngineView

C, S, X = Priority.CRITICAL, Priority.STANDARD, Priority.SHEDDABLE


def v(name: str, kv: float, *, routable: bool = True, fresh: bool = True) -> EngineView:
    return EngineView(name=name, routable=routable, fresh=fresh, load=0.0, kv_usage=kv)


@pytest.mark.parametrize(
    ("header", "body", "expected"),
    [
        (None, None, S),
        ("critical", None, C),
        ("  SHEDDABLE ", None, X),
        ("Standard", 5, S),  # the header wins
        ("-1", None, C),
        ("3", None, X),
        (None, -5, C),
        (None, 0, S),
        (None, 2, X),
        (None, "critical", C),
        ("", 1, X),
    ],
)
def test_parse_priority(header: str | None, body: object, expected: Priority) -> None:
    assert parse_priority(header, body) is expected


@pytest.mark.parametrize(
    ("header", "body"), [("urgent", None), (None, "urgent"), (None, 1.5), (None, True), (None, [1])]
)
def test_parse_priority_rejects(header: str | None, body: object) -> None:
    with pytest.raises(BadRequest) as info:
        parse_priority(header, body)
    assert info.value.param == "priority"


def test_engine_priority_lower_runs_first() -> None:
    assert engine_priority(C) < engine_priority(S) < engine_priority(X)
    assert engine_priority(S) == 0


def test_sheds_sheddable_first_then_standard_never_critical() -> None:
    adm = Admission(AdmissionConfig())
    hot = [v("a", 0.9), v("b", 0.88)]
    assert adm.decide("target", X, hot) == Shed("kv_pressure", 2)
    assert adm.decide("target", S, hot) == Admit()
    hotter = [v("a", 0.99), v("b", 1.0)]
    assert adm.decide("target", S, hotter) == Shed("kv_pressure", 2)
    assert adm.decide("target", C, hotter) == Admit()


def test_best_engine_decides() -> None:
    adm = Admission(AdmissionConfig())
    assert adm.decide("target", X, [v("a", 0.99), v("b", 0.2)]) == Admit()
    # An unroutable or stale engine's low KV does not count.
    assert isinstance(adm.decide("target", X, [v("a", 0.99), v("b", 0.1, routable=False)]), Shed)
    assert isinstance(adm.decide("target", X, [v("a", 0.99), v("b", 0.1, fresh=False)]), Shed)


def test_hysteresis() -> None:
    adm = Admission(AdmissionConfig())
    seq = [0.80, 0.86, 0.84, 0.80, 0.76, 0.74, 0.80, 0.86]
    got = [isinstance(adm.decide("p", X, [v("a", kv)]), Shed) for kv in seq]
    assert got == [False, True, True, True, True, False, False, True]


def test_hysteresis_is_per_pool_and_class() -> None:
    adm = Admission(AdmissionConfig())
    adm.decide("target", X, [v("a", 0.9)])
    assert adm.shedding("target", X)
    assert not adm.shedding("draft", X)
    assert not adm.shedding("target", S)
    assert adm.decide("draft", X, [v("a", 0.8)]) == Admit()


def test_nothing_routable_sheds_everyone() -> None:
    adm = Admission(AdmissionConfig())
    for cls in Priority:
        assert adm.decide("p", cls, [v("a", 0.1, routable=False)]) == Shed("no_routable_engine", 2)
        assert adm.decide("p", cls, []) == Shed("no_routable_engine", 2)


def test_all_stale_fails_open_except_sheddable() -> None:
    adm = Admission(AdmissionConfig(retry_after_s=5))
    stale = [v("a", 0.99, fresh=False), v("b", 0.99, fresh=False)]
    assert adm.decide("p", C, stale) == Admit(stale_fail_open=True)
    assert adm.decide("p", S, stale) == Admit(stale_fail_open=True)
    assert adm.decide("p", X, stale) == Shed("telemetry_stale", 5)


kvs = st.lists(st.floats(0, 1), min_size=1, max_size=40)


@given(kvs, st.sampled_from(list(Priority)))
def test_hysteresis_property(seq: list[float], cls: Priority) -> None:
    adm = Admission(AdmissionConfig())
    limits = adm.threshold(cls)
    shedding = False
    for kv in seq:
        shed = isinstance(adm.decide("p", cls, [v("a", kv)]), Shed)
        if kv > limits.shed_above:
            assert shed
        elif kv < limits.admit_below:
            assert not shed
        else:
            assert shed == shedding  # in the band: keep the previous decision
        shedding = shed
    if cls is C:
        assert not shedding


def test_eligible_drops_hot_fresh_engines() -> None:
    adm = Admission(AdmissionConfig())
    vs = [v("a", 0.9), v("b", 0.5), v("c", 0.95, fresh=False)]
    assert [e.name for e in adm.eligible(X, vs)] == ["b", "c"]
    assert [e.name for e in adm.eligible(C, vs)] == ["a", "b", "c"]
    all_hot = [v("a", 0.9), v("b", 0.91)]
    assert adm.eligible(X, all_hot) == all_hot  # never empties a pool that has routable engines


# --- KV overcommit guard ------------------------------------------------------------------------

OPEN_P = Pressure()
SOFT = Pressure(Level.SHEDDABLE, "kv_overcommit", 0.9)
HARD = Pressure(Level.STANDARD, "preempting", 0.97, 3.0)


def pv(name: str, kv: float, pressure: Pressure, *, fresh: bool = True) -> EngineView:
    return EngineView(name=name, routable=True, fresh=fresh, load=0.0, kv_usage=kv,
                      pressure=pressure)


def test_closed_to_orders_the_classes() -> None:
    assert [closed_to(OPEN_P, c) for c in (X, S, C)] == [False, False, False]
    assert [closed_to(SOFT, c) for c in (X, S, C)] == [True, False, False]
    assert [closed_to(HARD, c) for c in (X, S, C)] == [True, True, False]


def test_pressure_sheds_sheddable_first_then_standard_never_critical() -> None:
    adm = Admission(AdmissionConfig())
    soft = [pv("a", 0.5, SOFT), pv("b", 0.4, SOFT)]
    assert adm.decide("p", X, soft) == Shed("kv_overcommit", 2)
    assert adm.decide("p", S, soft) == Admit()
    hard = [pv("a", 0.5, HARD), pv("b", 0.4, SOFT)]
    assert adm.decide("p", X, hard) == Shed("preempting", 2)  # one preempts: that is the reason
    assert adm.decide("p", S, hard) == Admit()  # b is still open to standard work
    all_hard = [pv("a", 0.5, HARD), pv("b", 0.4, HARD)]
    assert adm.decide("p", S, all_hard) == Shed("preempting", 2)
    assert adm.decide("p", C, all_hard) == Admit()


def test_pressured_engine_is_left_out_of_the_kv_figure_and_of_eligibility() -> None:
    adm = Admission(AdmissionConfig())
    vs = [pv("a", 0.2, SOFT), pv("b", 0.9, OPEN_P)]
    # The low KV of an engine closed to sheddable work does not admit sheddable work elsewhere.
    assert adm.decide("p", X, vs) == Shed("kv_pressure", 2)
    vs = [pv("a", 0.2, HARD), pv("b", 0.6, SOFT), pv("c", 0.7, OPEN_P)]
    assert [e.name for e in adm.eligible(X, vs)] == ["c"]
    assert [e.name for e in adm.eligible(S, vs)] == ["b", "c"]
    assert [e.name for e in adm.eligible(C, vs)] == ["a", "b", "c"]
    closed = [pv("a", 0.2, HARD), pv("b", 0.6, HARD)]
    assert adm.eligible(S, closed) == closed  # never empties a pool that has routable engines


def test_stale_engines_are_judged_by_staleness_not_pressure() -> None:
    adm = Admission(AdmissionConfig())
    stale = [pv("a", 0.5, OPEN_P, fresh=False)]
    assert adm.decide("p", S, stale) == Admit(stale_fail_open=True)
