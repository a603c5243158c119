"""The batch-size schedule: refused as vLLM would refuse it, looked up as vLLM looks it up."""

import pytest

from engine_sidecar.speculation.schedule import (
    Range,
    ScheduleError,
    dense,
    from_edges,
    k_for_batch,
    parse_json,
    render,
    to_json,
    validate,
)


def test_a_valid_schedule_comes_back_sorted():
    got = validate([[9, 32, 2], [1, 8, 4]], max_k=4)
    assert got == (Range(1, 8, 4), Range(9, 32, 2))
    assert to_json(got) == [[1, 8, 4], [9, 32, 2]]
    assert render(got) == "1-8:4 9-32:2"


@pytest.mark.parametrize(("raw", "words"), [
    ([[1, 8, 4], [8, 16, 2]], "ranges 1-8 and 8-16 overlap"),
    ([[1, 8, 5]], "k=5 for batch sizes 1-8 exceeds the profile's num_speculative_tokens=4"),
    ([[2, 8, 1]], "must start at batch size 1"),
    ([[1, 0, 1]], "must be positive"),
    ([[4, 1, 1]], "is after its end"),
    ([[1, 8, -1]], "k must be >= 0"),
    ([[1, 8]], "expected [start, end, k]"),
    ([[1, 8, 1.5]], "must be integers"),
    ([], "non-empty list"),
    ("1-8:4", "non-empty list"),
])
def test_what_vllm_would_reject_is_refused_with_the_reason(raw, words):
    with pytest.raises(ScheduleError) as info:
        validate(raw, max_k=4)
    assert words in str(info.value)


def test_an_engine_without_speculation_takes_no_schedule():
    with pytest.raises(ScheduleError, match="without speculation"):
        validate([[1, 8, 0]], max_k=0)


def test_lookup_carries_k_through_gaps_and_the_tail_like_vllm():
    # vLLM's own example: [(1, 16, 3), (32, 128, 2)] maps 17-31 to 3 and beyond 128 to 2.
    schedule = validate([[1, 16, 3], [32, 128, 2]], max_k=3)
    assert [k_for_batch(schedule, b, 3) for b in (1, 16, 17, 31, 32, 128, 200)] == [
        3, 3, 3, 3, 2, 2, 2]
    assert dense(schedule, 4, 2) == (0, 2, 2, 2, 2)  # capped at the engine's maximum


def test_edges_make_contiguous_ranges_up_to_the_largest_batch():
    assert from_edges((1, 5, 17), (8, 4, 0), 256) == (
        Range(1, 4, 8), Range(5, 16, 4), Range(17, 256, 0))


def test_json_text_is_checked_too():
    with pytest.raises(ScheduleError, match="not valid JSON"):
        parse_json("[[1, 2", max_k=3)
    assert parse_json("[[1, 4, 2]]", max_k=3) == (Range(1, 4, 2),)
