"""An asyncio event loop on a virtual clock, for benchmarks of in-process simulated engines.

Rules: the loop's ``time()`` is virtual; whenever nothing is ready to run, the clock jumps to the
next timer instead of sleeping, so a simulated hour takes the CPU time its Python work takes, and
the same seed gives the same run on any machine. Only for code that does no real I/O (sockets
would still work, but a wait on one with nothing scheduled is reported as a deadlock).
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _Clock:
    now = 0.0


class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self, clock: _Clock) -> None:
        super().__init__()
        self._clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise RuntimeError("virtual clock: nothing scheduled and nothing ready (deadlock)")
        self._clock.now += timeout
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._vclock = _Clock()
        super().__init__(_VirtualSelector(self._vclock))

    def time(self) -> float:
        return self._vclock.now


def run(main: Coroutine[Any, Any, T]) -> T:
    with asyncio.Runner(loop_factory=VirtualClockLoop) as runner:
        return runner.run(main)
