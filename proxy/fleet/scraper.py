"""The telemetry loop: scrape every engine's ``/metrics`` on a fixed interval, all at once.

Rules:
- One named task owns the loop; it runs until cancelled and never dies of an engine's failure.
- Every scrape has its own timeout, shorter than the interval (the config enforces it), so one slow
  engine never delays the others or the next round. Whatever goes wrong in one engine's scrape is
  that engine's failure, never the round's.
- Plain-HTTP engines are scraped through ``proxy.fleet.metrics_client`` (one kept connection
  per engine, a hand-written GET: a fraction of aiohttp's per-request CPU, five times a second
  per engine, busy or idle); anything else (https) through the aiohttp session. Both keep the
  rules below.
- An engine's ``/metrics`` is hostile input. Redirects are never followed (a 3xx would have us
  believe another server's figures): any status but 200 is a failure labelled ``http_<status>``.
  The body is read in bounded chunks and abandoned, connection closed, past
  ``telemetry.max_metrics_bytes`` (``too_large``); it must be UTF-8 (``decode``) and plausible
  (``MetricsError``'s reason: ``unparsable``, ``out_of_range``).
- A failure is counted in ``kvproxy_scrape_failures_total`` by reason and logged once per run of
  failures, without a traceback; what it means for the engine's health is the telemetry state
  machine's decision, not ours. Every change of an engine's health is logged once, with its reason.
- After each round every engine is ticked, so staleness is noticed even when scrapes hang.
- A scrape still unanswered at its round's timeout is counted as that round's failure, as above,
  but not abandoned: it stays open (one per engine; no new one is started for that engine while
  it is) until it is ``stale_after_s`` old, and its answer, when it comes, is applied as any other
  (stamped with its own start, and relayed to sibling workers). An engine busy enough to answer
  ``/metrics`` in 300 ms, past the timeout, so keeps a snapshot younger than ``stale_after_s``
  instead of going STALE at the busiest moment, and is not asked to render a text that would be
  thrown away and asked again; one that answers nothing within ``stale_after_s`` gets a fresh
  request (a new connection) on the next round, as before.
- ``first_round`` is set once the first round has ended, however it went: until then no engine's
  health is known and the proxy does not listen (``proxy.server.lifecycle``). With engines
  discovered in Redis, the first round waits (bounded) for the registry's first read
  (``first_after``), so that it covers them and the proxy does not listen knowing only the
  configured engines.
- One of several workers (``kvproxy serve --workers N``) skips the engines a sibling scrapes for it
  and relays the outcomes of those it scrapes (``proxy.fleet.scrape_share``): each engine is
  scraped once per machine.
- A timeout is measured on this process's own event loop: when the loop ran late during a scrape
  (its timer fired late, or the loop-lag probe saw a wake-up late by a quarter of the timeout or
  more), the answer may be sitting unread in the socket, so the scrape gets one more timeout's
  worth of time. Still unanswered with the loop still lagging, it is counted as ``proxy_busy``
  and not charged to the engine: an engine is never failed or aged because the proxy was busy
  (staleness itself needs a failed scrape, ``EngineState.tick``). A timeout that is the engine's
  (the loop was on time) is counted as ``timeout`` but marks the engine unanswered, not broken:
  it goes STALE, and UNHEALTHY only after a long silence (``EngineState.on_scrape_failed``),
  which the engine's answers to requests since its last scrape break
  (``Engine.heard_since_last_look``).
- Frozen metrics: a repeated text is news unless a request dispatched after the previous text was
  fetched completed at least half an interval before this scrape began
  (``EngineState.body_is_news``; the margin lets an exporter that counts a request just after
  answering it catch up). A text proven frozen is a failed scrape (``frozen``): the old snapshot
  ages, the engine is probed again each round and recovers by itself once its text changes or it
  has had no such request.
- A text that repeats the engine's previous one byte for byte (an idle engine repeats itself,
  simulated or real) is not parsed again: its snapshot is the previous one stamped with this
  scrape's start. The same bytes give the same figures, so nothing gets staler; only the parse is
  saved. What a repeat means for frozen metrics is still ``body_is_news``'s decision.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import zlib
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import NamedTuple

import aiohttp
from prometheus_client import Histogram

from proxy.core.config import TelemetryConfig
from proxy.core.engine_state import Health
from proxy.core.scrape_relay import Outcome
from proxy.core.telemetry import EngineSnapshot, MetricsError, parse_metrics
from proxy.fleet.engines import Engine, Fleet
from proxy.fleet.metrics_client import (
    PROXY_SHORT,
    FetchError,
    MetricsClient,
    fetch_with,
    supports,
    transport_failure,
)
from proxy.fleet.periodic import stop_if_cancelled
from proxy.fleet.scrape_share import FROZEN, ScrapeShare, failed_outcome, ok_outcome
from proxy.fleet.upstream import proxy_short
from proxy.observe.looplag import LoopLag, nearest_tick
from proxy.observe.metrics import ProxyMetrics

log = logging.getLogger(__name__)

Clock = Callable[[], float]


class Scraper:
    def __init__(
        self,
        fleet: Fleet,
        session: aiohttp.ClientSession,
        cfg: TelemetryConfig,
        metrics: ProxyMetrics,
        clock: Clock,
        *,
        lag: LoopLag | None = None,
        share: ScrapeShare | None = None,
        first_after: tuple[asyncio.Event, float] | None = None,
    ) -> None:
        self._lag = lag
        self._first_after = first_after  # an event, and how long the first round waits for it
        # With sibling workers: engines they scrape are skipped, what this one scrapes relayed.
        self._share = share
        self._fleet = fleet
        self._session = session  # for what ``MetricsClient`` does not speak (https)
        self._client = MetricsClient(cfg.max_metrics_bytes)
        self._cfg = cfg
        self._metrics = metrics
        self._clock = clock
        self.rounds = 0
        # Set once the first round has ended (whatever its outcome): the proxy listens only then.
        self.first_round = asyncio.Event()
        self._health: dict[str, Health] = {}  # as last logged
        # Per engine, the last text parsed into a snapshot, and that snapshot (bounded by the
        # fleet: at most ``max_metrics_bytes`` per engine).
        self._parsed: dict[str, tuple[bytes, EngineSnapshot]] = {}
        self.parses = 0  # texts actually parsed (the rest were repeats)
        self._durations: dict[str, tuple[Engine, Histogram]] = {}
        # Per engine, its scrape still open (past a round's timeout, or in the round running).
        self._open: dict[str, _Open] = {}

    async def run(self) -> None:
        """Scrape forever; cancel the task to stop."""
        try:
            await self._before_first_round()
            while True:
                started = self._clock()
                try:
                    await self.scrape_all()
                except Exception:
                    # A bug must not end telemetry for good: every engine would silently go
                    # stale.
                    log.exception("telemetry round failed")
                self.first_round.set()
                stop_if_cancelled()
                await self._until_next_round(started)
        finally:
            self.close()

    async def _before_first_round(self) -> None:
        if self._first_after is None:
            return
        event, bound_s = self._first_after
        try:
            async with asyncio.timeout(bound_s):
                await event.wait()
        except TimeoutError:
            log.warning("the engine registry's first read took over %.2fs: the first scrape "
                        "round covers the engines known so far", bound_s)

    def close(self) -> None:
        """Close the kept connections and the scrapes left open (``run`` does it when
        cancelled)."""
        for kept in self._open.values():
            kept.fetch.cancel()
        self._open.clear()
        self._client.close()

    async def _until_next_round(self, started: float) -> None:
        """Sleep until ``interval_s`` after the round's start, moved to the nearest point of the
        loop-lag probe's grid (less than half a probe interval, once: after that rounds start on
        the grid), so that the round's wake-up is the probe's too."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        due = now + max(0.0, self._cfg.interval_s - (self._clock() - started))
        if self._lag is not None:
            due = nearest_tick(due, self._lag.interval_s)
        await asyncio.sleep(max(0.0, due - now))

    async def scrape_all(self) -> None:
        share, now = self._share, self._clock()
        engines = [e for e in self._fleet if share is None or not share.follows(e, now)]
        outcomes = await self._round(engines)
        if share is not None:
            share.publish([o for o in outcomes if o is not None])
            share.forget_removed()
        self._fleet.tick(self._clock(), self._cfg.stale_after_s)
        names = {e.name for e in self._fleet}
        if not names.issuperset(self._parsed) or not names.issuperset(self._durations):
            self._parsed = {k: v for k, v in self._parsed.items() if k in names}
            self._durations = {k: v for k, v in self._durations.items() if k in names}
        if self._open:
            present = {e.name for e in self._fleet}
            for name in [n for n in self._open if n not in present]:
                self._open.pop(name).fetch.cancel()  # a removed engine's scrape
        if self._client.idle_connections > len(self._fleet):
            self._client.forget({e.metrics_url for e in self._fleet})
        self._log_transitions()
        self.rounds += 1

    async def _round(self, engines: list[Engine]) -> list[Outcome | None]:
        """Scrape ``engines`` at once; what to relay to sibling workers, per engine.

        Each answer is applied the moment it arrives (a done callback), so a slow engine delays
        no other's snapshot; one timeout serves the whole round, as every scrape in it started
        together (one timer and one wait per round, not per engine)."""
        started = self._clock()
        loop = asyncio.get_running_loop()
        begun = loop.time()
        tally = _Tally([None] * len(engines))
        fetches: list[asyncio.Future[bytes]] = []
        for i, engine in enumerate(engines):
            kept = self._open.get(engine.name)
            if kept is not None and kept.engine is engine and not kept.fetch.done():
                fetches.append(kept.fetch)  # still open from an earlier round: its answer counts
                continue
            url = engine.metrics_url
            fetch = (self._client.start(url) if supports(url)
                     else asyncio.ensure_future(
                         fetch_with(self._session, url, self._cfg.max_metrics_bytes)))
            fetch.add_done_callback(partial(self._arrived, engine, started, tally, i))
            fetches.append(fetch)
            self._open[engine.name] = _Open(fetch, begun, engine, started)
        try:
            late, busy = await self._wait_in_time(fetches, begun)
            for i in late:
                tally.outcomes[i] = self._unanswered(engines[i], started, busy)
        except BaseException:
            await _cancel(fetches)
            raise
        finally:
            tally.closed = True
        await self._give_up_on_old(loop.time())
        return tally.outcomes

    async def _give_up_on_old(self, now: float) -> None:
        """Cancel the scrapes open for ``stale_after_s`` or more (their duration observed: a
        cancelled fetch observes none); forget the finished ones."""
        old = []
        for name, kept in list(self._open.items()):
            if kept.fetch.done():
                del self._open[name]
            elif now - kept.begun >= self._cfg.stale_after_s:
                del self._open[name]
                old.append(kept.fetch)
                if self._fleet.live(name) is kept.engine:
                    self._observe_duration(kept.engine, kept.started)
        await _cancel(old)

    async def _wait_in_time(self, fetches: list[asyncio.Future[bytes]],
                            begun: float) -> tuple[list[int], bool]:
        """(indexes of the fetches still unanswered after the timeout, whether only this
        process was too slow for them)."""
        if not fetches:
            return [], False
        loop, timeout = asyncio.get_running_loop(), self._cfg.timeout_s
        _, pending = await asyncio.wait(fetches, timeout=timeout)
        if pending and self._busy(begun, loop.time()):
            # The answers may be sitting unread: one more timeout's worth of time.
            busy_since = loop.time()
            _, pending = await asyncio.wait(pending, timeout=timeout)
            if pending and self._busy(busy_since, loop.time()):
                return [i for i, f in enumerate(fetches) if f in pending], True
        return [i for i, f in enumerate(fetches) if f in pending], False

    def _unanswered(self, engine: Engine, started: float, busy: bool) -> Outcome | None:
        # No duration yet: the scrape stays open (``_arrived`` or ``_give_up_on_old`` observes).
        if self._fleet.live(engine.name) is not engine:
            return None  # it left the fleet during the round: nothing to judge
        if busy:
            self._metrics.scrape_failures.labels(engine.name, "proxy_busy").inc()
            return None
        return self._failed(engine, started, "timeout", "scrape timed out", unanswered=True)

    def _arrived(self, engine: Engine, started: float, tally: _Tally, i: int,
                 fetch: asyncio.Future[bytes]) -> None:
        """A fetch finished: apply what it brought (a cancelled one was the round's to judge).
        One that outlived its round is relayed to sibling workers here, not by the round."""
        if fetch.cancelled() or self._fleet.live(engine.name) is not engine:
            return  # cancelled (the round judged it), or the engine has left the fleet
        try:
            outcome = self._attempt(engine, started, fetch)
        finally:
            self._observe_duration(engine, started)
        if not tally.closed:
            tally.outcomes[i] = outcome
        elif outcome is not None and self._share is not None:
            self._share.publish([outcome])

    def _own_want(self, engine: Engine) -> None:
        """This process could not open the connection (no descriptor left): counted, and, as
        ``proxy_busy``, no verdict on the engine."""
        self._metrics.scrape_failures.labels(engine.name, PROXY_SHORT).inc()

    def _observe_duration(self, engine: Engine, started: float) -> None:
        # The labelled child looked up once per engine, not on every scrape; kept with the
        # engine it was made for: one that left (its series removed) and came back under the
        # same name between two rounds gets a child its series is exported from again.
        kept = self._durations.get(engine.name)
        if kept is None or kept[0] is not engine:
            kept = self._durations[engine.name] = (
                engine, self._metrics.scrape_duration.labels(engine.name))
        kept[1].observe(self._clock() - started)

    def _attempt(self, engine: Engine, started: float,
                 fetch: asyncio.Future[bytes]) -> Outcome | None:
        """Apply the fetch's result to ``engine``; what to relay to sibling workers."""
        try:
            snapshot, digest = self._judge(engine, fetch.result(), started)
        except FetchError as exc:
            if exc.reason == PROXY_SHORT:
                self._own_want(engine)
                return None
            return self._failed(engine, started, exc.reason, exc.detail)
        except aiohttp.ClientError as exc:
            if proxy_short(exc):
                self._own_want(engine)
                return None
            reason, detail = transport_failure(exc)
            return self._failed(engine, started, reason, detail, str(exc) or type(exc).__name__)
        except MetricsError as exc:
            return self._failed(engine, started, exc.reason, str(exc))
        except Exception:
            # A bug here must cost this engine its scrape, not the other engines theirs.
            if engine.state.consecutive_failures == 0:
                log.exception("scrape of %s failed inside the proxy", engine.name)
            self._count(engine, "internal", "internal error while scraping")
            return None
        fetched = self._clock()
        engine.state.on_scrape_ok(snapshot, fetched)
        # Built only for sibling workers: a lone process has nobody to tell.
        return None if self._share is None else ok_outcome(engine, snapshot, digest, fetched)

    def _judge(self, engine: Engine, body: bytes, started: float) -> tuple[EngineSnapshot, int]:
        """The snapshot in ``body`` and the text's digest, or ``FetchError`` / ``MetricsError``
        when it is not usable."""
        # crc32, not hash(): sibling workers compare digests (``scrape_share``) and hash() of
        # bytes differs from process to process.
        digest = zlib.crc32(body)
        news = engine.state.body_is_news(
            digest, started, self._clock(), settle_s=self._cfg.interval_s / 2
        )
        snapshot = self._parse(engine, body, started)
        if not news:
            raise FetchError("frozen", FROZEN)
        return snapshot, digest

    def _parse(self, engine: Engine, body: bytes, started: float) -> EngineSnapshot:
        """The snapshot in ``body``, stamped with the start: dispatches after it may be missing
        from the text, so they stay counted on top of it rather than vanish."""
        last = self._parsed.get(engine.name)
        if last is not None and last[0] == body:
            return replace(last[1], taken_at=started)
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise FetchError("decode", "metrics are not UTF-8 text") from None
        snapshot = parse_metrics(text, taken_at=started)
        self.parses += 1
        self._parsed[engine.name] = (body, snapshot)
        return snapshot

    def _busy(self, since: float, now: float) -> bool:
        """Whether the loop ran late enough since ``since`` to explain a missed timeout."""
        timeout = self._cfg.timeout_s
        overdue = now - (since + timeout)  # how late the timeout itself fired
        lag = 0.0 if self._lag is None else self._lag.worst_since(since, now)
        return max(overdue, lag) >= timeout / 4

    def _failed(self, engine: Engine, started: float, reason: str, detail: str,
                logged: str = "", *, unanswered: bool = False) -> Outcome | None:
        """Count a failed scrape; log the first of a run (``logged``: a more detailed text;
        ``unanswered``: no answer in time, see ``EngineState.on_scrape_failed``)."""
        if engine.state.consecutive_failures == 0:
            log.warning("scrape of %s failed (%s): %s", engine.name, reason, logged or detail)
        self._count(engine, reason, detail, unanswered=unanswered)
        if self._share is None:
            return None
        return failed_outcome(engine, started, self._clock(), reason, detail)

    def _count(self, engine: Engine, reason: str, detail: str, *,
               unanswered: bool = False) -> None:
        self._metrics.scrape_failures.labels(engine.name, reason).inc()
        now = self._clock()
        if unanswered and engine.heard_since_last_look():
            engine.state.on_answering(now)  # late metrics from an engine still answering
        engine.state.on_scrape_failed(now, detail, unanswered=unanswered)

    def _log_transitions(self) -> None:
        """Log each engine's health once per change, with the reason for it."""
        now: dict[str, Health] = {}
        for engine in self._fleet:
            health = now[engine.name] = engine.state.health
            before = self._health.get(engine.name, Health.UNKNOWN)
            if health is before:
                continue
            level = logging.INFO if health in (Health.HEALTHY, Health.DRAINING) else logging.WARNING
            reason = engine.state.health_reason
            log.log(level, "engine %s is %s%s", engine.name, health.value,
                    f": {reason}" if reason else "")
        self._health = now


class _Open(NamedTuple):
    """A scrape not answered yet: its fetch, its start (loop time, and the clock's)."""

    fetch: asyncio.Future[bytes]
    begun: float
    engine: Engine
    started: float


class _Tally:
    """One round's outcomes, by engine; ``closed`` once the round has ended."""

    __slots__ = ("closed", "outcomes")

    def __init__(self, outcomes: list[Outcome | None]) -> None:
        self.outcomes = outcomes
        self.closed = False


async def _cancel(fetches: list[asyncio.Future[bytes]]) -> None:
    """Cancel the fetches still running and wait until they are gone (closing their
    connections)."""
    left = [f for f in fetches if not f.done()]
    for fetch in left:
        fetch.cancel()
    for fetch in left:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await fetch
