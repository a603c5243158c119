"""Precise routing for the pools that have it: tokenizers, KV-event listeners, holdings.

Rules:
- Built at start-up from the configuration: every pool ``tokenizer`` is loaded (a bad path is a
  ``ConfigError`` naming ``pools[i].tokenizer``) and every engine with ``kv_events`` of such a pool
  gets an ``EngineListener``. ``start`` opens one ZMQ context and starts one named task per
  listener; ``close`` cancels them and closes the context. Nothing outlives the application.
- ``prepare`` tokenizes a request's prompt and hashes its blocks, once, before routing; only
  for a pool with a tokenizer and at least one engine in sync. Encoding costs about a
  millisecond per thousand tokens, so a request whose prompt or body is longer than
  ``INLINE_CHARS`` (the body bounds what a template renders besides the messages' text: tools,
  tool-call arguments, documents) is rendered and encoded on a small thread pool (the
  ``tokenizers`` library releases the GIL while it encodes) and the event loop keeps relaying
  other streams meanwhile; a short one is encoded inline, where the thread hop would cost more
  than it saves. Hashing the blocks (Python, holding the GIL) is done on the loop either way,
  with one ``ChainMemo``, so a prefix shared with earlier prompts is hashed once.
- ``holdings`` answers, for one prepared request, what each in-sync engine holds of its prompt
  (``core.exact_holdings.PreciseHoldings``); engines out of sync, without a publisher, or of a
  pool without a tokenizer are left to the approximate index. A request that cannot be
  tokenized is counted and routed approximately.
- ``dispatched`` records the pick: the prompt's blocks the engine did not hold count as held for
  ``kv_events.provisional_s``, and the engine must publish within ``silent_after_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq.asyncio

from proxy.core.blockhash import ChainMemo, ChainRoot, root_for, warm_up
from proxy.core.config import Config
from proxy.core.exact_holdings import PreciseHoldings
from proxy.core.inbound import Endpoint, Inbound
from proxy.core.routing import EngineView
from proxy.fleet.kvevents import EngineListener
from proxy.fleet.tokenizer import PromptTokenizer, loaded_tokenizers
from proxy.observe.kvmetrics import KvEventMetrics

# Prompts up to this many characters (about 500 tokens, a few hundred microseconds to encode) are
# prepared on the event loop; longer ones on the thread pool.
INLINE_CHARS = 2048
TOKENIZE_THREADS = 2


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
        self._by_pool: dict[str, list[EngineListener]] = {
            pool.name: [self.listeners[e.name] for e in pool.engines if e.name in self.listeners]
            for pool in cfg.pools}
        self._tasks: list[asyncio.Task[None]] = []
        self._pool: ThreadPoolExecutor | None = None
        # Block keys of shared prefixes, hashed once (used on the event loop only).
        self._memo = ChainMemo()

    def start(self) -> None:
        self._pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="kvproxy-tokenize")
        self._pool.submit(warm_up)  # the hashing table, built off the event loop and start-up
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
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    async def prepare(self, pool: str, inbound: Inbound,
                      salt: str | None) -> PreciseHoldings | None:
        """The request's prompt tokenized and hashed in the block sizes of the pool's in-sync
        engines; None when the pool is not routed precisely now or the prompt cannot be
        tokenized (counted)."""
        tokenizer = self.tokenizers.get(pool)
        sizes = {x.index.block_size or 0 for x in self._by_pool.get(pool, ()) if x.precise}
        if tokenizer is None or not sizes:
            return None
        if max(len(inbound.prompt_text), inbound.size) <= INLINE_CHARS or self._pool is None:
            ids = self._encoded(tokenizer, inbound)
        else:
            ids = await asyncio.get_running_loop().run_in_executor(
                self._pool, self._encoded, tokenizer, inbound)
        if ids is None:
            self._metrics.tokenize_failures.labels(pool).inc()
            return None
        return self._hashed(ids, root_for(salt), sizes)

    @staticmethod
    def _encoded(tokenizer: PromptTokenizer, inbound: Inbound) -> list[int] | None:
        return tokenizer.request_ids(inbound.endpoint is Endpoint.CHAT, inbound.body)

    def _hashed(self, ids: list[int], root: ChainRoot, sizes: set[int]) -> PreciseHoldings:
        # On the event loop: hashing is Python holding the GIL, and on a thread it would make
        # the loop wait for the GIL after every system call (the GIL's switch interval) while
        # the thread hashes; encoding on the thread releases it.
        found = PreciseHoldings(ids, root, self.cfg.max_prompt_blocks, memo=self._memo)
        for size in sizes:
            if size:  # 0: the engine has not said yet; its scraped block size is used later
                found.keys(size)
        return found

    def holdings(self, prepared: PreciseHoldings | None,
                 views: Sequence[EngineView]) -> PreciseHoldings | None:
        """What each in-sync engine of ``views`` holds of the prepared prompt (its block size
        from its events, else from its scraped ``block_size``)."""
        if prepared is None:
            return None
        now = self._clock()
        for view in views:
            listener = self.listeners.get(view.name)
            if listener is None or not listener.precise:
                continue
            size = listener.index.block_size or view.block_size
            if size:
                prepared.add(view.name, listener.index, size, now)
        return prepared if prepared.held else None

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
