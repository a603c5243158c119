"""An engine hands back its last view while nothing it shows has changed, and a new one as soon
as anything has: every kept view equals the one built afresh."""

from __future__ import annotations

from proxy.core.breaker import Outcome
from proxy.core.commitment import ANSWERED_REFRESH_S, Flight
from proxy.core.config import Config
from proxy.core.fleet_config import EngineConfig, PoolConfig
from proxy.core.routing import EngineView
from proxy.core.telemetry import EngineSnapshot
from proxy.fleet.engines import Engine, Fleet


def engine() -> Engine:
    pool = PoolConfig("target", "m", (EngineConfig("e0", "http://127.0.0.1:1"),))
    return Fleet(Config(pools=(pool,))).get("e0")


def snap(at: float, kv: float) -> EngineSnapshot:
    return EngineSnapshot(taken_at=at, kv_usage=kv, running=2, waiting=1, block_size=16,
                          num_gpu_blocks=1000)


def fresh(e: Engine, now: float) -> EngineView:
    e.state._view_key = ()  # forget the kept one: built from scratch
    return e.view(now)


def test_the_same_view_comes_back_while_nothing_changed() -> None:
    e = engine()
    e.state.on_scrape_ok(snap(0.0, 0.2), 0.0)
    first = e.view(0.01)
    assert e.view(0.02) is first


def test_every_change_an_engine_sees_shows_in_its_next_view() -> None:
    e = engine()
    seen: list[EngineView] = []

    def check(now: float) -> None:
        kept = e.view(now)
        assert kept == fresh(e, now)
        seen.append(kept)

    e.state.on_scrape_ok(snap(0.0, 0.2), 0.0)
    check(0.0)
    ticket = e.state.on_dispatch(0.01, 400.0)  # load and prefill backlog
    assert e.estimate is not None
    e.estimate.learn_answer(100, 10_000, streamed=True)  # bytes per token known
    flight = e.commitments.dispatch(ticket, Flight(400.0, e.estimate.expected(2000)))
    check(0.01)
    e.state.on_first_byte(ticket)
    e.commitments.first_byte(ticket)
    check(0.02)
    flight.relayed += 200_000  # the answer's bytes change what it still owes (pressure) ...
    check(0.02 + ANSWERED_REFRESH_S)  # ... once the answered flights are summed again
    e.state.on_scrape_ok(snap(0.2, 0.6), 0.2)  # a new snapshot
    check(0.2)
    for _ in range(3):
        e.record(Outcome.FAILURE, 0.21)  # the breaker opens
    check(0.21)
    e.state.on_settle(ticket)
    e.commitments.settle(ticket)
    check(0.22)
    e.state.on_scrape_failed(5.0, "refused")  # stale, then unhealthy
    check(5.0)
    assert [v.load for v in seen[:2]] == [3.0, 4.0]
    assert seen[2].prefill < seen[1].prefill
    assert seen[3].pressure != seen[2].pressure
    assert seen[4].kv_usage == 0.6
    assert seen[4].routable and not seen[5].routable
    assert not seen[7].fresh
