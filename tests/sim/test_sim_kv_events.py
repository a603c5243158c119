"""The simulator publishes vLLM's KV-cache events: the same ZMQ framing and msgpack batches, block
hashes that a router recomputes from the token ids with vLLM's ``sha256_cbor`` rule, stored blocks
on prefill, removed blocks on eviction, a cleared cache on reset, and replay of missed batches.

Golden values were produced by vLLM 0.32 itself (``vllm.utils.hashing.sha256_cbor``,
``hash_block_tokens`` and ``msgspec``'s encoding of a ``KVEventBatch``)."""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

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
from engine_sidecar.vllm.profile import resolve_python
from proxy.core import blockhash
from sim.conftest import FAST, Start
from sim.kv_subscriber import (
    NONE_HASH,
    Subscriber,
    block_hash,
    prompt_keys,
    replay,
    verify_chains,
)

# vLLM 0.32: sha256_cbor("vllm-none-hash"), and hash_block_tokens(sha256_cbor, ...) of small blocks.
GOLD_NONE = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
GOLD_H1 = "58d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111"  # [1, 2, 3, 4]
GOLD_H2 = "e1bc29393a2da9fd798f35ff04d215f846aee6df4b803ce3d43b57df56b58fb1"  # then [5, 6, 7, 8]
GOLD_SALT = "6b34eefae052446391748e3de039648a84a16ca73963c333b538b6b0f92cc3f8"  # [1..4], salt s1
GOLD_WIDE = "d8253efc66b999aec122fd7848a9da2076276d6c4649dc5a4bd766f18e130205"
WIDE = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32]  # every CBOR integer width
# msgspec's encoding of KVEventBatch(ts=1.5, [BlockStored(h1, h2, salt s1), BlockStored(h2 after
# h1), BlockRemoved(h2), AllBlocksCleared()], data_parallel_rank=0) after vLLM's KV-cache manager
# set kv_cache_spec_kind, as vLLM's ZmqEventPublisher sends it: hashes as 64-bit integers (vLLM's
# default), then as whole digests (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).
_STORED_TAIL = (
    "a9746f6b656e5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d6564"
    "69756da3475055a96c6f72615f6e616d65c0aa65787472615f6b6579739291a27331c0a967726f75705f6964"
    "7800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e8ba474797065ab42"
    "6c6f636b53746f726564ac626c6f636b5f68617368657391"
)
_SECOND_TAIL = (
    "a9746f6b656e5f6964739405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3"
    "475055a96c6f72615f6e616d65c0aa65787472615f6b65797391c0a967726f75705f69647800b26b765f6361"
    "6368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e84a474797065ac426c6f636b52656d6f"
    "766564ac626c6f636b5f68617368657391"
)
_END = ("a66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c6561"
        "72656400")
_HEAD = ("93cb3ff8000000000000948ba474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739"
         "2")
_PARENT = "b1706172656e745f626c6f636b5f68617368"
I1, I2 = "cf84b146b151d55111", "cfd43b57df56b58fb1"
B1, B2 = "c420" + GOLD_H1, "c420" + GOLD_H2
GOLD_BATCH_INT = (_HEAD + I1 + I2 + _PARENT + "c0" + _STORED_TAIL + I2 + _PARENT + I1
                  + _SECOND_TAIL + I2 + _END)
GOLD_BATCH_BYTES = (_HEAD + B1 + B2 + _PARENT + "c0" + _STORED_TAIL + B2 + _PARENT + B1
                    + _SECOND_TAIL + B2 + _END)
ROOT = Path(__file__).resolve().parents[2]
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
    events = [BlockStored([h1, h2], None, list(range(1, 9)), 4, [("s1",), None]),
              BlockStored([h2], h1, [5, 6, 7, 8], 4, [None]), BlockRemoved(h2),
              AllBlocksCleared()]
    assert encode_batch(1.5, events).hex() == GOLD_BATCH_INT
    assert encode_batch(1.5, events, int_hashes=False).hex() == GOLD_BATCH_BYTES


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


async def events_engine(start: Start, sub: Subscriber, int_hashes: bool = True,
                        **overrides: Any) -> tuple[str, str]:
    """An engine publishing to ``sub``; returns its URL and its replay endpoint."""
    settings = KvEventsSettings(endpoint=sub.endpoint, replay_endpoint="tcp://127.0.0.1:0",
                                int_hashes=int_hashes)
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


def stored_hashes(events: list[dict[str, Any]]) -> list[bytes | int]:
    return [h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]]


def removed_hashes(events: list[dict[str, Any]]) -> list[bytes | int]:
    return [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]


async def test_prefill_publishes_the_prompts_blocks_with_vllms_hashes(
        start: Start, sub: Subscriber, http: aiohttp.ClientSession) -> None:
    url, replay_at = await events_engine(start, sub)
    prompt = "The quick brown fox jumps over the lazy dog, " * 3  # 135 bytes: 8 full blocks
    tokens = await complete(http, url, prompt)
    expected = prompt_keys(tokens, BLOCK)
    assert len(expected) == 8 and all(isinstance(h, int) for h in expected)
    events = await sub.until(lambda ev: set(expected) <= set(stored_hashes(ev)),
                             replay_endpoint=replay_at)
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert verify_chains(events) == len(stored)
    for event in stored:
        assert (event["block_size"], event["medium"], event["group_idx"]) == (BLOCK, "GPU", 0)
        assert event["kv_cache_spec_kind"] == "full_attention"
        assert event["lora_id"] is None and event["lora_name"] is None
    first = next(e for e in stored if e["block_hashes"][0] == expected[0])
    assert first["parent_block_hash"] is None and first["token_ids"][:BLOCK] == tokens[:BLOCK]
    seqs = sorted(sub.batches)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert all(b.rank == 0 and b.ts > 0 for b in sub.batches.values())


@pytest.mark.parametrize("int_hashes", [True, False], ids=["int-hashes", "bytes-hashes"])
async def test_cache_salt_keys_the_first_block(
        start: Start, sub: Subscriber, http: aiohttp.ClientSession, int_hashes: bool) -> None:
    url, replay_at = await events_engine(start, sub, int_hashes=int_hashes)
    prompt = "tenant scoped prefix cache entry" * 2  # 64 bytes: 4 full blocks
    tokens = await complete(http, url, prompt, cache_salt="tenant-a")
    expected = prompt_keys(tokens, BLOCK, cache_salt="tenant-a", int_hashes=int_hashes)
    assert expected[0] != prompt_keys(tokens, BLOCK, int_hashes=int_hashes)[0]
    events = await sub.until(lambda ev: set(expected) <= set(stored_hashes(ev)),
                             replay_endpoint=replay_at)
    first = next(e for e in events if e["type"] == "BlockStored"
                 and e["block_hashes"][0] == expected[0])
    assert first["extra_keys"][0] == ["tenant-a"]
    assert all(k is None for k in first["extra_keys"][1:])
    assert verify_chains(events) >= 1


async def test_eviction_under_a_tiny_cache_publishes_block_removed(
        start: Start, sub: Subscriber, http: aiohttp.ClientSession) -> None:
    url, replay_at = await events_engine(start, sub, num_gpu_blocks=10)
    first = await complete(http, url, "a" * 4 * BLOCK * 6)  # 6 blocks, then 3 output tokens
    old = prompt_keys(first, BLOCK)
    await sub.until(lambda ev: set(old) <= set(stored_hashes(ev)), replay_endpoint=replay_at)
    second = await complete(http, url, "b" * 4 * BLOCK * 6)  # needs blocks the first left cached
    new = prompt_keys(second, BLOCK)
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
    await sub.until(lambda ev: prompt_keys(tokens, BLOCK)[0] in stored_hashes(ev),
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
    await sub.until(lambda ev: prompt_keys(tokens, BLOCK)[0] in stored_hashes(ev),
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


_VLLM_DECODE = """
import struct, sys, msgspec
from vllm.distributed.kv_events import KVEventBatch
data, kinds = sys.stdin.buffer.read(), set()
while data:
    (size,), data = struct.unpack(">I", data[:4]), data[4:]
    batch = msgspec.msgpack.decode(data[:size], type=KVEventBatch)
    data = data[size:]
    assert batch.data_parallel_rank == 0, batch
    kinds.update(type(e).__name__ for e in batch.events)
print(*sorted(kinds))
"""


async def test_vllms_own_decoder_reads_the_simulators_batches(
        start: Start, sub: Subscriber, http: aiohttp.ClientSession) -> None:
    python = resolve_python(None, os.environ, ROOT, "")
    if not python:
        pytest.skip("vLLM is not installed (set KVPROXY_VLLM_PYTHON)")
    url, replay_at = await events_engine(start, sub, num_gpu_blocks=8)
    await complete(http, url, "p" * 4 * BLOCK * 5)
    await complete(http, url, "q" * 4 * BLOCK * 5)  # evicts some of the first prompt's blocks
    async with http.post(url + "/reset_prefix_cache") as resp:
        assert (await resp.json())["success"]
    await sub.until(lambda ev: any(e["type"] == "AllBlocksCleared" for e in ev),
                    replay_endpoint=replay_at)
    stream = b"".join(len(b.payload).to_bytes(4, "big") + b.payload
                      for b in sub.batches.values())
    proc = await asyncio.create_subprocess_exec(
        python, "-c", _VLLM_DECODE, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(stream), 120)
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    assert out.decode().split()[-3:] == ["AllBlocksCleared", "BlockRemoved", "BlockStored"]
