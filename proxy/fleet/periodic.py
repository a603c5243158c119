"""Periodic background work that outlives its own bugs.

Rules: a round that raises is logged and the loop goes on (a bug in one round must not end
breaker sharing, engine discovery or lease renewal for good, silently); cancellation is never
caught, so the task that owns the loop still stops it at once. On Python 3.11 ``asyncio.timeout``
turns a cancellation that lands while its own deadline expires into ``TimeoutError`` (the library
code under a round — Redis, aiohttp — uses it): a loop that then carried on would never stop and
would hang shutdown. So after every round a loop checks whether its task is being cancelled.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import NoReturn

log = logging.getLogger(__name__)


async def every(period_s: float, step: Callable[[], Awaitable[None]], what: str) -> NoReturn:
    """Run ``step``, then wait ``period_s``, until cancelled."""
    while True:
        try:
            await step()
        except Exception:
            log.exception("%s failed; trying again in %.1f s", what, period_s)
        stop_if_cancelled()
        await asyncio.sleep(period_s)


def stop_if_cancelled() -> None:
    """Raise ``CancelledError`` if the current task was asked to stop, even when a library
    swallowed the cancellation on its way up."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
