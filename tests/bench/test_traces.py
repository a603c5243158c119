"""Trace loading, slicing, caps and hit-rate arithmetic."""

import json

import pytest

from bench.traces import (
    Caps,
    TraceRequest,
    apply_caps,
    default_trace_path,
    describe,
    hit_rate,
    load_azure,
    load_mooncake,
    oracle_hit_rate,
    take_slice,
)


def _mooncake(tmp_path, rows):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return load_mooncake(path)


def test_mooncake_rows_become_requests_in_seconds(tmp_path):
    reqs = _mooncake(tmp_path, [
        {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 1500, "input_length": 100, "output_length": 7, "hash_ids": [0]},
    ])
    assert reqs[1] == TraceRequest(1, 1.5, 100, 7, (0,))


def test_azure_timestamps_are_seconds_from_the_first(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:17:03.9799600,4808,10\n"
                    "2023-11-16 18:17:05.4799600,3180,8\n")
    reqs = load_azure(path)
    assert [r.input_tokens for r in reqs] == [4808, 3180]
    assert reqs[1].arrival_s == pytest.approx(1.5)
    assert reqs[1].hash_ids == ()


def test_slice_rebases_and_limits():
    reqs = [TraceRequest(i, float(i), 10, 1) for i in range(10)]
    picked = take_slice(reqs, start_s=3, duration_s=4, max_requests=3)
    assert [r.index for r in picked] == [3, 4, 5]
    assert [r.arrival_s for r in picked] == [0.0, 1.0, 2.0]


def test_caps_truncate_hash_ids_to_the_capped_input():
    req = TraceRequest(0, 0.0, 2000, 400, (1, 2, 3, 4))
    capped = apply_caps([req], Caps(max_input_tokens=700, max_output_tokens=50,
                                    output_scale=0.5), block_tokens=512)[0]
    assert capped.input_tokens == 700
    assert capped.hash_ids == (1, 2)  # the ids that still cover tokens, in order
    assert capped.output_tokens == 50


def test_output_scale_never_goes_below_the_minimum():
    req = TraceRequest(0, 0.0, 10, 3)
    assert apply_caps([req], Caps(output_scale=0.1))[0].output_tokens == 1


def test_ideal_hit_rate_counts_leading_repeated_blocks_by_tokens():
    reqs = [
        TraceRequest(0, 0.0, 1024, 1, (7, 8)),
        TraceRequest(1, 1.0, 1024, 1, (7, 9)),  # block 7 repeats: 512 of 1024
        TraceRequest(2, 2.0, 700, 1, (7, 8)),  # both repeat, capped at the input length
    ]
    assert hit_rate(reqs) == pytest.approx((0 + 512 + 700) / (1024 + 1024 + 700))


def test_round_robin_caches_see_only_their_own_requests():
    reqs = [TraceRequest(i, float(i), 512, 1, (5,)) for i in range(4)]
    assert hit_rate(reqs, instances=1) == pytest.approx(3 / 4)
    assert hit_rate(reqs, instances=2) == pytest.approx(2 / 4)


def test_describe_empty_and_nonempty():
    assert describe([])["requests"] == 0
    d = describe([TraceRequest(0, 0.0, 10, 2), TraceRequest(1, 2.0, 30, 4)])
    assert d["rate_per_s"] == 1.0
    assert d["mean_input_tokens"] == 20


@pytest.mark.skipif(not default_trace_path("mooncake_conversation.jsonl").exists(),
                    reason="shared traces not present")
def test_mooncake_trace_matches_its_published_hit_rates():
    reqs = load_mooncake(default_trace_path("mooncake_conversation.jsonl"))
    assert len(reqs) == 12031
    assert hit_rate(reqs) == pytest.approx(0.374, abs=0.001)
    assert hit_rate(reqs, instances=8) == pytest.approx(0.139, abs=0.001)


def test_oracle_hit_rate_follows_conversations_until_the_caches_are_too_small():
    # Two conversations on two caches, both starting with the shared block 0; each turn extends
    # its conversation by one block. Every block is 512 tokens.
    turns = []
    for t in range(1, 4):
        for conv in (10, 20):
            ids = (0, *range(conv, conv + t))
            n = len(turns)
            turns.append(TraceRequest(index=n, arrival_s=n, input_tokens=512 * len(ids),
                                      output_tokens=1, hash_ids=ids))
    queries = sum(r.input_tokens for r in turns)
    # Infinitely large caches: only each conversation's newest block is computed (and block 0
    # once per cache).
    hits = (0 + 0 + 2 + 2 + 3 + 3) * 512
    assert oracle_hit_rate(turns, 2, 10**9) == pytest.approx(hits / queries)
    # Room for one block per cache: every turn evicts what the next one would need.
    assert oracle_hit_rate(turns, 2, 512) == 0.0
    assert oracle_hit_rate(turns, 1, 10**9) <= hit_rate(turns)
