"""Holding: standard and sheddable work waits for room on a pool before it is refused.

The KV overcommit guard closes an engine to low-priority work while what this proxy's requests in
flight still owe it (``proxy.core.commitment``) stands above the class's committed mark. That KV
drains by itself, answer by answer, within seconds: a request refused at that moment would find
room if it came back a little later, and a client told ``Retry-After`` only comes back a bounded
number of times, often too early, and then gives up. So the proxy keeps such a request for a
bounded time and admits it as soon as there is room ("low-priority work slowed before refused").

Rules:
- Only a refusal for load is held: the pool's KV committed (``kv_committed``), projected
  (``kv_overcommit``) or used (``kv_pressure``) past the class's mark, or its engines preempting
  (``preempting``), and only while this proxy has answers in flight on the pool: each that ends
  frees room, so the closing passes. With none in flight nothing the proxy can see will change
  it (the load is another client's), and the request is refused at once, as it is when it is
  refused for anything but load (no engine, stale telemetry, connections full).
- Per pool, a bounded queue (``pressure.hold_max_requests``), FIFO within a class; critical work is
  never held (it is never closed by commitments). A class whose bound is 0 is never held.
- A request is held at most its class's bound (``pressure.hold_standard_s`` /
  ``hold_sheddable_s``), never past the client's own deadline less ``DEADLINE_MARGIN_S`` (it
  needs time to be answered); with no time left, or the queue full, it is refused at once.
- Order: a new request of a class queues behind the held requests of its class and of every class
  before it (standard before sheddable), so a late arrival does not overtake work waiting longer.
  Only the head of each class's queue tries admission again; when it gets in, the next one tries.
- Pacing (``pressure.pace_standard``): a standard request still refused when its time is up,
  and refused only by the commitment forecast (``kv_committed``), is admitted to the engines the
  hard evidence leaves open to it (``paced``): fresh and routable, no preemptions or unexplained
  growth closing it even to sheddable work (``Pressure.evidence`` OPEN), KV usage and its
  projection under the class's threshold, the class not shedding by threshold. Committed KV
  assumes every request in flight runs to its expected length before any ends, which argues that
  it overstates the peak; measured, it is close to it, so pacing is off by default. Sheddable
  work is refused as before; critical is never held.
- A held request that is still refused when its time is up gets 503 with ``Retry-After``: the
  time the pool's flights are expected to need to free the room it lacked (``drain_s``), at least
  1 s and at most ``MAX_RETRY_AFTER_S``.
- Pure: no clock (``now`` is passed in), no I/O, no asyncio; the shell (``proxy.server.admit``)
  does the waiting.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from proxy.core.admission import REASON_KV, Admission, Priority, kv_share
from proxy.core.config import PressureConfig
from proxy.core.pressure import (
    REASON_COMMITTED,
    REASON_OVERCOMMIT,
    REASON_PREEMPTING,
    Level,
)
from proxy.core.routing import EngineView

# The reasons a refusal may be held for (see the rules above).
HOLDABLE = frozenset({REASON_COMMITTED, REASON_OVERCOMMIT, REASON_KV, REASON_PREEMPTING})
REASON_HOLD_FULL = "hold_queue_full"
# A held request leaves at least this long before the client's deadline, to be answered in it.
DEADLINE_MARGIN_S = 1.0
MAX_RETRY_AFTER_S = 60
# Classes in the order they are served from the queue; critical is never held.
ORDER = (Priority.STANDARD, Priority.SHEDDABLE)
# The drain rate is measured over the answers that ended within this many seconds.
DRAIN_WINDOW_S = 10.0


@dataclass(frozen=True)
class Hold:
    """Keep the request until ``until`` at the latest."""

    until: float


@dataclass(frozen=True)
class Refuse:
    """Refuse the request now; ``reason`` is the shed reason to report."""

    reason: str


def holdable(reason: str, in_flight: int) -> bool:
    """Whether a refusal for ``reason`` may wait, with ``in_flight`` answers of this proxy on the
    pool (what frees its room)."""
    return reason in HOLDABLE and in_flight > 0


def hold_bound(cfg: PressureConfig, cls: Priority) -> float:
    """The longest a request of ``cls`` is held; 0: never."""
    if cls is Priority.STANDARD:
        return cfg.hold_standard_s
    return cfg.hold_sheddable_s if cls is Priority.SHEDDABLE else 0.0


def committed_mark(cfg: PressureConfig, cls: Priority) -> float | None:
    """The committed-KV mark that closes an engine to ``cls``; None: never closed by it."""
    if cls is Priority.STANDARD:
        return cfg.committed_standard.shed_above
    return cfg.committed_sheddable.shed_above if cls is Priority.SHEDDABLE else None


def paced(admission: Admission, pool: str, cls: Priority, reason: str,
          views: Sequence[EngineView]) -> list[EngineView]:
    """The engines a request of ``cls`` refused for ``reason`` at the end of its hold goes to
    anyway (empty: it is refused): for standard work refused only by the commitment forecast,
    those that no hard evidence closes and whose KV, now and projected, is under the threshold."""
    if cls is not Priority.STANDARD or reason != REASON_COMMITTED or admission.shedding(pool, cls):
        return []
    limit = admission.threshold(cls).shed_above
    return [v for v in views if v.routable and v.fresh and v.pressure.evidence is Level.OPEN
            and max(v.kv_usage, v.pressure.projected_kv or 0.0) < limit]


def room_short(views: Sequence[EngineView], mark: float | None, need_tokens: float,
               usage_mark: float | None = None) -> float | None:
    """KV tokens the emptiest fresh engine must free before a request needing ``need_tokens``
    fits under the committed ``mark`` and, with ``usage_mark`` (a class refused for its reported
    KV usage is admitted again below it), before its usage is under that too (0: it fits); None
    when no engine's figures say."""
    shorts = []
    for v in views:
        p = v.pressure
        if not (v.routable and v.fresh and p.capacity_tokens):
            continue
        parts = []
        if mark is not None and p.committed_kv is not None:
            parts.append(p.committed_kv - mark + kv_share(need_tokens, p.capacity_tokens, mark))
        if usage_mark is not None:
            parts.append(v.kv_usage - usage_mark)
        if parts:
            shorts.append(max(parts) * p.capacity_tokens)
    return max(0.0, min(shorts)) if shorts else None


class DrainRate:
    """KV tokens a pool's answers free per second, from the answers that ended lately."""

    def __init__(self, window_s: float = DRAIN_WINDOW_S) -> None:
        self._window_s = window_s
        self._ended: deque[tuple[float, float]] = deque(maxlen=4096)
        self._sum = 0.0
        # The first answer since the window was last empty: the window is not full before, so
        # the rate is over the time since then (not since the process started: after a quiet
        # spell the same recent answers would otherwise read as a rate ten times lower).
        self._since: float | None = None

    def ended(self, now: float, tokens: float) -> None:
        """An answer ended at ``now``; its prompt and output (``tokens``) are freed."""
        if tokens <= 0:
            return
        self._expire(now)
        if not self._ended:
            self._since = now
        if len(self._ended) == self._ended.maxlen:
            self._sum -= self._ended[0][1]
        self._ended.append((now, tokens))
        self._sum += tokens
        self._expire(now)

    def _expire(self, now: float) -> None:
        while self._ended and now - self._ended[0][0] > self._window_s:
            self._sum -= self._ended.popleft()[1]

    def seconds_for(self, tokens: float, now: float) -> float | None:
        """Expected seconds until ``tokens`` more are freed; None before any answer ended."""
        self._expire(now)
        if self._since is None or not self._ended:
            return None
        span = min(self._window_s, max(now - self._since, 1.0))
        rate = self._sum / span
        return tokens / rate if rate > 0 else None


def retry_after(drain_s: float | None, fallback_s: int) -> int:
    """Whole seconds for ``Retry-After``: the expected drain time, else ``fallback_s``."""
    if drain_s is None or not math.isfinite(drain_s):
        return fallback_s
    return max(1, min(MAX_RETRY_AFTER_S, math.ceil(drain_s)))


class HoldQueue:
    """The held requests of one pool, by ticket, FIFO per class."""

    def __init__(self, cfg: PressureConfig) -> None:
        self._cfg = cfg
        self._held: dict[Priority, OrderedDict[int, float]] = {c: OrderedDict() for c in ORDER}

    def __len__(self) -> int:
        return sum(len(q) for q in self._held.values())

    def must_queue(self, cls: Priority) -> bool:
        """Whether a new ``cls`` request waits behind held ones instead of trying admission."""
        if cls not in self._held:
            return False
        ahead = ORDER[: ORDER.index(cls) + 1]
        return any(self._held[c] for c in ahead)

    def offer(self, ticket: int, cls: Priority, reason: str, now: float, *, in_flight: int,
              deadline: float | None = None) -> Hold | Refuse:
        """Hold a request refused for ``reason``, or say it is refused now."""
        bound = hold_bound(self._cfg, cls)
        if not holdable(reason, in_flight) or bound <= 0:
            return Refuse(reason)
        if len(self) >= self._cfg.hold_max_requests:
            return Refuse(REASON_HOLD_FULL)
        until = now + bound
        if deadline is not None:
            until = min(until, deadline - DEADLINE_MARGIN_S)
        if until <= now:
            return Refuse(reason)
        self._held[cls][ticket] = until
        return Hold(until)

    def head(self, cls: Priority) -> int | None:
        """The ``cls`` request held longest: the one that tries admission next."""
        queue = self._held.get(cls)
        return next(iter(queue), None) if queue else None

    def heads(self) -> list[int]:
        """The head of every class's queue, in serving order."""
        return [t for t in (self.head(c) for c in ORDER) if t is not None]

    def remove(self, ticket: int) -> None:
        """The request left the queue: admitted, refused, or its client went away."""
        for queue in self._held.values():
            queue.pop(ticket, None)
