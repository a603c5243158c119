"""One rollout of an engine at a time: a second request while one runs is held, and the pool's
lease stays with the first until its restart is over."""

from __future__ import annotations

import asyncio

from engine_sidecar.speculation import schedule as sch
from engine_sidecar.speculation.controller import Controller, ControllerSettings
from engine_sidecar.speculation.lease import LocalLease
from engine_sidecar.speculation.policy import PolicySettings


class SlowEngine:
    """An engine whose restart lasts until the test lets it end."""

    def __init__(self) -> None:
        self.schedule = sch.uniform(4, 64)
        self.restarting = asyncio.Event()
        self.back = asyncio.Event()
        self.asked: list[sch.Schedule] = []

    def current_schedule(self) -> sch.Schedule:
        return self.schedule

    async def metrics_text(self) -> str | None:
        return None

    async def reconfigure(self, schedule: sch.Schedule, on_drained=None) -> None:
        self.asked.append(schedule)
        self.restarting.set()
        await self.back.wait()
        self.schedule = schedule


async def test_a_second_rollout_while_one_runs_is_held_and_the_lease_kept() -> None:
    engine, lease = SlowEngine(), LocalLease(max_out=1)
    settings = ControllerSettings(PolicySettings(max_k=8, max_batch=64))
    controller = Controller("engine-a", engine, settings, lease)
    first = asyncio.create_task(controller.apply_now(sch.uniform(1, 64)))
    async with asyncio.timeout(5):
        await engine.restarting.wait()
    assert not await controller.apply_now(sch.uniform(2, 64))  # held, at once
    assert "in progress" in controller.last_hold
    assert lease.holders == {"engine-a"}  # still out: no other engine of the pool may go
    assert not await LocalLease.acquire(lease, "engine-b")
    engine.back.set()
    async with asyncio.timeout(5):
        assert await first
    assert engine.asked == [sch.uniform(1, 64)] and engine.schedule == sch.uniform(1, 64)
    assert lease.holders == set()
    assert controller.stats.decisions["held"] == 1
