"""The telemetry loop: scrape every engine's ``/metrics`` on a fixed interval, all at once.

Rules:
- One named task owns the loop; it runs until cancelled and never dies of an engine's failure.
- Every scrape has its own timeout, shorter than the interval (the config enforces it), so one slow
  engine never delays the others or the next round.
- A scrape that fails, times out, answers non-200 or sends unusable text is a failure for that
  engine; what that means for its health is the telemetry state machine's decision, not ours.
- After each round every engine is ticked, so staleness is noticed even when scrapes hang.
- Frozen metrics: an idle engine legitimately repeats its body, but one that completed requests
  for us since it first sent a body cannot (its counters moved). Such a repeat is no news: the
  snapshot keeps the time the body was first seen, so the engine ages into STALE instead of
  passing as idle.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from proxy.config import TelemetryConfig
from proxy.fleet import Engine, Fleet
from proxy.metrics import ProxyMetrics
from proxy.telemetry import MetricsError, parse_metrics

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
    ) -> None:
        self._fleet = fleet
        self._session = session
        self._cfg = cfg
        self._metrics = metrics
        self._clock = clock
        self.rounds = 0
        self._seen: dict[str, _Seen] = {}

    async def run(self) -> None:
        """Scrape forever; cancel the task to stop."""
        while True:
            started = self._clock()
            try:
                await self.scrape_all()
            except Exception:
                # A bug must not end telemetry for good: every engine would silently go stale.
                log.exception("telemetry round failed")
            elapsed = self._clock() - started
            await asyncio.sleep(max(0.0, self._cfg.interval_s - elapsed))

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self._scrape(engine) for engine in self._fleet))
        self._fleet.tick(self._clock(), self._cfg.stale_after_s)
        self.rounds += 1

    async def _scrape(self, engine: Engine) -> None:
        started = self._clock()
        completed = engine.completed
        try:
            async with asyncio.timeout(self._cfg.timeout_s):
                text = await self._fetch(engine.metrics_url)
            snapshot = parse_metrics(text, taken_at=self._news_at(engine, text, started, completed))
        except TimeoutError:
            self._failed(engine, "timeout", "scrape timed out")
        except aiohttp.ClientError as exc:
            self._failed(engine, _reason(exc), str(exc) or type(exc).__name__)
        except MetricsError as exc:
            self._failed(engine, "unparsable", str(exc))
        else:
            if engine.state.consecutive_failures:
                log.info("scrape of %s works again", engine.name)
            engine.state.on_scrape_ok(snapshot, self._clock())
        finally:
            self._metrics.scrape_duration.labels(engine.name).observe(self._clock() - started)

    def _news_at(self, engine: Engine, text: str, started: float, completed: int) -> float:
        """When the information in ``text`` was new (see the frozen-metrics rule)."""
        digest = hash(text)
        seen = self._seen.get(engine.name)
        if seen is not None and seen.digest == digest and completed > seen.completed:
            return seen.since
        # Stamped with the start: dispatches after it may be missing from the text, so they stay
        # counted on top of it rather than vanish.
        self._seen[engine.name] = _Seen(digest, completed, started)
        return started

    async def _fetch(self, url: str) -> str:
        async with self._session.get(url) as resp:
            if resp.status != 200:
                raise _BadStatus(resp.status)
            return await resp.text()

    def _failed(self, engine: Engine, reason: str, detail: str) -> None:
        self._metrics.scrape_failures.labels(engine.name, reason).inc()
        if engine.state.consecutive_failures == 0:
            log.warning("scrape of %s failed: %s", engine.name, detail)
        engine.state.on_scrape_failed(self._clock(), detail)


@dataclass(frozen=True)
class _Seen:
    digest: int
    completed: int
    since: float


class _BadStatus(aiohttp.ClientError):
    def __init__(self, status: int) -> None:
        super().__init__(f"metrics answered HTTP {status}")
        self.status = status


def _reason(exc: aiohttp.ClientError) -> str:
    if isinstance(exc, _BadStatus):
        return f"http_{exc.status}"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect"
    return "transport"
