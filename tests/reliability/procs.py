"""Engines as real processes (``kvproxy-sidecar sim``), for faults only a process can show: a
SIGKILL mid-stream, a SIGSTOP. Each is stopped by its PID when the test ends."""

from __future__ import annotations

import asyncio
import re
import sys
from dataclasses import dataclass


@dataclass
class EngineProcess:
    proc: asyncio.subprocess.Process
    url: str

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


async def start_engine(name: str, model: str, *args: str) -> EngineProcess:
    """One simulated engine in its own process on a free loopback port."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "engine_sidecar", "sim", "--port", "0", "--host", "127.0.0.1",
        "--name", name, "--model", model, *args, stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    try:
        while True:
            line = (await asyncio.wait_for(proc.stderr.readline(), 20)).decode()
            assert line, "the simulator exited before serving"
            found = re.search(r"at (http://\S+)$", line.strip())
            if found:
                break
    except BaseException:
        proc.kill()
        await proc.wait()
        raise
    # Keep draining its log so that a chatty engine never blocks on a full pipe.
    asyncio.get_running_loop().create_task(_drain(proc.stderr), name=f"drain-{name}")
    return EngineProcess(proc, found.group(1))


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass
