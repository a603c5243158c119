"""Fixtures for the reliability tier: real processes and servers on loopback, bounded in time.

The simulated stack comes from the integration tier (``make_stack`` / ``stack``) and real
``redis-server`` processes from the Redis tier (``redis_factory``); ``rogue`` is an engine that
misbehaves on purpose (redirects, hangs, lies in its metrics), for what the simulator does not
model. Every server started here is stopped here.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from integration.conftest import make_stack, stack  # noqa: F401 (fixtures)

# The Redis tier's helpers are plain modules of its folder (it is not a package); they are the same
# module objects as the ones that tier imports.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "redis"))
from loops import BOTH, Factories
from proxystack import door_config
from redisproc import RedisFactory

from .rogue import RogueEngine

__all__ = ["RedisFactory", "door_config"]


@pytest.fixture
async def rogue() -> AsyncIterator[RogueEngine]:
    engine = RogueEngine()
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


@pytest.fixture
def redis_factory() -> Iterator[RedisFactory]:
    factory = RedisFactory()
    try:
        yield factory
    finally:
        factory.stop_all()


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Factories:
    """The relay's rule book runs on both loops (``tests/loops.py``)."""
    return BOTH
