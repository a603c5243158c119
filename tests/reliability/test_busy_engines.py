"""Engines that answer late, or a proxy too busy to read them on time, are never "unreachable".

The engines run in a real simulator process that the test pauses in slices (SIGSTOP / SIGCONT):
alive, but answering ``/metrics`` after the scrape timeout, as a simulator tokenizing for eight
engines on one core did in the routing suite. Requests keep arriving on their own clock (not
waiting for each other), so any moment at which the proxy believes no engine is reachable shows
up as a 503. A process stopped for good must still be failed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
import pytest
from integration.stack import TARGET_MODEL, chat_body, proxy_config

from proxy.core.config import TelemetryConfig
from proxy.server.lifecycle import ProxyServer

ENGINES = 2
# The stack's telemetry: every 0.1 s, timeout 0.09 s, stale after 0.6 s, unhealthy after 3
# failures, so an engine silent for 1.8 s counts as gone.


@dataclass
class Sim:
    proc: asyncio.subprocess.Process
    urls: list[str]

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)


@asynccontextmanager
async def sim_process() -> AsyncIterator[Sim]:
    """``ENGINES`` simulated engines in one process of their own, killed (by PID) at the end."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "engine_sidecar", "sim", "--engines", str(ENGINES), "--port", "0",
        "--host", "127.0.0.1", "--model", TARGET_MODEL, stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    drain: asyncio.Task[None] | None = None
    try:
        urls: list[str] = []
        async with asyncio.timeout(20):
            while len(urls) < ENGINES:
                line = (await proc.stderr.readline()).decode()
                assert line, "the simulator exited before serving"
                urls += re.findall(r"http://127\.0\.0\.1:\d+", line)
        drain = asyncio.create_task(_drain(proc.stderr))
        yield Sim(proc, urls)
    finally:
        if proc.returncode is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            await proc.wait()
        if drain is not None:
            drain.cancel()


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass


@asynccontextmanager
async def proxy_before(sim: Sim, **sections: object) -> AsyncIterator[ProxyServer]:
    names = [f"e{i}" for i in range(ENGINES)]
    server = ProxyServer(proxy_config(sim.urls, names, ["target"] * ENGINES, **sections))
    await server.start()
    try:
        async with aiohttp.ClientSession() as http:
            await _wait_all(http, server.url, "healthy")
        yield server
    finally:
        await server.stop()


async def _wait_all(http: aiohttp.ClientSession, url: str, health: str) -> None:
    """Until every engine's health is ``health`` (10 s at most)."""
    async with asyncio.timeout(10):
        while not all(row["health"] == health for row in (await _rows(http, url)).values()):  # noqa: ASYNC110 (polls the proxy over HTTP)
            await asyncio.sleep(0.05)


async def _rows(http: aiohttp.ClientSession, url: str) -> dict[str, dict[str, object]]:
    async with http.get(url + "/admin/engines") as resp:
        body = await resp.json()
    return {row["name"]: row for row in body["engines"]}


async def _scrape_timeouts(http: aiohttp.ClientSession, url: str, engine: str) -> float:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    prefix = f'kvproxy_scrape_failures_total{{engine="{engine}",reason="timeout"}} '
    return sum(float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix))


@dataclass
class Answers:
    """What the requests sent on their own clock got: (status, error code) each."""

    got: list[tuple[int, str]] = field(default_factory=list)

    def no_engine(self) -> int:
        return sum(1 for _, code in self.got if code == "no_engine_reachable")


async def _ask(http: aiohttp.ClientSession, url: str, answers: Answers, i: int) -> None:
    async with asyncio.timeout(15), http.post(
        url + "/v1/chat/completions", json=chat_body(f"question {i}")
    ) as resp:
        code = "" if resp.status == 200 else (await resp.json())["error"].get("code") or ""
        await resp.read()
        answers.got.append((resp.status, str(code)))


async def _traffic_while(
    url: str, disturb: Callable[[], asyncio.Future[None]], every_s: float = 0.05
) -> Answers:
    """Send a request every ``every_s`` (not waiting for answers) while ``disturb`` runs."""
    answers = Answers()
    async with aiohttp.ClientSession() as http:
        sent: list[asyncio.Task[None]] = []
        disturbing = disturb()
        while not disturbing.done():
            sent.append(asyncio.create_task(_ask(http, url, answers, len(sent))))
            await asyncio.sleep(every_s)
        await disturbing
        await asyncio.gather(*sent)
    return answers


async def test_engines_answering_late_are_never_called_unreachable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="proxy.fleet.scraper")
    rng = random.Random(16)

    async def pause_in_slices(sim: Sim) -> None:
        # Paused 0.3-0.6 s at a time (three to six scrape timeouts in a row), awake 0.1 s.
        deadline = time.monotonic() + 3.0
        try:
            while time.monotonic() < deadline:
                sim.pause()
                await asyncio.sleep(rng.uniform(0.3, 0.6))
                sim.resume()
                await asyncio.sleep(0.1)
        finally:
            sim.resume()

    async with sim_process() as sim, proxy_before(sim) as proxy:
        answers = await _traffic_while(
            proxy.url, lambda: asyncio.ensure_future(pause_in_slices(sim))
        )
        async with aiohttp.ClientSession() as http:
            timeouts = [await _scrape_timeouts(http, proxy.url, f"e{i}") for i in range(ENGINES)]
    assert min(timeouts) >= 6  # the engines really did answer late, several times in a row
    assert answers.no_engine() == 0, answers.got
    assert {status for status, _ in answers.got} == {200}
    assert not [r for r in caplog.records if "is unhealthy" in r.getMessage()]


async def test_an_engine_process_that_never_answers_is_still_failed() -> None:
    async with sim_process() as sim, proxy_before(sim) as proxy:
        sim.pause()
        async with aiohttp.ClientSession() as http:
            await _wait_all(http, proxy.url, "unhealthy")
            rows = await _rows(http, proxy.url)
            assert {row["health_reason"] for row in rows.values()} == {"scrape timed out"}
            async with http.post(proxy.url + "/v1/chat/completions",
                                 json=chat_body("anyone?")) as resp:
                assert resp.status == 503
                assert (await resp.json())["error"]["code"] == "no_engine_reachable"
            sim.resume()
            await _wait_all(http, proxy.url, "healthy")


async def test_a_proxy_blocked_in_slices_calls_no_engine_unreachable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="proxy.fleet.scraper")
    rng = random.Random(61)
    # A timeout the engine process answers well within however loaded the machine, so that any
    # scrape missing it does so because this process was blocked.
    telemetry = TelemetryConfig(interval_s=0.6, timeout_s=0.5, stale_after_s=3.0)

    async def block_in_slices() -> None:
        # This process (the proxy's event loop) stalls 0.6-1.2 s at a time, longer than the
        # scrape timeout. In between it is free for 0-50 ms, or for 2 ms at most: a round begun
        # then is still waiting when the next stall begins, so its timer fires late and its
        # answers are read only after the stall.
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(0.6, 1.2))  # noqa: ASYNC251 - blocking is the point
            await asyncio.sleep(rng.uniform(0.0, rng.choice((0.002, 0.05))))

    async with sim_process() as sim, proxy_before(sim, telemetry=telemetry) as proxy:
        answers = await _traffic_while(proxy.url, lambda: asyncio.ensure_future(block_in_slices()))
        async with aiohttp.ClientSession() as http:
            timeouts = [await _scrape_timeouts(http, proxy.url, f"e{i}") for i in range(ENGINES)]
    assert answers.no_engine() == 0, answers.got
    assert {status for status, _ in answers.got} == {200}
    assert timeouts == [0.0] * ENGINES  # the lateness was this process's, charged to no engine
    assert not [r for r in caplog.records if "is unhealthy" in r.getMessage()]
    assert not [r for r in caplog.records if "is stale" in r.getMessage()]
