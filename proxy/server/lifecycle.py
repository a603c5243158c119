"""Running the proxy as a server: start, serve, drain on a signal, stop.

Rules:
- ``ProxyServer`` owns one aiohttp runner and its listening site; tests and the demo use it on
  ``127.0.0.1`` port 0 in their own event loop, ``run_server`` adds the signal handling.
- The proxy listens only once the scraper's first round has ended (``FLEET_KNOWN``): before it no
  engine's health is known, so every request would be refused. This matters most for a worker
  restarted under ``--workers N``, which joins the shared port while clients are sending; its
  siblings take the connections until it knows the fleet. The round is bounded by its own timeouts
  (twice ``telemetry.timeout_s`` at most), and with engines discovered in Redis it starts after
  the registry's first read (bounded: ``RedisConfig.first_read_bound_s``); past both bounds the
  proxy listens anyway, with a warning, so that ``/ready`` and ``/health`` can say what is wrong.
- Handlers are cancelled when their client disconnects (``handler_cancellation``), which is how an
  abandoned request reaches the relay's ``finally`` and closes its engine connection at once.
- Client connections are ``connections.GuardedHandler``: request heads have a deadline
  (``server.header_timeout_s``), idle kept-alive connections ``server.keepalive_timeout_s``, and
  their number a cap (``server.max_connections``, else ``proxy.core.conncap``'s from the open-files
  limit).
- Shutdown order: stop admitting (``/ready`` 503, new requests 503) while still listening, wait for
  open requests up to ``server.drain_timeout_s``; streams still open then are ended with an SSE
  error event (their engine connections closed), and get a short grace to write it; then close the
  listener, cancel what is left, and run the app's cleanup (sessions, scraper task).
- A served process tunes its garbage collector once started (``settle_heap``): what start-up built
  lives as long as the process, so it is frozen out of every collection. The youngest generation
  is collected per ``server.gc_young_threshold`` allocations (a young pause is about proportional
  to it) and the middle one per ``server.gc_middle_threshold`` young collections; a middle
  collection scans every open stream's state, so their product, not the young threshold alone,
  sets how often the long pauses come. Tests' in-process servers keep the interpreter's defaults.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import resource
import signal
from collections.abc import Callable

from aiohttp import web

from proxy.core.config import Config
from proxy.core.conncap import client_cap
from proxy.server.app import build_app
from proxy.server.connections import GuardedRunner
from proxy.server.handlers import own_metrics
from proxy.server.keys import FLEET_KNOWN, SHELL, WORKER
from proxy.server.worker import WorkerSeat
from proxy.tenancy.frontdoor import DOOR

log = logging.getLogger(__name__)

# After the drain, whatever is still open gets this long before it is cancelled.
_FINAL_GRACE_S = 0.5
# How long start-up waits for the first scrape round, in ``telemetry.timeout_s``: twice the
# round's own bound (two timeouts when the loop ran late).
_FIRST_ROUND_TIMEOUTS = 4
# Garbage collector threshold once serving for the oldest generation (middle collections between
# two of the oldest; the interpreter also waits until a quarter of the old heap is new).
_GC_OLD = 20


class ProxyServer:
    def __init__(self, cfg: Config, app: web.Application | None = None, *,
                 reuse_port: bool = False) -> None:
        self.cfg = cfg
        self.app = app if app is not None else build_app(cfg)
        self._reuse_port = reuse_port
        engines = sum(len(pool.engines) for pool in cfg.pools)
        self._runner = GuardedRunner(
            self.app,
            header_timeout_s=cfg.server.header_timeout_s,
            cap=client_cap(cfg.server.max_connections, _open_files(), engines),
            metrics=self.app[SHELL].metrics,
            keepalive_timeout=cfg.server.keepalive_timeout_s,
            handler_cancellation=True,
            shutdown_timeout=_FINAL_GRACE_S,
            access_log=None,
        )
        self._site: web.TCPSite | None = None
        self.port = 0

    @property
    def url(self) -> str:
        host = self.cfg.server.host
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
        return f"http://{shown}:{self.port}"

    async def start(self) -> None:
        await self._runner.setup()
        await self._first_round()
        self._site = web.TCPSite(self._runner, self.cfg.server.host, self.cfg.server.port,
                                 reuse_port=self._reuse_port or None)
        await self._site.start()
        self.port = _bound_port(self._runner)

    async def _first_round(self) -> None:
        known = self.app.get(FLEET_KNOWN)
        if known is None:
            return
        bound = (_FIRST_ROUND_TIMEOUTS * self.cfg.telemetry.timeout_s
                 + self.app[DOOR].cfg.redis.first_read_bound_s)  # the round waits for it
        try:
            async with asyncio.timeout(bound):
                await known.wait()
        except TimeoutError:
            log.warning("the first scrape round took over %.2fs: listening before it ends", bound)

    async def drain(self) -> bool:
        """Refuse new work and wait for open requests; True if all finished in time."""
        drain = self.app[SHELL].drain
        drain.start()
        log.info("draining: waiting up to %.1fs for %d open requests", self._timeout, drain.open)
        finished = await drain.wait_idle(self._timeout)
        if not finished:
            log.warning("drain timeout: %d requests still open are cut off", drain.open)
            if drain.cut_all():
                # Streams end with an error event at once; let them write it before the cancel.
                await drain.wait_idle(_FINAL_GRACE_S)
        return finished

    @property
    def _timeout(self) -> float:
        return self.cfg.server.drain_timeout_s

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def drain_and_stop(self) -> bool:
        finished = await self.drain()
        await self.stop()
        log.info("kvproxy stopped")
        return finished


def _open_files() -> int | None:
    """This process's soft limit on open files (``kvproxy serve`` raised it at start), or None
    when there is none."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def _bound_port(runner: web.AppRunner) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    raise RuntimeError("the proxy is not listening on a TCP port")


async def run_server(
    cfg: Config,
    on_started: Callable[[ProxyServer], None] | None = None,
    worker: WorkerSeat | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT, then drain and stop. ``worker``: serve as one of the
    workers of ``kvproxy serve --workers N`` (shared port; see ``proxy.server.workers``)."""
    server = ProxyServer(cfg, build_app(cfg, worker=worker), reuse_port=worker is not None)
    # Before starting: a stop signal during start-up (the first scrape round may take seconds)
    # is a stop after it, drained and exit 0, not the default handler's death.
    stop = stop_event()
    await server.start()
    settle_heap(cfg.server.gc_young_threshold, cfg.server.gc_middle_threshold)
    link = server.app.get(WORKER)
    try:
        if link is not None:
            ctx = server.app[SHELL]
            await link.start(lambda: own_metrics(ctx))
        else:
            log.info("kvproxy listening on %s", server.url)
        if on_started is not None:
            on_started(server)
        await stop.wait()
    finally:
        await server.drain_and_stop()
        if link is not None:
            await link.close()


def settle_heap(young_threshold: int, middle_threshold: int) -> None:
    """Freeze what start-up built out of the collector's work and space collections out."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(young_threshold, middle_threshold, _GC_OLD)


def stop_event() -> asyncio.Event:
    """An event set by the first SIGTERM, SIGINT or SIGHUP (a closed terminal, or a supervisor's
    hang-up: drained like a stop, never the default of dying mid-stream)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, _on_signal, sig, stop)
    return stop


def _on_signal(sig: signal.Signals, stop: asyncio.Event) -> None:
    if stop.is_set():
        return
    log.info("%s received: shutting down", sig.name)
    stop.set()
