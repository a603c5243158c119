"""Pure parts of the simulator, no sockets: tokenizer, block pool, scheduler, step-time model."""

from __future__ import annotations

import random
from array import array

import pytest

from engine_sidecar.sim.config import FaultConfig, SimEngineConfig
from engine_sidecar.sim.kvcache import BlockPool
from engine_sidecar.sim.profiles import PROFILES
from engine_sidecar.sim.scheduler import Scheduler, SimRequest, Status
from engine_sidecar.sim.tokenizer import VOCAB, WordStream, count_tokens, encode


def test_tokenizer_rule() -> None:
    assert len(encode("abcd")) == 1
    assert len(encode("abcde")) == 2
    assert count_tokens("héllo") == 2  # 6 UTF-8 bytes
    assert encode("abcdefgh")[:1] == encode("abcdxyz")[:1]
    assert all(len(w.encode()) == 4 and w.startswith(" ") for w in VOCAB)
    assert encode("".join(VOCAB[:5])).tolist() == [encode(w)[0] for w in VOCAB[:5]]


def test_block_pool_prefix_hits_and_lru_eviction() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    a = pool.chain(array("I", [1, 2, 3, 4]))
    blocks = pool.allocate(2)
    assert blocks is not None
    for block, h in zip(blocks, a, strict=True):
        pool.register(block, h)
    assert pool.usage == 0.5
    pool.release(blocks)
    assert pool.usage == 0.0
    assert pool.lookup(a) == blocks
    # Uncached free blocks go first; then the cached ones, tail block before head block.
    fresh = pool.allocate(3)
    assert fresh is not None
    assert blocks[0] not in fresh and blocks[1] in fresh
    assert pool.lookup(a) == [blocks[0]]
    assert pool.allocate(2) is None


def test_block_pool_shared_refcounts() -> None:
    pool = BlockPool(num_blocks=2, block_size=1)
    h = pool.chain(array("I", [7]))
    got = pool.allocate(1)
    assert got is not None
    pool.register(got[0], h[0])
    hit = pool.lookup(h)
    pool.touch(hit)
    pool.release(got)
    assert pool.usage == 0.5  # still held by the second reader
    pool.release(hit)
    assert pool.usage == 0.0


def _request(rid: int, prompt_len: int, target: int, priority: int = 0) -> SimRequest:
    return SimRequest(request_id=str(rid), token_ids=array("I", range(rid * 1000,
                      rid * 1000 + prompt_len)), prompt_len=prompt_len, target_len=target,
                      finish_reason="length", priority=priority, seq=rid, words=WordStream(rid))


def _scheduler(blocks: int, policy: str = "fcfs", seqs: int = 8, budget: int = 64,
               acceptance: tuple[float, ...] = ()) -> Scheduler:
    return Scheduler(BlockPool(blocks, 4), max_num_seqs=seqs, max_num_batched_tokens=budget,
                     policy=policy, spec_acceptance=acceptance, rng=random.Random(0))


def _run(sched: Scheduler, limit: int = 10_000) -> int:
    steps = 0
    while sched.has_work:
        sched.complete(sched.schedule())
        steps += 1
        assert steps < limit
    return steps


def test_chunked_prefill_respects_token_budget() -> None:
    sched = _scheduler(blocks=64, budget=16)
    req = _request(1, prompt_len=40, target=2)
    sched.add(req)
    plan = sched.schedule()
    assert [item.num_new for item in plan.items] == [16]
    sched.complete(plan)
    assert req.output == []
    assert _run(sched) == 3  # 16 + 8 (+1 token) then one decode step
    assert len(req.output) == 2


def test_preemption_recomputes_and_finishes_everything() -> None:
    sched = _scheduler(blocks=6)
    reqs = [_request(i, prompt_len=6, target=10) for i in range(3)]
    for req in reqs:
        sched.add(req)
    _run(sched)
    assert sched.stats.preemptions > 0
    assert all(r.status is Status.FINISHED and len(r.output) == 10 for r in reqs)
    assert sched.pool.usage == 0.0


def test_priority_preempts_the_least_important() -> None:
    sched = _scheduler(blocks=5, policy="priority")
    low = _request(1, prompt_len=8, target=8, priority=5)
    high = _request(2, prompt_len=8, target=8, priority=-5)
    sched.add(low)
    sched.add(high)
    while high.status is not Status.FINISHED:
        sched.complete(sched.schedule())
    assert high.num_preemptions == 0
    assert low.num_preemptions > 0


def test_speculation_accepts_per_position() -> None:
    sched = _scheduler(blocks=64, acceptance=(1.0, 0.0))
    req = _request(1, prompt_len=4, target=21)
    sched.add(req)
    steps = _run(sched)
    assert len(req.output) == 21
    assert steps == 11  # prefill gives 1 token, then 2 per step
    assert sched.stats.spec_accepted_per_pos == [10, 0]
    assert sched.stats.spec_draft_tokens == 20  # k drafts every step, as vLLM proposes them


def test_abort_frees_blocks() -> None:
    sched = _scheduler(blocks=16)
    req = _request(1, prompt_len=8, target=100)
    sched.add(req)
    sched.complete(sched.schedule())
    assert sched.pool.usage > 0
    sched.abort(req)
    assert sched.pool.usage == 0.0
    assert not sched.has_work


def test_step_time_model_prefill_compute_decode_bandwidth() -> None:
    p = PROFILES["llama70b-h100"]
    decode = p.step_time(batched_tokens=1, context_tokens=1000, attn_work=1000)
    bandwidth_bound = p.t_fixed + (p.weight_bytes + p.kv_bytes_per_token * 1000) / (
        p.bandwidth * p.mbu)
    assert decode == pytest.approx(bandwidth_bound)
    prefill = p.step_time(batched_tokens=8192, context_tokens=8192, attn_work=8192 * 4096)
    assert prefill > 5 * decode
    assert p.step_time(64, 64_000, 64_000) > decode  # a bigger batch reads more KV
    assert PROFILES["llama8b-l4"].num_gpu_blocks(16) > 1000


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="block_size"):
        SimEngineConfig(block_size=0)
    with pytest.raises(ValueError, match="profile"):
        SimEngineConfig(profile="nope")
    with pytest.raises(ValueError, match="acceptance"):
        SimEngineConfig(num_speculative_tokens=2, acceptance=(1.5,))
    assert SimEngineConfig(num_speculative_tokens=3, acceptance=(0.9, 0.5)).acceptance_per_pos == (
        0.9, 0.5, 0.5)
    faults = FaultConfig()
    with pytest.raises(ValueError, match="error_rate"):
        faults.update({"error_rate": -1})
    assert faults == FaultConfig()
