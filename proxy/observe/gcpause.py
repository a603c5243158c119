"""The garbage collector's pauses: how long each collection stopped the process, by generation.

Rules:
- A collection stops everything the event loop does (the relay, the scraper, the lag probe), so
  its length is exported as ``kvproxy_gc_pause_seconds{generation}`` next to the loop's lag: a
  lag spike that matches a generation-2 pause is the collector, not the relay.
- Fed from ``gc.callbacks`` (the interpreter calls them at the start and the end of every
  collection, in the thread that collects); the callback does one clock read per phase and one
  histogram observation per collection, a handful of collections per second under load.
- ``install`` adds the callback, ``remove`` takes it away (the app owns it for its lifetime); the
  collector is process-wide, so several proxies in one test process each count every collection.
- The callback never allocates while it holds a lock: prometheus-client's locks guard float
  additions only, so a collection can never start inside one and re-enter it.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from prometheus_client import Histogram

GENERATIONS = ("0", "1", "2")


class GcPauses:
    def __init__(self, histogram: Histogram) -> None:
        # Children looked up once: a callback inside the collector must stay cheap.
        self._by_generation = [histogram.labels(generation=g) for g in GENERATIONS]
        self._started = 0.0

    def install(self) -> None:
        if self._on_phase not in gc.callbacks:
            gc.callbacks.append(self._on_phase)

    def remove(self) -> None:
        if self._on_phase in gc.callbacks:
            gc.callbacks.remove(self._on_phase)

    def _on_phase(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        generation = min(int(info.get("generation", 2)), len(GENERATIONS) - 1)
        self._by_generation[generation].observe(time.perf_counter() - self._started)
