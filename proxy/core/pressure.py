"""KV overcommit guard: a per-engine pressure level from successive telemetry snapshots.

An engine run with more KV memory promised than it can hold under a burst runs out of KV blocks
and starts preempting (recomputing) running requests: every request on it slows down, critical ones
included. The router cannot take back work an engine already holds, so it must stop adding work
*before* that point. This module decides when, per engine, from what the scraper sees.

Rules:
- Fed one snapshot at a time (``observe``: its time, KV usage and the cumulative preemption
  counter); a snapshot not newer than the last one is ignored. Pure: no clock (``now`` is passed
  in), no I/O.
- Growth: the least-squares slope of KV usage over the snapshots of the last ``window_scrapes``
  scrape intervals. Projected KV = usage now + max(0, slope) x ``horizon_scrapes`` intervals (a
  falling KV earns no credit: what is admitted now still grows).
- Preemptions: deltas of the cumulative counter between successive snapshots. A counter that went
  down was reset (engine restart): its new value is what happened since, as Prometheus' ``rate``
  counts it. A gap longer than ``stale_after_s`` between snapshots restarts the window: nothing
  is measured across a blind spot.
- Levels: ``SHEDDABLE`` (closed to sheddable work) and ``STANDARD`` (closed to standard and
  sheddable). ``critical`` is never closed by pressure alone. A class closes on an engine when its
  projected KV reaches the class's admission threshold (``shed_above``), reason ``kv_overcommit``,
  or when the engine preempts, reason ``preempting``: any preemption in the window closes
  sheddable; preemptions in ``escalate_scrapes`` intervals of the window close standard too.
- Growth this proxy has committed: with commitments known, a projection closing holds only while
  the projection stands above committed KV, i.e. the engine grows by more than everything this
  proxy's requests in flight still owe it (another client's or replica's work). Growth they
  explain is already judged, request by request, against the committed marks; counting it twice
  closed engines after every burst of admissions while their committed KV had room.
- Hysteresis: a KV closing opens again only when projected KV falls below the class's
  ``admit_below``; a preemption closing lasts ``hold_scrapes`` intervals after the last preemption.
- Commitments (``proxy.core.commitment``): the engine's reported usage plus the KV its requests in
  flight from this proxy will still take (``commit``, judged again on every dispatch, not only per
  snapshot): a forecast of the engine's peak, not its usage now, so it has marks of its own
  (``committed_sheddable``, ``committed_standard`` of the config), near the capacity rather than
  at the usage thresholds. A class closes when committed usage reaches its committed mark's
  ``shed_above``, reason ``kv_committed``, and opens again below that mark's ``admit_below``.
  None (capacity unknown): no such signal.
- Evidence: besides the level in force, a ``Pressure`` carries ``evidence``, the level that the
  engine's own figures close (preemptions, or a growth projection closing as above), leaving the
  commitment forecast out, for holding (``proxy.core.holding``) to pace standard work that only
  the forecast still refuses (``pressure.pace_standard``). A remote level counts as evidence
  unless its reason is ``kv_committed``.
- Stale: when the last snapshot is older than ``stale_after_s`` the engine's own level is OPEN;
  stale figures never count as pressure.
- Remote levels (another proxy replica's, through Redis) merge by maximum until they expire.
- ``local`` is read per engine on every admission: it hands back the same ``Pressure`` object
  while what it is built from (the last snapshot's judgement, level, reason, committed figures,
  evidence) compares equal, rather than building an equal one each time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from enum import IntEnum

from proxy.core.config import ClassThreshold, PressureConfig

REASON_PREEMPTING = "preempting"
REASON_OVERCOMMIT = "kv_overcommit"
REASON_COMMITTED = "kv_committed"


class Level(IntEnum):
    """How far an engine is closed; higher closes more classes."""

    OPEN = 0
    SHEDDABLE = 1  # closed to sheddable work
    STANDARD = 2  # closed to standard and sheddable work


@dataclass(frozen=True)
class Pressure:
    """An engine's pressure at one instant (what admission, routing and the admin view see)."""

    level: Level = Level.OPEN
    reason: str | None = None
    projected_kv: float | None = None
    preemptions_per_s: float = 0.0
    remote: bool = False  # the level comes from another replica
    # Reported usage plus what this proxy's in-flight requests still owe (None: unknown), and the
    # engine's KV capacity in tokens, so that admission can tell whether one more would cross.
    committed_kv: float | None = None
    capacity_tokens: int | None = None
    # The level closed by the engine's figures alone (preemptions, unexplained growth), without
    # the commitment forecast (what pacing reads, ``proxy.core.holding.paced``).
    evidence: Level = Level.OPEN


NO_PRESSURE = Pressure()


@dataclass(frozen=True)
class _Sample:
    at: float
    kv: float
    preempted: float  # preemptions since the previous sample


def counter_delta(previous: float, current: float) -> float:
    """Increase of a cumulative counter; a decrease is a reset and counts ``current``."""
    return current - previous if current >= previous else current


def slope(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (time, value) points; 0 with fewer than two distinct times."""
    n = len(samples)
    if n < 2:
        return 0.0
    mean_t = sum(t for t, _ in samples) / n
    mean_v = sum(v for _, v in samples) / n
    var = sum((t - mean_t) ** 2 for t, _ in samples)
    if var <= 0.0:
        return 0.0
    return sum((t - mean_t) * (v - mean_v) for t, v in samples) / var


class PressureTracker:
    """One engine's pressure: its recent snapshots and the hysteresis state of each level."""

    def __init__(
        self,
        cfg: PressureConfig,
        *,
        sheddable: ClassThreshold,
        standard: ClassThreshold,
        interval_s: float,
        stale_after_s: float,
    ) -> None:
        self.cfg = cfg
        self._limits = {Level.SHEDDABLE: sheddable, Level.STANDARD: standard}
        self._committed_limits = {Level.SHEDDABLE: cfg.committed_sheddable,
                                  Level.STANDARD: cfg.committed_standard}
        self._interval_s = interval_s
        self._stale_after_s = stale_after_s
        self._samples: deque[_Sample] = deque(maxlen=max(2, 4 * cfg.window_scrapes))
        self._last: tuple[float, float] | None = None  # (taken_at, preemption counter)
        self._kv_closed = {Level.SHEDDABLE: False, Level.STANDARD: False}
        self._commit_closed = {Level.SHEDDABLE: False, Level.STANDARD: False}
        self._preempt_until = {Level.SHEDDABLE: float("-inf"), Level.STANDARD: float("-inf")}
        self._state = NO_PRESSURE
        self._committed: tuple[float, int | None] | None = None  # committed usage, capacity
        self._remote: tuple[Level, str, float] | None = None  # level, reason, expires at
        # The last ``local`` answer and what it was built from.
        self._built: tuple[object, ...] = ()
        self._local = NO_PRESSURE

    # -- feeding

    def observe(self, taken_at: float, kv_usage: float, preemptions: float) -> None:
        """A snapshot; one not newer than the last is ignored."""
        if self._last is not None and taken_at <= self._last[0]:
            return
        if self._last is None or taken_at - self._last[0] > self._stale_after_s:
            self._samples.clear()  # a blind spot: growth and deltas across it mean nothing
            preempted = 0.0
        else:
            preempted = counter_delta(self._last[1], preemptions)
        self._last = (taken_at, preemptions)
        self._samples.append(_Sample(taken_at, kv_usage, preempted))
        window = self.cfg.window_scrapes * self._interval_s
        while len(self._samples) > 2 and taken_at - self._samples[0].at > window:
            self._samples.popleft()
        self._state = self._judge(taken_at, kv_usage)

    def _judge(self, now: float, kv: float) -> Pressure:
        points = [(s.at - now, s.kv) for s in self._samples]
        projected = kv + max(0.0, slope(points)) * self.cfg.horizon_scrapes * self._interval_s
        preempting = [s for s in self._samples if s.preempted > 0]
        hold = self.cfg.hold_scrapes * self._interval_s
        if preempting:
            self._preempt_until[Level.SHEDDABLE] = now + hold
        if len(preempting) >= self.cfg.escalate_scrapes:
            self._preempt_until[Level.STANDARD] = now + hold
        for level, limits in self._limits.items():
            if projected >= limits.shed_above:
                self._kv_closed[level] = True
            elif projected < limits.admit_below:
                self._kv_closed[level] = False
        span = self._samples[-1].at - self._samples[0].at
        rate = sum(s.preempted for s in self._samples) - self._samples[0].preempted
        rate = rate / span if span > 0 else 0.0
        return Pressure(projected_kv=round(projected, 4), preemptions_per_s=round(rate, 3))

    def commit(self, committed_kv: float | None, capacity_tokens: int | None = None) -> None:
        """What this proxy's in-flight requests commit the engine to (``proxy.core.commitment``):
        reported usage plus the growth they still owe, a fraction of capacity; None: unknown."""
        if committed_kv is None:
            self._committed = None
            self._commit_closed = {Level.SHEDDABLE: False, Level.STANDARD: False}
            return
        self._committed = (committed_kv, capacity_tokens)
        for level, limits in self._committed_limits.items():
            if committed_kv >= limits.shed_above:
                self._commit_closed[level] = True
            elif committed_kv < limits.admit_below:
                self._commit_closed[level] = False

    def _level(self, now: float) -> tuple[Level, str | None]:
        for level in (Level.STANDARD, Level.SHEDDABLE):
            if self._preempt_until[level] > now:
                return level, REASON_PREEMPTING
            if self._kv_closed[level] and self._unexplained():
                return level, REASON_OVERCOMMIT
            if self._commit_closed[level]:
                return level, REASON_COMMITTED
        return Level.OPEN, None

    def _evidence(self, now: float) -> Level:
        """The highest level closed by preemptions or unexplained growth, not by commitments."""
        for level in (Level.STANDARD, Level.SHEDDABLE):
            if self._preempt_until[level] > now or (self._kv_closed[level] and self._unexplained()):
                return level
        return Level.OPEN

    def _unexplained(self) -> bool:
        """Whether the projected growth goes beyond what this proxy's requests in flight still
        owe the engine: always, when commitments are unknown."""
        committed = self._committed
        projected = self._state.projected_kv
        return committed is None or projected is None or projected > committed[0]

    # -- reading

    def local(self, now: float) -> Pressure:
        """This replica's own judgement; OPEN when the last snapshot is stale or missing."""
        if self._last is None or now - self._last[0] > self._stale_after_s:
            return NO_PRESSURE
        # Judged at every read: preemption holds run out and commitments change between snapshots.
        level, reason = self._level(now)
        committed, capacity = self._committed or (None, None)
        # Rounded as the Pressure carries it: the unrounded figure moves with every byte relayed,
        # the rounded one seldom, so the answer is rebuilt only when what it says changes.
        shown = None if committed is None else round(committed, 4)
        evidence = self._evidence(now)
        key = (self._state, level, reason, shown, capacity, evidence)
        if key != self._built:
            # An equal key builds an identical Pressure: its floats are sums with +0.0 (never
            # -0.0, which equals 0.0), and a NaN never equals itself, so it only ever rebuilds.
            # Built field by field (``_judge`` sets only the two figures of ``_state``): the
            # committed figure moves with the bytes relayed, so this runs for most engines on
            # most admissions, and ``dataclasses.replace`` costs twice a plain construction.
            self._built = key
            state = self._state
            self._local = Pressure(level, reason, state.projected_kv, state.preemptions_per_s,
                                   False, shown, capacity, evidence)
        return self._local

    def pressure(self, now: float) -> Pressure:
        """The level in force: this replica's, or another replica's when that one is higher."""
        own = self.local(now)
        remote = self._remote
        if remote is None or remote[2] <= now:
            return own
        if remote[1] != REASON_COMMITTED and remote[0] > own.evidence:
            own = replace(own, evidence=remote[0])  # another replica saw it: evidence too
        if remote[0] <= own.level:
            return own
        return replace(own, level=remote[0], reason=remote[1], remote=True)

    def apply_remote(self, level: Level, reason: str, expires_at: float) -> None:
        """Another replica judged this engine at ``level``; it holds until ``expires_at``."""
        self._remote = (level, reason, expires_at) if level > Level.OPEN else None
