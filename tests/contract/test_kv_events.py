"""KV-cache events, the same on the simulator and on real vLLM: after a request, engine ``a``'s
events hold ``BlockStored`` for every full block of the prompt, with the hashes a router computes
from the prompt's token ids (``sha256_cbor``, chained from vLLM's ``NONE_HASH``, sent as the
digest's low 64 bits), and both engines' batches decode with one decoder into the same field
layout. Missed batches (sent before the subscriber connected) come back from the replay socket.
(``tests/sim/test_sim_kv_events.py`` also has vLLM's own typed decoder read the simulator's
bytes.)"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest_asyncio
from sim.kv_subscriber import Subscriber, prompt_keys, verify_chains

from contract.client import Backend, post_json

STORED_FIELDS = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                 "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"}


@pytest_asyncio.fixture(loop_scope="session")
async def events(backend: Backend) -> AsyncIterator[tuple[Subscriber, str]]:
    assert backend.kv_events is not None, "engine a of every backend publishes KV events"
    subscriber = Subscriber(connect=backend.kv_events.connect_at)
    yield subscriber, backend.kv_events.replay_at
    subscriber.close()


def stored(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == "BlockStored"]


async def test_a_request_publishes_its_prompts_full_blocks(
        backend: Backend, events: tuple[Subscriber, str]) -> None:
    sub, replay_at = events
    prompt = f"{uuid.uuid4().hex} " + "the router learns what each engine holds. " * 20
    status, tok = await post_json(backend.a.url + "/tokenize",
                                  {"model": backend.model, "prompt": prompt})
    assert status == 200, tok
    tokens: list[int] = tok["tokens"]
    expected = prompt_keys(tokens, backend.block_size)  # 64-bit integers, vLLM's default
    assert len(expected) >= 2, f"prompt of {len(tokens)} tokens is too short"
    status, body = await post_json(backend.a.url + "/v1/completions", {
        "model": backend.model, "prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert status == 200, body

    def holds_prompt(evs: list[dict[str, Any]]) -> bool:
        return set(expected) <= {h for e in stored(evs) for h in e["block_hashes"]}

    got = await sub.until(holds_prompt, timeout_s=60, replay_endpoint=replay_at)
    for event in stored(got):
        assert set(event) == STORED_FIELDS, sorted(event)
        assert event["block_size"] == backend.block_size and event["group_idx"] == 0
        assert event["kv_cache_spec_kind"] == "full_attention"
    # Every event since the engine started (warm-up requests included) chains correctly.
    assert verify_chains(got) == len(stored(got))
    first = next(e for e in stored(got) if e["block_hashes"][0] == expected[0])
    assert first["parent_block_hash"] is None
    assert first["token_ids"][:backend.block_size] == tokens[:backend.block_size]
    seqs = sorted(sub.batches)
    assert seqs == list(range(len(seqs))), "batches are numbered from 0 without gaps"
    assert all(b.rank == 0 for b in sub.batches.values())
