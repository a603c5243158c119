"""Admission on the request path: the pool that serves a request, after holding it for room.

Rules:
- The decisions are the pure core's: ``Admission.decide`` for the asked pool, then its tier
  fallbacks (sheddable work degraded to a smaller pool before it would be refused), and
  ``proxy.core.holding`` for whether a refusal waits. This module performs them.
- Waiting lives in the request's own coroutine (no background task): one ``asyncio.Event`` per
  held request. The head of each class's queue tries admission again whenever an answer of the
  pool ends (``ended``) and at least every half scrape interval (a scrape may show blocks freed);
  the others sleep until they become head. A head that gets in wakes the next one at once.
- When a held request's time is up it tries admission once more; a standard one that only the
  commitment forecast still refuses is then paced through (``holding.paced``, with
  ``pressure.pace_standard``): admitted with the views of the engines it may go to, so that the
  ranking picks among those alone.
- A held request leaves the queue however it ends: admitted, paced, refused when its time is up (503
  with the last refusal's reason and a ``Retry-After`` from the pool's drain rate), or its client
  gone (``CancelledError`` is re-raised).
- Times are the event loop's (``loop.time()``), as the client deadlines of ``Job`` are.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from proxy.core.admission import REASON_KV, REASON_NO_ENGINE, Admit, Priority
from proxy.core.errors import NoCapacity, NoEngine
from proxy.core.holding import (
    HOLDABLE,
    REASON_HOLD_FULL,
    DrainRate,
    Hold,
    HoldQueue,
    committed_mark,
    holdable,
    paced,
    retry_after,
    room_short,
)
from proxy.core.inbound import Inbound
from proxy.core.pools import PoolPlan
from proxy.core.pressure import REASON_COMMITTED
from proxy.core.routing import EngineView
from proxy.server.context import ShellContext
from proxy.tenancy.frontdoor import CHARS_PER_TOKEN


def need_tokens(ctx: ShellContext, pool: str, inbound: Inbound, max_tokens: int | None) -> float:
    """KV tokens the request is expected to take: its prompt and its expected answer."""
    prompt = len(inbound.prompt_text) / CHARS_PER_TOKEN
    return prompt + ctx.fleet.estimate(pool).expected(max_tokens)


Admitted = tuple[str, list[EngineView]]
"""The pool that serves a request and its engines' views as admission judged them: built once
per request (a per-engine walk of the requests in flight), the ranking reads the same ones."""


def decide(
    ctx: ShellContext, plan: PoolPlan, priority: Priority, inbound: Inbound, max_tokens: int | None
) -> Admitted:
    """The pool that serves the request now, or ``NoCapacity`` (shed) with the reason."""
    now = ctx.clock()
    need = need_tokens(ctx, plan.pool, inbound, max_tokens)
    views = ctx.fleet.views(plan.pool, now)
    decision = ctx.admission.decide(plan.pool, priority, views, need)
    if isinstance(decision, Admit):
        return _admitted(ctx, plan.pool, decision), views
    moved = degrade(ctx, plan, priority, inbound, max_tokens)
    if moved is not None:
        return moved
    if decision.reason == REASON_NO_ENGINE:
        raise NoEngine(plan.pool, reason=decision.reason, retry_after_s=decision.retry_after_s)
    raise NoCapacity(
        f"{plan.pool} pool is overloaded for {priority.value} requests ({decision.reason})",
        reason=decision.reason,
        retry_after_s=decision.retry_after_s,
    )


def degrade(
    ctx: ShellContext, plan: PoolPlan, priority: Priority, inbound: Inbound, max_tokens: int | None
) -> Admitted | None:
    """The first of the plan's fallback pools that admits the request now, or None."""
    now = ctx.clock()
    for fallback in _fallbacks(plan, priority):
        need = need_tokens(ctx, fallback, inbound, max_tokens)
        views = ctx.fleet.views(fallback, now)
        second = ctx.admission.decide(fallback, priority, views, need)
        if isinstance(second, Admit):
            ctx.metrics.degraded.labels(plan.pool, fallback).inc()
            return _admitted(ctx, fallback, second), views
    return None


def _fallbacks(plan: PoolPlan, priority: Priority) -> tuple[str, ...]:
    """Where a request the first pool would shed may go instead, in order: only sheddable work
    for a tier chain (``resolve_model`` already cut chains to one pool without degrading)."""
    return plan.fallbacks if priority is Priority.SHEDDABLE else ()


def _admitted(ctx: ShellContext, pool: str, decision: Admit) -> str:
    if decision.stale_fail_open:
        ctx.metrics.stale_fail_open.labels(pool).inc()
    return pool


@dataclass(frozen=True)
class _Ask:
    """What admission needs to know of one request."""

    plan: PoolPlan
    priority: Priority
    inbound: Inbound
    max_tokens: int | None

    def decide(self, ctx: ShellContext) -> Admitted:
        return decide(ctx, self.plan, self.priority, self.inbound, self.max_tokens)

    def degrade(self, ctx: ShellContext) -> Admitted | None:
        return degrade(ctx, self.plan, self.priority, self.inbound, self.max_tokens)

    def need(self, ctx: ShellContext, pool: str) -> float:
        return need_tokens(ctx, pool, self.inbound, self.max_tokens)


class Holding:
    """The held requests of every pool of one proxy process (one per application: ``HOLDING``)."""

    def __init__(self, ctx: ShellContext) -> None:
        self._ctx = ctx
        self._cfg = ctx.cfg.pressure
        self._enabled = self._cfg.enabled and self._cfg.hold_max_requests > 0
        self._poll_s = ctx.cfg.telemetry.interval_s / 2
        self._queues: dict[str, HoldQueue] = {}
        self._drains: dict[str, DrainRate] = {}
        self._events: dict[int, asyncio.Event] = {}
        self._tickets = itertools.count(1)

    def _queue(self, pool: str) -> HoldQueue:
        found = self._queues.get(pool)
        if found is None:
            found = self._queues[pool] = HoldQueue(self._cfg)
        return found

    def _drain(self, pool: str) -> DrainRate:
        found = self._drains.get(pool)
        if found is None:
            found = self._drains[pool] = DrainRate()
        return found

    def ended(self, pool: str, tokens: float) -> None:
        """An answer of ``pool`` ended, freeing ``tokens`` of KV: held requests try again."""
        if not self._enabled:
            return
        self._drain(pool).ended(asyncio.get_running_loop().time(), tokens)
        self._wake(pool)

    def _wake(self, pool: str) -> None:
        queue = self._queues.get(pool)
        for ticket in queue.heads() if queue is not None else ():
            event = self._events.get(ticket)
            if event is not None:
                event.set()

    async def admit(self, plan: PoolPlan, priority: Priority, inbound: Inbound,
                    max_tokens: int | None, deadline: float | None, *,
                    on_hold: Callable[[], Awaitable[None]] | None = None) -> Admitted:
        """The pool that serves the request (and its engines' views), after holding it for room
        where the core says so. ``on_hold`` is awaited once if the request is held: identical
        requests waiting for its answer (the response cache's single flight) are let go then,
        so that a held request never holds up another class's work."""
        ask = _Ask(plan, priority, inbound, max_tokens)
        if not (self._enabled and self._queue(plan.pool).must_queue(priority)):
            try:
                return ask.decide(self._ctx)
            except NoCapacity as shed:
                if not (self._enabled and holdable(shed.reason, self._in_flight(plan.pool))):
                    raise
                refused = shed
        else:
            # Behind work held for the first pool's room, but free to go down its tier chain:
            # a pool further down that admits it now takes it (it jumps no one held there).
            moved = ask.degrade(self._ctx)
            if moved is not None:
                return moved
            refused = self._refusal(ask, REASON_COMMITTED)  # in line behind held work
        return await self._hold(ask, deadline, refused, on_hold)

    async def _hold(self, ask: _Ask, deadline: float | None, refused: NoCapacity,
                    on_hold: Callable[[], Awaitable[None]] | None) -> Admitted:
        pool = ask.plan.pool
        ticket = next(self._tickets)
        queue = self._queue(pool)
        verdict = queue.offer(ticket, ask.priority, refused.reason,
                              asyncio.get_running_loop().time(),
                              in_flight=self._in_flight(pool), deadline=deadline)
        if not isinstance(verdict, Hold):
            self._count(ask, "refused")
            raise self._late(ask, verdict.reason, refused)
        event = self._events[ticket] = asyncio.Event()
        self._ctx.metrics.held_now.labels(pool).set(len(queue))
        outcome = "gone"
        try:
            if on_hold is not None:
                await on_hold()
            served, outcome = await self._wait(ask, ticket, verdict.until, event)
            return served
        except NoCapacity:
            outcome = "refused"
            raise
        finally:
            queue.remove(ticket)
            self._events.pop(ticket, None)
            self._ctx.metrics.held_now.labels(pool).set(len(queue))
            self._count(ask, outcome)
            self._wake(pool)  # the next one in line tries at once

    async def _wait(self, ask: _Ask, ticket: int, until: float,
                    event: asyncio.Event) -> tuple[Admitted, str]:
        """Try admission each time this request is head of its class's queue and woken, until
        it gets in (the pool, and how) or ``until`` passes (``_last_try``)."""
        loop = asyncio.get_running_loop()
        queue = self._queue(ask.plan.pool)
        while (left := until - loop.time()) > 0:
            head = queue.head(ask.priority) == ticket
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, self._poll_s) if head else left):
                    await event.wait()
            event.clear()
            if queue.head(ask.priority) != ticket:
                continue
            try:
                return ask.decide(self._ctx), "admitted"
            except NoCapacity as shed:
                if shed.reason not in HOLDABLE:
                    raise  # not load (no engine left, stale telemetry): as it is, at once
                if not holdable(shed.reason, self._in_flight(ask.plan.pool)):
                    raise self._late(ask, shed.reason, shed) from None
        return self._last_try(ask)

    def _last_try(self, ask: _Ask) -> tuple[Admitted, str]:
        """Once the hold is over: admitted now, paced through (standard work that only the
        commitment forecast still refuses), or refused (``NoCapacity``)."""
        ctx, pool = self._ctx, ask.plan.pool
        try:
            return ask.decide(ctx), "admitted"
        except NoCapacity as shed:
            if shed.reason not in HOLDABLE:
                raise
            last = shed
        # Standard work that only the commitment forecast refuses is paced, not refused (core).
        if self._cfg.pace_standard:
            views = ctx.fleet.views(pool, ctx.clock())
            through = paced(ctx.admission, pool, ask.priority, last.reason, views)
            if through:
                return (pool, through), "paced"
        raise self._late(ask, last.reason, last)

    def _in_flight(self, pool: str) -> int:
        """This proxy's answers in flight on ``pool``: what will free its room."""
        return sum(e.state.open_requests for e in self._ctx.fleet.pool(pool))

    def _refusal(self, ask: _Ask, reason: str) -> NoCapacity:
        return NoCapacity(
            f"{ask.plan.pool} pool is overloaded for {ask.priority.value} requests ({reason})",
            reason=reason, retry_after_s=self._ctx.cfg.admission.retry_after_s)

    def _late(self, ask: _Ask, reason: str, refused: NoCapacity) -> NoCapacity:
        """The refusal of a request that cannot be held (longer), with an honest Retry-After:
        how long the pool's answers are expected to take to free the room it lacks."""
        ctx, pool = self._ctx, ask.plan.pool
        mark = committed_mark(self._cfg, ask.priority)
        # Refused for the usage the engines report: that must fall under the class's
        # re-admission mark too (the commitments alone may show room: 0 s would be a lie).
        usage_mark = ctx.admission.threshold(ask.priority).admit_below if reason == REASON_KV \
            else None
        short = None if mark is None and usage_mark is None else room_short(
            ctx.fleet.views(pool, ctx.clock()), mark, ask.need(ctx, pool), usage_mark)
        drain_s = None if short is None else self._drain(pool).seconds_for(
            short, asyncio.get_running_loop().time())
        wait = retry_after(drain_s, int(refused.retry_after_s))
        message = refused.message if reason != REASON_HOLD_FULL else (
            f"{pool} pool is overloaded for {ask.priority.value} requests (too many held)")
        return NoCapacity(message, reason=reason, retry_after_s=wait)

    def _count(self, ask: _Ask, outcome: str) -> None:
        self._ctx.metrics.held.labels(ask.plan.pool, ask.priority.value, outcome).inc()


HOLDING = web.AppKey("holding", Holding)
