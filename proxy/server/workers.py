"""``kvproxy serve --workers N``: the parent process that runs N proxy workers on one port.

Rules:
- Each worker is a full proxy in its own process (``python -m proxy serve ... --worker-seat``),
  listening on the same port with ``SO_REUSEPORT``, so the kernel spreads connections over them.
  With port 0 the parent binds the port first (bound, never listening: it only holds the number)
  and hands the number to every worker.
- The parent owns a private directory (``mkdtemp``, mode 0700) with the hub socket that carries
  routing state between workers (``proxy.tenancy.hub``) when there is no Redis, and each worker's
  own-metrics socket. It says the proxy is listening once every worker has said hello.
- Supervision: a worker that exits while the proxy is not shutting down is logged and restarted
  after a back-off that doubles from ``_BACKOFF_S`` up to ``_BACKOFF_MAX_S`` and starts over once a
  worker has run ``_HEALTHY_S``. A worker that exits before the proxy ever served means the proxy
  cannot start (a port in use, a bad setting): every worker is stopped and the parent exits 1.
- Liveness: a worker that has served (said hello since it started) and then sends the hub nothing
  for ``server.worker_stuck_after_s`` (it beats five times in that span) is stuck: stopped
  (SIGSTOP), or its event loop blocked in one call. The kernel would go on handing it a share of
  the port's connections, which would hang; the parent kills it (SIGKILL, logged) and supervision
  restarts it like any dead worker. Not while the proxy drains: the drain's own deadline applies.
- Shutdown: the first SIGTERM or SIGINT is passed to every worker as SIGTERM; each drains as a
  lone proxy does. The parent waits for all of them (the drain timeout plus ``_EXIT_GRACE_S``,
  then SIGKILL) and exits 0 only if every worker did.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence

from proxy.core.config import Config
from proxy.server.lifecycle import stop_event
from proxy.tenancy.hub import Hub, beat_interval

log = logging.getLogger("kvproxy.workers")

_BACKOFF_S = 0.5
_BACKOFF_MAX_S = 30.0
_HEALTHY_S = 30.0
_EXIT_GRACE_S = 10.0
# The status a seat reports when its worker could not even be started (an exit status of 1).
_SPAWN_FAILED = 1


def reserve_port(host: str, port: int) -> tuple[socket.socket, int]:
    """A socket bound (not listening) to ``host:port`` with ``SO_REUSEPORT``, and its port.

    The port must be free first: a plain bind (without ``SO_REUSEPORT``) is tried and released.
    ``SO_REUSEPORT`` alone would let this proxy join another one already serving the port (any
    process of the same user may), each taking a share of the clients with nothing shared."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not a user
        probe.bind((host, port))  # EADDRINUSE: someone serves it
        port = int(probe.getsockname()[1])
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock, int(sock.getsockname()[1])


class Supervisor:
    """Starts, watches, restarts and finally stops the workers."""

    def __init__(self, cfg: Config, command: Sequence[str], count: int, directory: str) -> None:
        self.cfg = cfg
        self._command = list(command)
        self.count = count
        self.directory = directory
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.ready = asyncio.Event()
        self.failed = asyncio.Event()
        self._stopped = asyncio.Event()  # set by ``stop``: also ends a restart's back-off
        self.restarts = 0
        self._hello: set[int] = set()
        self._started: dict[int, float] = {}  # the loop's time each seat's process started

    @property
    def stopping(self) -> bool:
        return self._stopped.is_set()

    def on_hello(self, index: int) -> None:
        self._hello.add(index)
        if len(self._hello) >= self.count:
            self.ready.set()

    def _argv(self, index: int) -> list[str]:
        return [*self._command, "--worker-seat", f"{self.directory}:{index}:{self.count}"]

    async def keep(self, index: int) -> int:
        """Run worker ``index`` until shutdown, restarting it when it dies; its last status."""
        backoff = _BACKOFF_S
        while True:
            started = time.monotonic()
            self._started[index] = asyncio.get_running_loop().time()
            try:
                proc = await asyncio.create_subprocess_exec(*self._argv(index))
            except OSError as exc:  # out of file descriptors or processes, for now
                if self.stopping:
                    return 0
                if not self.ready.is_set():
                    log.error("worker %d could not start: %s", index, exc)
                    self.failed.set()
                    return _SPAWN_FAILED
                # A seat is never given up while the proxy serves: tried again, backing off.
                log.error("worker %d could not be restarted (%s); trying again in %.1f s",
                          index, exc, backoff)  # fmt: skip
            else:
                self.procs[index] = proc
                code = await proc.wait()
                if self.stopping:
                    # Our own SIGTERM, reaching a worker before it could take it gracefully (it
                    # was still starting, so it served no one), is a clean stop too.
                    return 0 if code == -signal.SIGTERM else code
                if not self.ready.is_set():
                    log.error("worker %d exited with status %d before the proxy served",
                              index, code)  # fmt: skip
                    self.failed.set()
                    return code
                if time.monotonic() - started >= _HEALTHY_S:
                    backoff = _BACKOFF_S
                log.warning("worker %d (pid %d) exited with status %d; restarting it in %.1f s",
                            index, proc.pid, code, backoff)  # fmt: skip
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), backoff)
            if self.stopping:
                return 0  # stopped while waiting to restart: nothing of it to drain
            backoff = min(_BACKOFF_MAX_S, backoff * 2)
            self.restarts += 1

    def stuck(self, last_heard: dict[int, float], now: float) -> list[int]:
        """The seats whose running worker served and has been silent past the limit."""
        limit = self.cfg.server.worker_stuck_after_s
        out = []
        for index, proc in self.procs.items():
            heard = last_heard.get(index)
            if proc.returncode is not None or heard is None or heard < self._started[index]:
                continue  # gone already, or this process has not served yet
            if now - heard > limit:
                out.append(index)
        return out

    async def watch(self, last_heard: dict[int, float]) -> None:
        """Kill stuck workers (``keep`` restarts them) until the proxy stops."""
        loop = asyncio.get_running_loop()
        period = beat_interval(self.cfg.server.worker_stuck_after_s)
        while not self.stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), period)
            if self.stopping:
                return
            now = loop.time()
            for index in self.stuck(last_heard, now):
                proc = self.procs[index]
                log.error("worker %d (pid %d) has sent nothing for %.1f s (stopped, or blocked in "
                          "one call); killing it", index, proc.pid, now - last_heard[index])
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                last_heard.pop(index, None)  # once per process: its successor says hello anew

    async def stop(self, tasks: Sequence[asyncio.Task[int]]) -> bool:
        """SIGTERM every worker, wait for them to drain; True when all exited 0."""
        self._stopped.set()
        for proc in self.procs.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = self.cfg.server.drain_timeout_s + _EXIT_GRACE_S
        _, pending = await asyncio.wait(tasks, timeout=deadline)
        for proc in self.procs.values():
            if proc.returncode is None:
                log.error("worker pid %d did not stop in time; killing it", proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        if pending:
            await asyncio.wait(pending)
        unclean = {i: t.result() for i, t in enumerate(tasks) if t.result() != 0}
        if unclean:
            log.error("workers that did not stop cleanly (index: status): %s", unclean)
        return not unclean


async def run_workers(cfg: Config, command: Sequence[str], count: int) -> int:
    """Serve with ``count`` workers until SIGTERM or SIGINT; the parent's exit status.
    ``command``: the worker's command line up to (not including) its seat."""
    holder, port = reserve_port(cfg.server.host, cfg.server.port)  # a port in use: nothing made
    directory = tempfile.mkdtemp(prefix="kvproxy-workers-")
    sup = Supervisor(cfg, [*command, "--port", str(port)], count, directory)
    hub = Hub(os.path.join(directory, "hub.sock"), on_hello=sup.on_hello, seats=count)
    watch: asyncio.Task[None] | None = None
    try:
        await hub.start()
        stop = stop_event()
        tasks = [asyncio.create_task(sup.keep(i), name=f"kvproxy-worker-{i}")
                 for i in range(count)]  # fmt: skip
        watch = asyncio.create_task(sup.watch(hub.last_heard), name="kvproxy-workers-watch")
        started = await _first(sup.ready, sup.failed, stop)
        if started is sup.ready:
            host = cfg.server.host if cfg.server.host not in ("0.0.0.0", "") else "127.0.0.1"
            log.info("kvproxy listening on http://%s:%d (%d workers)", host, port, count)
            await _first(stop)
        clean = await sup.stop(tasks)
        await watch
        log.info("kvproxy stopped (%d workers)", count)
        return 0 if clean and started is not sup.failed else 1
    finally:
        if watch is not None and not watch.done():
            watch.cancel()
        await hub.close()
        holder.close()
        shutil.rmtree(directory, ignore_errors=True)


async def _first(*events: asyncio.Event) -> asyncio.Event:
    waits = {asyncio.ensure_future(e.wait()): e for e in events}
    done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    return waits[next(iter(done))]


def worker_command(args: Sequence[str]) -> list[str]:
    """``python -m proxy`` with ``args``: how the parent starts a worker."""
    return [sys.executable, "-m", "proxy", *args]
