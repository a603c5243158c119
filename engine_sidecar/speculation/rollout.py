"""The rollout of a new schedule to one engine, as an explicit state machine, and its gate.

Rules:
- One engine goes ``idle -> leased -> draining -> restarting -> idle`` (ready again with the new
  schedule); a failed restart goes ``restarting -> rolling_back -> idle`` (back on the last good
  schedule) or, if that fails too, ``rolling_back -> failed``, where the supervisor's ordinary
  restart-with-backoff takes over, and ``failed -> idle`` once the engine is back. A drain that
  does not end in time is abandoned, ``draining -> idle``: the engine was never stopped, and
  cutting its streams would lose requests. Any other move raises :class:`IllegalTransition`.
- The lease is what keeps more than ``max_out`` engines of a pool from being out at once; it is
  held from ``leased`` until the engine is back and ready, through ``failed`` too.
- :func:`may_start` is the gate before a lease is even asked for: never while the pool sheds or
  queues (the engines that stay up must be able to take the drained engine's share).
"""

from __future__ import annotations

from enum import Enum


class RolloutState(Enum):
    IDLE = "idle"
    LEASED = "leased"
    DRAINING = "draining"
    RESTARTING = "restarting"
    ROLLING_BACK = "rolling_back"
    FAILED = "failed"


class IllegalTransition(RuntimeError):
    pass


_S = RolloutState
TRANSITIONS: dict[RolloutState, frozenset[RolloutState]] = {
    _S.IDLE: frozenset({_S.LEASED}),
    _S.LEASED: frozenset({_S.DRAINING, _S.IDLE}),
    _S.DRAINING: frozenset({_S.RESTARTING, _S.ROLLING_BACK, _S.IDLE}),
    _S.RESTARTING: frozenset({_S.IDLE, _S.ROLLING_BACK}),
    _S.ROLLING_BACK: frozenset({_S.IDLE, _S.FAILED}),
    _S.FAILED: frozenset({_S.IDLE}),
}


class Rollout:
    def __init__(self) -> None:
        self.state = RolloutState.IDLE

    def move(self, to: RolloutState) -> None:
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"rollout cannot go from {self.state.value} to {to.value}")
        self.state = to

    @property
    def out_of_service(self) -> bool:
        return self.state in (_S.DRAINING, _S.RESTARTING, _S.ROLLING_BACK, _S.FAILED)


def may_start(*, shed_increase: float | None, pool_waiting: float, max_waiting: float
              ) -> tuple[bool, str]:
    """Whether a rollout may begin now, and why not."""
    if shed_increase is not None and shed_increase > 0:
        return False, f"the pool is shedding ({shed_increase:.0f} requests since last look)"
    if pool_waiting > max_waiting:
        return False, f"the pool queues {pool_waiting:.0f} requests (limit {max_waiting:.0f})"
    return True, "ok"
