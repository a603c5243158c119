"""One worker of ``kvproxy serve --workers N``: its seat, its link to the parent, its siblings.

Rules:
- A worker is a full proxy on the shared port (``SO_REUSEPORT``). Its parent gives it a private
  directory and an index (``WorkerSeat``); in that directory the parent's hub listens on
  ``hub.sock`` and the worker serves its own exposition on ``worker-<index>.sock``.
- The worker connects to the hub only once its port is listening: its hello is how the parent
  knows it serves. Without Redis, routing state goes through the hub (``shared_routing``).
- A worker whose parent is gone (killed without passing on a signal) drains and stops as if it had
  been sent SIGTERM: a worker never outlives its parent by more than a drain.
- ``/metrics`` answered by any worker is the whole proxy's: it asks every sibling's socket for its
  own exposition (at most ``_SIBLING_TIMEOUT_S``; a sibling that does not answer, e.g. one being
  restarted, is left out of that exposition) and merges them (``proxy.observe.merge``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from proxy.observe.merge import merge_expositions
from proxy.tenancy.hub import HubBus, beat_interval

log = logging.getLogger(__name__)

_SIBLING_TIMEOUT_S = 1.0
_PARENT_CHECK_S = 0.5


@dataclass(frozen=True)
class WorkerSeat:
    directory: str
    index: int
    workers: int  # how many the parent runs

    @property
    def hub_path(self) -> str:
        return os.path.join(self.directory, "hub.sock")

    def metrics_path(self, index: int | None = None) -> str:
        return os.path.join(self.directory, f"worker-{self.index if index is None else index}.sock")


class WorkerLink:
    """The worker's hub connection and its own-metrics socket, started once it serves."""

    def __init__(self, seat: WorkerSeat, stuck_after_s: float = 10.0) -> None:
        self.seat = seat
        self.bus = HubBus(seat.hub_path, seat.index, beat_s=beat_interval(stuck_after_s))
        self._task: asyncio.Task[None] | None = None
        self._orphan_watch: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self._parent = os.getppid()
        self._orphaned = False  # the parent died without cleaning up: the workers do

    async def start(self, own_metrics: Callable[[], bytes]) -> None:
        """Serve this worker's own exposition, then say hello to the parent."""
        async def metrics(_: web.Request) -> web.Response:
            return web.Response(body=own_metrics(), content_type="text/plain")

        internal = web.Application()
        internal.router.add_get("/metrics", metrics)
        self._runner = web.AppRunner(internal, access_log=None)
        await self._runner.setup()
        path = self.seat.metrics_path()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # left by this seat's previous worker
        await web.UnixSite(self._runner, path).start()
        self._task = asyncio.create_task(self.bus.run(), name="kvproxy-workers-hub")
        self._orphan_watch = asyncio.create_task(self._watch_parent(), name="kvproxy-parent-watch")

    async def _watch_parent(self) -> None:
        # No event tells a process its parent died (PR_SET_PDEATHSIG would need ctypes): poll.
        while os.getppid() == self._parent:  # noqa: ASYNC110
            await asyncio.sleep(_PARENT_CHECK_S)
        log.warning("worker %d: the parent process is gone; shutting down", self.seat.index)
        self._orphaned = True
        os.kill(os.getpid(), signal.SIGTERM)

    async def close(self) -> None:
        for task in (self._task, self._orphan_watch):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.bus.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._orphaned:
            self._clean_up_after_parent()

    def _clean_up_after_parent(self) -> None:
        """What a killed parent left: this worker's socket, the hub's, and the private directory
        once empty (the last worker out removes it; the others find a sibling's socket still
        there)."""
        for path in (self.seat.metrics_path(), self.seat.hub_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        with contextlib.suppress(OSError):
            os.rmdir(self.seat.directory)

    async def merged_metrics(self, own: bytes) -> bytes:
        """The whole proxy's exposition: ``own`` merged with every sibling's."""
        seat = self.seat
        siblings = (seat.metrics_path(i) for i in range(seat.workers) if i != seat.index)
        others = await asyncio.gather(*(_fetch(p) for p in siblings))
        return merge_expositions([own.decode(), *(t for t in others if t is not None)])


async def _fetch(path: str) -> str | None:
    try:
        timeout = aiohttp.ClientTimeout(total=_SIBLING_TIMEOUT_S)
        connector = aiohttp.UnixConnector(path=path)
        async with (
            aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
            session.get("http://worker/metrics") as resp,
        ):
            return await resp.text() if resp.status == 200 else None
    except (aiohttp.ClientError, OSError, TimeoutError):
        return None
