"""Model discovery asks a few engines at a time (``proxy.fleet.discovery.PARALLEL``): a fleet of
hundreds would otherwise open as many new connections every round, next to the scrapes'."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from proxy.core.config import Config
from proxy.fleet.discovery import PARALLEL, ModelDiscovery


class _Counting(ModelDiscovery):
    open = 0
    most = 0
    asked: list[str]

    async def check(self, engine: Any) -> None:
        self.open += 1
        self.most = max(self.most, self.open)
        await asyncio.sleep(0.001)
        self.asked.append(engine.name)
        self.open -= 1


async def test_a_round_asks_every_engine_but_a_few_at_a_time() -> None:
    engines = [SimpleNamespace(name=f"e{i}") for i in range(10 * PARALLEL)]
    discovery = _Counting(Config(), engines, lambda: None)  # type: ignore[arg-type,return-value]
    discovery.asked = []
    await discovery.check_all()
    assert sorted(discovery.asked) == sorted(e.name for e in engines)
    assert discovery.most == PARALLEL
