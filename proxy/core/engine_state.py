"""What the proxy knows about one engine: its health state machine, freshness and in-flight load.

Rules (pure, no I/O; no clock is read here: callers pass ``now``):
- An engine whose snapshot (``proxy.core.telemetry``) is older than ``stale_after_s`` with at least
  one failed scrape since (no successful scrape recently) is STALE: neither idle nor full, routable
  only when no engine is fresh. Age alone is not enough: a proxy too busy to scrape on time must
  not hold that against its engines.
- Frozen metrics: an idle engine legitimately repeats its text. A repeat proves the exporter stuck
  only when a request dispatched after the previous text was fetched completed before this scrape
  began (the engine counted it in between); ``body_is_news`` says so, and the caller treats it as
  a failed scrape, so the engine recovers by itself on the next scrape not proven frozen.
- A scrape that timed out is not a failing engine's answer but a missing one: a busy engine (or
  the busy process hosting it) answers late, alive. Timeouts alone call an engine UNHEALTHY only
  once it has answered nothing for ``unhealthy_after_failures`` stale periods (``silent_limit_s``);
  before that it is STALE, still routable. Answers on the data plane count too (first bytes,
  whole answers, and ``on_answering`` for a stream's bytes): an engine streaming answers to this
  proxy is alive, however late its metrics come (an engine's HTTP server saturated by its own
  streams answers a scrape last), so it stays STALE while it serves, and goes UNHEALTHY once both
  fall silent (a hung engine answers neither). Errors it answers (5xx, garbage, frozen text,
  refused connections) count at once: a whole fleet that is merely slow never reads as down.
- Health moves only along the transition table; any other move raises ``IllegalTransition``;
  ``health_reason`` says why an engine is not HEALTHY.
- Load between scrapes is ``running + waiting`` of the last snapshot plus the requests dispatched
  after that snapshot was taken and still open, so a burst does not pile onto an engine that looked
  idle a moment ago.
- Other proxy processes' requests count too: ``remote_pending`` (their requests sent since their
  own last snapshot, set by ``proxy.tenancy.shared_routing``) adds to the load like this proxy's,
  and ``remote_backlog`` (their requests without a first byte: prompt tokens still to compute,
  how many, how many their snapshots counted) to the prefill backlog the cost model queues a
  request behind, exactly as this proxy's own: otherwise N replicas each see 1/N of a burst and
  pile it onto one engine until the next scrape, and after it see the others' long prompts in
  chunked prefill only as running sequences. Their snapshots and this one are not taken at the
  same instant: for up to one interval a request may count twice (an over-count) or be missed.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from enum import Enum

from proxy.core.pressure import NO_PRESSURE, Pressure
from proxy.core.rates import EngineRates, update_rates
from proxy.core.routeview import EngineView
from proxy.core.sharing import NO_BACKLOG, Backlog
from proxy.core.telemetry import EngineSnapshot

# Completions remembered for the frozen-metrics proof; those between two scrapes are what counts.
_COMPLETIONS_KEPT = 4096


# --- engine health state machine -----------------------------------------------------------------


class Health(Enum):
    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    STALE = "stale"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"


class HealthEvent(Enum):
    SCRAPED = "scraped"  # a usable snapshot from a ready engine
    SCRAPED_DRAINING = "scraped_draining"  # a usable snapshot saying draining / not ready
    FAILED = "failed"  # scrapes failed unhealthy_after_failures times in a row
    AGED = "aged"  # the last snapshot became older than stale_after_s


class IllegalTransition(RuntimeError):
    """A health event that the transition table does not allow from the current state."""


_H = Health
_E = HealthEvent
TRANSITIONS: dict[tuple[Health, HealthEvent], Health] = {
    **{(s, _E.SCRAPED): _H.HEALTHY for s in _H},
    **{(s, _E.SCRAPED_DRAINING): _H.DRAINING for s in _H},
    **{(s, _E.FAILED): _H.UNHEALTHY for s in _H},
    (_H.HEALTHY, _E.AGED): _H.STALE,
}


class EngineState:
    """What the proxy knows about one engine: last snapshot, health and requests in flight."""

    def __init__(
        self,
        name: str,
        pool: str,
        url: str,
        *,
        stale_after_s: float = 1.0,
        unhealthy_after_failures: int = 3,
    ) -> None:
        self.name = name
        self.pool = pool
        self.url = url
        self.snapshot: EngineSnapshot | None = None
        self.health = Health.UNKNOWN
        self.stale_after_s = stale_after_s
        self.unhealthy_after_failures = unhealthy_after_failures
        self.consecutive_failures = 0
        self.last_error: str | None = None
        self.open_requests = 0
        self.completed = 0  # requests this proxy saw the engine answer in full
        self.answered_at: float | None = None  # when the data plane was last seen answering
        # What the other proxy processes report in flight here (``proxy.core.sharing``): sent
        # since their last snapshot (counted in the load), and open in all.
        self.remote_pending = 0.0
        self.remote_open = 0.0
        self.remote_backlog = NO_BACKLOG
        # ticket -> dispatch time (None: unknown, counted until the next snapshot of any age).
        self._since_snapshot: dict[int, float | None] = {}
        # Per open ticket: prompt tokens the engine is expected to prefill, until the first byte.
        self._prefill: dict[int, float] = {}
        # ``backlog`` is read per engine on every admission: kept until the tickets or the
        # snapshot change (``_tickets_changed`` counts the changes).
        self._tickets_changed = 0
        self._backlog: tuple[int, EngineSnapshot | None, Backlog] = (-1, None, NO_BACKLOG)
        # ``view``'s last answer and what it was built from.
        self._view_key: tuple[object, ...] = ()
        self._view: EngineView | None = None
        self._next_ticket = 0
        # What proves a repeated metrics text frozen (``body_is_news``): open tickets' dispatch
        # times, recent completions as (dispatched, completed), and the last text as (digest,
        # fetched at).
        self._dispatched_at: dict[int, float] = {}
        self._completions: deque[tuple[float, float]] = deque(maxlen=_COMPLETIONS_KEPT)
        self._last_body: tuple[int, float] | None = None
        self.rates = EngineRates()
        # Told when a request opens here: wakes a quiet sharing round (``shared_routing``),
        # which sleeps only while nothing is open. Must be cheap and must not raise.
        self.on_open: Callable[[], None] | None = None

    # -- transitions

    def _move(self, event: HealthEvent) -> None:
        try:
            self.health = TRANSITIONS[(self.health, event)]
        except KeyError:
            raise IllegalTransition(
                f"{self.name}: {event.value} from {self.health.value}"
            ) from None

    def on_scrape_ok(self, snap: EngineSnapshot, now: float) -> None:
        """A fresh snapshot; dispatches it already includes stop counting extra."""
        if self.snapshot is not None and snap.taken_at < self.snapshot.taken_at:
            return  # a late answer to an older scrape must not replace a newer snapshot
        self.rates = update_rates(self.rates, self.snapshot, snap)
        self.snapshot = snap
        self.consecutive_failures = 0
        self.last_error = None
        self._since_snapshot = {
            t: at for t, at in self._since_snapshot.items() if at is not None and at > snap.taken_at
        }
        draining = snap.draining or not snap.ready
        self._move(HealthEvent.SCRAPED_DRAINING if draining else HealthEvent.SCRAPED)
        self.tick(now, self.stale_after_s)

    def on_scrape_failed(
        self, now: float, error: str | None = None, *, unanswered: bool = False
    ) -> None:
        """A scrape failed; after enough failures in a row the engine is unhealthy.

        ``unanswered``: the engine said nothing wrong, it only did not answer in time (a
        timeout). That proves it slow, not broken: it counts toward unhealthy only once the
        engine has been silent for ``silent_limit_s`` too; until then it ages into STALE."""
        self.consecutive_failures += 1
        self.last_error = error
        failed = self.consecutive_failures >= self.unhealthy_after_failures
        if failed and not (unanswered and self.silence(now) < self.silent_limit_s):
            self._move(HealthEvent.FAILED)
        else:
            self.tick(now, self.stale_after_s)

    def on_answering(self, now: float) -> None:
        """The engine was seen answering requests at ``now`` (first bytes, whole answers, or
        bytes of a stream), whatever its metrics endpoint does."""
        self.answered_at = now

    def silence(self, now: float) -> float:
        """Seconds since the engine was last heard from: a snapshot, or an answer."""
        age = self.snapshot_age(now)
        if self.answered_at is None:
            return age
        return min(age, max(0.0, now - self.answered_at))

    @property
    def silent_limit_s(self) -> float:
        """How long an engine may answer no scrape at all before it counts as gone: as many
        stale periods as the failures in a row that call an engine unhealthy."""
        return self.stale_after_s * self.unhealthy_after_failures

    def tick(self, now: float, stale_after_s: float) -> None:
        """Age the snapshot: a HEALTHY engine whose snapshot is too old becomes STALE, once a
        scrape since it has failed (a snapshot that is old only because the proxy was too busy
        to scrape on time says nothing against the engine)."""
        if (
            self.health is Health.HEALTHY
            and self.consecutive_failures > 0
            and self.snapshot_age(now) > stale_after_s
        ):
            self._move(HealthEvent.AGED)

    def body_is_news(
        self, digest: int, started: float, fetched_at: float, settle_s: float = 0.0
    ) -> bool:
        """Record the metrics text fetched at ``fetched_at`` by a scrape begun at ``started``.

        False when it repeats the previous text although a request dispatched after that text
        was fetched completed at least ``settle_s`` before this scrape began: the engine counted
        that request in between, so an unchanged text is frozen. Anything else is news, idle
        repeats included. ``settle_s`` gives an exporter that counts a request a moment after
        answering it (vLLM records its stats after handing the output over) time to do so.
        """
        previous, self._last_body = self._last_body, (digest, fetched_at)
        if previous is None:
            return True
        since = previous[1]
        # Completions dispatched before the previous text can prove nothing any more (an idle
        # engine has none: nothing to rebuild, five times a second).
        if self._completions:
            self._completions = deque(
                (c for c in self._completions if c[0] > since), maxlen=_COMPLETIONS_KEPT
            )
        if previous[0] != digest:
            return True
        return not any(done < started - settle_s for _, done in self._completions)

    # -- in-flight accounting

    def on_dispatch(self, now: float | None = None, prefill: float = 0.0) -> int:
        """Count a request sent to this engine; returns the ticket to settle it with.

        ``prefill``: the prompt tokens it is expected to compute (not in the engine's cache);
        they count as pending until its first byte."""
        self._next_ticket += 1
        self._tickets_changed += 1
        self._since_snapshot[self._next_ticket] = now
        if now is not None:
            self._dispatched_at[self._next_ticket] = now
        if prefill > 0:
            self._prefill[self._next_ticket] = prefill
        self.open_requests += 1
        if self.on_open is not None:
            self.on_open()
        return self._next_ticket

    def on_complete(self, ticket: int, now: float) -> None:
        """The engine answered the request in full, so its metrics have counted it by now."""
        self.completed += 1
        self.answered_at = now
        dispatched = self._dispatched_at.get(ticket)
        if dispatched is not None:
            self._completions.append((dispatched, now))

    def on_first_byte(self, ticket: int, now: float | None = None) -> None:
        """The engine answered: the request's prompt is computed, its prefill no longer pending
        (and, given ``now``, the engine was heard from then)."""
        self._prefill.pop(ticket, None)
        self._tickets_changed += 1
        if now is not None:
            self.answered_at = now

    def on_settle(self, ticket: int | None = None) -> None:
        """The request finished (any outcome).

        Without its ticket a request dispatched since the snapshot stays counted until the next
        snapshot, which over-counts briefly rather than letting a burst through.
        """
        self.open_requests = max(0, self.open_requests - 1)
        if ticket is not None:
            self._tickets_changed += 1
            self._since_snapshot.pop(ticket, None)
            self._prefill.pop(ticket, None)
            self._dispatched_at.pop(ticket, None)

    @property
    def inflight(self) -> int:
        """Requests sent to this engine by this proxy and not settled yet."""
        return self.open_requests

    @property
    def dispatched_since_snapshot(self) -> int:
        return len(self._since_snapshot)

    @property
    def backlog(self) -> Backlog:
        """This proxy's requests here without a first byte, as the other processes weigh them."""
        changed, snap, backlog = self._backlog
        if changed != self._tickets_changed or snap is not self.snapshot:
            prefill = self._prefill
            backlog = Backlog(sum(prefill.values()), float(len(prefill)),
                              float(self._pending_seen()))
            self._backlog = (self._tickets_changed, self.snapshot, backlog)
        return backlog

    # -- views

    @property
    def health_reason(self) -> str | None:
        """Why the engine is not HEALTHY, in words for the admin view; None when it is."""
        health, error, snap = self.health, self.last_error, self.snapshot
        if health is Health.HEALTHY:
            return None
        if health is Health.DRAINING:
            return "draining" if snap is not None and snap.draining else "not ready"
        if health is Health.STALE:
            return "no successful scrape recently" + (f": {error}" if error else "")
        if health is Health.UNKNOWN:
            return error or "not scraped yet"
        return error or "scrapes failed"

    def snapshot_age(self, now: float) -> float:
        return math.inf if self.snapshot is None else max(0.0, now - self.snapshot.taken_at)

    def load(self) -> float:
        base = 0.0 if self.snapshot is None else self.snapshot.running + self.snapshot.waiting
        return base + len(self._since_snapshot) + self.remote_pending

    def _pending_seen(self) -> int:
        """Requests awaiting their first byte that the snapshot already counts (sent before it)."""
        snap = self.snapshot
        if snap is None:
            return 0
        at = self._dispatched_at
        return sum(1 for t in self._prefill if at.get(t, math.inf) <= snap.taken_at)

    def view(self, now: float, breaker_allows: bool,
             pressure: Pressure = NO_PRESSURE) -> EngineView:
        """What routing and admission see of this engine at ``now`` (``pressure``: the KV
        overcommit guard's level in force)."""
        self.tick(now, self.stale_after_s)
        snap, local, remote = self.snapshot, self.backlog, self.remote_backlog
        # Admission asks every engine of the pool for its view on every request, and most of
        # them have not changed since the last one: the same inputs give back the same (frozen)
        # view instead of building an equal one.
        key = (self.health, breaker_allows, pressure, self.load(), snap, local, remote,
               self.rates)
        if key == self._view_key and self._view is not None:
            return self._view
        self._view_key = key
        self._view = EngineView(
            name=self.name,
            pressure=pressure,
            routable=self.health in (Health.HEALTHY, Health.STALE) and breaker_allows,
            fresh=self.health is Health.HEALTHY,
            load=key[3],
            kv_usage=snap.kv_usage if snap is not None else 1.0,
            prefill=local.tokens + remote.tokens,
            remote_prefill=remote.tokens,
            block_size=snap.block_size if snap is not None else None,
            running=snap.running if snap is not None else 0.0,
            waiting=snap.waiting if snap is not None else 0.0,
            pending=int(local.requests + remote.requests),
            pending_seen=int(local.seen + remote.seen),
            prefill_tps=self.rates.prefill_tps,
            step_s=self.rates.step_s,
        )
        return self._view
