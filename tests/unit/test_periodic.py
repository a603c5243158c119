import asyncio
import contextlib

import pytest

from proxy.fleet.periodic import every


async def test_a_failing_round_does_not_end_the_loop(caplog: pytest.LogCaptureFixture) -> None:
    rounds: list[int] = []
    third = asyncio.Event()

    async def step() -> None:
        rounds.append(len(rounds))
        if len(rounds) == 1:
            raise RuntimeError("bug in one round")
        if len(rounds) == 3:
            third.set()

    task = asyncio.create_task(every(0.001, step, "test loop"))
    await asyncio.wait_for(third.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "test loop failed" in caplog.text


async def test_cancellation_inside_a_round_stops_the_loop() -> None:
    started = asyncio.Event()

    async def step() -> None:
        started.set()
        await asyncio.sleep(10)

    task = asyncio.create_task(every(0.001, step, "test loop"))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_round_that_swallows_the_cancellation_still_ends_the_loop() -> None:
    # asyncio.timeout on Python 3.11 turns a cancellation that lands as its deadline expires into
    # TimeoutError; library code under a round can therefore eat the cancel meant for the loop.
    async def swallow() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(10)

    task = asyncio.create_task(every(0.01, swallow, "swallowing"))
    await asyncio.sleep(0.02)
    task.cancel()
    async with asyncio.timeout(2):
        with pytest.raises(asyncio.CancelledError):
            await task
