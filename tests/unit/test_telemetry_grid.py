"""The wake-up grid that the loop-lag probe and the scraper's rounds share."""

from __future__ import annotations

import pytest

from proxy.observe.looplag import nearest_tick, next_tick


@pytest.mark.parametrize("now", [0.0, 1.0, 1234.5678, 98765.4321, 1e6 + 0.049])
def test_the_next_tick_is_after_now_within_one_period(now: float) -> None:
    tick = next_tick(now, 0.05)
    assert now < tick <= now + 0.05 + 1e-9


@pytest.mark.parametrize("when", [0.0, 17.3, 1234.5678, 98765.4321, 5e5 + 0.1999])
def test_a_round_lands_exactly_on_a_probe_tick(when: float) -> None:
    """A round moved to the probe's grid is due at the very float a probe tick is due at (the
    loop then runs both in one wake-up), and moves by at most half a period."""
    due = nearest_tick(when, 0.05)
    assert abs(due - when) <= 0.025 + 1e-9
    assert next_tick(due - 0.01, 0.05) == due
    # ... and so does every later round, interval after interval.
    assert nearest_tick(due + 0.2, 0.05) == next_tick(due + 0.2 - 0.01, 0.05)
