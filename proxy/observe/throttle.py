"""One log line per interval for a thing that can happen at any rate (a client opening connections
and saying nothing, a proxy out of descriptors, an index emptied by every batch): the first is
logged, the rest are counted until the next line is due, which says how many there were."""

from __future__ import annotations


class Throttle:
    """At most one line per ``every_s``; the events between two lines are counted."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._at = float("-inf")
        self._held = 0

    def due(self, now: float) -> int | None:
        """One more event at ``now``: None while no line is due (the event is counted), else how
        many events were held back since the last line (this one not included)."""
        if now - self._at < self.every_s:
            self._held += 1
            return None
        held, self._held, self._at = self._held, 0, now
        return held
