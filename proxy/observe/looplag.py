"""The event loop's lag: how late a periodic probe wakes, exported and kept for the scraper.

Rules:
- One named task per process runs the probe (the app owns and cancels it): it sleeps a fixed
  ``interval_s`` and records how much later than asked it woke, in
  ``kvproxy_event_loop_lag_seconds``. That lateness is time the loop could not attend to anything:
  callbacks queued behind other work, a GC pause, a blocking call.
- The probe costs one timer per interval, whatever the load (a plain callback, not a task that
  sleeps); it never allocates per request.
- Its wake-ups fall on a grid of ``interval_s`` in the loop's time (``next_tick``), and the
  scraper starts its rounds on the same grid: a round's start and a probe then share one wake-up
  of the process (each costs about 0.1 ms of CPU when idle, most of it the kernel's) instead of
  two. The lag measured is unchanged: how late the timer fired against when it was due.
- ``worst_since`` answers "was this process too busy to read its sockets in time?" for timeouts
  measured on the same loop (the scraper's), from the last ``_KEPT`` wake-ups.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import NoReturn

from prometheus_client import Histogram

DEFAULT_INTERVAL_S = 0.05
_KEPT = 64  # 3.2 s of wake-ups at the default interval


def next_tick(now: float, period_s: float) -> float:
    """The first point after ``now`` of the grid of ``period_s`` (whole milliseconds, so that
    grids whose periods divide each other meet at exactly equal times)."""
    tick_ms = max(1, round(period_s * 1000))
    return (int(now * 1000) // tick_ms + 1) * tick_ms / 1000


def nearest_tick(when: float, period_s: float) -> float:
    """The point of the grid of ``period_s`` (as ``next_tick``'s) nearest to ``when``."""
    tick_ms = max(1, round(period_s * 1000))
    return round(when * 1000 / tick_ms) * tick_ms / 1000


class LoopLag:
    def __init__(self, histogram: Histogram, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self._histogram = histogram
        self.interval_s = interval_s
        self._recent: deque[tuple[float, float]] = deque(maxlen=_KEPT)  # (woke at, lag)
        self._timer: asyncio.TimerHandle | None = None

    async def run(self) -> NoReturn:
        """Probe until cancelled: a bare timer callback re-armed each time it fires (no task
        wake-up, future or coroutine step per probe)."""
        loop = asyncio.get_running_loop()
        due = next_tick(loop.time(), self.interval_s)
        self._timer = loop.call_at(due, self._fire, loop, due)
        try:
            await loop.create_future()  # never set: the probe lives in its timer
        finally:
            self._timer.cancel()
        raise AssertionError("unreachable")

    def _fire(self, loop: asyncio.AbstractEventLoop, due: float) -> None:
        woke = loop.time()
        self.observe(woke, max(0.0, woke - due))
        due = next_tick(woke, self.interval_s)
        self._timer = loop.call_at(due, self._fire, loop, due)

    def observe(self, woke: float, lag: float) -> None:
        self._recent.append((woke, lag))
        self._histogram.observe(lag)

    def worst_since(self, since: float, now: float) -> float:
        """The largest lag seen by wake-ups after ``since``, counting a probe overdue at ``now``
        (one that should have woken by then and has not) as late by as much."""
        worst = max((lag for woke, lag in self._recent if woke >= since), default=0.0)
        if self._recent:
            overdue = now - (self._recent[-1][0] + self.interval_s)
            worst = max(worst, overdue)
        return worst
