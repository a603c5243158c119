"""Periodic background work that outlives its own bugs.

Rules: a round that raises is logged and the loop goes on (a bug in one round must not end
breaker sharing, engine discovery or lease renewal for good, silently); cancellation is never
caught, so the task that owns the loop still stops it at once.
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
        await asyncio.sleep(period_s)
