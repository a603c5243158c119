"""What the async shell shares between its parts: the process-wide context and the drain state.

Rules: one ``ShellContext`` per application, created by ``build_app`` and reachable only through
the app's typed key; the HTTP sessions inside it are opened and closed by the app's cleanup
context, never by a request. ``Drain`` counts open proxied requests so shutdown can wait for them,
and knows every open stream so that, when the drain times out, each one can be ended cleanly (an
error event) rather than dropped.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import aiohttp

from proxy.core.admission import Admission
from proxy.core.config import Config
from proxy.core.errors import NoCapacity
from proxy.core.isolation import TenantSalts
from proxy.core.routing import Policy
from proxy.core.sharing_state import Outbox
from proxy.core.spread import Blindness
from proxy.fleet.engines import Fleet
from proxy.fleet.precise import PreciseRouting
from proxy.observe.metrics import ProxyMetrics
from proxy.tenancy.shared_decision import SharedDecider

# The message of the cancellation the drain's cut gives a request whose answer has not begun:
# its handler answers 503 ``draining`` instead of closing the connection unanswered.
DRAIN_CUT = "kvproxy: drain timeout"


class Drain:
    """Open-request accounting and the draining flag (set once, on SIGTERM)."""

    def __init__(self, metrics: ProxyMetrics) -> None:
        self.draining = False
        self.open = 0
        self._metrics = metrics
        self._idle = asyncio.Event()
        self._idle.set()
        self._cuts: set[Callable[[], None]] = set()

    def enter(self, retry_after_s: int) -> None:
        """Count one proxied request (``leave`` once it ends, always); refuse it while draining.

        A pair of calls in the handler's try/finally, not a context manager: a generator-based
        one is three more objects per open request for the collector to scan (``bench.perstream``).
        """
        if self.draining:
            raise NoCapacity(
                "the proxy is shutting down", reason="draining", retry_after_s=retry_after_s
            )
        self.open += 1
        self._idle.clear()
        self._metrics.inflight_total.inc()

    def leave(self) -> None:
        self.open -= 1
        self._metrics.inflight_total.dec()
        if self.open == 0:
            self._idle.set()

    def add_cut(self, cut: Callable[[], None]) -> None:
        """Until ``discard_cut``, ``cut_all`` calls ``cut`` (which must end the stream promptly)."""
        self._cuts.add(cut)

    def discard_cut(self, cut: Callable[[], None]) -> None:
        self._cuts.discard(cut)

    @contextmanager
    def cuttable(self, cut: Callable[[], None]) -> Iterator[None]:
        """``add_cut`` while inside (for code where three objects per stream do not matter)."""
        self.add_cut(cut)
        try:
            yield
        finally:
            self.discard_cut(cut)

    def cut_all(self) -> int:
        """Ask every open stream to end now; returns how many were asked."""
        cuts = list(self._cuts)
        for cut in cuts:
            cut()
        return len(cuts)

    def start(self) -> None:
        self.draining = True
        self._metrics.draining.set(1)

    async def wait_idle(self, timeout_s: float) -> bool:
        """True if every open request finished within ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True


@dataclass
class ShellContext:
    cfg: Config
    fleet: Fleet
    policies: dict[str, Policy]
    admission: Admission
    metrics: ProxyMetrics
    drain: Drain
    clock: Callable[[], float]
    started_at: float
    data_session: aiohttp.ClientSession | None = None
    scrape_session: aiohttp.ClientSession | None = None
    # Engine cache salts per tenant; ``build_app`` sets them from the front door's settings.
    salts: TenantSalts = field(default_factory=lambda: TenantSalts("", tenants_known=False))
    # Dispatches to share with the other proxy processes; off until ``app`` finds a transport.
    outbox: Outbox = field(default_factory=lambda: Outbox(1, enabled=False))
    # Precise routing from KV events, when a pool has a tokenizer; None: approximate only.
    precise: PreciseRouting | None = None
    # Per pool, what this process's own arrivals say of the other processes' unseen dispatches
    # (``proxy.core.spread``); empty while nothing is shared. ``rng`` draws the spread pick.
    blindness: dict[str, Blindness] = field(default_factory=dict)
    rng: random.Random = field(default_factory=random.Random)
    # Routing decisions serialised with the other replicas' through Redis
    # (``proxy.tenancy.shared_decision``); None: sharing is off or not over Redis.
    decider: SharedDecider | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self.data_session is None:
            raise RuntimeError("the upstream session is opened by the app's cleanup context")
        return self.data_session
