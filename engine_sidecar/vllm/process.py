"""One run of the vLLM server as a child process group.

Rules:
- vLLM forks an engine-core process and workers; the server is started in its own session so the
  whole group is signalled together and nothing outlives a stop.
- Stopping is SIGTERM to the group, then SIGKILL after a grace period, and happens once per run:
  also after the server exited by itself, since its children can outlive it.
- A stop returns once the whole group is gone, not only the server: an engine-core process that
  is still exiting holds the old run's sockets, and a restart started beside it fails to bind
  them (one wasted start and a backoff). The wait is bounded (``GROUP_EXIT_S``): a group member
  that is a zombie nobody reaps (a sidecar running as PID 1 without a reaper) must not hold
  the restart up forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Mapping, Sequence

log = logging.getLogger(__name__)

# How long a stop waits for the group's last members after SIGKILL, and how often it looks.
GROUP_EXIT_S = 10.0
_GROUP_POLL_S = 0.05


class EngineProcess:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self._proc = proc
        self._stopped = False

    @classmethod
    async def start(cls, cmd: Sequence[str], env: Mapping[str, str]) -> EngineProcess:
        proc = await asyncio.create_subprocess_exec(*cmd, env=dict(env), start_new_session=True,
                                                    stdin=asyncio.subprocess.DEVNULL)
        log.info("started vLLM pid=%d", proc.pid)
        return cls(proc)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    async def wait(self) -> int:
        return await self._proc.wait()

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)

    async def stop(self, timeout_s: float) -> int:
        """SIGTERM the group, SIGKILL it after ``timeout_s``; returns the exit status. Also after
        the server itself died: its engine-core and worker processes may still run."""
        if self._stopped:
            return await self._proc.wait()
        self._stopped = True
        if self._proc.returncode is None:
            self._signal_group(signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(self._proc.wait()), timeout_s)
            except TimeoutError:
                log.warning("vLLM pid=%d ignored SIGTERM for %.0f s; killing", self.pid, timeout_s)
        # Children may linger after the server itself exited; the group goes in every case.
        self._signal_group(signal.SIGKILL)
        status = await self._proc.wait()
        await self._group_gone(GROUP_EXIT_S)
        return status

    async def _group_gone(self, timeout_s: float) -> None:
        """Wait until no process of the group is left, at most ``timeout_s``."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout_s
        while self._group_alive():
            if loop.time() >= until:
                log.warning("vLLM pid=%d: its process group outlived SIGKILL by %.0f s",
                            self.pid, timeout_s)
                return
            await asyncio.sleep(_GROUP_POLL_S)

    def _group_alive(self) -> bool:
        try:
            os.killpg(self._proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # a member exists, only not ours to signal
        return True
