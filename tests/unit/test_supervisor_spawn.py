"""The workers' supervisor when a worker cannot even be started (out of file descriptors or
processes): while the proxy serves, the seat is tried again with the back-off, never given up,
and a stop is still clean."""

from __future__ import annotations

import asyncio
import errno
import sys
from pathlib import Path
from typing import Any

import pytest

from proxy.core.config import Config, ServerConfig
from proxy.core.fleet_config import EngineConfig, PoolConfig
from proxy.server import workers
from proxy.server.workers import Supervisor

CFG = Config(server=ServerConfig(port=0, drain_timeout_s=1.0),
             pools=(PoolConfig("target", "m", (EngineConfig("e0", "http://127.0.0.1:9"),)),))
EXITS = [sys.executable, "-c", "import sys; sys.exit(3)"]  # a worker that dies at once


async def test_a_seat_that_cannot_be_restarted_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(workers, "_BACKOFF_S", 0.01)
    spawn = asyncio.create_subprocess_exec
    calls: list[str] = []

    async def flaky(*argv: Any, **kw: Any) -> asyncio.subprocess.Process:
        calls.append("try")
        if 2 <= len(calls) <= 3:  # the first restarts find no file descriptor left
            raise OSError(errno.EMFILE, "Too many open files")
        return await spawn(*argv, **kw)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", flaky)
    sup = Supervisor(CFG, EXITS, 1, str(tmp_path))
    sup.ready.set()  # the proxy is serving
    task = asyncio.create_task(sup.keep(0))
    async with asyncio.timeout(10):
        while len(calls) < 5:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    assert not task.done() and sup.restarts >= 4
    assert await sup.stop([task]) is True  # a clean stop: no error escapes the seat


async def test_a_worker_that_cannot_start_at_all_fails_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def none_left(*argv: Any, **kw: Any) -> asyncio.subprocess.Process:
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.setattr(asyncio, "create_subprocess_exec", none_left)
    sup = Supervisor(CFG, EXITS, 1, str(tmp_path))
    async with asyncio.timeout(5):
        assert await sup.keep(0) != 0
    assert sup.failed.is_set()
