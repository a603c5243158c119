"""Whether an engine is routed precisely (from its KV events) or approximately, and what to do
with each batch's sequence number.

Rules:
- ``Sequencer`` (one per publisher, i.e. per data-parallel rank) says what a batch's sequence
  number means: the next one (apply it), an old one (a duplicate after a replay: drop it), one past
  a gap (replay from the first missing number first), or, right after a reconnection, a number
  below the expected one (the publisher restarted: its cache is new, start over).
- ``Listening`` is the engine's mode as an explicit state machine: ``connecting`` and ``refused``
  before any publisher answered, ``precise`` while it is in sync, ``disconnected`` when the
  publisher went away and ``silent`` when the proxy sent it new prompt blocks and nothing was
  published for ``silent_after_s``. Only ``precise`` routes from the exact index; every other
  state routes the engine from the approximate index. ``change`` returns whether the state moved
  (the shell logs one line per move and counts falls back).
- Pure: no I/O; the clock is passed in.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Seq(enum.Enum):
    APPLY = "apply"
    DUPLICATE = "duplicate"
    GAP = "gap"
    RESTART = "restart"


class Sequencer:
    """Sequence numbers of one publisher."""

    def __init__(self) -> None:
        self.expected: int | None = None  # the next number wanted; None: nothing seen yet
        self.last: int | None = None
        self._reconnected = False

    def reconnected(self) -> None:
        self._reconnected = True

    def classify(self, seq: int) -> Seq:
        reconnected, self._reconnected = self._reconnected, False
        if self.expected is None:
            # The first batch ever: what came before it is fetched by a replay from 0.
            return Seq.APPLY if seq == 0 else Seq.GAP
        if seq == self.expected:
            return Seq.APPLY
        if seq > self.expected:
            return Seq.GAP
        if reconnected or seq == 0:
            return Seq.RESTART
        return Seq.DUPLICATE

    def applied(self, seq: int) -> None:
        self.last = seq
        self.expected = seq + 1

    def restart(self) -> None:
        self.expected = None
        self.last = None

    def skip_to(self, seq: int) -> None:
        """Give up on what is missing before ``seq`` (it is no longer replayable)."""
        self.expected = seq


class Mode(enum.Enum):
    CONNECTING = "connecting"
    REFUSED = "refused"
    PRECISE = "precise"
    DISCONNECTED = "disconnected"
    SILENT = "silent"


_MOVES: dict[Mode, frozenset[Mode]] = {
    Mode.CONNECTING: frozenset({Mode.REFUSED, Mode.PRECISE, Mode.DISCONNECTED}),
    Mode.REFUSED: frozenset({Mode.CONNECTING, Mode.PRECISE, Mode.DISCONNECTED}),
    Mode.PRECISE: frozenset({Mode.DISCONNECTED, Mode.SILENT, Mode.CONNECTING}),
    Mode.DISCONNECTED: frozenset({Mode.CONNECTING, Mode.REFUSED, Mode.PRECISE}),
    Mode.SILENT: frozenset({Mode.PRECISE, Mode.DISCONNECTED, Mode.CONNECTING}),
}


class IllegalMove(RuntimeError):
    pass


@dataclass
class Listening:
    """One engine's listening state (see the module rules)."""

    silent_after_s: float
    mode: Mode = Mode.CONNECTING
    # When the engine must have published by, given what the proxy sent it (None: no deadline).
    publish_by: float | None = None

    @property
    def precise(self) -> bool:
        return self.mode is Mode.PRECISE

    def change(self, to: Mode) -> bool:
        """Move to ``to``; False when already there. Moves outside the table raise."""
        if to is self.mode:
            return False
        if to not in _MOVES[self.mode]:
            raise IllegalMove(f"{self.mode.value} -> {to.value}")
        self.mode = to
        if to is not Mode.PRECISE:
            self.publish_by = None
        return True

    def published(self) -> bool:
        """A batch arrived in sync: a silent engine is precise again; returns whether it moved."""
        self.publish_by = None
        return self.mode is Mode.SILENT and self.change(Mode.PRECISE)

    def sent_new_blocks(self, now: float) -> None:
        """The proxy sent the engine prompt blocks it did not hold: it must publish soon."""
        if self.mode is Mode.PRECISE and self.publish_by is None:
            self.publish_by = now + self.silent_after_s

    def tick(self, now: float) -> bool:
        """Fall silent when the deadline passed; returns whether the mode moved."""
        if self.publish_by is not None and now >= self.publish_by:
            return self.change(Mode.SILENT)
        return False
