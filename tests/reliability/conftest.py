"""Fixtures for the reliability tier: real processes and servers on loopback, bounded in time.

The simulated stack comes from the integration tier (``make_stack`` / ``stack``); ``rogue`` is an
engine that misbehaves on purpose (redirects, hangs, lies in its metrics), for what the simulator
does not model. Every server started here is stopped here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from integration.conftest import make_stack, stack  # noqa: F401 (fixtures)

from .rogue import RogueEngine


@pytest.fixture
async def rogue() -> AsyncIterator[RogueEngine]:
    engine = RogueEngine()
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()
