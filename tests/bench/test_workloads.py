"""The suite's workload generators: pure, seeded, and of the shapes they claim."""

import collections
import itertools
import random
import statistics

import pytest

from bench import workloads as wl
from bench.prompts import PromptMapper
from bench.traces import TRACE_DIR, hit_rate, oracle_hit_rate

KV_TOKENS_PER_ENGINE = 883_776  # llama70b-h100x4-kv8, what the suite's fleet reports
needs_traces = pytest.mark.skipif(not (TRACE_DIR / "azure2023_code.csv").exists(),
                                  reason="shared traces not present")


def _cv(times):
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return statistics.pstdev(gaps) / statistics.mean(gaps)


def _well_formed(reqs):
    assert [r.index for r in reqs] == list(range(len(reqs)))
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(reqs))
    # Hash blocks must fit the prompt with the unique tail, or PromptMapper would cut them.
    assert all(len(r.hash_ids) * wl.BLOCK <= r.input_tokens - 2 for r in reqs)


@pytest.mark.parametrize("make", [wl.rag, wl.chat, wl.unique, wl.longdoc])
def test_generators_are_pure_and_seeded(make):
    assert make(60.0) == make(60.0)
    assert make(60.0, seed=11) != make(60.0, seed=12)
    _well_formed(make(120.0))


def test_rag_reuses_long_prefixes_with_zipf_popularity():
    reqs = wl.rag(600.0)
    _well_formed(reqs)
    assert 0.7 <= hit_rate(reqs) <= 0.95  # heavy reuse, yet a question is never cached
    prefix = [len(r.hash_ids) * wl.BLOCK for r in reqs]
    assert min(prefix) >= 4 * wl.BLOCK and max(prefix) <= 32 * wl.BLOCK  # system 1k-4k + doc 1k-12k
    assert all(16 <= r.input_tokens - p <= 128 for r, p in zip(reqs, prefix, strict=True))
    per_doc = collections.Counter(r.hash_ids[-1] >> 12 for r in reqs)
    counts = sorted(per_doc.values())
    assert counts[-1] >= 10 * counts[0]  # a few hot documents, a long tail
    tenants = {r.hash_ids[0] for r in reqs}
    assert len(tenants) == 8  # 4 tenants x 2 system prompts


def test_chat_turn_counts_are_sharegpt_like():
    rng = random.Random(0)
    turns = [wl.draw_turns(rng) for _ in range(20_000)]
    assert 5.5 <= statistics.mean(turns) <= 6.2
    assert min(turns) == 1 and max(turns) == 30


def test_chat_turns_resend_the_whole_history():
    conv = wl.conversation(random.Random(1), wl.ChatShape(), conv=7, start_s=0.0)
    for before, after in itertools.pairwise(conv):
        assert after.hash_ids[: len(before.hash_ids)] == before.hash_ids
        assert after.input_tokens > before.input_tokens + before.output_tokens
        assert after.arrival_s > before.arrival_s


def test_chat_has_many_users_mid_conversation():
    reqs = wl.chat(600.0)
    _well_formed(reqs)
    shared = {r.hash_ids[0] for r in reqs}
    assert len(shared) == 1  # one system block for everyone: a first-block key is useless
    conversations = {r.hash_ids[1] for r in reqs if len(r.hash_ids) > 1}
    assert len(conversations) >= 300
    assert 0.4 <= hit_rate(reqs) <= 0.9
    assert reqs[0].input_tokens > 2 * wl.BLOCK  # the slice opens mid-conversation


def test_unique_prompts_share_nothing():
    reqs = wl.unique(600.0)
    _well_formed(reqs)
    assert all(not r.hash_ids for r in reqs)
    assert all(2048 <= r.input_tokens <= 16384 for r in reqs)
    mapper = PromptMapper()
    heads = {mapper.prompt(r)[:64] for r in reqs}
    assert len(heads) == len(reqs)
    assert hit_rate(reqs) == 0.0
    assert oracle_hit_rate(reqs, 8, KV_TOKENS_PER_ENGINE) == 0.0


def test_longdoc_documents_do_not_fit_one_engine():
    shape = wl.LongDocShape()
    reqs = wl.longdoc(600.0)
    _well_formed(reqs)
    docs = {r.hash_ids[0]: len(r.hash_ids) * wl.BLOCK for r in reqs}
    assert len(docs) == shape.documents
    assert all(32 * 1024 <= n <= 56 * 1024 for n in docs.values())
    assert sum(docs.values()) > KV_TOKENS_PER_ENGINE
    assert sum(docs.values()) < 8 * KV_TOKENS_PER_ENGINE
    spread = oracle_hit_rate(reqs, 8, KV_TOKENS_PER_ENGINE)
    one = oracle_hit_rate(reqs, 1, KV_TOKENS_PER_ENGINE)
    assert spread >= 0.98 * hit_rate(reqs)
    assert one < spread - 0.1  # one engine's cache evicts what eight hold


@needs_traces
def test_bursts_keep_the_azure_code_arrivals_with_rag_prefixes():
    reqs = wl.bursts(90.0)
    _well_formed(reqs)
    assert len(reqs) == 514
    assert _cv([r.arrival_s for r in reqs]) > 10
    assert all(len(r.hash_ids) >= 4 for r in reqs)
    assert _cv([r.arrival_s for r in wl.rag(120.0)]) < 1.5  # the rag shape alone is Poisson


@needs_traces
@pytest.mark.parametrize("w", wl.WORKLOADS, ids=lambda w: w.name)
def test_oracle_with_infinite_caches_reaches_the_ideal(w):
    """The oracle routes each request to the cache holding its longest prefix; with caches that
    never evict it must then reach the single-cache ideal on every shape (within one block)."""
    reqs = w.requests(quick=True)
    ideal = hit_rate(reqs)
    assert oracle_hit_rate(reqs, 8, 1 << 40) == pytest.approx(ideal, abs=0.005)
    assert oracle_hit_rate(reqs, 8, KV_TOKENS_PER_ENGINE) <= ideal + 1e-9
    assert hit_rate(reqs, 8) <= ideal + 1e-9


def test_workload_table():
    names = [w.name for w in wl.WORKLOADS]
    assert len(names) >= 6 and len(set(names)) == len(names)
    assert [w.name for w in wl.by_name("rag,chat")] == ["rag", "chat"]
    assert wl.by_name(None) == list(wl.WORKLOADS)
    with pytest.raises(ValueError, match="unknown workload"):
        wl.by_name("rag,nope")


def test_block_ids_never_collide_across_entities():
    a = wl.block_ids(wl.KIND_DOC, 1, 4000)
    b = wl.block_ids(wl.KIND_DOC, 2, 10)
    c = wl.block_ids(wl.KIND_CHAT, 1, 10)
    assert not set(a) & set(b) and not set(a) & set(c)
