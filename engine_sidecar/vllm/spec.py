"""Speculative-decoding figures derived from vLLM's counters.

Rules:
- Pure: samples come in with the time they were taken; nothing here reads a clock.
- vLLM counts per verification step ("draft"): ``num_drafts``, ``num_draft_tokens``,
  ``num_accepted_tokens`` and ``num_accepted_tokens_per_pos{position=i}``. A token at position i
  is accepted only if every earlier one was, so ``accepted_per_pos[i] / drafts`` is the probability
  that a step accepts at least ``i + 1`` draft tokens.
- Rates are over a sliding window: the difference between the newest sample and the oldest one
  still inside the window. A counter going backwards means the engine restarted: the window starts
  again from that sample.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class SpecCounters:
    drafts: float
    draft_tokens: float
    accepted: float
    accepted_per_pos: tuple[float, ...]

    def minus(self, older: SpecCounters) -> SpecCounters:
        n = max(len(self.accepted_per_pos), len(older.accepted_per_pos))
        mine = self.accepted_per_pos + (0.0,) * (n - len(self.accepted_per_pos))
        theirs = older.accepted_per_pos + (0.0,) * (n - len(older.accepted_per_pos))
        return SpecCounters(
            drafts=self.drafts - older.drafts,
            draft_tokens=self.draft_tokens - older.draft_tokens,
            accepted=self.accepted - older.accepted,
            accepted_per_pos=tuple(a - b for a, b in zip(mine, theirs, strict=True)),
        )

    def went_backwards(self, older: SpecCounters) -> bool:
        delta = self.minus(older)
        fields = (delta.drafts, delta.draft_tokens, delta.accepted, *delta.accepted_per_pos)
        return any(v < 0 for v in fields)


@dataclass(frozen=True)
class SpecStats:
    """Figures over one window; rates are ``None`` while the window saw no draft."""

    window_s: float
    drafts: float
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    per_position: tuple[float, ...]
    best_num_speculative_tokens: int | None


class SpecWindow:
    """Sliding window of counter samples."""

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        self.window_s = window_s
        self._samples: deque[tuple[float, SpecCounters]] = deque()

    def add(self, now: float, counters: SpecCounters) -> None:
        if self._samples and counters.went_backwards(self._samples[-1][1]):
            self._samples.clear()
        self._samples.append((now, counters))
        # Keep one sample at or before the window start, so the window is fully covered.
        while len(self._samples) >= 2 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    def delta(self) -> tuple[float, SpecCounters] | None:
        if len(self._samples) < 2:
            return None
        (t0, old), (t1, new) = self._samples[0], self._samples[-1]
        return t1 - t0, new.minus(old)

    def stats(self, *, num_speculative_tokens: int, token_cost: float) -> SpecStats:
        found = self.delta()
        if found is None:
            return SpecStats(0.0, 0.0, None, None, (), None)
        span, d = found
        return derive_stats(d, span, num_speculative_tokens=num_speculative_tokens,
                            token_cost=token_cost)


def derive_stats(d: SpecCounters, span_s: float, *, num_speculative_tokens: int,
                 token_cost: float) -> SpecStats:
    if d.drafts <= 0:
        return SpecStats(span_s, 0.0, None, None, (), None)
    rate = d.accepted / d.draft_tokens if d.draft_tokens > 0 else None
    per_pos = tuple(min(1.0, max(0.0, a / d.drafts)) for a in d.accepted_per_pos)
    best = best_num_speculative_tokens(per_pos, token_cost=token_cost,
                                       max_tokens=max(num_speculative_tokens, len(per_pos)))
    return SpecStats(span_s, d.drafts, rate, 1.0 + d.accepted / d.drafts, per_pos, best)


def expected_tokens_per_step(per_position: tuple[float, ...], k: int) -> float:
    """Tokens one verification step yields with ``k`` draft tokens: the bonus/target token plus
    each draft position's probability of being reached and accepted."""
    return 1.0 + sum(per_position[:k])


def extend_positions(per_position: tuple[float, ...], max_tokens: int) -> tuple[float, ...]:
    """Extrapolate measured positions to ``max_tokens`` by repeating the last conditional
    acceptance rate (the chance that position i is accepted given that i-1 was)."""
    rates = list(per_position)
    if not rates or len(rates) >= max_tokens:
        return tuple(rates[:max_tokens])
    prev = rates[-2] if len(rates) >= 2 else 1.0
    conditional = rates[-1] / prev if prev > 0 else 0.0
    while len(rates) < max_tokens:
        rates.append(rates[-1] * min(1.0, conditional))
    return tuple(rates)


def best_num_speculative_tokens(per_position: tuple[float, ...], *, token_cost: float,
                                max_tokens: int) -> int:
    """The draft length ``k`` (0..max_tokens) that maximises expected tokens per unit of step time.

    A step with ``k`` draft tokens yields ``1 + sum(p[:k])`` tokens and costs ``1 + token_cost * k``
    target-step equivalents (drafting plus the wider verification). Ties go to the shorter draft,
    which wastes less compute when acceptance drifts down.
    """
    if token_cost < 0:
        raise ValueError("token_cost must be >= 0")
    positions = extend_positions(per_position, max_tokens)
    best_k, best_value = 0, 1.0
    for k in range(1, len(positions) + 1):
        value = expected_tokens_per_step(positions, k) / (1.0 + token_cost * k)
        if value > best_value + 1e-12:
            best_k, best_value = k, value
    return best_k
