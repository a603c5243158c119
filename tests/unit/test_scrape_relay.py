"""Scrape outcomes relayed between workers: the message format and its bounds, whom a worker
follows, and how a worker applies a sibling's outcomes to its own engines."""

from __future__ import annotations

import orjson
import pytest
from prometheus_client import generate_latest

from proxy.core.config import Config
from proxy.core.engine_state import Health
from proxy.core.fleet_config import EngineConfig, PoolConfig
from proxy.core.scrape_relay import (
    MAX_OUTCOMES,
    BadRelay,
    Outcome,
    SnapshotMemo,
    Sources,
    decode,
    encode,
)
from proxy.core.telemetry import EngineSnapshot
from proxy.fleet.engines import Fleet
from proxy.fleet.scrape_share import FROZEN, ScrapeShare, failed_outcome, ok_outcome, url_print
from proxy.observe.metrics import ProxyMetrics

SNAP = EngineSnapshot(taken_at=10.0, kv_usage=0.4, running=3, waiting=1, prefix_queries=100,
                      prefix_hits=40, block_size=16, num_gpu_blocks=1000, itl_sum=1.5,
                      itl_count=30)  # fmt: skip


def _ok(engine: str = "e0", started: float = 10.0, digest: int = 7) -> Outcome:
    return Outcome(engine, 1234, started, started + 0.01, digest,
                   EngineSnapshot(**{**SNAP.__dict__, "taken_at": started}))  # fmt: skip


def test_outcomes_survive_the_round_trip() -> None:
    failed = Outcome("e1", 99, 10.0, 10.2, 0, None, "timeout", "scrape timed out")
    [raw] = encode(1, [_ok(), failed])
    sender, got = decode(raw, max_bytes=1 << 20, workers=2)
    assert sender == 1 and got == [_ok(), failed]


def test_many_outcomes_are_split_into_bounded_messages() -> None:
    outcomes = [_ok(f"e{i}") for i in range(MAX_OUTCOMES + 1)]
    raws = encode(0, outcomes)
    assert len(raws) == 2
    assert [o for raw in raws for o in decode(raw, max_bytes=1 << 20, workers=2)[1]] == outcomes


def _row(**change: object) -> bytes:
    [raw] = encode(0, [_ok()])
    doc = orjson.loads(raw)
    row = doc["o"][0]
    where = {"engine": 0, "url": 1, "started": 2, "fetched": 3, "digest": 4, "reason": 6}
    for key, value in change.items():
        if key in where:
            row[where[key]] = value
        else:
            fields = list(EngineSnapshot.__dataclass_fields__)[1:]
            row[5][fields.index(key)] = value
    return orjson.dumps(doc)


@pytest.mark.parametrize("change", [
    {"engine": ""}, {"engine": "x" * 300}, {"url": -1}, {"url": 1 << 40}, {"digest": "7"},
    {"started": -1.0}, {"fetched": 9.0}, {"kv_usage": 1.5}, {"running": -1},
    {"waiting": 2e6}, {"kv_usage": True}, {"block_size": 0}, {"block_size": 1.5},
    {"ready": 1}, {"prefix_hits": "many"}, {"preemptions": None},
])  # fmt: skip
def test_a_bad_outcome_is_refused(change: dict[str, object]) -> None:
    with pytest.raises(BadRelay):
        decode(_row(**change), max_bytes=1 << 20, workers=2)


@pytest.mark.parametrize("raw", [
    b"", b"[]", b"not json", b'{"v": 2, "w": 0, "o": []}', b'{"v": 1, "w": 2, "o": []}',
    b'{"v": 1, "w": -1, "o": []}', b'{"v": 1, "w": true, "o": []}', b'{"v": 1, "w": 0}',
    b'{"v": 1, "w": 0, "o": [["e", 1, 1.0, 1.0, 0, null, "", ""]]}',
])  # fmt: skip
def test_a_bad_message_is_refused(raw: bytes) -> None:
    with pytest.raises(BadRelay):
        decode(raw, max_bytes=1 << 20, workers=2)


def test_repeated_figures_are_restamped_and_changed_or_bad_ones_still_checked() -> None:
    memo = SnapshotMemo()
    [first] = decode(encode(0, [_ok(started=10.0)])[0], max_bytes=1 << 20, workers=2, memo=memo)[1]
    [again] = decode(encode(0, [_ok(started=10.2)])[0], max_bytes=1 << 20, workers=2, memo=memo)[1]
    assert again == _ok(started=10.2) and again.snapshot is not first.snapshot
    # Figures that change after a repeat are read as they are.
    moved = Outcome("e0", 1234, 10.4, 10.41, 8, EngineSnapshot(**{**SNAP.__dict__,
                    "taken_at": 10.4, "running": 9}))  # fmt: skip
    [got] = decode(encode(0, [moved])[0], max_bytes=1 << 20, workers=2, memo=memo)[1]
    assert got == moved and got.snapshot is not None and got.snapshot.running == 9
    # A lie after a repeat is still refused, the memo notwithstanding.
    with pytest.raises(BadRelay):
        decode(_row(kv_usage=1.5), max_bytes=1 << 20, workers=2, memo=memo)
    # Another engine's identical figures are its own.
    [other] = decode(encode(0, [_ok("e9", 10.6)])[0], max_bytes=1 << 20, workers=2, memo=memo)[1]
    assert other == _ok("e9", 10.6)


def test_a_message_over_the_size_bound_is_refused_unread() -> None:
    [raw] = encode(0, [_ok()])
    with pytest.raises(BadRelay, match="too large"):
        decode(raw, max_bytes=len(raw) - 1, workers=2)


def test_a_worker_follows_only_lower_indexes_and_the_lowest_of_them() -> None:
    sources = Sources(own=2, hold_s=0.3)
    assert not sources.follows("e", 0.0)
    assert not sources.accept(3, "e", 0.0)  # a higher index never
    assert not sources.accept(2, "e", 0.0)  # nor its own
    assert sources.accept(1, "e", 0.0) and sources.follows("e", 0.1)
    assert sources.accept(0, "e", 0.1)  # a lower one wins at once
    assert not sources.accept(1, "e", 0.2)  # ... and the higher one is ignored meanwhile
    assert sources.follows("e", 0.35) and not sources.follows("e", 0.45)
    assert sources.accept(1, "e", 0.5)  # worker 0 fell silent: 1 is followed again


def test_worker_zero_follows_nobody() -> None:
    sources = Sources(own=0, hold_s=0.3)
    assert not sources.accept(1, "e", 0.0) and not sources.follows("e", 0.0)


def test_removed_engines_are_forgotten() -> None:
    sources = Sources(own=1, hold_s=0.3)
    sources.accept(0, "a", 0.0)
    sources.accept(0, "b", 0.0)
    sources.forget(["a"])
    assert len(sources) == 1 and sources.follows("a", 0.1) and not sources.follows("b", 0.1)


class _Receiver:
    def __init__(self, index: int = 1) -> None:
        pools = (PoolConfig("target", "m", tuple(EngineConfig(f"e{i}", f"http://127.0.0.1:{9 + i}")
                                                 for i in range(2))),)  # fmt: skip
        self.fleet = Fleet(Config(pools=pools))
        self.metrics = ProxyMetrics()
        self.sent: list[bytes] = []
        self.now = 10.0
        self.share = ScrapeShare(self.fleet, self.metrics, lambda: self.now, index=index,
                                 workers=2, interval_s=0.1, max_bytes=1 << 20,
                                 send=self._send)  # fmt: skip

    def _send(self, payload: bytes) -> bool:
        self.sent.append(payload)
        return True

    def relay(self, *outcomes: Outcome, sender: int = 0) -> None:
        for raw in encode(sender, outcomes):
            self.share.receive(raw)

    def counted(self, result: str) -> float:
        value = self.metrics.registry.get_sample_value(
            "kvproxy_scrape_relayed_total", {"result": result})
        return value or 0.0


def _scraped(rx: _Receiver, name: str = "e0", started: float = 10.0, digest: int = 7) -> Outcome:
    engine = rx.fleet.get(name)
    snap = EngineSnapshot(**{**SNAP.__dict__, "taken_at": started})
    return ok_outcome(engine, snap, digest, started + 0.01)


def test_a_relayed_snapshot_is_applied_as_if_scraped_here() -> None:
    rx = _Receiver()
    rx.relay(_scraped(rx))
    state = rx.fleet.get("e0").state
    assert state.health is Health.HEALTHY and state.snapshot is not None
    assert state.snapshot.taken_at == 10.0 and state.snapshot.running == 3
    assert rx.share.follows(rx.fleet.get("e0"), 10.2)
    assert not rx.share.follows(rx.fleet.get("e1"), 10.2)  # nobody scrapes e1 for it
    assert rx.counted("applied") == 1


def test_relayed_failures_make_the_engine_unhealthy_like_own_ones() -> None:
    rx = _Receiver()
    engine = rx.fleet.get("e0")
    rx.relay(_scraped(rx))
    for i in range(3):
        rx.now += 0.1
        rx.relay(failed_outcome(engine, rx.now, rx.now, "http_500", "metrics answered HTTP 500"))
        assert engine.state.consecutive_failures == i + 1
    assert engine.state.health is Health.UNHEALTHY
    assert engine.state.last_error == "metrics answered HTTP 500"


def test_relayed_timeouts_prove_the_engine_slow_not_gone_like_own_ones() -> None:
    rx = _Receiver()
    engine = rx.fleet.get("e0")
    rx.relay(_scraped(rx))
    silent_limit = engine.state.stale_after_s * engine.state.unhealthy_after_failures
    for _ in range(3):  # as many failures as fail an engine, well within the silence limit
        rx.now += 0.1
        rx.relay(failed_outcome(engine, rx.now, rx.now, "timeout", "scrape timed out"))
    assert engine.state.consecutive_failures == 3
    assert engine.state.health is not Health.UNHEALTHY
    rx.now = 10.0 + silent_limit + 0.1  # answered nothing for longer: now it is failed
    rx.relay(failed_outcome(engine, rx.now, rx.now, "timeout", "scrape timed out"))
    assert engine.state.health is Health.UNHEALTHY


def test_relayed_timeouts_do_not_fail_an_engine_answering_this_workers_requests() -> None:
    rx = _Receiver()
    engine = rx.fleet.get("e0")
    rx.relay(_scraped(rx))
    silent_limit = engine.state.stale_after_s * engine.state.unhealthy_after_failures
    end = rx.now + 2 * silent_limit
    while rx.now < end:  # one request answered here between any two relayed timeouts
        rx.now += 0.5
        ticket = engine.state.on_dispatch(rx.now)
        engine.state.on_first_byte(ticket, rx.now)
        engine.state.on_settle(ticket)
        rx.relay(failed_outcome(engine, rx.now, rx.now, "timeout", "scrape timed out"))
        assert engine.state.health is not Health.UNHEALTHY
    assert engine.state.health is Health.STALE
    for _ in range(int(silent_limit / 0.5) + 1):  # then nothing answered here either
        rx.now += 0.5
        rx.relay(failed_outcome(engine, rx.now, rx.now, "timeout", "scrape timed out"))
    assert engine.state.health is Health.UNHEALTHY


def test_answers_older_than_the_last_snapshot_do_not_keep_a_hung_engine_alive() -> None:
    rx = _Receiver()
    engine = rx.fleet.get("e0")
    for _ in range(5):  # answered before the snapshot below was taken
        ticket = engine.state.on_dispatch(rx.now)
        engine.state.on_first_byte(ticket, rx.now)
        engine.state.on_settle(ticket)
    rx.relay(_scraped(rx))
    silent_limit = engine.state.stale_after_s * engine.state.unhealthy_after_failures
    while rx.now < 10.0 + silent_limit:  # then the engine hangs: no answer of any kind
        rx.now = round(rx.now + 0.1, 6)
        rx.relay(failed_outcome(engine, rx.now, rx.now, "timeout", "scrape timed out"))
    assert engine.state.health is Health.UNHEALTHY  # at the limit from its last snapshot


def test_a_repeat_this_worker_proves_frozen_is_a_failed_scrape_here() -> None:
    rx = _Receiver()
    engine = rx.fleet.get("e0")
    rx.relay(_scraped(rx, started=10.0, digest=5))
    ticket = engine.state.on_dispatch(10.05)  # after the first text was fetched (10.01)
    engine.state.on_complete(ticket, 10.06)
    engine.state.on_settle(ticket)
    rx.now = 10.3
    rx.relay(_scraped(rx, started=10.2, digest=5))
    assert engine.state.consecutive_failures == 1 and engine.state.last_error == FROZEN
    text = generate_latest(rx.metrics.registry).decode()
    assert 'kvproxy_scrape_failures_total{engine="e0",reason="frozen"} 1.0' in text


def test_outcomes_not_meant_for_this_worker_are_ignored() -> None:
    rx = _Receiver()
    good = _scraped(rx)
    rx.relay(Outcome(**{**good.__dict__, "engine": "unknown"}))
    rx.relay(Outcome(**{**good.__dict__, "url": url_print(rx.fleet.get("e0")) ^ 1}))
    rx.relay(Outcome(**{**good.__dict__, "started": rx.now + 5, "fetched_at": rx.now + 5}))
    rx.share.receive(b"{}")
    assert rx.fleet.get("e0").state.snapshot is None
    assert rx.counted("ignored") == 3 and rx.counted("invalid") == 1
    zero = _Receiver(index=0)
    zero.relay(_scraped(zero), sender=1)  # worker 0 scrapes for itself
    assert zero.fleet.get("e0").state.snapshot is None


def test_own_outcomes_are_published_only_with_siblings() -> None:
    rx = _Receiver(index=0)
    rx.share.publish([_scraped(rx)])
    assert len(rx.sent) == 1 and decode(rx.sent[0], max_bytes=1 << 20, workers=2)[0] == 0
    rx.share.publish([])
    assert len(rx.sent) == 1 and rx.counted("sent") == 1
