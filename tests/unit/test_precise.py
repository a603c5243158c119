"""Precise routing's pure parts: block keys as vLLM hashes them (checked against the independent
hasher of the KV-event tests), batches as vLLM sends them (and hostile ones), the exact index,
sequence numbers and listening states, holdings, configuration errors and the pool tokenizer."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sim.kv_subscriber import prompt_keys
from tokenizer_files import make_tokenizer_dir

from engine_sidecar.sim.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch
from proxy.core import blockhash
from proxy.core.blockhash import (
    MEMO_BLOCKS,
    ChainMemo,
    chain_keys,
    hash_block_tokens,
    int_hash,
    root_for,
)
from proxy.core.config import Config, RoutingConfig
from proxy.core.errors import ConfigError
from proxy.core.exact_holdings import PreciseHoldings
from proxy.core.fleet_config import EngineConfig, PoolConfig
from proxy.core.kv_config import EngineEvents
from proxy.core.kvindex import BadBatch, Batch, ExactIndex, Limits, Removed, Stored, parse_batch
from proxy.core.kvstate import IllegalMove, Listening, Mode, Seq, Sequencer
from proxy.core.routing import PrefixAffinity, RouteKey
from proxy.fleet.tokenizer import load_tokenizer
from proxy.server.app import build_app

IDS = list(range(100, 140))


def test_chain_keys_are_vllms_block_hashes_in_their_64_bit_form() -> None:
    assert chain_keys(IDS, 8) == prompt_keys(IDS, 8)
    assert chain_keys(IDS, 8, root_for("salt-a")) == prompt_keys(IDS, 8, "salt-a")
    assert chain_keys(IDS, 8, root_for("salt-a")) != chain_keys(IDS, 8)
    assert chain_keys(IDS, 8, max_blocks=2) == prompt_keys(IDS, 8)[:2]
    assert chain_keys(IDS[:7], 8) == []


def _wire(events: list[Any], int_hashes: bool = True) -> object:
    return msgpack.unpackb(encode_batch(1.0, events, int_hashes=int_hashes), raw=False)


@given(st.lists(st.one_of(st.integers(0, 300), st.integers(0, 1 << 20), st.integers(0, 1 << 40)),
                max_size=64), st.sampled_from([1, 4, 16]))
@settings(max_examples=200, deadline=None)
def test_block_keys_agree_with_the_independent_hasher_for_ids_of_every_size(
        ids: list[int], block_size: int) -> None:
    # Ids below the encoding table, past it (a client's token-id prompt) and mixed in one block.
    assert chain_keys(ids, block_size) == prompt_keys(ids, block_size)


@given(st.lists(st.integers(0, 1 << 17), max_size=80), st.sampled_from([1, 3, 16]),
       st.sampled_from([None, "s", "ü-salt"]), st.sampled_from([None, 0, 2]))
@settings(max_examples=200, deadline=None)
def test_the_fast_chain_gives_the_independent_hashers_keys(
        ids: list[int], block_size: int, salt: str | None, max_blocks: int | None) -> None:
    # The whole-prompt encoding path (ids within the table), salted or not, cut or not.
    want = prompt_keys(ids, block_size, salt) if salt else prompt_keys(ids, block_size)
    got = chain_keys(ids, block_size, root_for(salt), max_blocks)
    assert got == want[:max_blocks] if max_blocks is not None else got == want


@given(st.lists(st.integers(0, 1 << 17), min_size=1, max_size=3 * MEMO_BLOCKS * 2),
       st.lists(st.tuples(st.integers(0, 200), st.lists(st.integers(0, 1 << 17), max_size=70)),
                min_size=1, max_size=4),
       st.sampled_from([1, 2, 3]), st.sampled_from([None, 40]), st.integers(1, 4))
@settings(max_examples=150, deadline=None)
def test_a_memo_gives_the_same_keys_for_prompts_that_share_prefixes(
        shared: list[int], variants: list[tuple[int, list[int]]], block_size: int,
        max_blocks: int | None, repeat: int) -> None:
    # Prompts that share a prefix of any length, salted or not, and go on differently, some
    # repeating their runs, hashed through one memo (small, so that runs are also dropped):
    # each prompt's keys are the independent hasher's.
    memo = ChainMemo(max_runs=5)
    for n, (cut, more) in enumerate(variants + variants):
        ids = (shared[:cut] * repeat)[:3 * MEMO_BLOCKS * 2] + more
        salt = "s" if n % 2 else None
        want = prompt_keys(ids, block_size, salt) if salt else prompt_keys(ids, block_size)
        got = chain_keys(ids, block_size, root_for(salt), max_blocks, memo)
        assert got == (want[:max_blocks] if max_blocks is not None else want)
    assert len(memo) <= 5


def test_a_prefix_hashed_before_is_looked_up_not_hashed_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    document = list(range(1000, 1000 + 10 * MEMO_BLOCKS * 16))
    memo = ChainMemo()
    first = chain_keys(document + [1, 2, 3] * 20, 16, memo=memo)
    hashed: list[int] = []
    real = blockhash.hashlib.sha256

    def counting(data: bytes) -> Any:
        hashed.append(1)
        return real(data)

    monkeypatch.setattr(blockhash.hashlib, "sha256", counting)
    second = chain_keys(document + [7, 8, 9] * 20, 16, memo=memo)
    monkeypatch.undo()
    assert second[:10 * MEMO_BLOCKS] == first[:10 * MEMO_BLOCKS] and second != first
    assert memo.hits == 10 and len(hashed) == len(second) - 10 * MEMO_BLOCKS
    assert second == prompt_keys(document + [7, 8, 9] * 20, 16)


def test_runs_of_the_same_tokens_at_other_places_in_the_chain_keep_their_own_keys() -> None:
    run = list(range(5000, 5000 + MEMO_BLOCKS * 16))
    memo = ChainMemo()
    for ids in (run * 3, run * 4 + [1] * 40, run[:100] + run * 2):
        assert chain_keys(ids, 16, memo=memo) == prompt_keys(ids, 16)
    assert memo.hits >= 2


@pytest.mark.parametrize("edge", [0, 255, 256, (1 << 16) - 1, 1 << 16, (1 << 18) - 1, 1 << 18,
                                  (1 << 24) + 5, (1 << 32) - 1, 1 << 32, -1])
def test_ids_at_the_edges_of_the_table_hash_as_the_independent_hasher_does(edge: int) -> None:
    # The table's range is checked on the ids' machine bytes: each edge of it, and ids that only
    # a byte past it tells apart, give the independent hasher's keys, with and without a memo.
    ids = [edge if i % 7 == 3 else 1000 + i for i in range(2 * MEMO_BLOCKS * 4 + 5)]
    want = prompt_keys(ids, 4)
    assert chain_keys(ids, 4) == want
    memo = ChainMemo()
    assert chain_keys(ids, 4, memo=memo) == want == chain_keys(ids, 4, memo=memo)


@pytest.mark.parametrize("int_hashes", [True, False])
def test_a_batch_as_vllm_sends_it_parses_to_the_same_keys(int_hashes: bool) -> None:
    h1 = hash_block_tokens(None, IDS[:8])
    h2 = hash_block_tokens(h1, IDS[8:16])
    batch = parse_batch(_wire([BlockStored([h1, h2], None, IDS[:16], 8, [None, None]),
                               BlockRemoved(h2), AllBlocksCleared()], int_hashes))
    assert batch.events == (Stored((int_hash(h1), int_hash(h2)), 8), Removed((int_hash(h2),)),
                            batch.events[2])
    assert batch.rank == 0


@pytest.mark.parametrize("body", [
    None, 3, [], [1.0], [1.0, "x", 0], [True, [], 0], [1.0, [], -1], [1.0, [], 64],
    [1.0, [3], 0], [1.0, [{}], 0], [1.0, [{"type": "BlockStored", "block_hashes": [1]}], 0],
    [1.0, [{"type": "BlockStored", "block_hashes": 1, "block_size": 16}], 0],
    [1.0, [{"type": "BlockRemoved", "block_hashes": [1 << 65]}], 0],
    [1.0, [{"type": "BlockRemoved", "block_hashes": ["abc"]}], 0],
    [1.0, [{"type": "BlockRemoved", "block_hashes": [True]}], 0],
])
def test_malformed_batches_are_bad_batches(body: object) -> None:
    with pytest.raises(BadBatch):
        parse_batch(body)


def test_unknown_event_types_are_skipped_and_missing_rank_is_rank_0() -> None:
    batch = parse_batch([2.0, [{"type": "SomethingNew", "x": 1}]])
    assert batch.events == () and batch.rank == 0


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5)
                    | st.binary(max_size=40),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.sampled_from(["type", "block_hashes", "block_size",
                                                       "BlockStored"]), inner, max_size=4)
                    | st.just({"type": "BlockStored"}), max_leaves=20))
def test_parsing_anything_either_gives_a_batch_or_a_bad_batch(body: object) -> None:
    with contextlib.suppress(BadBatch):
        parse_batch(body)


def _stored(keys: list[int], rank: int = 0) -> Batch:
    return Batch(0.0, (Stored(tuple(keys), 4),), rank)


def test_the_index_holds_what_was_stored_less_what_was_removed_or_cleared() -> None:
    index = ExactIndex(capacity=100)
    index.apply(_stored([1, 2, 3]))
    index.apply(Batch(0.0, (Removed((3,)),), 0))
    assert index.keys() == {1, 2} and index.block_size == 4
    assert index.held_blocks([1, 2, 3], now=0.0) == 2
    assert index.held_blocks([2, 1], now=0.0) == 2
    assert index.held_blocks([9, 1], now=0.0) == 0  # a prefix is walked from its first block
    index.apply(_stored([7], rank=1))
    index.apply(parse_batch([0.0, [{"type": "AllBlocksCleared"}], 0]))
    assert index.keys() == {7}  # rank 1 still holds its block
    index.apply(Batch(0.0, (Removed((7,)),), 0))
    assert index.keys() == {7}  # removed from rank 0, which never held it


def test_the_index_is_bounded_and_forgets_the_oldest_first() -> None:
    index = ExactIndex(capacity=3)
    index.apply(_stored([1, 2, 3, 4, 5]))
    assert index.keys() == {3, 4, 5} and index.forgotten == 2


def test_provisional_blocks_count_until_they_expire_or_are_stored() -> None:
    index = ExactIndex(capacity=10, provisional_s=5.0)
    index.provisional([1, 2], now=100.0)
    assert index.held_blocks([1, 2, 3], now=104.0) == 2
    assert index.held_blocks([1, 2, 3], now=105.0) == 0
    index.provisional([1], now=200.0)
    index.apply(_stored([1]))
    assert index.held_blocks([1], now=999.0) == 1


def test_sequence_numbers() -> None:
    seq = Sequencer()
    assert seq.classify(0) is Seq.APPLY
    seq.applied(0)
    assert seq.classify(1) is Seq.APPLY
    assert seq.classify(3) is Seq.GAP
    assert seq.classify(0) is Seq.RESTART  # a publisher never repeats 0 on its live socket
    seq.applied(1)
    assert seq.classify(1) is Seq.DUPLICATE
    seq.reconnected()
    assert seq.classify(1) is Seq.RESTART
    assert seq.classify(1) is Seq.DUPLICATE
    assert Sequencer().classify(5) is Seq.GAP  # joined late: replay what came before


def test_listening_falls_silent_and_comes_back() -> None:
    state = Listening(silent_after_s=10.0)
    state.sent_new_blocks(now=0.0)
    assert state.publish_by is None  # nothing is expected of an engine not yet in sync
    assert state.change(Mode.PRECISE) and not state.change(Mode.PRECISE)
    state.sent_new_blocks(now=1.0)
    state.sent_new_blocks(now=5.0)
    assert not state.tick(10.9) and state.tick(11.0) and state.mode is Mode.SILENT
    assert state.published() and state.precise
    with pytest.raises(IllegalMove):
        Listening(1.0, mode=Mode.SILENT).change(Mode.REFUSED)


def test_precise_holdings_replace_the_approximate_guess_in_routing() -> None:
    index = ExactIndex(capacity=100)
    keys = chain_keys(IDS, 8)
    index.apply(Batch(0.0, (Stored(tuple(keys[:3]), 8),), 0))
    found = PreciseHoldings(IDS, root_for(None), 100)
    found.add("a", index, 8, now=0.0)
    found.add("b", ExactIndex(capacity=100), 8, now=0.0)
    assert found.held_tokens("a") == 24 and found.held_tokens("b") == 0
    assert found.held_tokens("c") is None
    assert found.new_blocks("a") == keys[3:]
    held = found.known(["a", "b", "c"])
    assert held == {"a": 24.0, "b": 0.0}
    policy = PrefixAffinity(RoutingConfig())
    policy.observe(RouteKey((1, 2, 3, 4)), "b")  # the approximate index guesses b
    assert policy.uncached(RouteKey((1, 2, 3, 4)), "b") == 0
    # 10 tokens a chain block: a holds 24 tokens, 2 whole blocks; b is known to hold nothing.
    exact = RouteKey((1, 2, 3, 4), held=held, block_tokens=10.0)
    assert policy.uncached(exact, "b") == 4
    assert policy.uncached(exact, "a") == 2


@pytest.mark.parametrize(("endpoint", "bind"), [
    ("http://x:1", False), ("tcp://x", False), ("tcp://x:0", False), ("tcp://x:99999", False),
    ("tcp://*:5557", False), ("ipc://", False),
])
def test_a_malformed_endpoint_is_a_config_error_naming_the_field(endpoint: str,
                                                                 bind: bool) -> None:
    with pytest.raises(ConfigError) as err:
        EngineEvents(endpoint, bind=bind)
    assert err.value.field == "endpoint"
    EngineEvents("tcp://*:5557", bind=True)
    assert EngineEvents("tcp://h:5557", "tcp://h:5558", ranks=2).endpoints() == [
        ("tcp://h:5557", "tcp://h:5558"), ("tcp://h:5558", "tcp://h:5559")]


def test_kv_events_without_a_tokenizer_is_a_config_error() -> None:
    engine = EngineConfig("a", "http://h:1", kv_events=EngineEvents("tcp://h:5557"))
    with pytest.raises(ConfigError) as err:
        PoolConfig("p", "m", (engine,))
    assert err.value.field == "tokenizer"


def test_a_tokenizer_path_that_does_not_exist_fails_start_up_naming_the_pool(
        tmp_path: Path) -> None:
    pool = PoolConfig("p", "m", (EngineConfig("a", "http://h:1"),),
                      tokenizer=str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError) as err:
        build_app(Config(pools=(pool,)))
    assert err.value.field == "pools[0].tokenizer"


def test_the_pool_tokenizer_renders_chat_as_the_hf_template_does(tmp_path: Path) -> None:
    tok = load_tokenizer(str(make_tokenizer_dir(tmp_path)), "f")
    plain = tok.request_ids(False, {"prompt": "the router learns"})
    assert plain is not None
    chat = tok.request_ids(True, {"messages": [{"role": "user", "content": "the router learns"}]})
    # '<s><|user|>the router learns<|assistant|>', as transformers renders the template.
    assert chat == [1, 4, *plain, 5]
    parts = {"messages": [{"role": "user", "content": [{"type": "text",
                                                        "text": "the router learns"}]}]}
    assert tok.request_ids(True, parts) == chat
    assert tok.request_ids(False, {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert tok.request_ids(True, {"messages": [{"role": "user", "content": 3}]}) is None
    assert tok.request_ids(True, {"messages": "no"}) is None


def test_a_batch_holding_more_hashes_than_an_index_keeps_is_bad() -> None:
    limits = Limits(max_events=64, max_hashes=64, max_batch_hashes=100)
    event = {"type": "BlockStored", "block_hashes": list(range(60)), "block_size": 16}
    assert len(parse_batch([1.0, [event], 0], limits).events) == 1
    with pytest.raises(BadBatch, match="more block hashes"):
        parse_batch([1.0, [event, event], 0], limits)  # 120 in all
    cleared = {"type": "AllBlocksCleared"}
    assert len(parse_batch([1.0, [cleared] * 64, 0], limits).events) == 64


def test_a_run_of_clears_costs_one_pass_over_the_index(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 1 clearing over and over while rank 0 holds many blocks: one rebuild, not one per
    # event (each is a pass over every block).
    index = ExactIndex(1 << 20)
    index.apply(parse_batch([1.0, [{"type": "BlockStored", "block_hashes": list(range(5000)),
                                    "block_size": 16}], 0]))
    index.apply(parse_batch([1.0, [{"type": "BlockStored", "block_hashes": [1, 2, 9999],
                                    "block_size": 16}], 1]))
    passes = []
    clear = ExactIndex._clear
    monkeypatch.setattr(ExactIndex, "_clear", lambda self, bit: (passes.append(bit),
                                                                   clear(self, bit))[1])
    storm = [{"type": "AllBlocksCleared"}] * 200
    index.apply(parse_batch([1.0, storm, 1]))
    assert passes == [2] and len(index) == 5000 and 9999 not in index
    stored = {"type": "BlockStored", "block_hashes": [7], "block_size": 16}
    index.apply(parse_batch([1.0, [{"type": "AllBlocksCleared"}, stored,
                                   {"type": "AllBlocksCleared"}], 1]))
    assert passes == [2, 2, 2]  # a store in between: the next clear has work again
