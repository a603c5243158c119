"""Engine telemetry: parsing an engine's Prometheus text, and each engine's health state machine.

Rules:
- ``parse_metrics`` reads only the families the proxy uses; everything else is skipped before its
  labels are parsed (it runs every 200 ms per engine). Samples are summed over the ``engine`` label
  (data-parallel ranks); KV usage, a fraction, is averaged instead. ``vllm:kv_cache_usage_perc`` is
  preferred, ``vllm:gpu_cache_usage_perc`` (vLLM <= 0.10) is the fallback. NaN samples are ignored.
- The text comes from outside and is not believed blindly: a negative or infinite sample of a
  family we read, a KV usage above 1 (plus ``KV_SLACK``) or more than ``MAX_REQUESTS`` running or
  waiting makes the whole snapshot unusable (``ImplausibleMetrics``); routing on part of a lying
  exposition would be worse than routing without it.
- A snapshot carries the time it was taken. An engine whose snapshot is older than ``stale_after_s``
  with at least one failed scrape since (no successful scrape recently) is STALE: neither idle nor
  full, routable only when no engine is fresh. Age alone is not enough: a proxy too busy to scrape
  on time must not hold that against its engines.
- Frozen metrics: an idle engine legitimately repeats its text. A repeat proves the exporter stuck
  only when a request dispatched after the previous text was fetched completed before this scrape
  began (the engine counted it in between); ``body_is_news`` says so, and the caller treats it as
  a failed scrape, so the engine recovers by itself on the next scrape not proven frozen.
- Health moves only along the transition table; any other move raises ``IllegalTransition``;
  ``health_reason`` says why an engine is not HEALTHY.
- Load between scrapes is ``running + waiting`` of the last snapshot plus the requests dispatched
  after that snapshot was taken and still open, so a burst does not pile onto an engine that looked
  idle a moment ago. No clock is read here: callers pass ``now``.
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
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from proxy.core.pressure import NO_PRESSURE, Pressure
from proxy.core.rates import EngineRates, update_rates
from proxy.core.routeview import EngineView
from proxy.core.sharing import NO_BACKLOG, Backlog

# Bounds past which a figure is a lie or a bug, not a reading: KV usage is a 0-1 fraction (a little
# rounding slack allowed); an engine runs hundreds of sequences, a million queued is already absurd.
KV_SLACK = 0.01
MAX_REQUESTS = 1_000_000.0
# Cache-config figures outside this range are ignored rather than believed.
_MAX_INFO_INT = 1 << 31
# Completions remembered for the frozen-metrics proof; those between two scrapes are what counts.
_COMPLETIONS_KEPT = 4096


class MetricsError(ValueError):
    """The metrics text cannot be used (missing KV usage, running or waiting)."""

    reason = "unparsable"  # the scrape-failure label


class ImplausibleMetrics(MetricsError):
    """A figure no engine can report: negative, infinite, KV usage above 1, absurd queues."""

    reason = "out_of_range"


@dataclass(frozen=True)
class EngineSnapshot:
    taken_at: float
    kv_usage: float
    running: float
    waiting: float
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    preemptions: float = 0.0
    spec_drafts: float = 0.0
    spec_draft_tokens: float = 0.0
    spec_accepted: float = 0.0
    draining: bool = False
    ready: bool = True
    # Histogram sums and counts for the engine's own rates (``proxy.core.rates``); None: absent.
    prefill_tokens_sum: float | None = None
    prefill_seconds_sum: float | None = None
    itl_sum: float | None = None
    itl_count: float | None = None


# sample name -> snapshot field. Counters appear with ``_total``; bare names are accepted as well.
_SUMMED: dict[str, str] = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:gpu_prefix_cache_queries_total": "prefix_queries_legacy",
    "vllm:gpu_prefix_cache_hits_total": "prefix_hits_legacy",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:spec_decode_num_drafts_total": "spec_drafts",
    "vllm:spec_decode_num_draft_tokens_total": "spec_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "spec_accepted",
    "vllm:request_prefill_kv_computed_tokens_sum": "prefill_tokens_sum",
    "vllm:request_prefill_time_seconds_sum": "prefill_seconds_sum",
    "vllm:inter_token_latency_seconds_sum": "itl_sum",
    "vllm:inter_token_latency_seconds_count": "itl_count",
    "kvproxy_sidecar_draining": "draining",
    "kvproxy_sidecar_ready": "ready",
}
_SUMMED.update(
    {k.removesuffix("_total"): v for k, v in list(_SUMMED.items()) if k.endswith("_total")}
)
_MEANED: dict[str, str] = {
    "vllm:kv_cache_usage_perc": "kv",
    "vllm:gpu_cache_usage_perc": "kv_legacy",
}
_INFO = "vllm:cache_config_info"
_WANTED = frozenset(_SUMMED) | frozenset(_MEANED) | {_INFO}
# str.startswith with a tuple runs in C: most lines (histogram buckets, help text) are dropped
# before any Python-level parsing. Samples are expected at the start of a line, as exporters write.
_PREFIXES = tuple(sorted(_WANTED))
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return (
        value.replace("\\\\", "\x00").replace('\\"', '"').replace("\\n", "\n").replace("\x00", "\\")
    )


def parse_labels(text: str) -> dict[str, str]:
    """Labels of one sample's ``{...}`` body (without the braces), escapes undone."""
    return {m.group(1): _unescape(m.group(2)) for m in _LABEL_RE.finditer(text)}


def _info_int(labels: dict[str, str], key: str) -> int | None:
    try:
        value = int(float(labels[key]))
    except (KeyError, ValueError, OverflowError):
        return None
    return value if 0 < value <= _MAX_INFO_INT else None


def _check_sample(name: str, value: float) -> None:
    """Every family we read is non-negative and finite; a KV usage sample is at most 1."""
    if value < 0 or math.isinf(value):
        raise ImplausibleMetrics(f"{name} is {value:g}")
    if name in _MEANED and value > 1.0 + KV_SLACK:
        raise ImplausibleMetrics(f"{name} is {value:g}, above 1")


def _split_sample(line: str) -> tuple[str, str, str] | None:
    """(name, label text, value text) of a sample line, or None when it is not one."""
    brace = line.find("{")
    space = line.find(" ")
    if brace < 0 or 0 <= space < brace:
        parts = line.split()
        return (parts[0], "", parts[1]) if len(parts) >= 2 else None
    # Label values may contain anything, but the value and timestamp after the set cannot hold "}".
    close = line.rfind("}")
    rest = line[close + 1 :].split()
    if close < brace or not rest:
        return None
    return line[:brace].rstrip(), line[brace + 1 : close], rest[0]


def _collect(text: str) -> tuple[dict[str, float], dict[str, list[float]], dict[str, str]]:
    sums: dict[str, float] = {}
    means: dict[str, list[float]] = {}
    info: dict[str, str] = {}
    for line in text.split("\n"):
        if not line.startswith(_PREFIXES):
            continue
        sample = _split_sample(line)
        if sample is None or sample[0] not in _WANTED:
            continue  # a longer name that merely starts like a wanted one
        name, labels, value_text = sample
        if name == _INFO:
            info = parse_labels(labels)
            continue
        try:
            value = float(value_text)
        except ValueError:
            continue
        if math.isnan(value):
            continue
        _check_sample(name, value)
        if name in _MEANED:
            means.setdefault(_MEANED[name], []).append(value)
        else:
            key = _SUMMED[name]
            sums[key] = sums.get(key, 0.0) + value
    return sums, means, info


def parse_metrics(text: str, *, taken_at: float) -> EngineSnapshot:
    """The snapshot in ``text`` (Prometheus text format); ``MetricsError`` if it is unusable."""
    sums, means, info = _collect(text)
    kv_samples = means.get("kv") or means.get("kv_legacy")
    if not kv_samples:
        raise MetricsError("no vllm:kv_cache_usage_perc or vllm:gpu_cache_usage_perc")
    for need in ("running", "waiting"):
        if need not in sums:
            raise MetricsError(f"no vllm:num_requests_{need}")
        if sums[need] > MAX_REQUESTS:
            raise ImplausibleMetrics(f"vllm:num_requests_{need} is {sums[need]:g}")
    return EngineSnapshot(
        taken_at=taken_at,
        kv_usage=sum(kv_samples) / len(kv_samples),
        running=sums["running"],
        waiting=sums["waiting"],
        prefix_queries=sums.get("prefix_queries", sums.get("prefix_queries_legacy", 0.0)),
        prefix_hits=sums.get("prefix_hits", sums.get("prefix_hits_legacy", 0.0)),
        block_size=_info_int(info, "block_size"),
        num_gpu_blocks=_info_int(info, "num_gpu_blocks"),
        preemptions=sums.get("preemptions", 0.0),
        spec_drafts=sums.get("spec_drafts", 0.0),
        spec_draft_tokens=sums.get("spec_draft_tokens", 0.0),
        spec_accepted=sums.get("spec_accepted", 0.0),
        draining=sums.get("draining", 0.0) > 0,
        ready=sums.get("ready", 1.0) > 0,
        prefill_tokens_sum=sums.get("prefill_tokens_sum"),
        prefill_seconds_sum=sums.get("prefill_seconds_sum"),
        itl_sum=sums.get("itl_sum"),
        itl_count=sums.get("itl_count"),
    )


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

    def on_scrape_failed(self, now: float, error: str | None = None) -> None:
        """A scrape failed; after enough failures in a row the engine is unhealthy."""
        self.consecutive_failures += 1
        self.last_error = error
        if self.consecutive_failures >= self.unhealthy_after_failures:
            self._move(HealthEvent.FAILED)
        else:
            self.tick(now, self.stale_after_s)

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
        # Completions dispatched before the previous text can prove nothing any more.
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
        dispatched = self._dispatched_at.get(ticket)
        if dispatched is not None:
            self._completions.append((dispatched, now))

    def on_first_byte(self, ticket: int) -> None:
        """The engine answered: the request's prompt is computed, its prefill no longer pending."""
        self._prefill.pop(ticket, None)
        self._tickets_changed += 1

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
