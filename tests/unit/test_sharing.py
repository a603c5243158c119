"""The pure part of shared routing state: the outbox, the message format, the peers' counts."""

from __future__ import annotations

import orjson
import pytest

from proxy.core.config import RoutingConfig
from proxy.core.costmodel import ExpectedTTFT
from proxy.core.routeview import RouteKey
from proxy.core.sharing import (
    BadMessage,
    Dispatch,
    Message,
    Outbox,
    PeerTable,
    decode,
    encode,
)
from proxy.core.telemetry import EngineSnapshot, EngineState


def _decode(raw: bytes) -> Message:
    return decode(raw, max_bytes=1 << 20, max_chain=512)


def test_a_message_survives_the_round_trip() -> None:
    msg = Message("r1", 7, (Dispatch("target", "t0", (1, 2, (1 << 64) - 1)),), {"t0": 2.0},
                  {"t0": 3.0})
    assert _decode(encode(msg)) == msg


def test_the_outbox_is_bounded_and_counts_what_it_drops() -> None:
    box = Outbox(2)
    for i in range(5):
        box.dispatched("p", "e", (i,))
    assert [d.chain for d in box.take()] == [(0,), (1,)]
    assert box.dropped == 3 and box.take() == []


def test_a_disabled_outbox_keeps_nothing() -> None:
    box = Outbox(8, enabled=False)
    box.dispatched("p", "e", (1,))
    assert box.take() == [] and box.dropped == 0


@pytest.mark.parametrize("doc", [
    [], {"v": 2, "r": "x", "s": 1}, {"v": 1, "r": "", "s": 1}, {"v": 1, "r": "x", "s": True},
    {"v": 1, "r": "x", "s": 1, "d": [["p", "e", [-1]]]},
    {"v": 1, "r": "x", "s": 1, "d": [["p", "e", list(range(600))]]},
    {"v": 1, "r": "x", "s": 1, "d": [["p", "e" * 300, [1]]]},
    {"v": 1, "r": "x", "s": 1, "d": [["p", "e", [1.5]]]},
    {"v": 1, "r": "x", "s": 1, "p": {"e": -1}},
    {"v": 1, "r": "x", "s": 1, "p": {"e": 1e12}},
    {"v": 1, "r": "x", "s": 1, "o": {"e": "1"}},
])  # fmt: skip
def test_hostile_messages_are_refused(doc: object) -> None:
    with pytest.raises(BadMessage):
        _decode(orjson.dumps(doc))


def test_oversized_and_garbled_messages_are_refused() -> None:
    with pytest.raises(BadMessage):  # a hash past 64 bits (orjson itself refuses to write one)
        _decode(b'{"v":1,"r":"x","s":1,"d":[["p","e",[18446744073709551616]]]}')
    with pytest.raises(BadMessage):
        decode(b"{" * 10, max_bytes=1 << 20, max_chain=4)
    with pytest.raises(BadMessage):
        decode(encode(Message("r", 1)), max_bytes=5, max_chain=4)


def test_peer_counts_add_up_and_expire() -> None:
    table = PeerTable(ttl_s=2.0)
    assert table.heard(Message("a", 1, pending={"e": 2.0}, open={"e": 3.0}), now=10.0)
    assert table.heard(Message("b", 1, pending={"e": 1.0, "f": 1.0}), now=11.0)
    assert table.totals(11.5) == ({"e": 3.0, "f": 1.0}, {"e": 3.0})
    assert table.live(11.5) == 2
    assert table.totals(12.5) == ({"e": 1.0, "f": 1.0}, {})  # a's figures expired
    table.expire(13.5)
    assert table.live(13.5) == 0


def test_an_older_message_from_a_peer_does_not_replace_a_newer_one() -> None:
    table = PeerTable(ttl_s=2.0)
    table.heard(Message("a", 5, pending={"e": 4.0}), now=1.0)
    assert not table.heard(Message("a", 4, pending={"e": 0.0}), now=1.1)
    assert table.totals(1.2)[0] == {"e": 4.0}


def test_the_peer_table_is_bounded() -> None:
    table = PeerTable(ttl_s=2.0, max_peers=2)
    assert table.heard(Message("a", 1), now=0.0)
    assert table.heard(Message("b", 1), now=0.0)
    assert not table.heard(Message("c", 1), now=1.0)
    assert table.heard(Message("c", 1), now=2.5)  # the others expired


def test_other_processes_dispatches_count_in_an_engines_load() -> None:
    state = EngineState("e", "p", "http://e")
    state.on_dispatch(now=1.0)
    state.remote_pending = 2.0
    assert state.load() == 3.0
    assert state.view(1.0, True).load == 3.0


def test_pending_prompt_tokens_travel_and_are_bounded() -> None:
    msg = Message("r1", 3, (), {"t0": 2.0}, {"t0": 2.0}, {"t0": 48_000.0})
    assert _decode(encode(msg)) == msg
    # A sender that does not say how many tokens it has pending says 0.
    assert _decode(b'{"v":1,"r":"x","s":1,"p":{"e":1}}').prefill == {}
    for bad in (b'-1', b'1e13', b'"many"', b'true'):
        with pytest.raises(BadMessage):
            _decode(b'{"v":1,"r":"x","s":1,"t":{"e":' + bad + b"}}")


def test_peer_prefill_adds_up_and_expires_with_the_peer() -> None:
    table = PeerTable(ttl_s=2.0)
    table.heard(Message("a", 1, pending={"e": 1.0}, prefill={"e": 3000.0}), now=10.0)
    table.heard(Message("b", 1, pending={"e": 1.0}, prefill={"e": 500.0, "f": 9.0}), now=11.0)
    assert table.prefill_totals(11.5) == {"e": 3500.0, "f": 9.0}
    assert table.prefill_totals(12.5) == {"e": 500.0, "f": 9.0}  # a's figures expired


def test_only_prompts_sent_since_the_snapshot_and_not_yet_answered_are_published() -> None:
    state = EngineState("e", "p", "http://e", stale_after_s=1.0)
    before = state.on_dispatch(now=0.5, prefill=1000.0)
    state.on_scrape_ok(_snap(1.0), 1.0)  # the snapshot counts ``before`` among its waiting
    answered = state.on_dispatch(now=1.1, prefill=200.0)
    state.on_dispatch(now=1.2, prefill=3000.0)
    state.on_first_byte(answered)
    assert state.prefill_since_snapshot == 3000.0
    assert before  # still open: this proxy counts it, the others see it in their snapshots


def test_other_processes_pending_prompts_are_queued_work_the_cost_model_weighs() -> None:
    cfg = RoutingConfig()
    states = [EngineState(n, "p", f"http://{n}", stale_after_s=1.0) for n in ("a", "b")]
    for s in states:
        s.on_scrape_ok(_snap(1.0), 1.0)
    key = RouteKey(chain=(1, 2, 3), prompt_tokens=2000.0)
    policy = ExpectedTTFT(cfg)
    views = [s.view(1.1, True) for s in states]
    first = policy.rank(key, views)[0]
    policy.observe(key, first)
    assert policy.rank(key, views)[0] == first  # it holds the prompt now
    # Another replica just sent a 40k-token prompt there: the prompt's next request goes elsewhere.
    busy = states[[s.name for s in states].index(first)]
    busy.remote_pending, busy.remote_prefill = 1.0, 40_000.0
    assert busy.view(1.1, True).prefill == 40_000.0
    assert policy.rank(key, [s.view(1.1, True) for s in states])[0] != first


def _snap(at: float) -> EngineSnapshot:
    return EngineSnapshot(taken_at=at, kv_usage=0.1, running=0.0, waiting=0.0)
