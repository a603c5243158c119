"""Per-engine circuit breaker: stop sending requests to an engine that keeps failing.

Rules:
- States move only along the transition table; any other move raises ``IllegalTransition``.
- Only breakage counts: transport errors and 5xx other than 503 are ``FAILURE``. 429 and 503 are
  ``BACKPRESSURE`` (the engine is busy, not broken) and 4xx is ``CLIENT_ERROR``; neither opens the
  breaker, and neither resets the failure count.
- CLOSED opens after ``failure_threshold`` consecutive failures. OPEN becomes HALF_OPEN once
  ``open_s`` has passed; HALF_OPEN lets at most ``half_open_probes`` requests through; a probe's
  success closes the breaker, a failure reopens it for another ``open_s``.
- Pure: the caller passes ``now`` (a monotonic clock) to every call.
"""

from __future__ import annotations

from enum import Enum

from proxy.core.config import BreakerConfig


class BreakerState(Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Outcome(Enum):
    SUCCESS = "success"
    FAILURE = "failure"  # transport error, 5xx except 503
    BACKPRESSURE = "backpressure"  # 429, 503
    CLIENT_ERROR = "client_error"  # other 4xx


class BreakerEvent(Enum):
    TRIP = "trip"  # failure threshold reached, or a probe failed
    COOL = "cool"  # open_s has passed
    RECOVER = "recover"  # a probe succeeded


class IllegalTransition(RuntimeError):
    """An event that the breaker's transition table does not allow from its state."""


TRANSITIONS: dict[tuple[BreakerState, BreakerEvent], BreakerState] = {
    (BreakerState.CLOSED, BreakerEvent.TRIP): BreakerState.OPEN,
    (BreakerState.OPEN, BreakerEvent.COOL): BreakerState.HALF_OPEN,
    (BreakerState.HALF_OPEN, BreakerEvent.TRIP): BreakerState.OPEN,
    (BreakerState.HALF_OPEN, BreakerEvent.RECOVER): BreakerState.CLOSED,
}


def classify_status(status: int) -> Outcome:
    """The outcome of an upstream HTTP status."""
    if status in (429, 503):
        return Outcome.BACKPRESSURE
    if status >= 500:
        return Outcome.FAILURE
    if status >= 400:
        return Outcome.CLIENT_ERROR
    return Outcome.SUCCESS


class Breaker:
    """One engine's breaker."""

    def __init__(self, cfg: BreakerConfig) -> None:
        self.cfg = cfg
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.opened_at = 0.0
        self.probes_in_flight = 0

    def _move(self, event: BreakerEvent, now: float) -> None:
        try:
            self.state = TRANSITIONS[(self.state, event)]
        except KeyError:
            raise IllegalTransition(f"{event.value} from {self.state.value}") from None
        self.failures = 0
        self.probes_in_flight = 0
        if self.state is BreakerState.OPEN:
            self.opened_at = now

    def _cool(self, now: float) -> None:
        if self.state is BreakerState.OPEN and now - self.opened_at >= self.cfg.open_s:
            self._move(BreakerEvent.COOL, now)

    def peek(self, now: float) -> bool:
        """Whether a request would be let through now. A query that takes no probe slot, so views
        may call it freely."""
        self._cool(now)
        if self.state is BreakerState.HALF_OPEN:
            return self.probes_in_flight < self.cfg.half_open_probes
        return self.state is BreakerState.CLOSED

    def allows(self, now: float) -> bool:
        """Whether a request may go to the engine now; in HALF_OPEN this takes one of the
        ``half_open_probes`` slots, so call it once per request dispatched and ``record`` the
        outcome (use ``peek`` for views)."""
        if not self.peek(now):
            return False
        if self.state is BreakerState.HALF_OPEN:
            self.probes_in_flight += 1
        return True

    def record(self, outcome: Outcome, now: float) -> None:
        """The result of a request that ``allows`` let through."""
        self._cool(now)
        if outcome is Outcome.FAILURE:
            self._on_failure(now)
        elif outcome is Outcome.SUCCESS:
            self._on_success(now)
        elif self.state is BreakerState.HALF_OPEN:
            # Busy or a bad request: says nothing about breakage; free the probe slot.
            self.probes_in_flight = max(0, self.probes_in_flight - 1)

    def _on_failure(self, now: float) -> None:
        if self.state is BreakerState.CLOSED:
            self.failures += 1
            if self.failures >= self.cfg.failure_threshold:
                self._move(BreakerEvent.TRIP, now)
        elif self.state is BreakerState.HALF_OPEN:
            self._move(BreakerEvent.TRIP, now)
        # OPEN: a late failure from before the trip changes nothing.

    def _on_success(self, now: float) -> None:
        if self.state is BreakerState.CLOSED:
            self.failures = 0
        elif self.state is BreakerState.HALF_OPEN:
            self._move(BreakerEvent.RECOVER, now)
