"""Scraping once per machine: one worker of ``kvproxy serve --workers N`` scrapes the engines and
relays what it found to its siblings, which apply it as if they had scraped.

Rules:
- Who scrapes is ``proxy.core.scrape_relay.Sources``' rule: per engine, the lowest-index worker
  that is scraping it; every other worker follows it while its outcomes keep arriving and takes
  over by itself ``hold_s`` after they stop. A worker rather than the parent, because a scrape
  needs what only a serving worker has (the fleet, Redis-registered engines included; the
  frozen-metrics proof from completed requests; the loop-lag judgement of a missed timeout), and
  because the takeover then needs no election, no control message and no new process role: a
  worker that dies, restarts, loses the hub or cannot scrape on time is replaced by the next one
  within ``hold_s``, and an engine only one worker knows (registered a moment ago) is scraped by
  the worker that knows it.
- The scraper skips the engines this worker follows (``follows``) and publishes what it did scrape
  (``publish``): snapshots parsed and checked, with the digest of their text; failures with their
  reason. Nothing is relayed for a scrape this worker was too busy to finish.
- Received outcomes (``receive``) are applied through the same ``EngineState`` transitions as an
  own scrape: a snapshot after this worker's own frozen-metrics proof (its completed requests; a
  repeat it proves frozen is a failed scrape here, counted as ``frozen``), a failure as a failed
  scrape. Scrape counts and durations are the scraping worker's only, so the merged ``/metrics``
  counts each scrape once. Relayed outcomes are counted by result in
  ``kvproxy_scrape_relayed_total``.
- Freshness: a relayed snapshot carries the time its scrape began, as an own one does (the workers
  of a machine share CLOCK_MONOTONIC), so an engine's age reads the same in every worker, older
  than an own scrape's by the hub's delay only. A gap in the relay never makes an engine STALE by
  itself (staleness needs a failed scrape, ``EngineState.tick``); after ``hold_s`` without
  outcomes this worker scrapes the engine itself. ``hold_s`` is three scrape intervals: a round
  that runs into its timeouts, even twice (``Scraper._fetch_in_time``), still lands inside it.
- Hostile input: messages are decoded by ``scrape_relay.decode`` (bounded, validated); outcomes
  for an engine this worker does not have, about another metrics URL than its own for that name,
  from a sibling it does not follow, or begun in the future are dropped.
- KV events (precise mode) are not relayed: each worker subscribes to every engine's publisher
  itself (a ZMQ publisher fans out to every subscriber; each worker decodes the events). With
  ``bind = true`` only one worker can bind the endpoint (the others retry and route by the
  approximate index): precise mode with several workers wants publishers the proxy connects to.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Sequence

from proxy.core.scrape_relay import BadRelay, Outcome, SnapshotMemo, Sources, decode, encode
from proxy.core.telemetry import EngineSnapshot
from proxy.fleet.engines import Engine, Fleet
from proxy.observe.metrics import ProxyMetrics

log = logging.getLogger(__name__)

HOLD_INTERVALS = 3
# A relayed scrape may begin this much after this worker's now (the two read the clock apart).
_FUTURE_S = 1.0
FROZEN = "frozen metrics: unchanged although requests completed"


def url_print(engine: Engine) -> int:
    """The fingerprint of the metrics URL ``engine`` is scraped at."""
    return zlib.crc32(engine.metrics_url.encode())


class ScrapeShare:
    """This worker's side: which engines to leave to a sibling, what to relay, what to apply."""

    def __init__(self, fleet: Fleet, metrics: ProxyMetrics, clock: Callable[[], float], *,
                 index: int, workers: int, interval_s: float, max_bytes: int,
                 send: Callable[[bytes], bool]) -> None:
        self._fleet = fleet
        self._metrics = metrics
        self._clock = clock
        self.index = index
        self._workers = workers
        self._settle_s = interval_s / 2
        self._max_bytes = max_bytes
        self._send = send
        self.sources = Sources(index, HOLD_INTERVALS * interval_s)
        # An idle engine's figures repeat: those already checked are not checked again.
        self._memo = SnapshotMemo()
        self._relayed = metrics.scrape_relayed

    def follows(self, engine: Engine, now: float) -> bool:
        return self.sources.follows(engine.name, now)

    def publish(self, outcomes: Sequence[Outcome]) -> None:
        """Relay this round's own outcomes; lost when the hub cannot take them (a sibling then
        takes over after ``hold_s``)."""
        if not outcomes or self._workers < 2:
            return
        for payload in encode(self.index, outcomes):
            if len(payload) > self._max_bytes or not self._send(payload):
                self._relayed.labels("unsent").inc(len(outcomes))
                return
        self._relayed.labels("sent").inc(len(outcomes))

    def receive(self, payload: bytes) -> None:
        """Apply a sibling's outcomes (the hub's callback: never raises)."""
        try:
            sender, outcomes = decode(payload, max_bytes=self._max_bytes,
                                      workers=self._workers, memo=self._memo)
        except BadRelay as exc:
            self._relayed.labels("invalid").inc()
            log.debug("scrape outcomes from a sibling dropped: %s", exc)
            return
        now = self._clock()
        for outcome in outcomes:
            self._relayed.labels(self._apply(sender, outcome, now)).inc()

    def _apply(self, sender: int, o: Outcome, now: float) -> str:
        """Apply one outcome; the result it is counted as."""
        engine = self._fleet.live(o.engine)
        if engine is None:
            return "ignored"
        if o.url != url_print(engine) or o.started > now + _FUTURE_S:
            return "ignored"
        if not self.sources.accept(sender, o.engine, now):
            return "ignored"
        state = engine.state
        if o.snapshot is None:
            # A sibling's timeout proves the engine slow, not broken, as the worker's own does,
            # and this worker's own requests answered since say it is alive.
            unanswered = o.reason == "timeout"
            if unanswered and engine.heard_since_last_look():
                state.on_answering(now)
            state.on_scrape_failed(now, o.detail, unanswered=unanswered)
        elif not state.body_is_news(o.digest, o.started, o.fetched_at, settle_s=self._settle_s):
            self._metrics.scrape_failures.labels(engine.name, "frozen").inc()
            state.on_scrape_failed(now, FROZEN)
        else:
            state.on_scrape_ok(o.snapshot, now)
        return "applied"

    def forget_removed(self) -> None:
        """Forget engines no longer in the fleet (called each round; costs only after a removal)."""
        if len(self.sources) > len(self._fleet):
            self.sources.forget(e.name for e in self._fleet)


def ok_outcome(engine: Engine, snapshot: EngineSnapshot, digest: int,
               fetched_at: float) -> Outcome:
    return Outcome(engine.name, url_print(engine), snapshot.taken_at, fetched_at, digest, snapshot)


def failed_outcome(engine: Engine, started: float, fetched_at: float, reason: str,
                   detail: str) -> Outcome:
    return Outcome(engine.name, url_print(engine), started, max(started, fetched_at), 0, None,
                   reason[:200], detail[:200])
