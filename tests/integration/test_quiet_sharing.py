"""Sharing rounds over the workers' hub on a real Unix socket go quiet when nothing happens: an
idle process runs (almost) no rounds beyond its heartbeats, yet a dispatch wakes it and reaches
the sibling long before any heartbeat would; while a request is open its first byte and its end
reach the sibling as before, and the rounds go quiet again after it; heartbeats keep an idle
sibling live and a dead sibling's figures still expire on time."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry

from proxy.core.config import RoutingConfig
from proxy.core.engine_state import EngineState
from proxy.core.routing import make_policy
from proxy.core.sharing_state import Outbox
from proxy.tenancy.hub import Hub, HubBus
from proxy.tenancy.shared_routing import SharedRouting

INTERVAL_S = 0.02


@dataclass
class Engine:
    name: str
    pool: str
    state: EngineState


@dataclass
class Side:
    shared: SharedRouting
    outbox: Outbox
    engines: list[Engine]
    registry: CollectorRegistry
    merged: list[int] = field(default_factory=list)  # peer dispatches merged, per round

    def published(self) -> float:
        value = self.registry.get_sample_value(
            "kvproxy_sharing_published_total", {"kind": "messages"})
        return value or 0.0


def _side(bus: HubBus, ttl_s: float) -> Side:
    engines = [Engine(n, "p", EngineState(n, "p", f"http://{n}")) for n in ("e0", "e1")]
    registry, outbox, merged = CollectorRegistry(), Outbox(64), []

    def on_merged(_peers: int, dispatches: Mapping[str, int]) -> None:
        merged.append(dispatches.get("p", 0))

    shared = SharedRouting(
        bus, outbox, {"p": make_policy(RoutingConfig())}, lambda: engines, ttl_s=ttl_s,
        interval_s=INTERVAL_S, max_chain=64, clock=time.monotonic, registry=registry,
        transport="the workers' hub", on_merged=on_merged,
    )  # fmt: skip
    return Side(shared, outbox, engines, registry, merged)


async def _until(cond: Callable[[], bool], within_s: float) -> None:
    async with asyncio.timeout(within_s):
        while not cond():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def _pair(tmp_path: Path, ttl_s: float) -> AsyncIterator[tuple[Side, Side]]:
    path = str(tmp_path / "hub.sock")
    parent = Hub(path)
    await parent.start()
    buses = [HubBus(path, i) for i in range(2)]
    sides = [_side(bus, ttl_s) for bus in buses]
    tasks = [asyncio.create_task(b.run()) for b in buses]
    tasks += [asyncio.create_task(s.shared.run()) for s in sides]
    try:
        await _until(lambda: all(s.shared.peers_heard == 1 for s in sides), 5.0)
        yield sides[0], sides[1]
    finally:
        for side in sides:
            side.shared.stop()
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for bus in buses:
            await bus.close()
        await parent.close()


async def test_an_idle_worker_runs_no_rounds_yet_a_dispatch_reaches_its_sibling(
    tmp_path: Path,
) -> None:
    # ttl 60 s: heartbeats every 15 s, far beyond this test; every round here is a woken one.
    async with _pair(tmp_path, ttl_s=60.0) as (a, b):
        await asyncio.sleep(0.2)  # the first rounds' changes settle
        rounds = (a.shared.rounds, b.shared.rounds)
        sent = (a.published(), b.published())
        await asyncio.sleep(1.0)  # about 50 rounds each when rounds poll every interval
        assert a.shared.rounds - rounds[0] <= 2 and b.shared.rounds - rounds[1] <= 2
        assert (a.published(), b.published()) == sent
        a.outbox.dispatched("p", "e0", (1, 2, 3))
        await _until(lambda: sum(b.merged) == 1, 5.0)  # woken: long before a heartbeat
        assert b.shared.peers_heard == 1


async def test_an_open_request_s_first_byte_and_end_reach_the_sibling_then_rounds_go_quiet(
    tmp_path: Path,
) -> None:
    async with _pair(tmp_path, ttl_s=60.0) as (a, b):
        state = a.engines[0].state
        ticket = state.on_dispatch(time.monotonic(), prefill=100.0)
        a.outbox.dispatched("p", "e0", (7,))
        await _until(lambda: b.engines[0].state.remote_open == 1.0, 5.0)
        assert b.engines[0].state.remote_backlog.tokens == 100.0
        await asyncio.sleep(0.2)  # open: the rounds keep their interval
        state.on_first_byte(ticket)
        await _until(lambda: b.engines[0].state.remote_backlog.tokens == 0.0, 5.0)
        state.on_settle(ticket)
        await _until(lambda: b.engines[0].state.remote_open == 0.0, 5.0)
        await asyncio.sleep(0.2)
        rounds = a.shared.rounds
        await asyncio.sleep(1.0)  # nothing in flight any more: quiet
        assert a.shared.rounds - rounds <= 2


async def test_a_request_opened_without_a_dispatch_wakes_a_quiet_round(tmp_path: Path) -> None:
    """A retry or a speculation leg opens a ticket at an engine with no outbox entry: the sibling
    still hears of it within a few intervals, not at the next heartbeat (15 s away here)."""
    async with _pair(tmp_path, ttl_s=60.0) as (a, b):
        await asyncio.sleep(0.2)  # quiet
        state = a.engines[1].state
        ticket = state.on_dispatch(time.monotonic(), prefill=0.0)
        # 5 s: a third of the way to the next heartbeat.
        await _until(lambda: b.engines[1].state.remote_open == 1.0, 5.0)
        state.on_settle(ticket)
        await _until(lambda: b.engines[1].state.remote_open == 0.0, 5.0)


async def test_heartbeats_keep_an_idle_sibling_live_and_a_dead_one_expires(
    tmp_path: Path,
) -> None:
    ttl_s = 0.4  # heartbeats every 0.1 s
    async with _pair(tmp_path, ttl_s=ttl_s) as (a, b):
        a.engines[0].state.open_requests = 0
        sent, rounds, started = a.published(), a.shared.rounds, time.monotonic()
        for _ in range(20):  # ~1 s idle: the sibling stays live on heartbeats alone
            await asyncio.sleep(0.05)
            assert b.shared.peers_heard == 1
        beats = (time.monotonic() - started) / (ttl_s / 4)  # heartbeats due meanwhile
        # About one message per heartbeat, not one per interval (5x as many).
        assert 2 <= a.published() - sent <= beats + 3
        assert a.shared.rounds - rounds <= 2 * beats + 5  # its own heartbeats and the sibling's
        a.shared.stop()
        # Its figures expire ttl_s after its last heartbeat, with nothing to wake ``b``.
        await _until(lambda: b.shared.peers_heard == 0, 5.0)

