"""Precise routing for the pools that have it: tokenizers, KV-event listeners, holdings.

Rules:
- Built at start-up from the configuration: every pool ``tokenizer`` is loaded (a bad path is a
  ``ConfigError`` naming ``pools[i].tokenizer``) and every engine with ``kv_events`` of such a pool
  gets an ``EngineListener``. ``start`` opens one ZMQ context and starts one named task per
  listener; ``close`` cancels them and closes the context. Nothing outlives the application.
- ``holdings`` answers, for one request, what each in-sync engine holds of its prompt
  (``core.holdings.PreciseHoldings``); engines out of sync, without a publisher, or of a pool
  without a tokenizer are left to the approximate index. A request that cannot be tokenized is
  counted and routed approximately.
- ``dispatched`` records the pick: the prompt's blocks the engine did not hold count as held for
  ``kv_events.provisional_s``, and the engine must publish within ``silent_after_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import zmq.asyncio

from proxy.core.blockhash import root_for
from proxy.core.config import Config
from proxy.core.exact_holdings import PreciseHoldings
from proxy.core.inbound import Endpoint, Inbound
from proxy.core.routing import EngineView
from proxy.fleet.kvevents import EngineListener
from proxy.fleet.tokenizer import PromptTokenizer, loaded_tokenizers
from proxy.observe.kvmetrics import KvEventMetrics


class PreciseRouting:
    def __init__(self, cfg: Config, metrics: KvEventMetrics, clock: Callable[[], float]) -> None:
        self.cfg = cfg.kv_events
        self.tokenizers: dict[str, PromptTokenizer] = loaded_tokenizers(cfg.pools)
        self._metrics = metrics
        self._clock = clock
        self._ctx: zmq.asyncio.Context | None = None
        self.listeners: dict[str, EngineListener] = {
            engine.name: EngineListener(engine.name, engine.kv_events, self.cfg, metrics, clock)
            for pool in cfg.pools if pool.name in self.tokenizers
            for engine in pool.engines if engine.kv_events is not None}
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._ctx = ctx = zmq.asyncio.Context()
        for listener in self.listeners.values():
            listener.ctx = ctx
        self._tasks = [asyncio.create_task(listener.run(), name=f"kvproxy-kv-events:{name}")
                       for name, listener in self.listeners.items()]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def holdings(self, pool: str, inbound: Inbound, salt: str | None,
                 views: Sequence[EngineView]) -> PreciseHoldings | None:
        """What each in-sync engine of ``views`` holds of the request's prompt (its block size
        from its events, else from its scraped ``block_size``)."""
        tokenizer = self.tokenizers.get(pool)
        sizes = {v.name: v.block_size for v in views}
        live = [(e, self.listeners[e]) for e in sizes
                if e in self.listeners and self.listeners[e].precise]
        if tokenizer is None or not live:
            return None
        ids = tokenizer.request_ids(inbound.endpoint is Endpoint.CHAT, inbound.body)
        if ids is None:
            self._metrics.tokenize_failures.labels(pool).inc()
            return None
        found = PreciseHoldings(ids, root_for(salt), self.cfg.max_prompt_blocks)
        now = self._clock()
        for engine, listener in live:
            size = listener.index.block_size or sizes[engine]
            if size:
                found.add(engine, listener.index, size, now)
        return found if found.held else None

    def dispatched(self, engine: str, holdings: PreciseHoldings) -> None:
        listener = self.listeners.get(engine)
        if listener is not None:
            listener.dispatched(holdings.new_blocks(engine), self._clock())

    def admin_row(self, engine: str) -> dict[str, Any]:
        listener = self.listeners.get(engine)
        if listener is None:
            return {"mode": "approximate", "state": "no_publisher"}
        return listener.row()

    def refresh_metrics(self) -> None:
        for name, listener in self.listeners.items():
            self._metrics.precise.labels(name).set(1.0 if listener.precise else 0.0)
            self._metrics.blocks.labels(name).set(len(listener.index))
