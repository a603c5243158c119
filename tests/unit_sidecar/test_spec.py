"""Speculative-decoding derivations: windows over counters and the best draft length."""

import pytest

from engine_sidecar.vllm.spec import (
    SpecCounters,
    SpecWindow,
    best_num_speculative_tokens,
    derive_stats,
    expected_tokens_per_step,
    extend_positions,
)


def counters(drafts, draft_tokens, accepted, per_pos):
    return SpecCounters(drafts, draft_tokens, accepted, tuple(per_pos))


def test_expected_tokens_counts_bonus_token_and_reached_positions():
    assert expected_tokens_per_step((0.8, 0.5, 0.2), 0) == 1.0
    assert expected_tokens_per_step((0.8, 0.5, 0.2), 2) == pytest.approx(2.3)


def test_free_drafting_takes_every_position_that_ever_accepts():
    assert best_num_speculative_tokens((0.9, 0.7, 0.4), token_cost=0.0, max_tokens=3) == 3


def test_costly_drafting_stops_where_the_next_position_no_longer_pays():
    # k=1: 1.9/1.3=1.46; k=2: 2.5/1.6=1.56; k=3: 2.6/1.9=1.37
    assert best_num_speculative_tokens((0.9, 0.6, 0.1), token_cost=0.3, max_tokens=3) == 2


def test_no_acceptance_means_no_speculation():
    assert best_num_speculative_tokens((0.0, 0.0, 0.0), token_cost=0.1, max_tokens=3) == 0
    assert best_num_speculative_tokens((), token_cost=0.1, max_tokens=4) == 0


def test_ties_prefer_the_shorter_draft():
    assert best_num_speculative_tokens((0.5, 0.0), token_cost=0.0, max_tokens=2) == 1


def test_extrapolation_repeats_the_last_conditional_rate():
    assert extend_positions((0.8, 0.4), 4) == pytest.approx((0.8, 0.4, 0.2, 0.1))
    assert extend_positions((0.5,), 3) == pytest.approx((0.5, 0.25, 0.125))
    assert extend_positions((0.8, 0.4, 0.2), 2) == (0.8, 0.4)


def test_best_can_exceed_the_configured_length_when_acceptance_stays_high():
    best = best_num_speculative_tokens((0.95, 0.9), token_cost=0.02, max_tokens=6)
    assert best == 6


def test_negative_cost_is_rejected():
    with pytest.raises(ValueError, match="token_cost"):
        best_num_speculative_tokens((0.5,), token_cost=-1, max_tokens=1)


def test_derive_stats_matches_vllm_definitions():
    d = counters(10, 30, 18, (8, 6, 4))
    stats = derive_stats(d, 60.0, num_speculative_tokens=3, token_cost=0.1)
    assert stats.acceptance_rate == pytest.approx(0.6)
    assert stats.mean_acceptance_length == pytest.approx(2.8)
    assert stats.per_position == pytest.approx((0.8, 0.6, 0.4))
    assert stats.best_num_speculative_tokens == 3


def test_window_without_drafts_has_no_rates():
    stats = derive_stats(counters(0, 0, 0, ()), 5.0, num_speculative_tokens=3, token_cost=0.1)
    assert stats.acceptance_rate is None and stats.best_num_speculative_tokens is None


def test_window_uses_oldest_sample_still_covering_it():
    w = SpecWindow(10.0)
    w.add(0.0, counters(0, 0, 0, (0, 0)))
    w.add(5.0, counters(10, 20, 10, (6, 4)))
    w.add(12.0, counters(20, 40, 30, (16, 14)))
    # t=0 is the last sample at or before the window start (t=2): it stays, so the whole window
    # is covered.
    assert w.delta() == (12.0, counters(20, 40, 30, (16, 14)))
    w.add(15.0, counters(30, 60, 40, (20, 20)))
    # Now t=5 covers the window start (t=5) by itself and t=0 is dropped.
    assert w.delta() == (10.0, counters(20, 40, 30, (14, 16)))


def test_window_restarts_when_a_counter_goes_backwards():
    w = SpecWindow(60.0)
    w.add(0.0, counters(100, 300, 200, (90, 70, 40)))
    w.add(1.0, counters(5, 15, 3, (2, 1, 0)))
    assert w.delta() is None
    w.add(2.0, counters(10, 30, 6, (4, 2, 0)))
    assert w.delta() == (1.0, counters(5, 15, 3, (2, 1, 0)))


def test_window_stats_before_two_samples_are_empty():
    w = SpecWindow(60.0)
    stats = w.stats(num_speculative_tokens=3, token_cost=0.1)
    assert stats.drafts == 0 and stats.per_position == ()
    with pytest.raises(ValueError):
        SpecWindow(0)
