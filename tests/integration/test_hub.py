"""The workers' hub on a real Unix socket: routing-state frames queue for the sharing rounds,
telemetry frames reach the siblings' callback as they arrive, and neither goes back to its
sender."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from proxy.tenancy.hub import HELLO, Hub, HubBus, frame


@pytest.fixture
async def hub(tmp_path: Path) -> AsyncIterator[tuple[Hub, list[HubBus], list[list[bytes]]]]:
    hello: set[int] = set()
    ready = asyncio.Event()

    def on_hello(index: int) -> None:
        hello.add(index)
        if len(hello) == 3:
            ready.set()

    path = str(tmp_path / "hub.sock")
    parent = Hub(path, on_hello=on_hello)
    await parent.start()
    buses = [HubBus(path, i) for i in range(3)]
    heard: list[list[bytes]] = [[] for _ in buses]
    for bus, got in zip(buses, heard, strict=True):
        bus.on_telemetry = got.append
    tasks = [asyncio.create_task(bus.run()) for bus in buses]
    try:
        async with asyncio.timeout(5):
            await ready.wait()
            while not all(bus.live for bus in buses):  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        yield parent, buses, heard
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for bus in buses:
            await bus.close()
        await parent.close()


async def test_telemetry_reaches_every_sibling_and_routing_state_stays_queued(
    hub: tuple[Hub, list[HubBus], list[list[bytes]]],
) -> None:
    _, buses, heard = hub
    assert buses[0].send_telemetry(b"scraped")
    await buses[0].publish(b"dispatched")
    fetched: list[list[bytes]] = [[] for _ in buses]
    async with asyncio.timeout(5):
        while not (heard[1] and heard[2] and fetched[1] and fetched[2]):
            for bus, got in zip(buses, fetched, strict=True):
                got.extend(await bus.fetch())
            await asyncio.sleep(0.01)
    assert heard == [[], [b"scraped"], [b"scraped"]]
    assert fetched == [[], [b"dispatched"], [b"dispatched"]]


async def test_telemetry_is_not_sent_without_the_hub(tmp_path: Path) -> None:
    bus = HubBus(str(tmp_path / "nobody.sock"), 0)
    assert not bus.send_telemetry(b"scraped")


async def test_a_quiet_worker_beats_and_its_beats_reach_no_sibling(tmp_path: Path) -> None:
    path = str(tmp_path / "hub.sock")
    parent = Hub(path)
    await parent.start()
    quiet, other = HubBus(path, 0, beat_s=0.05), HubBus(path, 1, beat_s=60.0)
    heard: list[bytes] = []
    other.on_telemetry = heard.append
    tasks = [asyncio.create_task(bus.run()) for bus in (quiet, other)]
    try:
        async with asyncio.timeout(5):
            while 0 not in parent.last_heard or 1 not in parent.last_heard:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        hello = parent.last_heard[1]
        heard_at = [parent.last_heard[0]]
        async with asyncio.timeout(5):
            while len(heard_at) < 4:  # beats, with nothing to say, again and again
                await asyncio.sleep(0.01)
                if parent.last_heard[0] > heard_at[-1]:
                    heard_at.append(parent.last_heard[0])
        assert parent.last_heard[1] == hello  # the slow beater (60 s): only its hello
        assert heard == [] and await other.fetch() == [] and parent.forwarded == 0
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for bus in (quiet, other):
            await bus.close()
        await parent.close()


async def _closed_by_hub(reader: asyncio.StreamReader) -> bool:
    """Whether the hub closes this connection within a second (nothing is ever sent to it)."""
    try:
        async with asyncio.timeout(1.0):
            return await reader.read(1) == b""
    except TimeoutError:
        return False


async def test_the_hub_holds_no_connection_that_is_not_a_worker(tmp_path: Path) -> None:
    path = str(tmp_path / "hub.sock")
    hellos: list[int] = []
    parent = Hub(path, on_hello=hellos.append, seats=2, max_connections=4, hello_timeout_s=0.2)
    await parent.start()
    opened: list[asyncio.StreamWriter] = []
    try:
        # Silent: closed once the hello is overdue.
        silent, writer = await asyncio.open_unix_connection(path)
        opened.append(writer)
        assert await _closed_by_hub(silent)
        # A hello for a seat this proxy does not have, or not a seat at all: refused.
        for payload in (b"2", b"-1", b"x"):
            reader, writer = await asyncio.open_unix_connection(path)
            opened.append(writer)
            writer.write(frame(HELLO, payload))
            assert await _closed_by_hub(reader)
        assert hellos == [] and parent.refused == 4
        # Past the bound, a new connection is closed at once, whatever it would say.
        idle = []
        for _ in range(4):
            reader, writer = await asyncio.open_unix_connection(path)
            opened.append(writer)
            idle.append(reader)
        extra, writer = await asyncio.open_unix_connection(path)
        opened.append(writer)
        assert await _closed_by_hub(extra)
        # The bound counts open connections: once the idle ones are gone a worker gets in.
        for reader in idle:
            assert await _closed_by_hub(reader)  # their hellos were overdue
        bus = HubBus(path, 1)
        task = asyncio.create_task(bus.run())
        try:
            async with asyncio.timeout(5):
                while not bus.live:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
            assert hellos == [1]
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await bus.close()
    finally:
        for writer in opened:
            writer.close()
        await parent.close()
