"""KV commitments: booking in-flight requests, learning answer lengths, and what they add to the
overcommit guard (pure: no sockets, no clock)."""

import pytest

from proxy.core.admission import Admission, Priority
from proxy.core.commitment import (
    Commitments,
    Flight,
    OutputEstimate,
    owed,
    projected_usage,
)
from proxy.core.config import AdmissionConfig, Config, PressureConfig
from proxy.core.fleet_config import EngineConfig, PoolConfig
from proxy.core.pressure import REASON_COMMITTED, Level, PressureTracker
from proxy.core.telemetry import EngineSnapshot
from proxy.fleet.engines import Fleet

ADM = AdmissionConfig()  # sheddable 0.85/0.75, standard 0.95/0.90
CFG = PressureConfig()


def tracker() -> PressureTracker:
    return PressureTracker(CFG, sheddable=ADM.sheddable, standard=ADM.standard, interval_s=0.2,
                           stale_after_s=1.0)


def test_a_flight_owes_its_prompt_until_the_first_byte_then_only_the_output_to_come() -> None:
    book = Commitments()
    book.dispatch(1, Flight(prompt_tokens=160, output_tokens=320))
    assert book.owed_blocks(16, None) == pytest.approx(30.0)  # (160 + 320) / 16
    book.first_byte(1)
    assert book.owed_blocks(16, None) == pytest.approx(20.0)  # the prompt is in the engine now
    assert book.settle(1) is not None
    assert book.owed_blocks(16, None) == 0.0
    assert book.settle(1) is None  # settling twice is harmless
    book.first_byte(7)  # an unknown ticket too


def test_output_already_relayed_is_no_longer_owed_and_never_goes_negative() -> None:
    flight = Flight(prompt_tokens=0, output_tokens=320, answered=True)
    assert owed(flight, 16, bytes_per_token=10.0) == pytest.approx(20.0)
    flight.relayed = 1600  # 160 tokens at 10 bytes each
    assert owed(flight, 16, bytes_per_token=10.0) == pytest.approx(10.0)
    assert owed(flight, 16, bytes_per_token=None) == pytest.approx(20.0)  # ratio unknown: safe side
    flight.relayed = 10_000  # longer than expected
    assert owed(flight, 16, bytes_per_token=10.0) == 0.0


def test_expected_output_is_the_prior_then_the_learned_mean_capped_by_max_tokens() -> None:
    est = OutputEstimate(PressureConfig(output_window=4, output_min_samples=2,
                                        prior_output_tokens=500))
    assert est.expected(None) == 500
    assert est.expected(100) == 100  # the client's own cap
    est.learn(100)
    assert est.expected(None) == 500  # one answer is not enough
    est.learn(300)
    assert est.expected(None) == pytest.approx(200)
    assert est.expected(150) == 150
    for tokens in (400, 400, 400, 400):  # the window slides: only the last four count
        est.learn(tokens)
    assert est.expected(None) == pytest.approx(400)
    assert est.samples == 4


def test_usage_and_bytes_per_token_are_learned_from_an_answer() -> None:
    est = OutputEstimate(PressureConfig(output_min_samples=1))
    est.learn_answer(100, 20_000, streamed=True)
    assert est.mean() == 100
    assert est.bytes_per_token == pytest.approx(200.0)
    est.learn_answer(None, 40_000, streamed=True)  # no usage: from the bytes
    assert est.mean() == pytest.approx(150)
    est.learn_answer(None, 900, streamed=False)  # a JSON answer without usage
    assert est.samples == 2
    est.learn(10, relayed=1)  # an absurd ratio is not learned
    assert est.bytes_per_token == pytest.approx(200.0)


def test_an_engines_usage_is_believed_only_up_to_what_the_answer_could_hold() -> None:
    est = OutputEstimate(PressureConfig(output_min_samples=1))
    lie = 999_999_999
    est.learn_answer(lie, 4000, streamed=False, max_tokens=300)
    assert est.mean() == 300
    est.learn_answer(lie, 4000, streamed=False)
    assert est.mean() == pytest.approx((300 + 4000) / 2)


def test_unknown_capacity_gives_no_commitment_signal() -> None:
    assert projected_usage(0.5, 100, 16, None) is None
    assert projected_usage(0.5, 100, None, 1000) is None
    assert projected_usage(0.5, 100, 16, 1000) == pytest.approx(0.6)
    t = tracker()
    t.observe(0.0, 0.5, 0.0)
    t.commit(0.95, 16_000)
    assert t.pressure(0.0).level is Level.SHEDDABLE
    t.commit(None)
    p = t.pressure(0.0)
    assert p.level is Level.OPEN and p.committed_kv is None and p.capacity_tokens is None


def test_committed_usage_closes_sheddable_then_standard_with_hysteresis() -> None:
    t = tracker()  # committed marks: sheddable 0.90/0.85, standard 1.00/0.95
    t.observe(0.0, 0.2, 0.0)  # the engine itself reports little: the burst is still coming
    t.commit(0.91, 16_000)
    p = t.pressure(0.1)
    assert (p.level, p.reason, p.committed_kv) == (Level.SHEDDABLE, REASON_COMMITTED, 0.91)
    t.commit(1.01, 16_000)
    assert t.pressure(0.1).level is Level.STANDARD
    t.commit(0.97, 16_000)  # between standard's marks: stays closed
    assert t.pressure(0.1).level is Level.STANDARD
    t.commit(0.88, 16_000)  # below 0.95 opens standard; between sheddable's marks
    assert t.pressure(0.1).level is Level.SHEDDABLE
    t.commit(0.80, 16_000)
    assert t.pressure(0.1).level is Level.OPEN


def test_stale_telemetry_gives_no_commitment_pressure() -> None:
    t = tracker()
    t.observe(0.0, 0.2, 0.0)
    t.commit(0.99, 16_000)
    assert t.pressure(5.0).level is Level.OPEN


def fleet(**pressure: object) -> Fleet:
    cfg = Config(pools=(PoolConfig("target", "m", (EngineConfig("e0", "http://127.0.0.1:1"),)),),
                 pressure=PressureConfig(**pressure))  # type: ignore[arg-type]
    return Fleet(cfg)


def snap(kv: float, blocks: int | None = 1000) -> EngineSnapshot:
    return EngineSnapshot(taken_at=0.0, kv_usage=kv, running=0, waiting=0, block_size=16,
                          num_gpu_blocks=blocks)


def test_dispatched_flights_raise_the_engines_committed_usage_before_it_reports_any() -> None:
    f = fleet(prior_output_tokens=800)
    engine = f.get("e0")
    engine.state.on_scrape_ok(snap(0.10), 0.0)
    assert engine.view(0.0).pressure.committed_kv == pytest.approx(0.10)
    assert engine.estimate is f.estimate("target")
    for ticket in range(1, 17):  # 16 requests of 800 output tokens: 50 blocks each
        engine.commitments.dispatch(ticket, Flight(0.0, engine.estimate.expected(None)))
    view = engine.view(0.0)
    assert view.pressure.committed_kv == pytest.approx(0.10 + 16 * 50 / 1000)
    assert view.pressure.level is Level.SHEDDABLE
    assert view.pressure.reason == REASON_COMMITTED
    for ticket in range(1, 17):
        engine.commitments.settle(ticket)
    assert engine.view(0.0).pressure.level is Level.OPEN


def test_no_capacity_in_the_snapshot_or_reservation_off_means_no_commitment() -> None:
    f = fleet()
    engine = f.get("e0")
    engine.state.on_scrape_ok(snap(0.10, blocks=None), 0.0)
    engine.commitments.dispatch(1, Flight(0.0, 100_000))
    assert engine.view(0.0).pressure.committed_kv is None
    assert engine.view(0.0).pressure.level is Level.OPEN
    off = fleet(reserve_output=False).get("e0")
    assert off.estimate is None
    off.state.on_scrape_ok(snap(0.10), 0.0)
    assert off.view(0.0).pressure.committed_kv is None


def test_admission_keeps_a_request_off_an_engine_it_would_take_past_the_threshold() -> None:
    f = fleet()
    engine = f.get("e0")
    engine.state.on_scrape_ok(snap(0.50), 0.0)
    adm = Admission(ADM)
    view = engine.view(0.0)  # committed 0.50 of 16 000 tokens
    assert not adm.closed(view, Priority.SHEDDABLE, need_tokens=6000)  # -> 0.875 < 0.90
    assert adm.closed(view, Priority.SHEDDABLE, need_tokens=6500)  # -> 0.906 >= 0.90
    assert not adm.closed(view, Priority.STANDARD, need_tokens=7000)  # 0.9375 < 1.00
    assert not adm.closed(view, Priority.CRITICAL, need_tokens=60_000)  # never for critical
    shed = adm.decide("target", Priority.SHEDDABLE, [view], need_tokens=6500)
    assert getattr(shed, "reason", None) == REASON_COMMITTED
