"""The simulator publishes vLLM's KV-cache events: the same ZMQ framing and msgpack batches, block
hashes that a router recomputes from the token ids with vLLM's ``sha256_cbor`` rule, stored blocks
on prefill, removed blocks on eviction, a cleared cache on reset, and replay of missed batches.

Golden values were produced by vLLM 0.32 itself (``vllm.utils.hashing.sha256_cbor``,
``hash_block_tokens`` and ``msgspec``'s encoding of a ``KVEventBatch``)."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from engine_sidecar.sim import blockhash
from engine_sidecar.sim.config import SimEngineConfig
from engine_sidecar.sim.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventsSettings,
    encode_batch,
    offset_endpoint,
)
from engine_sidecar.sim.kvpublisher import KvEventPublisher
from engine_sidecar.sim.main import add_arguments, configs_from_args
from sim.conftest import FAST, Start
from sim.kv_subscriber import (
    NONE_HASH,
    Subscriber,
    block_hash,
    check_stored_chain,
    prompt_hashes,
    replay,
)

# vLLM 0.32: sha256_cbor("vllm-none-hash"), and hash_block_tokens(sha256_cbor, ...) of small blocks.
GOLD_NONE = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
GOLD_H1 = "58d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111"  # [1, 2, 3, 4]
GOLD_H2 = "e1bc29393a2da9fd798f35ff04d215f846aee6df4b803ce3d43b57df56b58fb1"  # then [5, 6, 7, 8]
GOLD_SALT = "6b34eefae052446391748e3de039648a84a16ca73963c333b538b6b0f92cc3f8"  # [1..4], salt s1
GOLD_WIDE = "d8253efc66b999aec122fd7848a9da2076276d6c4649dc5a4bd766f18e130205"
WIDE = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32]  # every CBOR integer width
# msgspec's encoding of KVEventBatch(ts=1.5, [BlockStored(h1, h2), BlockRemoved(h2),
# AllBlocksCleared()], data_parallel_rank=0), as vLLM's ZmqEventPublisher sends it.
GOLD_BATCH = (
    "93cb3ff8000000000000938aa474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573"
    "92c42058d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111c420e1bc29393a"
    "2da9fd798f35ff04d215f846aee6df4b803ce3d43b57df56b58fb1b1706172656e745f626c6f636b5f68"
    "617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f69"
    "64c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b6579739291a27331c0a9"
    "67726f75705f6964780084a474797065ac426c6f636b52656d6f766564ac626c6f636b5f686173686573"
    "91c420e1bc29393a2da9fd798f35ff04d215f846aee6df4b803ce3d43b57df56b58fb1a66d656469756d"
    "a3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656400"
)
BLOCK = 4  # tokens per block: 16 bytes of prompt text per block under the sim's tokenizer


def test_block_hashes_are_vllms_sha256_cbor() -> None:
    assert blockhash.NONE_HASH.hex() == GOLD_NONE == NONE_HASH.hex()
    h1 = blockhash.hash_block_tokens(None, [1, 2, 3, 4])
    assert h1.hex() == GOLD_H1 == block_hash(None, [1, 2, 3, 4]).hex()
    assert blockhash.hash_block_tokens(h1, [5, 6, 7, 8]).hex() == GOLD_H2
    salted = blockhash.hash_block_tokens(None, [1, 2, 3, 4], blockhash.salt_keys("s1"))
    assert salted.hex() == GOLD_SALT == block_hash(None, [1, 2, 3, 4], "s1").hex()
    wide = blockhash.hash_block_tokens(None, WIDE)
    assert wide.hex() == GOLD_WIDE == block_hash(None, WIDE).hex()


def test_batch_encoding_is_byte_for_byte_vllms() -> None:
    h1, h2 = bytes.fromhex(GOLD_H1), bytes.fromhex(GOLD_H2)
    stored = BlockStored([h1, h2], None, list(range(1, 9)), 4, [("s1",), None])
    assert encode_batch(1.5, [stored, BlockRemoved(h2), AllBlocksCleared()]).hex() == GOLD_BATCH


def test_endpoints_move_up_per_engine_like_data_parallel_ranks() -> None:
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("tcp://127.0.0.1:0", 3) == "tcp://127.0.0.1:0"
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--engines", "2", "--kv-events-endpoint", "tcp://*:6000",
                              "--kv-events-replay-endpoint", "tcp://*:6100",
                              "--kv-events-topic", "kv"])
    first, second = (c.kv_events for c in configs_from_args(args))
    assert (first.endpoint, first.replay_endpoint, first.topic) == ("tcp://*:6000", "tcp://*:6100",
                                                                    "kv")
    assert (second.endpoint, second.replay_endpoint) == ("tcp://*:6001", "tcp://*:6101")
    assert not configs_from_args(parser.parse_args([]))[0].kv_events.enabled
    with pytest.raises(ValueError, match=r"kv_events\.endpoint"):
        KvEventsSettings(endpoint="http://x:1")


@pytest.fixture
async def sub() -> AsyncIterator[Subscriber]:
    subscriber = Subscriber()
    yield subscriber
    subscriber.close()


async def events_engine(start: Start, sub: Subscriber, **overrides: Any) -> tuple[str, str]:
    """An engine publishing to ``sub``; returns its URL and its replay endpoint."""
    settings = KvEventsSettings(endpoint=sub.endpoint, replay_endpoint="tcp://127.0.0.1:0")
    config = SimEngineConfig(**{"time_scale": FAST, "block_size": BLOCK, "kv_events": settings,
                                **overrides})
    cluster = await start(config)
    publisher = cluster.engines[0].kv_events
    assert publisher is not None
    return cluster.urls[0], publisher.replay_endpoint or ""


async def complete(http: aiohttp.ClientSession, url: str, prompt: str, **extra: Any
                   ) -> list[int]:
    """Run one completion to its end; the prompt's token ids as the engine tokenizes it."""
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 3, "temperature": 0, **extra}
    async with http.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
    async with http.post(url + "/tokenize", json={"prompt": prompt}) as resp:
        return list((await resp.json())["tokens"])


def stored_hashes(events: list[dict[str, Any]]) -> list[bytes]:
    return [h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]]


def removed_hashes(events: list[dict[str, Any]]) -> list[bytes]:
    return [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]


async def test_prefill_publishes_the_prompts_blocks_with_vllms_hashes(
        start: Start, sub: Subscriber, http: aiohttp.ClientSession) -> None:
    url, replay_at = await events_engine(start, sub)
    prompt = "The quick brown fox jumps over the lazy dog, " * 3  # 135 bytes: 8 full blocks
    tokens = await complete(http, url, prompt)
    expected = prompt_hashes(tokens, BLOCK)
    assert len(expected) == 8
    events = await sub.until(lambda ev: set(expected) <= set(stored_hashes(ev)),
                             replay_endpoint=replay_at)
    stored = [e for e in events if e["type"] == "BlockStored"]
    for event in stored:
        check_stored_chain(event)
        assert (event["block_size"], event["medium"], event["group_idx"]) == (BLOCK, "GPU", 0)
        assert event["lora_id"] is None and event["lora_name"] is None
    first = next(e for e in stored if e["block_hashes"][0] == expected[0])
    assert first["parent_block_hash"] is None and first["token_ids"][:BLOCK] == tokens[:BLOCK]
    seqs = sorted(sub.batches)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert all(b.rank == 0 and b.ts > 0 for b in sub.batches.values())


async def test_cache_salt_keys_the_first_block(
        start: Start, sub: Subscriber, http: aiohttp.ClientSession) -> None:
    url, replay_at = await events_engine(start, sub)
    prompt = "tenant scoped prefix cache entry" * 2  # 64 bytes: 4 full blocks
    tokens = await complete(http, url, prompt, cache_salt="tenant-a")
    expected = prompt_hashes(tokens, BLOCK, cache_salt="tenant-a")
    assert expected[0] != prompt_hashes(tokens, BLOCK)[0]
    events = await sub.until(lambda ev: set(expected) <= set(stored_hashes(ev)),
                             replay_endpoint=replay_at)
    first = next(e for e in events if e["type"] == "BlockStored"
                 and e["block_hashes"][0] == expected[0])
    assert first["extra_keys"][0] == ["tenant-a"]
    assert all(k is None for k in first["extra_keys"][1:])


async def test_eviction_under_a_tiny_cache_publishes_block_removed(
        start: Start, sub: Subscriber, http: aiohttp.ClientSession) -> None:
    url, replay_at = await events_engine(start, sub, num_gpu_blocks=10)
    first = await complete(http, url, "a" * 4 * BLOCK * 6)  # 6 blocks, then 3 output tokens
    old = prompt_hashes(first, BLOCK)
    await sub.until(lambda ev: set(old) <= set(stored_hashes(ev)), replay_endpoint=replay_at)
    second = await complete(http, url, "b" * 4 * BLOCK * 6)  # needs blocks the first left cached
    new = prompt_hashes(second, BLOCK)
    events = await sub.until(
        lambda ev: set(new) <= set(stored_hashes(ev)) and bool(removed_hashes(ev)),
        replay_endpoint=replay_at)
    gone = removed_hashes(events)
    assert set(gone) <= set(old), "only blocks that were stored can be removed"
    assert not set(gone) & set(new)
    # The tail of the first prompt goes first (its head is the most shareable part).
    assert old[-1] in gone and old[0] not in gone


async def test_reset_publishes_all_blocks_cleared(
        start: Start, sub: Subscriber, http: aiohttp.ClientSession) -> None:
    url, replay_at = await events_engine(start, sub)
    tokens = await complete(http, url, "x" * 4 * BLOCK * 3)
    await sub.until(lambda ev: prompt_hashes(tokens, BLOCK)[0] in stored_hashes(ev),
                    replay_endpoint=replay_at)
    async with http.post(url + "/reset_prefix_cache") as resp:
        assert (await resp.json()) == {"success": True}
    events = await sub.until(lambda ev: any(e["type"] == "AllBlocksCleared" for e in ev),
                             replay_endpoint=replay_at)
    assert events[-1] == {"type": "AllBlocksCleared"}


async def test_replay_returns_the_batches_a_late_subscriber_missed(
        start: Start, sub: Subscriber, http: aiohttp.ClientSession) -> None:
    url, replay_at = await events_engine(start, sub)
    for word in ("alpha", "bravo", "charlie"):
        tokens = await complete(http, url, word * 8)
    await sub.until(lambda ev: prompt_hashes(tokens, BLOCK)[0] in stored_hashes(ev),
                    replay_endpoint=replay_at)
    everything = await replay(replay_at, 0)
    seqs = [b.seq for b in everything]
    assert seqs == list(range(len(seqs))) and len(seqs) >= 3
    assert [b.events for b in everything] == [sub.batches[s].events for s in seqs]
    tail = await replay(replay_at, seqs[-1])
    assert [b.seq for b in tail] == [seqs[-1]]
    assert await replay(replay_at, seqs[-1] + 1) == []


async def test_a_full_queue_drops_batches_and_leaves_a_gap() -> None:
    publisher = KvEventPublisher(
        KvEventsSettings(endpoint="tcp://127.0.0.1:0", max_queue_size=1), "q")
    try:  # not started: nothing drains the queue
        publisher.publish([AllBlocksCleared()])
        publisher.publish([AllBlocksCleared()])
        publisher.publish([AllBlocksCleared()])
        assert publisher.dropped == 2
        assert publisher.state()["queued"] == 1
    finally:
        await publisher.close()


async def test_events_are_off_by_default(start: Start, http: aiohttp.ClientSession) -> None:
    cluster = await start()
    assert cluster.engines[0].kv_events is None
    async with http.get(cluster.urls[0] + "/admin/state") as resp:
        assert (await resp.json())["kv_events"] is None
