"""Committed KV's own marks: the guard holds its forecast of an engine's peak to marks near the
capacity, not to the usage thresholds of ``[admission]`` (pure: no sockets, no clock)."""

from pathlib import Path

import pytest

from proxy.core.admission import EMPTY_KV, Admission, Priority
from proxy.core.config import AdmissionConfig, ClassThreshold, PressureConfig
from proxy.core.configload import load_config
from proxy.core.errors import ConfigError
from proxy.core.holding import room_short
from proxy.core.pressure import REASON_COMMITTED, Level, PressureTracker
from proxy.core.routing import EngineView

ADM = AdmissionConfig()  # usage thresholds: sheddable 0.85/0.75, standard 0.95/0.90


def tracker(cfg: PressureConfig | None = None) -> PressureTracker:
    return PressureTracker(cfg or PressureConfig(), sheddable=ADM.sheddable,
                           standard=ADM.standard, interval_s=0.2, stale_after_s=1.0)


def test_defaults_close_sheddable_a_tenth_below_capacity_and_standard_at_capacity() -> None:
    cfg = PressureConfig()
    assert cfg.committed_sheddable == ClassThreshold(0.90, 0.85)
    assert cfg.committed_standard == ClassThreshold(1.00, 0.95)


def test_committed_kv_is_not_held_to_the_usage_thresholds() -> None:
    t = tracker()
    t.observe(0.0, 0.3, 0.0)
    t.commit(0.88, 16_000)  # past the usage thresholds' 0.85, below the committed mark
    assert t.pressure(0.1).level is Level.OPEN
    t.commit(0.97, 16_000)  # past standard's usage threshold, below capacity
    p = t.pressure(0.1)
    assert (p.level, p.reason) == (Level.SHEDDABLE, REASON_COMMITTED)


def test_committed_marks_are_configurable_and_each_has_its_hysteresis() -> None:
    t = tracker(PressureConfig(committed_sheddable=ClassThreshold(0.6, 0.5),
                               committed_standard=ClassThreshold(0.8, 0.7)))
    t.observe(0.0, 0.1, 0.0)
    steps = [(0.61, Level.SHEDDABLE), (0.81, Level.STANDARD), (0.75, Level.STANDARD),
             (0.69, Level.SHEDDABLE), (0.55, Level.SHEDDABLE), (0.49, Level.OPEN)]
    for committed, level in steps:
        t.commit(committed, 16_000)
        assert t.pressure(0.1).level is level, committed


def view(committed: float) -> EngineView:
    t = tracker()
    t.observe(0.0, committed, 0.0)
    t.commit(committed, 10_000)
    return EngineView(name="e0", routable=True, fresh=True, load=0.0, kv_usage=committed,
                      pressure=t.pressure(0.0))


def test_admission_measures_a_request_against_the_committed_mark_of_its_class() -> None:
    adm = Admission(ADM)
    engine = view(0.50)  # committed 0.50 of 10 000 tokens
    assert not adm.closed(engine, Priority.SHEDDABLE, need_tokens=3900)  # 0.89 < 0.90
    assert adm.closed(engine, Priority.SHEDDABLE, need_tokens=4000)  # 0.90
    assert not adm.closed(engine, Priority.STANDARD, need_tokens=4900)  # 0.99 < 1.00
    assert adm.closed(engine, Priority.STANDARD, need_tokens=5000)  # 1.00
    assert not adm.closed(engine, Priority.CRITICAL, need_tokens=50_000)  # never for critical
    tight = Admission(ADM, PressureConfig(committed_sheddable=ClassThreshold(0.6, 0.5)))
    assert tight.closed(engine, Priority.SHEDDABLE, need_tokens=1000)


def test_config_names_a_bad_mark(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="committed_sheddable"):
        PressureConfig(committed_sheddable=ClassThreshold(1.01, 0.9))  # after standard's 1.00
    with pytest.raises(ConfigError, match="admit_below"):
        ClassThreshold(0.9, 0.95)
    cfg = load_config(None, {"KVPROXY_PRESSURE_COMMITTED_STANDARD_SHED_ABOVE": "1.05"},
                      ["pressure.committed_sheddable.shed_above=0.95"])
    assert cfg.pressure.committed_standard.shed_above == 1.05
    assert cfg.pressure.committed_sheddable == ClassThreshold(0.95, 0.85)
    path = tmp_path / "k.toml"
    path.write_text("[pressure.committed_standard]\nshed_above = 0.8\nadmit_below = 0.7\n")
    with pytest.raises(ConfigError, match="committed_sheddable"):
        load_config(str(path), {}, [])  # sheddable's default 0.90 would close after standard


def test_a_request_that_alone_reaches_the_mark_waits_for_an_empty_engine_not_for_ever() -> None:
    # 12 000 tokens on an engine of 10 000: no amount of draining would take committed KV plus
    # it under a mark, so an empty engine takes it (the engine answers it, or refuses it as too
    # long), and any engine with work committed does not.
    adm = Admission(ADM)
    for cls in (Priority.SHEDDABLE, Priority.STANDARD):
        assert not adm.closed(view(0.0), cls, need_tokens=12_000)
        assert not adm.closed(view(EMPTY_KV / 2), cls, need_tokens=9_500)
        assert adm.closed(view(EMPTY_KV), cls, need_tokens=12_000)
        assert adm.closed(view(0.3), cls, need_tokens=12_000)
    # Below the mark nothing changes: the request's own share counts.
    assert not adm.closed(view(0.0), Priority.SHEDDABLE, need_tokens=8_000)
    assert adm.closed(view(0.2), Priority.SHEDDABLE, need_tokens=8_000)  # 1.0 >= 0.90


def test_the_hold_asks_an_oversized_request_for_an_empty_engine() -> None:
    # What the emptiest engine must free: its committed work (less the empty share), not an
    # amount no engine could ever free.
    views = [view(0.5), view(0.25)]
    assert room_short(views, 0.9, need_tokens=50_000) == pytest.approx(
        (0.25 - EMPTY_KV) * 10_000)
    assert room_short(views, 0.9, need_tokens=1_000) == 0.0
    assert room_short([view(0.0)], 0.9, need_tokens=50_000) == 0.0
