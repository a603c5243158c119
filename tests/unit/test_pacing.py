"""Pacing (``proxy.core.holding.paced``, ``Pressure.evidence``): a standard request that only the
commitment forecast still refuses at the end of its hold goes where the engine's own figures
leave room; anything else keeps today's refusal (pure: no sockets, no clock)."""

import pytest

from proxy.core.admission import Admission, Decision, Priority, Shed
from proxy.core.config import AdmissionConfig, PressureConfig
from proxy.core.configload import load_config
from proxy.core.holding import paced
from proxy.core.pressure import (
    REASON_COMMITTED,
    REASON_OVERCOMMIT,
    REASON_PREEMPTING,
    Level,
    Pressure,
    PressureTracker,
)
from proxy.core.routing import EngineView

STD, SHED, CRIT = Priority.STANDARD, Priority.SHEDDABLE, Priority.CRITICAL
ADM = AdmissionConfig()  # standard 0.95 / 0.90
DT = 0.2
CAP = 10_000


def committed(kv: float, committed_kv: float, *, evidence: Level = Level.OPEN,
              projected: float | None = None) -> Pressure:
    """An engine the commitment forecast closes to standard work (committed at its mark)."""
    return Pressure(level=Level.STANDARD, reason=REASON_COMMITTED, committed_kv=committed_kv,
                    capacity_tokens=CAP, evidence=evidence,
                    projected_kv=kv if projected is None else projected)


def view(name: str, kv: float, pressure: Pressure, *, fresh: bool = True,
         routable: bool = True) -> EngineView:
    return EngineView(name=name, routable=routable, fresh=fresh, load=0.0, kv_usage=kv,
                      pressure=pressure)


def refused(adm: Admission, views: list[EngineView], cls: Priority = STD) -> Decision:
    return adm.decide("p", cls, views, need_tokens=800)


def test_a_standard_request_only_the_forecast_refuses_goes_where_the_evidence_leaves_room(
) -> None:
    adm = Admission(ADM)
    views = [view("a", 0.60, committed(0.60, 1.02)), view("b", 0.70, committed(0.70, 1.05))]
    decision = refused(adm, views)
    assert decision == Shed(REASON_COMMITTED, ADM.retry_after_s)  # today's refusal...
    # ...which, at the end of the hold, the forecast alone no longer makes.
    assert [v.name for v in paced(adm, "p", STD, REASON_COMMITTED, views)] == ["a", "b"]


def test_sheddable_and_critical_are_not_paced() -> None:
    adm = Admission(ADM)
    views = [view("a", 0.60, committed(0.60, 1.02))]
    assert paced(adm, "p", SHED, REASON_COMMITTED, views) == []
    assert paced(adm, "p", CRIT, REASON_COMMITTED, views) == []


@pytest.mark.parametrize("reason", [REASON_PREEMPTING, REASON_OVERCOMMIT, "kv_pressure",
                                    "telemetry_stale", "no_routable_engine"])
def test_only_a_refusal_by_the_forecast_is_paced(reason: str) -> None:
    adm = Admission(ADM)
    views = [view("a", 0.60, committed(0.60, 1.02))]
    assert paced(adm, "p", STD, reason, views) == []


def test_hard_evidence_keeps_an_engine_closed() -> None:
    adm = Admission(ADM)
    views = [
        view("room", 0.50, committed(0.50, 1.1)),
        view("preempts", 0.50, committed(0.50, 1.1, evidence=Level.STANDARD)),
        view("one_preemption", 0.50, committed(0.50, 1.1, evidence=Level.SHEDDABLE)),
        view("full", 0.96, committed(0.96, 1.1)),  # usage past standard's 0.95
        view("growing", 0.80, committed(0.80, 1.1, projected=0.97)),  # projected past it
        view("stale", 0.10, committed(0.10, 1.1), fresh=False),
        view("down", 0.10, committed(0.10, 1.1), routable=False),
    ]
    # Even one preemption (which closes only sheddable work) is evidence enough not to pace.
    assert [v.name for v in paced(adm, "p", STD, REASON_COMMITTED, views)] == ["room"]


def test_a_class_shedding_by_threshold_is_not_paced() -> None:
    adm = Admission(ADM)
    assert refused(adm, [view("a", 0.97, Pressure())]) == Shed("kv_pressure", ADM.retry_after_s)
    # Usage has fallen to 0.92, under shed_above but not under admit_below (0.90): still shedding.
    views = [view("a", 0.92, committed(0.92, 1.05))]
    assert adm.shedding("p", STD)
    assert paced(adm, "p", STD, REASON_COMMITTED, views) == []


def tracker() -> PressureTracker:
    return PressureTracker(PressureConfig(), sheddable=ADM.sheddable, standard=ADM.standard,
                           interval_s=DT, stale_after_s=1.0)


def test_evidence_leaves_the_commitment_forecast_out() -> None:
    t = tracker()
    for i in range(5):
        t.observe(i * DT, 0.50, 0.0)
    t.commit(1.01, CAP)
    p = t.pressure(4 * DT)
    assert (p.level, p.reason, p.evidence) == (Level.STANDARD, REASON_COMMITTED, Level.OPEN)
    t.observe(5 * DT, 0.50, 1.0)  # a preemption: evidence, closing sheddable work
    assert t.pressure(5 * DT).evidence is Level.SHEDDABLE
    t.observe(6 * DT, 0.50, 2.0)  # preemptions in two intervals: standard too
    assert t.pressure(6 * DT).evidence is Level.STANDARD


def test_unexplained_growth_is_evidence_and_explained_growth_is_not() -> None:
    t = tracker()
    for i, kv in enumerate([0.60, 0.66, 0.72, 0.78, 0.84]):  # 0.3/s: projected 1.02
        t.observe(i * DT, kv, 0.0)
    t.commit(None)
    assert t.pressure(4 * DT).evidence is Level.STANDARD
    t.commit(1.05, CAP)  # this proxy's requests in flight owe more than that: explained
    assert t.pressure(4 * DT).evidence is Level.OPEN


def test_a_remote_level_is_evidence_unless_it_is_another_replicas_forecast() -> None:
    t = tracker()
    t.observe(0.0, 0.50, 0.0)
    t.apply_remote(Level.STANDARD, REASON_COMMITTED, expires_at=1.0)
    assert t.pressure(0.1).evidence is Level.OPEN
    t.apply_remote(Level.STANDARD, REASON_PREEMPTING, expires_at=1.0)
    assert t.pressure(0.1).evidence is Level.STANDARD
    assert t.pressure(1.5).evidence is Level.OPEN  # expired


def test_pacing_is_off_by_default_and_can_be_switched_on() -> None:
    assert PressureConfig().pace_standard is False
    env = {"KVPROXY_PRESSURE_PACE_STANDARD": "true"}
    assert load_config(None, env, []).pressure.pace_standard is True
    assert load_config(None, {}, ["pressure.pace_standard=true"]).pressure.pace_standard is True
