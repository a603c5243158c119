"""What a rollout leaves behind, whatever its outcome: the lease held while the engine is out (and
renewed in Redis however long that is), the state it shows, what it is charged, the gate."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from engine_sidecar.speculation import schedule as sch
from engine_sidecar.speculation.controller import (
    Controller,
    ControllerSettings,
    ReconfigureAbandoned,
    ReconfigureFailed,
)
from engine_sidecar.speculation.lease import LocalLease, RedisLease
from engine_sidecar.speculation.policy import PolicySettings
from engine_sidecar.speculation.rollout import RolloutState

START, NEW = sch.uniform(4, 64), sch.uniform(1, 64)


class Engine:
    """An engine whose restarts do what the test says: the first ``fails`` starts fail after
    ``restart_s``, ``abandon``: the drain gives up; its drain lasts until ``drained``."""

    def __init__(self, *, fails: int = 0, abandon: bool = False, restart_s: float = 0.0,
                 metrics: str | None = None) -> None:
        self.schedule = START
        self.fails, self.abandon, self.restart_s = fails, abandon, restart_s
        self.metrics = metrics
        self.drained = asyncio.Event()
        self.drained.set()
        self.draining = asyncio.Event()

    def current_schedule(self) -> sch.Schedule:
        return self.schedule

    async def metrics_text(self) -> str | None:
        return self.metrics

    async def reconfigure(self, schedule: sch.Schedule, on_drained: Callable[[], None]) -> None:
        self.draining.set()
        await self.drained.wait()
        if self.abandon:
            raise ReconfigureAbandoned("the drain did not end within 1 s")
        on_drained()
        await asyncio.sleep(self.restart_s)
        if self.fails > 0:
            self.fails -= 1
            raise ReconfigureFailed("exited with status 4 before /health")
        self.schedule = schedule


def _controller(engine: Engine, lease: LocalLease) -> Controller:
    settings = ControllerSettings(PolicySettings(max_k=4, max_batch=64), poll_s=0.1)
    return Controller("engine-a", engine, settings, lease)


async def test_a_failed_rollback_holds_the_lease_until_the_engine_is_back() -> None:
    engine, lease = Engine(fails=2, restart_s=0.05), LocalLease(max_out=1)
    controller = _controller(engine, lease)
    assert not await controller.apply_now(NEW)
    assert controller.rollout.state is RolloutState.FAILED
    assert "so did the rollback" in controller.last_hold
    # Down in the supervisor's backoff: still out, so no other engine of the pool may go.
    assert lease.holders == {"engine-a"}
    assert not await controller.apply_now(NEW)
    assert "failed rollback" in controller.last_hold
    await controller.step()  # not ready yet (no metrics)
    assert lease.holders == {"engine-a"}
    engine.metrics = "vllm:num_requests_running 0\n"  # the supervisor brought it back
    await controller.step()
    assert controller.rollout.state is RolloutState.IDLE and lease.holders == set()
    # Charged the whole outage: both starts, and the wait until it was back.
    assert controller.stats.out_s is not None and controller.stats.out_s >= 0.1
    assert controller.stats.reconfigurations["failed"] == 1


async def test_a_rolled_back_rollout_is_timed_and_says_so() -> None:
    engine, lease = Engine(fails=1, restart_s=0.1), LocalLease()
    controller = _controller(engine, lease)
    assert not await controller.apply_now(NEW)
    assert controller.last_hold == "the restart failed; rolled back to the last good schedule"
    assert controller.stats.out_s is not None and controller.stats.out_s >= 0.2
    assert controller.rollout.state is RolloutState.IDLE and lease.holders == set()


async def test_the_state_is_draining_until_the_engine_has_drained() -> None:
    engine, lease = Engine(), LocalLease()
    engine.drained.clear()
    controller = _controller(engine, lease)
    rollout = asyncio.create_task(controller.apply_now(NEW))
    async with asyncio.timeout(5):
        await engine.draining.wait()
    assert controller.rollout.state is RolloutState.DRAINING
    assert 'rollout_state{state="draining"} 1' in controller.metrics_text()
    engine.drained.set()
    async with asyncio.timeout(5):
        assert await rollout
    assert engine.schedule == NEW and controller.rollout.state is RolloutState.IDLE


async def test_an_abandoned_drain_keeps_the_schedule_counts_and_frees_the_lease() -> None:
    engine, lease = Engine(abandon=True), LocalLease()
    controller = _controller(engine, lease)
    assert not await controller.apply_now(NEW)
    assert engine.schedule == START
    assert controller.last_hold.startswith("abandoned: the drain did not end")
    assert controller.stats.reconfigurations == {"ok": 0, "rolled_back": 0, "failed": 0,
                                                 "abandoned": 1}
    assert controller.rollout.state is RolloutState.IDLE and lease.holders == set()
    assert 'reconfigurations_total{result="abandoned"} 1' in controller.metrics_text()


async def test_an_operators_request_before_the_first_evaluation_is_gated_by_the_queue() -> None:
    engine = Engine(metrics="vllm:num_requests_running 64\nvllm:num_requests_waiting 40\n")
    controller = _controller(engine, LocalLease())
    assert not await controller.apply_now(NEW)
    assert "queues 40" in controller.last_hold and engine.schedule == START


# -- the Redis lease is renewed while held ------------------------------------------------------

async def test_a_held_redis_lease_outlives_its_ttl_until_released(
        redis_url: str) -> None:
    mine = RedisLease(redis_url, "target:m", ttl_s=3.0)
    other = RedisLease(redis_url, "target:m", ttl_s=3.0)
    try:
        assert await mine.acquire("engine-a")
        # Past the TTL by a second (a slow drain, start and warm-up): only renewals, every
        # 1 s, keep the lease held; unrenewed, it would have expired at 3 s.
        await asyncio.sleep(4.0)
        assert not await other.acquire("engine-b")
        await mine.release("engine-a")
        assert await other.acquire("engine-b")
        await other.release("engine-b")
        assert await mine.acquire("engine-a")
    finally:
        await mine.close()  # releases what it holds
        assert await other.acquire("engine-b")
        await other.close()
