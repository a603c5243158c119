"""Has acceptance shifted inside the window? A change-point test on the first draft position.

Rules:
- The evidence is, per poll, the drafts made and how many of them had their first token accepted.
  Position 1 is proposed by every draft whatever the schedule's K, so its rate is comparable
  across batch sizes and schedules: a load ramp does not look like a shift, a domain change does.
- The test is the binomial likelihood ratio of "one rate before poll j, another from j on" against
  "one rate throughout", maximised over j (a sequential change-point test: it is run after every
  poll on the evidence so far). A shift is declared when twice the log ratio exceeds
  ``threshold`` (a chi-square-like statistic: 25 is far beyond noise) *and* the rates differ by at
  least ``min_shift``: with thousands of drafts a second, a statistically certain difference of a
  percent is no reason to restart an engine.
- A shift cuts the window at the change point, so the next decision sees only the new regime, and
  stands in for the policy's confirmations: the test has already made sure.
- Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ShiftSettings:
    threshold: float = 25.0
    min_shift: float = 0.1
    min_drafts: float = 30.0  # on each side of the change point

    def __post_init__(self) -> None:
        if self.threshold <= 0 or not 0 < self.min_shift < 1 or self.min_drafts < 1:
            raise ValueError("shift threshold must be > 0, min_shift within (0, 1), "
                             "min_drafts >= 1")


@dataclass(frozen=True)
class Shift:
    index: int  # the first poll of the new regime
    before: float  # first-position acceptance before it
    after: float  # and from it on
    statistic: float


def _loglik(accepted: float, drafts: float) -> float:
    if drafts <= 0:
        return 0.0
    p = min(1.0, max(0.0, accepted / drafts))
    out = 0.0
    if accepted > 0:
        out += accepted * math.log(p)
    if drafts - accepted > 0:
        out += (drafts - accepted) * math.log(1.0 - p)
    return out


def change_point(polls: Sequence[tuple[float, float]], settings: ShiftSettings
                 ) -> Shift | None:
    """The most likely change point in ``polls`` (``(drafts, accepted_first)`` per poll, oldest
    first) if it passes the test, else ``None``."""
    total_d = sum(d for d, _ in polls)
    total_a = sum(a for _, a in polls)
    whole = _loglik(total_a, total_d)
    best: Shift | None = None
    left_d = left_a = 0.0
    for j in range(1, len(polls)):
        left_d += polls[j - 1][0]
        left_a += polls[j - 1][1]
        right_d, right_a = total_d - left_d, total_a - left_a
        if min(left_d, right_d) < settings.min_drafts:
            continue
        stat = 2.0 * (_loglik(left_a, left_d) + _loglik(right_a, right_d) - whole)
        before, after = left_a / left_d, right_a / right_d
        if stat > settings.threshold and abs(after - before) >= settings.min_shift \
                and (best is None or stat > best.statistic):
            best = Shift(j, before, after, stat)
    return best
