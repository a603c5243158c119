"""The pure part of shared routing state: the outbox, the message format, the peers' counts."""

from __future__ import annotations

from dataclasses import replace

import orjson
import pytest

from proxy.core.config import RoutingConfig
from proxy.core.costmodel import ExpectedTTFT
from proxy.core.engine_state import EngineState
from proxy.core.routeview import RouteKey
from proxy.core.sharing import (
    Backlog,
    BadMessage,
    Dispatch,
    Message,
    Outbox,
    PeerTable,
    decode,
    dispatches_per_message,
    encode,
    next_round,
)
from proxy.core.telemetry import EngineSnapshot


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


def test_a_quiet_round_waits_for_the_heartbeat_or_the_first_peer_expiry() -> None:
    table = PeerTable(ttl_s=2.0)
    assert table.next_expiry(10.0) is None
    table.heard(Message("a", 1), now=10.0)
    table.heard(Message("b", 1), now=10.5)
    assert table.next_expiry(11.0) == 12.0
    assert table.next_expiry(12.2) == 12.5  # a's figures are gone already
    due = {"interval_s": 0.025, "heartbeat_at": 10.5}
    assert next_round(10.0, quiet=False, expiry=None, **due) == 10.025
    assert next_round(10.0, quiet=True, expiry=None, **due) == 10.5
    assert next_round(10.0, quiet=True, expiry=10.2, **due) == 10.2
    # Never sooner than one interval on: a heartbeat overdue still waits for it.
    assert next_round(10.0, quiet=True, expiry=9.0, **due) == 10.025
    box = Outbox(4)
    woken: list[bool] = []
    box.on_dispatch = lambda: woken.append(True)
    box.dispatched("p", "e", (1,))
    assert woken == [True] and box.take() == [Dispatch("p", "e", (1,))]


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


@pytest.mark.parametrize("max_chain", [1, 512, 2048, 8192])
def test_a_full_message_of_the_longest_chains_fits_a_frame(max_chain: int) -> None:
    frame = 1 << 20
    per = dispatches_per_message(max_chain, frame)
    name = "n" * 256
    chain = tuple([(1 << 64) - 1] * max_chain)  # the widest hashes, as decimal text
    full = Message(name, 1 << 62, tuple(Dispatch(name, name, chain) for _ in range(per)))
    raw = encode(full)
    assert len(raw) <= frame
    assert decode(raw, max_bytes=frame, max_chain=max_chain) == full


def test_the_old_fixed_batch_of_64_does_not_fit_a_frame_with_2048_block_chains() -> None:
    """Why the batch follows the chain cap: 64 dispatches of 128k-token prompts are 2.8 MB."""
    chain = tuple([(1 << 64) - 1] * 2048)
    raw = encode(Message("a", 1, tuple(Dispatch("p", "e", chain) for _ in range(64))))
    assert len(raw) > 1 << 20
    assert dispatches_per_message(2048, 1 << 20) < 64


def test_prefill_backlogs_travel_and_are_bounded() -> None:
    msg = Message("r1", 3, (), {"t0": 2.0}, {"t0": 2.0}, {"t0": Backlog(48_000.0, 3.0, 1.0)})
    assert _decode(encode(msg)) == msg
    # A sender that does not say what it has pending says nothing is.
    assert _decode(b'{"v":1,"r":"x","s":1,"p":{"e":1}}').prefill == {}
    for bad in (b"[-1,1,0]", b"[1e13,1,0]", b"[1,2,3]", b"[1,1]", b'"many"', b"[true,1,0]"):
        with pytest.raises(BadMessage):
            _decode(b'{"v":1,"r":"x","s":1,"t":{"e":' + bad + b"}}")


def test_peer_backlogs_add_up_and_expire_with_the_peer() -> None:
    table = PeerTable(ttl_s=2.0)
    table.heard(Message("a", 1, prefill={"e": Backlog(3000.0, 2.0, 1.0)}), now=10.0)
    table.heard(Message("b", 1, prefill={"e": Backlog(500.0, 1.0, 0.0),
                                         "f": Backlog(9.0, 1.0, 1.0)}), now=11.0)
    assert table.prefill_totals(11.5) == {"e": (3500.0, 3.0, 1.0), "f": (9.0, 1.0, 1.0)}
    assert table.prefill_totals(12.5) == {"e": (500.0, 1.0, 0.0), "f": (9.0, 1.0, 1.0)}


def test_the_published_backlog_is_every_prompt_not_yet_answered() -> None:
    state = EngineState("e", "p", "http://e", stale_after_s=1.0)
    state.on_dispatch(now=0.5, prefill=1000.0)
    state.on_scrape_ok(_snap(1.0), 1.0)  # the snapshot counts the first among its waiting
    answered = state.on_dispatch(now=1.1, prefill=200.0)
    state.on_dispatch(now=1.2, prefill=3000.0)
    state.on_first_byte(answered)
    assert state.backlog == (4000.0, 2.0, 1.0)


def test_other_processes_backlog_counts_like_this_proxys_own() -> None:
    state = EngineState("e", "p", "http://e", stale_after_s=1.0)
    state.on_scrape_ok(replace(_snap(1.0), waiting=3.0), 1.0)
    state.remote_backlog = Backlog(9000.0, 3.0, 2.0)
    view = state.view(1.1, True)
    assert (view.prefill, view.pending, view.pending_seen) == (9000.0, 3, 2)


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
    busy.remote_pending, busy.remote_backlog = 1.0, Backlog(40_000.0, 1.0, 0.0)
    assert busy.view(1.1, True).prefill == 40_000.0
    assert policy.rank(key, [s.view(1.1, True) for s in states])[0] != first


def _snap(at: float) -> EngineSnapshot:
    return EngineSnapshot(taken_at=at, kv_usage=0.1, running=0.0, waiting=0.0)
