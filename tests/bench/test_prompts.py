"""The trace -> prompt mapping: same id same text, exact lengths, unique tails."""

import pytest

from bench.prompts import (
    CHARS_PER_TOKEN,
    SYNTHETIC,
    PromptMapper,
    SharedPrefixWorkload,
    token_count,
    workload,
)
from bench.traces import TraceRequest, hit_rate


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_same_hash_id_gives_the_same_block_every_time():
    m1, m2 = PromptMapper(), PromptMapper()
    assert m1.block(42) == m2.block(42)
    assert m1.block(42) != m1.block(43)
    assert token_count(m1.block(42)) == 512
    assert len(m1.block(42)) == 512 * CHARS_PER_TOKEN


@pytest.mark.parametrize("tokens", [2, 5, 511, 512, 513, 1500, 2048])
def test_prompt_has_exactly_the_requested_tokens(tokens):
    req = TraceRequest(3, 0.0, tokens, 1, (1, 2, 3, 4))
    text = PromptMapper().prompt(req)
    assert token_count(text) == tokens
    assert len(text) == tokens * CHARS_PER_TOKEN


def test_shared_ids_share_exactly_their_blocks():
    m = PromptMapper()
    a = m.prompt(TraceRequest(0, 0.0, 1600, 1, (0, 1, 2, 3)))
    b = m.prompt(TraceRequest(1, 0.0, 1600, 1, (0, 1, 9, 10)))
    shared = _common_prefix(a, b)
    assert 2 * 512 * CHARS_PER_TOKEN <= shared < 2 * 512 * CHARS_PER_TOKEN + 3 * CHARS_PER_TOKEN


def test_identical_requests_differ_only_in_their_tails():
    m = PromptMapper()
    a = m.prompt(TraceRequest(0, 0.0, 700, 1, (0, 1)))
    b = m.prompt(TraceRequest(1, 0.0, 700, 1, (0, 1)))
    assert a != b
    assert _common_prefix(a, b) >= (700 - 2) * CHARS_PER_TOKEN - CHARS_PER_TOKEN


def test_tails_are_unique_across_many_requests():
    m = PromptMapper()
    tails = {m.tail(i, 2) for i in range(20000)}
    assert len(tails) == 20000


def test_prompt_tokenizes_as_the_simulator_counts():
    tok = pytest.importorskip("engine_sidecar.sim.tokenizer")
    m = PromptMapper()
    a = m.prompt(TraceRequest(0, 0.0, 1100, 1, (0, 1, 2)))
    b = m.prompt(TraceRequest(1, 0.0, 1100, 1, (0, 1, 5)))
    assert tok.count_tokens(a) == 1100
    ids_a = tok.encode(tok.chat_prompt([{"role": "user", "content": a}]))
    ids_b = tok.encode(tok.chat_prompt([{"role": "user", "content": b}]))
    same = _common_prefix(list(ids_a), list(ids_b))  # type: ignore[arg-type]
    assert same >= 2 * 512  # the two shared blocks, whatever the template's header


def test_seed_changes_every_block():
    assert PromptMapper(seed=1).block(0) != PromptMapper(seed=2).block(0)


def test_shared_prefix_workload_shares_system_and_documents():
    w = SharedPrefixWorkload(tenants=2, system_prompts_per_tenant=1, documents_per_tenant=2,
                             system_tokens=512, document_tokens=1024, rate_per_s=10.0)
    reqs = w.requests(200)
    assert reqs == w.requests(200)  # deterministic
    assert all(r.input_tokens == 512 + 1024 + 64 for r in reqs)
    assert all(len(r.hash_ids) == 3 for r in reqs)
    assert len({r.hash_ids[0] for r in reqs}) == 2  # one system prompt per tenant
    assert hit_rate(reqs) > 0.9  # 4 distinct prefixes over 200 requests
    times = [r.arrival_s for r in reqs]
    assert times == sorted(times)


def test_synthetic_workload_by_name_spans_the_duration():
    reqs = workload(SYNTHETIC, duration_s=30.0)
    assert len(reqs) == round(SharedPrefixWorkload().rate_per_s * 30.0)
    assert reqs[-1].arrival_s < 60.0
