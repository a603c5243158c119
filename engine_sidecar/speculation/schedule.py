"""vLLM's batch-size speculation schedule: validation, lookup and rendering.

Rules:
- A schedule is vLLM 0.32's ``speculative_config.num_speculative_tokens_per_batch_size``: a list
  of inclusive ranges ``(start, end, k)``. vLLM validates it only while the engine starts, so a
  bad schedule would cost a restart and a rollback: :func:`validate` refuses here, with a message
  naming the entry, everything vLLM refuses (non-positive or inverted ranges, overlaps, a first
  range not starting at 1, negative K) plus what it would silently clamp (K above the profile's
  ``num_speculative_tokens``).
- :func:`k_for_batch` follows vLLM's dense lookup exactly: gaps between ranges and the tail after
  the last range carry the previous K forward, and K is capped at the configured maximum.
- Pure: no I/O, no clock.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass

SCHEDULE_FIELD = "num_speculative_tokens_per_batch_size"


class ScheduleError(ValueError):
    """A schedule vLLM would reject (or silently change); the message names the entry."""


@dataclass(frozen=True, order=True)
class Range:
    start: int
    end: int
    k: int

    @property
    def label(self) -> str:
        return f"{self.start}-{self.end}"


Schedule = tuple[Range, ...]


def _entry(raw: object, index: int) -> Range:
    if not isinstance(raw, list | tuple) or len(raw) != 3:
        raise ScheduleError(f"{SCHEDULE_FIELD}[{index}]: expected [start, end, k], got {raw!r}")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in raw):
        raise ScheduleError(f"{SCHEDULE_FIELD}[{index}]: start, end and k must be integers")
    start, end, k = (int(v) for v in raw)
    if start <= 0 or end <= 0:
        raise ScheduleError(f"{SCHEDULE_FIELD}[{index}]: batch-size range ({start}, {end}) "
                            "must be positive")
    if start > end:
        raise ScheduleError(f"{SCHEDULE_FIELD}[{index}]: range start {start} is after its end "
                            f"{end}")
    if k < 0:
        raise ScheduleError(f"{SCHEDULE_FIELD}[{index}]: k must be >= 0, got {k}")
    return Range(start, end, k)


def validate(raw: object, *, max_k: int) -> Schedule:
    """The schedule ``raw`` (JSON-shaped) sorted by start, or :class:`ScheduleError`."""
    if max_k < 1:
        raise ScheduleError("the engine runs without speculation (num_speculative_tokens is 0)")
    if not isinstance(raw, list | tuple) or not raw:
        raise ScheduleError(f"{SCHEDULE_FIELD}: expected a non-empty list of [start, end, k]")
    ranges = sorted(_entry(item, i) for i, item in enumerate(raw))
    if ranges[0].start != 1:
        raise ScheduleError(f"{SCHEDULE_FIELD}: the first range must start at batch size 1, "
                            f"not {ranges[0].start}")
    for before, after in itertools.pairwise(ranges):
        if after.start <= before.end:
            raise ScheduleError(f"{SCHEDULE_FIELD}: ranges {before.label} and {after.label} "
                                "overlap")
    for r in ranges:
        if r.k > max_k:
            raise ScheduleError(f"{SCHEDULE_FIELD}: k={r.k} for batch sizes {r.label} exceeds "
                                f"the profile's num_speculative_tokens={max_k}")
    return tuple(ranges)


def k_for_batch(schedule: Schedule, batch: int, max_k: int) -> int:
    """K vLLM runs a step of ``batch`` scheduled requests with (its dense lookup, inlined)."""
    k = schedule[0].k
    for r in schedule:
        if r.start > batch:
            break
        k = r.k
    return min(k, max_k)


def dense(schedule: Schedule, max_batch: int, max_k: int) -> tuple[int, ...]:
    """``lookup[b]`` is K at batch size ``b`` (index 0 unused), as vLLM's scheduler builds it."""
    return (0, *(k_for_batch(schedule, b, max_k) for b in range(1, max_batch + 1)))


def uniform(k: int, max_batch: int) -> Schedule:
    return (Range(1, max(1, max_batch), k),)


def from_edges(edges: Sequence[int], ks: Sequence[int], max_batch: int) -> Schedule:
    """Ranges starting at each of ``edges`` (the first must be 1), the last ending at
    ``max_batch``; ``ks[i]`` is the K of range ``i``."""
    if len(edges) != len(ks):
        raise ScheduleError("one K per range is needed")
    ends = [e - 1 for e in edges[1:]] + [max(max_batch, edges[-1])]
    return tuple(Range(s, e, k) for s, e, k in zip(edges, ends, ks, strict=True))


def to_json(schedule: Schedule) -> list[list[int]]:
    return [[r.start, r.end, r.k] for r in schedule]


def render(schedule: Schedule) -> str:
    """Compact text for logs: ``1-4:8 5-16:4 17-256:0``."""
    return " ".join(f"{r.label}:{r.k}" for r in schedule)


def parse_json(text: str, *, max_k: int) -> Schedule:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScheduleError(f"{SCHEDULE_FIELD}: not valid JSON ({exc.msg})") from None
    return validate(raw, max_k=max_k)
