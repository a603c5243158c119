"""Restart delays for a supervised process: exponential backoff that forgives a long good run.

Rules: pure and clock-free; the caller says how long the process stayed up.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Backoff:
    initial_s: float
    max_s: float
    # A process that stayed up at least this long is treated as healthy again: its next crash
    # restarts after ``initial_s`` instead of the grown delay.
    reset_after_s: float
    factor: float = 2.0
    _next_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError("need 0 < initial_s <= max_s")
        if self.factor < 1:
            raise ValueError("factor must be >= 1")
        self._next_s = self.initial_s

    def next_delay(self, uptime_s: float) -> float:
        """Delay before the restart that follows a run of ``uptime_s`` seconds."""
        if uptime_s >= self.reset_after_s:
            self._next_s = self.initial_s
        delay = self._next_s
        self._next_s = min(self.max_s, self._next_s * self.factor)
        return delay
