"""Restart backoff: doubles to a ceiling, forgives a long healthy run."""

import pytest

from engine_sidecar.vllm.backoff import Backoff


def test_delays_double_up_to_the_ceiling():
    b = Backoff(initial_s=1, max_s=5, reset_after_s=100)
    assert [b.next_delay(0.5) for _ in range(5)] == [1, 2, 4, 5, 5]


def test_a_long_run_resets_the_delay():
    b = Backoff(initial_s=1, max_s=60, reset_after_s=30)
    b.next_delay(1)
    b.next_delay(1)
    assert b.next_delay(31) == 1
    assert b.next_delay(1) == 2


def test_invalid_settings_are_rejected():
    with pytest.raises(ValueError):
        Backoff(initial_s=0, max_s=1, reset_after_s=1)
    with pytest.raises(ValueError):
        Backoff(initial_s=2, max_s=1, reset_after_s=1)
