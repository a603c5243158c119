"""The pure part of shared routing state: the outbox, the message format, the peers' counts."""

from __future__ import annotations

from dataclasses import replace

import orjson
import pytest

from proxy.core.config import RoutingConfig
from proxy.core.costmodel import ExpectedTTFT
from proxy.core.engine_state import EngineState
from proxy.core.routeview import EngineView, RouteKey
from proxy.core.sharing import (
    MAX_CONFIRMATIONS,
    Backlog,
    BadMessage,
    Confirmation,
    Dispatch,
    Message,
    confirmations_per_message,
    decode,
    dispatches_per_message,
    encode,
)
from proxy.core.sharing_state import Outbox, PeerTable, Unconfirmed, next_round
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


# Confirmations: the first bytes of a sender's dispatches, shared so that the others settle them.


def test_confirmations_survive_the_round_trip_and_are_left_out_when_there_are_none() -> None:
    msg = Message("r1", 9, (Dispatch("p", "e0", (1, 2)),), {"e0": 1.0}, {"e0": 1.0},
                  confirmations=(Confirmation(9, 0, "e0"), Confirmation(4, 63, "e1")))
    assert _decode(encode(msg)) == msg
    assert "c" in orjson.loads(encode(msg))
    assert "c" not in orjson.loads(encode(replace(msg, confirmations=())))


def test_a_message_without_confirmations_still_decodes() -> None:
    # What every sender of the version before confirmations writes.
    raw = b'{"v":1,"r":"x","s":3,"d":[["p","e",[1,2]]],"p":{"e":1},"o":{"e":1}}'
    assert _decode(raw) == Message("x", 3, (Dispatch("p", "e", (1, 2)),), {"e": 1.0}, {"e": 1.0})


def test_a_receiver_of_the_older_version_reads_past_the_confirmations() -> None:
    """The version before confirmations decoded exactly as today's ``decode`` does, less ``c``:
    unknown top-level keys are ignored and every ``d`` entry must be three items. A new message
    keeps ``d`` as it was and adds only ``c``, so an older receiver merges all the rest."""
    msg = Message("r1", 5, (Dispatch("p", "e0", (1, 2)), Dispatch("p", "e1", (3,))),
                  {"e0": 1.0}, {"e0": 2.0}, {"e0": Backlog(10.0, 1.0, 0.0)},
                  (Confirmation(5, 1, "e1"),))
    doc = orjson.loads(encode(msg))
    assert set(doc) - {"v", "r", "s", "d", "p", "o", "t"} == {"c"}
    assert all(len(d) == 3 for d in doc["d"])
    # Unknown keys pass by: a key this version does not know is ignored, as ``c`` was before.
    doc["z"] = [[1, 2, 3, 4], {"anything": True}]
    older = {k: v for k, v in doc.items() if k != "c"}
    assert _decode(orjson.dumps(older)) == replace(msg, confirmations=())
    assert _decode(orjson.dumps(doc)) == msg


@pytest.mark.parametrize("c", [
    {}, "c", [[1, 0]], [[1, 0, "e", 1]], [[True, 0, "e"]], [[1, False, "e"]], [[1.0, 0, "e"]],
    [[1, 0, ""]], [[1, 0, "e" * 300]], [[1, 0, 7]], [[-1, 0, "e"]], [[1, -1, "e"]],
    [[6, 0, "e"]],  # a message later than this one
    [[5, 1, "e"]],  # this message has one dispatch: position 1 is not there
    [[4, 1 << 16, "e"]], [[1, 0, "e"]] * (MAX_CONFIRMATIONS + 1),
])  # fmt: skip
def test_hostile_confirmations_are_refused(c: object) -> None:
    doc = {"v": 1, "r": "x", "s": 5, "d": [["p", "e", [1]]], "c": c}
    with pytest.raises(BadMessage):
        _decode(orjson.dumps(doc))


def test_a_first_byte_is_confirmed_by_the_place_its_dispatch_went_out_in() -> None:
    box = Outbox(8)
    box.dispatched("p", "e0", (1,), token="a")
    box.dispatched("p", "e1", (2,), token="b")
    box.dispatched("p", "e0", (3,))  # no token: never confirmed
    box.answered("b", "e2")  # before its dispatch went out: a retry answered on e2
    first = box.pack("r", 10, per_message=2, per_confirm=8)
    assert [m.seq for m in first] == [10, 11]
    assert [len(m.dispatches) for m in first] == [2, 1]
    assert first[0].confirmations == (Confirmation(10, 1, "e2"),)
    box.answered("a", "e0")  # in a later round
    box.answered("a", "e0")  # twice: confirmed once
    box.answered("nobody", "e0")
    later = box.pack("r", 12, per_message=2, per_confirm=8)
    assert later == [Message("r", 12, confirmations=(Confirmation(10, 0, "e0"),))]


def test_confirmations_beyond_a_messages_share_go_in_the_next_never_before_their_dispatch() -> None:
    box = Outbox(16)
    for i in range(6):
        box.dispatched("p", "e", (i,), token=i)
    box.pack("r", 1, per_message=2, per_confirm=2)  # seq 1: 0, 1; 2: 2, 3; 3: 4, 5
    box.dispatched("p", "e", (6,), token=6)
    for i in range(7):
        box.answered(i, "e")
    msgs = box.pack("r", 4, per_message=2, per_confirm=2)
    assert [(m.seq, len(m.dispatches)) for m in msgs] == [(4, 1), (5, 0), (6, 0), (7, 0)]
    placed = [[(c.seq, c.pos) for c in m.confirmations] for m in msgs]
    assert placed == [[(1, 0), (1, 1)], [(2, 0), (2, 1)], [(3, 0), (3, 1)], [(4, 0)]]
    for m in msgs:  # each a message of its own that decodes
        assert _decode(encode(m)) == m
    # Within one pack the dispatch's own message is the earliest a confirmation may go in.
    box = Outbox(16)
    box.dispatched("p", "e", (1,), token="x")
    box.dispatched("p", "e", (2,), token="y")
    box.answered("y", "e")
    msgs = box.pack("r", 1, per_message=1, per_confirm=4)
    assert [m.confirmations for m in msgs] == [(), (Confirmation(2, 0, "e"),)]


def test_dropped_or_unsent_dispatches_have_no_confirmation() -> None:
    box = Outbox(1)
    box.dispatched("p", "e", (1,), token="kept")
    box.dispatched("p", "e", (2,), token="dropped")  # the outbox is full
    box.answered("kept", "e")
    box.answered("dropped", "e")  # the queue of first bytes is as bounded: dropped, counted
    assert (box.dropped, box.dropped_answers) == (1, 1)
    msgs = box.pack("r", 1, per_message=4, per_confirm=4)
    assert msgs[0].confirmations == (Confirmation(1, 0, "e"),)
    # A message that could not be sent: its dispatch is never confirmed.
    box.dispatched("p", "e", (3,), token="lost")
    box.pack("r", 2, per_message=4, per_confirm=4)
    box.unsent(2)
    box.answered("lost", "e")
    assert box.pack("r", 3, per_message=4, per_confirm=4)[0].confirmations == ()


def test_a_reused_token_does_not_confirm_the_request_that_had_it_before() -> None:
    box = Outbox(1)
    box.dispatched("p", "e", (1,), token=7)  # never answered
    box.pack("r", 1, per_message=4, per_confirm=4)
    box.dispatched("p", "e", (2,), token=7)  # the id comes back, for a request dropped here
    box.dispatched("p", "e", (3,), token=7)
    box.answered(7, "e")
    assert box.pack("r", 2, per_message=4, per_confirm=4)[0].confirmations == (
        Confirmation(2, 0, "e"),)


def test_a_full_message_with_confirmations_fits_a_frame() -> None:
    frame, max_chain = 1 << 20, 2048
    per, per_confirm = dispatches_per_message(max_chain, frame), confirmations_per_message(frame)
    name, widest = "n" * 256, (1 << 63) - 1  # orjson writes at most 64-bit signed sequences
    chain = tuple([(1 << 64) - 1] * max_chain)
    engines = {f"{i:0256d}": 1e6 for i in range(64)}
    full = Message(name, widest, tuple(Dispatch(name, name, chain) for _ in range(per)),
                   engines, engines, {n: Backlog(1e12, 1e6, 1e6) for n in engines},
                   tuple(Confirmation(widest - 1, 65535, name) for _ in range(per_confirm)))
    raw = encode(full)
    assert len(raw) <= frame
    assert decode(raw, max_bytes=frame, max_chain=max_chain) == full
    assert per_confirm == MAX_CONFIRMATIONS
    assert confirmations_per_message(4096) == 3 and confirmations_per_message(100) == 1


def test_a_confirmation_settles_only_what_was_merged_in_the_named_engines_pool() -> None:
    kept = Unconfirmed()
    pools = {"e0": "p", "e1": "p", "q0": "q"}
    kept.merged("a", 1, 0, Dispatch("p", "e0", (1, 2)))
    kept.merged("a", 1, 1, Dispatch("p", "e1", (3,)))
    kept.merged("b", 1, 0, Dispatch("p", "e0", (4,)))
    cs = (Confirmation(1, 0, "e1"),  # answered by a retry on e1
          Confirmation(1, 1, "q0"),  # an engine of another pool: ignored
          Confirmation(1, 2, "e0"),  # nothing merged there
          Confirmation(1, 0, "e0"))  # already confirmed
    found, ignored = kept.confirmed(Message("a", 2, confirmations=cs), pools)
    assert found == [Dispatch("p", "e1", (1, 2))] and ignored == 3
    assert len(kept) == 1  # b's, which no one confirmed yet


def test_what_waits_for_a_confirmation_is_bounded_by_entries_and_blocks() -> None:
    kept = Unconfirmed(max_entries=3, max_blocks=10)
    for i in range(5):
        kept.merged("a", i, 0, Dispatch("p", "e", (i,)))
    assert len(kept) == 3
    kept.merged("a", 9, 0, Dispatch("p", "e", tuple(range(9))))
    assert len(kept) == 2  # 9 + 1 blocks: the oldest went
    kept.merged("a", 10, 0, Dispatch("p", "e", tuple(range(11))))
    assert len(kept) == 0  # one chain over the bound is not kept at all
    found, ignored = kept.confirmed(Message("a", 11, confirmations=(Confirmation(4, 0, "e"),)),
                                    {"e": "p"})
    assert (found, ignored) == ([], 1)


def _idle(name: str, **kw: float) -> EngineView:
    return replace(EngineView(name, True, True, 0.0, 0.1), **kw)  # type: ignore[arg-type]


def test_a_siblings_first_byte_settles_its_prompt_here_as_there() -> None:
    """Worker A served a conversation's history on e0; worker B merged A's dispatch. Before
    confirmations B held it only provisionally, and moved the next turn off e0 more readily
    than A would; with A's first byte shared, B settles it and keeps the turn where A does."""
    history = RouteKey(chain=tuple(range(1, 48)), prompt_tokens=3000.0)
    turn = RouteKey(chain=tuple(range(1, 50)), prompt_tokens=3150.0)
    fleet = [_idle("e0", prefill=5000.0, pending=1, load=1.0), _idle("e1")]
    a, b = ExpectedTTFT(RoutingConfig()), ExpectedTTFT(RoutingConfig())
    box, kept = Outbox(8), Unconfirmed()
    # A's own path: dispatched, then its first byte (``pick.rank``, ``Relay._answered``).
    a.dispatched("job", history, "e0")
    box.dispatched("p", "e0", history.chain, token="job")
    a.first_byte("job", "e0")
    box.answered("job", "e0")
    # B merges A's message as ``SharedRouting`` does.
    (msg,) = [_decode(encode(m)) for m in box.pack("A", 1, per_message=4, per_confirm=4)]
    for pos, d in enumerate(msg.dispatches):
        b.observe(RouteKey(chain=d.chain), d.engine)
        kept.merged(msg.sender, msg.seq, pos, d)
    assert b.holdings.held_tokens(turn, ["e0"])["e0"] > 0
    assert b.holdings.settled_tokens(turn, ["e0"]) == {}  # held, not yet settled
    assert b.rank(turn, fleet)[0] == "e1"  # what B did before confirmations
    found, ignored = kept.confirmed(msg, {"e0": "p", "e1": "p"})
    for d in found:
        b.confirm(RouteKey(chain=d.chain), d.engine)
    assert ignored == 0
    assert b.holdings.settled_tokens(turn, ["e0"])["e0"] > 0
    assert a.rank(turn, fleet)[0] == b.rank(turn, fleet)[0] == "e0"
