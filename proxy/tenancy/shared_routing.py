"""Routing state shared between proxy processes: the shell around ``proxy.core.sharing``.

Rules:
- Every ``sharing.interval_s`` (unless quiet, below) one round: pack the outbox (dispatches
  and first bytes the request path recorded: ``Outbox.pack``), read each engine's in-flight
  counts, publish them as one message (or several, each within its share of a frame), then
  merge what the other processes published: their dispatches go into this process's policies
  through ``Policy.observe`` exactly as local ones do, their first bytes through
  ``Policy.confirm`` (settled, as the sender settled them), their in-flight counts into each
  engine's ``remote_pending`` (part of its load) and their prefill backlogs into its
  ``remote_backlog`` (part of the cost model's queued work). Own messages and unknown pools or
  engines are skipped; bad messages and confirmations of nothing merged here are dropped and
  counted.
- Counts are published when they change and at least every ``ttl_s / 4``, so a peer's figures
  never lapse while it lives, and vanish ``ttl_s`` after it dies or loses the transport.
- Quiet rounds (``proxy.core.sharing.next_round``), over a transport that says when messages
  arrive (the workers' hub: ``Bus.listen``): after a round that took no dispatch, merged no
  peer's dispatch and found nothing in flight in this process (so none of its counts can change
  before a request opens), the task sleeps until a dispatch (``Outbox.on_dispatch``), a request
  opened at an engine (``EngineState.on_open``: a retry, a speculation leg) or a peer's message
  wakes it, its heartbeat is due, or a peer's figures expire; a woken round still runs no
  sooner than one interval after the previous one. Every other round is followed by the next
  one interval on, as always; over Redis (read without blocking: it cannot wake a round) every
  round is, so claims are renewed every round there.
- Two transports: ``RedisStreamBus`` (one Redis stream for every replica, trimmed to
  ``sharing.stream_len`` entries and expiring ``ttl_s`` after the last write; read without blocking
  from the last id seen) and the workers' hub (``proxy.tenancy.hub``). Transport trouble skips the
  round: the process routes alone, ``kvproxy_sharing_live`` says 0, one log line says so, and
  another says when sharing is back.
- With decisions serialised through Redis (``proxy.tenancy.shared_decision``), each round also
  renews this process's claims there (``Claims.refresh``) after publishing.
- After every round ``on_merged`` is told the live peers (0 when the round failed: a process
  routing alone expects nothing unseen) and the peer dispatches merged per pool, from which
  ``proxy.core.spread`` learns how many peer dispatches a decision is concurrent with.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import replace
from typing import Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge

from proxy.core.engine_state import EngineState
from proxy.core.routing import Policy, RouteKey
from proxy.core.sharing import (
    NO_BACKLOG,
    BadMessage,
    Message,
    confirmations_per_message,
    decode,
    dispatches_per_message,
    encode,
)
from proxy.core.sharing_state import Outbox, PeerTable, Unconfirmed, next_round
from proxy.tenancy.hub import MAX_FRAME, BusDown
from proxy.tenancy.redis_link import RedisClient, RedisLink, RedisUnavailable

log = logging.getLogger("kvproxy.sharing")
T = TypeVar("T")

_READ_COUNT = 512  # stream entries read per round at most


class Bus(Protocol):
    @property
    def live(self) -> bool: ...

    async def publish(self, payload: bytes) -> None: ...

    async def fetch(self) -> list[bytes]: ...

    def listen(self, wake: Callable[[], None]) -> bool:
        """Call ``wake`` when messages arrive; False: the transport cannot, poll it."""
        ...


class Claims(Protocol):
    """Decisions serialised through Redis (``proxy.tenancy.shared_decision``), renewed each
    round."""

    async def refresh(self, engines: Iterable[EngineState]) -> None: ...


class HasState(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def pool(self) -> str: ...

    state: EngineState


_APPEND = """
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 'm', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
"""


class RedisStreamBus:
    """One Redis stream that every replica appends to and reads from."""

    def __init__(self, link: RedisLink, *, maxlen: int, ttl_s: float) -> None:
        self._link = link
        self._key = link.key("routing")
        self._maxlen = maxlen
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._last: str | None = None
        self._empty_reads = 0
        self.live = False
        self._append = link.client.register_script(_APPEND)

    def listen(self, wake: Callable[[], None]) -> bool:
        # A read that does not block cannot say when entries arrive: the rounds keep polling.
        return False

    async def publish(self, payload: bytes) -> None:
        key, maxlen, ttl = self._key, self._maxlen, self._ttl_ms
        # One script: the stream's lifetime is renewed only by an append that worked, so a key
        # that cannot take one (another type, or no stream id left) expires instead of living on.
        await self._run("sharing_publish",
                        lambda r: self._append(keys=[key], args=[payload, maxlen, ttl], client=r))

    async def fetch(self) -> list[bytes]:
        key = self._key
        if self._last is None:
            # Start after the newest entry: older ones describe dispatches long settled.
            self._last = await self._newest()
        last = self._last
        found: object = await self._run(
            "sharing_read", lambda r: r.xread({key: last}, count=_READ_COUNT)
        )
        out: list[bytes] = []
        for stream in found if isinstance(found, list) else []:
            for entry_id, payload in _entries(stream[1] if len(stream) == 2 else None):
                self._last = entry_id
                if payload is not None:
                    out.append(payload)
        if out:
            self._empty_reads = 0
        else:
            self._empty_reads += 1
            if self._empty_reads % _CHECK_AFTER_EMPTY == 0:
                await self._behind_the_cursor()
        return out

    async def _behind_the_cursor(self) -> None:
        """A stream whose newest entry is older than this reader's cursor was made anew (its key
        expired or was deleted, Redis restarted, an entry far in the future went): reading on
        from the cursor would see nothing for ever, so the cursor follows the stream back."""
        last = self._last
        head = await self._newest()
        if last is not None and _stream_id(head) < _stream_id(last):
            log.info("the routing stream was made anew; reading it from its newest entry")
            self._last = head

    async def _newest(self) -> str:
        """The id of the stream's newest entry (``0-0`` when it has none)."""
        key = self._key
        newest: object = await self._run("sharing_read", lambda r: r.xrevrange(key, count=1))
        entries = _entries(newest)
        return entries[-1][0] if entries else "0-0"

    async def _run(self, op: str, call: Callable[[RedisClient], Awaitable[T]]) -> T:
        try:
            result = await self._link.run(op, call)
        except RedisUnavailable as exc:
            self.live = False
            raise BusDown(str(exc)) from None
        self.live = True
        return result


# Empty reads in a row after which a reader checks that the stream is not behind its cursor.
_CHECK_AFTER_EMPTY = 40


def _stream_id(entry_id: str) -> tuple[int, int]:
    """A stream entry id as numbers, for ordering (``ms-seq``)."""
    ms, _, seq = entry_id.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        return (0, 0)


def _entries(raw: object) -> list[tuple[str, bytes | None]]:
    """(id, payload) of stream entries as redis-py returns them: [(id, {field: value}), ...]."""
    out: list[tuple[str, bytes | None]] = []
    for item in raw if isinstance(raw, list) else []:
        entry_id, fields = item
        payload = fields.get(b"m") if isinstance(fields, dict) else None
        out.append((entry_id.decode(), payload if isinstance(payload, bytes) else None))
    return out


class SharingMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.published = Counter(
            "kvproxy_sharing_published", "Routing state this process published to the others",
            ["kind"], registry=registry,
        )  # fmt: skip
        self.merged = Counter(
            "kvproxy_sharing_merged", "Routing state merged from other proxy processes",
            ["kind"], registry=registry,
        )  # fmt: skip
        self.dropped = Counter(
            "kvproxy_sharing_dropped", "Routing state not shared, by reason",
            ["reason"], registry=registry,
        )  # fmt: skip
        self.live = Gauge(
            "kvproxy_sharing_live",
            "1 while routing state is shared with the other proxy processes, 0 while routing alone",
            registry=registry,
        )  # fmt: skip
        self.peers = Gauge(
            "kvproxy_sharing_peers", "Other proxy processes heard from recently",
            registry=registry,
        )  # fmt: skip


class SharedRouting:
    """Publishes this process's dispatches and in-flight counts; merges the others'."""

    def __init__(
        self,
        bus: Bus,
        outbox: Outbox,
        policies: Mapping[str, Policy],
        engines: Callable[[], Iterable[HasState]],
        *,
        ttl_s: float,
        interval_s: float,
        max_chain: int,
        clock: Callable[[], float],
        registry: CollectorRegistry,
        transport: str,
        on_merged: Callable[[int, Mapping[str, int]], None] | None = None,
        claims: Claims | None = None,
    ) -> None:
        self._bus = bus
        self._outbox = outbox
        self._policies = policies
        self._engines = engines
        self._peers = PeerTable(ttl_s)
        self._heartbeat_s = ttl_s / 4
        self.interval_s = interval_s
        self._max_chain = max_chain
        self._per_message = dispatches_per_message(max_chain, MAX_FRAME)
        self._per_confirm = confirmations_per_message(MAX_FRAME)
        self._unconfirmed = Unconfirmed()
        self._clock = clock
        self.metrics = SharingMetrics(registry)
        self.transport = transport
        self.sender = uuid.uuid4().hex[:16]
        self._seq = 0
        # (pending, open, prefill) as last published.
        self._last_counts: tuple[Mapping[str, object], ...] = ({}, {}, {})
        self._last_sent = -1e18
        self._live: bool | None = None
        self._dropped_seen = (0, 0)  # the outbox's dispatches and first bytes dropped
        self._stopped = False
        # Told (live peers, dispatches merged per pool) after every round; 0 peers when the
        # round failed.
        self._on_merged = on_merged
        self._round: dict[str, int] = {}
        self._claims = claims
        # Other processes heard from within ``ttl_s`` at the last round (kept while the
        # transport is down, until their figures expire).
        self.peers_heard = 0
        self._wake = asyncio.Event()
        outbox.on_dispatch = self._wake.set
        self._pushes = bus.listen(self._wake.set)
        self._quiet = False  # whether the next round may wait for a wake (``next_round``)
        self.rounds = 0

    async def sync(self) -> None:
        """One round: publish, merge, and say whether sharing is live."""
        engines = list(self._engines())
        now = self._clock()
        self._round = {}
        self.rounds += 1
        for e in engines:  # engines come and go: (re)attached every round
            e.state.on_open = self._wake.set
        try:
            took = await self._publish(engines, now)
            if self._claims is not None:
                await self._claims.refresh(e.state for e in engines)
            await self._merge(engines, now)
        except BusDown as exc:
            self._set_live(False, str(exc))
            self._peers.expire(now - self._peers.ttl_s)  # keep figures until they expire
            live = took = False
        else:
            self._set_live(True, "")
            live = True
        # After dispatches, own or merged, the next round comes one interval on: ``spread``
        # judges a decision by the two merges after it. A peer's counts need no second round.
        idle = not any(e.state.open_requests for e in engines)
        self._quiet = live and self._pushes and idle and not (took or self._round)
        now = self._clock()
        peers = self._apply_counts(engines, now)
        if self._on_merged is not None:
            # Routing alone, nothing is merged: no peer's dispatch is expected to show up.
            self._on_merged(peers if live else 0, self._round)

    def _set_live(self, live: bool, why: str) -> None:
        if live != self._live:
            if live:
                log.info("sharing routing state with the other proxy processes (%s)",
                         self.transport)  # fmt: skip
            elif self._live is not None:
                log.warning("routing alone: cannot share routing state over %s (%s)",
                            self.transport, why)  # fmt: skip
            self._live = live
        self.metrics.live.set(1.0 if live else 0.0)

    async def _publish(self, engines: list[HasState], now: float) -> bool:
        """Publish what changed (or a heartbeat); whether the outbox held dispatches."""
        msgs = self._outbox.pack(self.sender, self._seq + 1, per_message=self._per_message,
                                 per_confirm=self._per_confirm)  # fmt: skip
        self._count_drops()
        pending = {e.name: float(e.state.dispatched_since_snapshot) for e in engines}
        opened = {e.name: float(e.state.open_requests) for e in engines}
        prefill = {e.name: e.state.backlog for e in engines}
        news = any(m.dispatches or m.confirmations for m in msgs)
        changed = (pending, opened, prefill) != self._last_counts
        if not news and not changed and now - self._last_sent < self._heartbeat_s:
            return False
        msgs[-1] = replace(msgs[-1], pending=pending, open=opened, prefill=prefill)
        self._seq = msgs[-1].seq  # all spent, even on failure: a message may have gone anyway
        for msg in msgs:
            try:
                await self._bus.publish(encode(msg))
            except BusDown:
                self._outbox.unsent(msg.seq)
                raise
            self.metrics.published.labels("dispatches").inc(len(msg.dispatches))
            self.metrics.published.labels("confirmations").inc(len(msg.confirmations))
            self.metrics.published.labels("messages").inc()
        self._last_counts, self._last_sent = (pending, opened, prefill), now
        return any(m.dispatches for m in msgs)

    def _count_drops(self) -> None:
        dispatches, answers = self._outbox.dropped, self._outbox.dropped_answers
        seen = self._dropped_seen
        if dispatches > seen[0]:
            self.metrics.dropped.labels("batch_full").inc(dispatches - seen[0])
        if answers > seen[1]:
            self.metrics.dropped.labels("confirm_batch_full").inc(answers - seen[1])
        self._dropped_seen = (dispatches, answers)

    async def _merge(self, engines: list[HasState], now: float) -> None:
        pools = {e.name: e.pool for e in engines}
        for raw in await self._bus.fetch():
            try:
                msg = decode(raw, max_bytes=MAX_FRAME, max_chain=self._max_chain)
            except BadMessage:
                self.metrics.dropped.labels("invalid").inc()
                continue
            if msg.sender == self.sender:
                continue
            self._learn(msg, pools)
            if msg.pending or msg.open or msg.prefill or not (msg.dispatches or msg.confirmations):
                self._peers.heard(msg, now)
            self.metrics.merged.labels("messages").inc()

    def _learn(self, msg: Message, pools: Mapping[str, str]) -> None:
        merged = 0
        for pos, d in enumerate(msg.dispatches):
            policy = self._policies.get(d.pool)
            if policy is None or pools.get(d.engine) != d.pool:
                continue
            # The chain is already seeded by model, tenant and salt; the index needs no more.
            policy.observe(RouteKey(chain=d.chain), d.engine)
            self._unconfirmed.merged(msg.sender, msg.seq, pos, d)
            self._round[d.pool] = self._round.get(d.pool, 0) + 1
            merged += 1
        self.metrics.merged.labels("dispatches").inc(merged)
        # After the dispatches: a confirmation may name one of this very message.
        settled, unknown = self._unconfirmed.confirmed(msg, pools)
        for d in settled:
            self._policies[d.pool].confirm(RouteKey(chain=d.chain), d.engine)
        self.metrics.merged.labels("confirmations").inc(len(settled))
        if unknown:
            self.metrics.dropped.labels("unknown_confirmation").inc(unknown)

    def _apply_counts(self, engines: list[HasState], now: float) -> int:
        """Set every engine's remote figures; returns the live peers."""
        pending, opened = self._peers.totals(now)
        prefill = self._peers.prefill_totals(now)
        for engine in engines:
            engine.state.remote_backlog = prefill.get(engine.name, NO_BACKLOG)
            engine.state.remote_pending = pending.get(engine.name, 0.0)
            engine.state.remote_open = opened.get(engine.name, 0.0)
        live = self.peers_heard = self._peers.live(now)
        self.metrics.peers.set(live)
        return live

    async def run(self) -> None:
        """Rounds until ``stop``. Not ``periodic.every``: redis-py can swallow a cancellation that
        lands inside a pipeline, and this loop must end on shutdown even then."""
        while not self._stopped:
            started = self._clock()
            # Cleared before the round: a dispatch or a message during it wakes the next one.
            self._wake.clear()
            try:
                await self.sync()
            except Exception:
                log.exception("sharing routing state failed; trying again")
                self._quiet = False
            await self._pause(started)

    async def _pause(self, started: float) -> None:
        """Until the next round: one interval, or for a quiet round until woken or due."""
        if not self._quiet:
            await asyncio.sleep(self.interval_s)
            return
        now = self._clock()
        due = next_round(now, quiet=True, interval_s=self.interval_s,
                         heartbeat_at=self._last_sent + self._heartbeat_s,
                         expiry=self._peers.next_expiry(now))  # fmt: skip
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(due - now):
                await self._wake.wait()
        # Batching: a woken round runs no sooner than one interval after the previous one.
        await asyncio.sleep(max(0.0, started + self.interval_s - self._clock()))

    def stop(self) -> None:
        self._stopped = True
