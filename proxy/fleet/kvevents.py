"""Listens to one engine's KV events (vLLM's ZMQ publisher) and keeps its exact index.

Rules:
- One ``EngineListener`` per engine with ``kv_events`` configured; its ``run`` is a named task
  owned by the application. Per data-parallel rank it holds a SUB socket (connected to the
  engine's endpoint, or bound with ``bind = true``) and a monitor of that socket's connection.
- A message is ``[topic, seq (8 bytes big endian), payload]``, the payload msgpack of
  ``[ts, [event, ...], rank]``; anything else (frame count, sizes, msgpack, content) is counted in
  ``kvproxy_kv_event_bad_messages`` and dropped, never raised. The socket refuses messages over
  ``kv_events.max_message_bytes``.
- Sequence numbers are checked per rank (``kvstate.Sequencer``): a gap is filled from the replay
  socket (a DEALER asks ``[b"", start]`` and reads ``[b"", topic, seq, payload]`` until the end
  marker, within ``replay_timeout_s``); a gap that cannot be filled, or a publisher that restarted,
  empties the index (it may then under-state what the engine holds, never over-state it).
- The engine is precise once every rank's publisher is connected and caught up; it falls back to
  the approximate index when a publisher refuses, disconnects, or falls silent (``kvstate``), with
  one log line per move and a count in ``kvproxy_kv_event_fallbacks``. A bind that fails is
  retried every ``_REOPEN_S`` seconds.
- A publisher is not trusted to be kind to the event loop: the listener yields to the loop after
  every ``_YIELD_BYTES`` of messages it applied and after every replayed batch, a replay ends at
  its deadline however fast its batches come, a sequence number from ``MAX_SEQ`` up (no publisher
  reaches it) and a batch of a rank the engine does not have are bad messages, a gap right after
  a replay that failed is given up on at once (no second wait while the socket fills), index
  restarts are logged at most once per ``_WARN_EVERY_S`` (the rest counted), and nothing a message
  does can end the listener: an unexpected error is logged and counted as a bad message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from proxy.core.kv_config import EngineEvents, KvEventsConfig
from proxy.core.kvindex import BadBatch, Batch, Cleared, ExactIndex, Limits, Removed, parse_batch
from proxy.core.kvstate import Listening, Mode, Seq, Sequencer
from proxy.observe.kvmetrics import KvEventMetrics
from proxy.observe.throttle import Throttle

log = logging.getLogger(__name__)
END_SEQ = b"\xff" * 8
_POLL_MS = 500
_REOPEN_S = 5.0
_DRAIN = 256  # batches taken per wake-up at most, so one busy engine cannot hold the loop
_YIELD_BYTES = 1 << 20  # message bytes applied between two yields to the event loop
MAX_SEQ = 1 << 63  # vLLM counts from 0 by one a step: a number this high is not a publisher's
_WARN_EVERY_S = 10.0
_FALLBACKS = (Mode.REFUSED, Mode.DISCONNECTED, Mode.SILENT)


@dataclass
class _Rank:
    rank: int
    endpoint: str
    replay: str | None
    seq: Sequencer = field(default_factory=Sequencer)
    sub: zmq.asyncio.Socket | None = None
    monitor: zmq.asyncio.Socket | None = None
    connected: bool = False


def _event_name(batch: Batch, i: int) -> str:
    event = batch.events[i]
    return ("cleared" if isinstance(event, Cleared) else
            "removed" if isinstance(event, Removed) else "stored")


class EngineListener:
    """One engine's subscription, exact index and listening state."""

    def __init__(self, engine: str, events: EngineEvents, cfg: KvEventsConfig,
                 metrics: KvEventMetrics, clock: Callable[[], float]) -> None:
        self.engine = engine
        self.events = events
        self.cfg = cfg
        self.index = ExactIndex(cfg.max_blocks_per_engine, cfg.provisional_s)
        self.listening = Listening(cfg.silent_after_s)
        self.ranks = [_Rank(i, ep, rp) for i, (ep, rp) in enumerate(events.endpoints())]
        self._limits = Limits(cfg.max_events_per_batch, cfg.max_hashes_per_event,
                              cfg.max_blocks_per_engine)
        self._metrics = metrics
        self._clock = clock
        self._topic = events.topic.encode()
        self._replay_failed_at = float("-inf")
        self._warn = Throttle(_WARN_EVERY_S)  # a storm of index restarts is one line
        self.ctx: zmq.asyncio.Context | None = None  # the owner's, set before ``run``

    @property
    def precise(self) -> bool:
        return self.listening.precise

    def row(self) -> dict[str, Any]:
        """This engine's part of ``/admin/engines``."""
        last = [r.seq.last for r in self.ranks]
        return {"mode": "precise" if self.precise else "approximate",
                "state": self.listening.mode.value, "blocks": len(self.index),
                "block_size": self.index.block_size,
                "last_seq": last[0] if len(last) == 1 else last,
                "forgotten_blocks": self.index.forgotten}

    async def run(self) -> None:
        assert self.ctx is not None, "the owner sets the ZMQ context before running"
        try:
            while True:  # a bind that fails (a port in use) is retried, not fatal
                if self._open():
                    break
                await asyncio.sleep(_REOPEN_S)
            poller = zmq.asyncio.Poller()
            for r in self.ranks:
                poller.register(r.sub, zmq.POLLIN)
                poller.register(r.monitor, zmq.POLLIN)
            while True:
                ready = dict(await poller.poll(_POLL_MS))
                for r in self.ranks:
                    if r.monitor in ready:
                        await self._on_monitor(r)
                    if r.sub in ready:
                        await self._drain(r)
                if self.listening.tick(self._clock()):
                    self._moved(Mode.SILENT)
        finally:
            self._close()

    # -- sockets --------------------------------------------------------------------------------

    def _open(self) -> bool:
        try:
            for r in self.ranks:
                sub = r.sub = self._socket(zmq.SUB)
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.RCVHWM, self.cfg.rcvhwm)
                sub.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_message_bytes)
                sub.setsockopt(zmq.SUBSCRIBE, self.events.topic.encode())
                r.monitor = sub.get_monitor_socket(
                    zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
                    | zmq.EVENT_CONNECT_RETRIED)
                (sub.bind if self.events.bind else sub.connect)(r.endpoint)
        except zmq.ZMQError as exc:
            self._close()
            if self.listening.mode is Mode.CONNECTING:
                self._move(Mode.REFUSED, f"cannot listen ({exc.strerror})")
            return False
        return True

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        assert self.ctx is not None
        return self.ctx.socket(kind)

    def _close(self) -> None:
        for r in self.ranks:
            if r.sub is not None:
                with contextlib.suppress(zmq.ZMQError):
                    r.sub.disable_monitor()
                r.sub.close(linger=0)
            if r.monitor is not None:
                r.monitor.close(linger=0)
            r.sub = r.monitor = None
            r.connected = False

    async def _on_monitor(self, r: _Rank) -> None:
        assert r.monitor is not None
        event = parse_monitor_message(await r.monitor.recv_multipart())["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            r.connected = True
            r.seq.reconnected()
            await self._replay(r, r.seq.expected or 0)
            if all(x.connected for x in self.ranks) and not self.precise:
                self._move(Mode.PRECISE, "publisher connected")
        elif event == zmq.EVENT_DISCONNECTED:
            r.connected = False
            self._move(Mode.DISCONNECTED, "publisher disconnected")
        elif event == zmq.EVENT_CONNECT_RETRIED and self.listening.mode is Mode.CONNECTING:
            self._move(Mode.REFUSED, "publisher refuses connections")

    # -- batches --------------------------------------------------------------------------------

    def _decode(self, frames: list[bytes]) -> tuple[int, Batch] | None:
        """``(seq, batch)`` of ``[topic, seq, payload]``; None (counted) when malformed."""
        try:
            if len(frames) != 3 or len(frames[1]) != 8:
                raise BadBatch("not [topic, seq, payload]")
            if self._topic and frames[0] != self._topic:
                raise BadBatch("another topic")  # the socket subscribes by prefix
            seq = int.from_bytes(frames[1], "big")
            if seq >= MAX_SEQ:
                raise BadBatch("a sequence number no publisher reaches")
            # The socket already refused anything over max_message_bytes; msgpack bounds every
            # container by the payload's own length.
            body = msgpack.unpackb(frames[2], raw=False)
            batch = parse_batch(body, self._limits)
            if batch.rank >= len(self.ranks):
                raise BadBatch("a rank this engine does not have")
            return seq, batch
        except (BadBatch, ValueError, TypeError, msgpack.UnpackException):
            self._metrics.bad.labels(self.engine).inc()
            return None

    async def _drain(self, r: _Rank) -> None:
        """Every batch already queued on the rank's socket, up to ``_DRAIN``: one wake-up of
        the poller per burst rather than per batch (an engine publishes one batch a step)."""
        assert r.sub is not None
        work = 0
        for _ in range(_DRAIN):
            try:
                frames = await r.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                await self._on_message(r, frames)
            except Exception:  # a message must never end the listener
                self._metrics.bad.labels(self.engine).inc()
                log.warning("engine %s: a KV-event message could not be applied", self.engine,
                            exc_info=True)
            work += sum(len(f) for f in frames)
            if work >= _YIELD_BYTES:  # big batches: let the loop run between them
                work = 0
                await asyncio.sleep(0)

    async def _on_message(self, r: _Rank, frames: list[bytes]) -> None:
        decoded = self._decode(frames)
        if decoded is None:
            return
        seq, batch = decoded
        verdict = r.seq.classify(seq)
        if verdict is Seq.RESTART:
            self._restart("publisher_restarted")
            r.seq.restart()
            verdict = r.seq.classify(seq)
        if verdict is Seq.GAP:
            if r.seq.expected is not None:  # not merely joining a running publisher
                self._metrics.gaps.labels(self.engine).inc()
            if self._clock() - self._replay_failed_at >= self.cfg.replay_timeout_s:
                await self._replay(r, r.seq.expected or 0)
            verdict = r.seq.classify(seq)
            if verdict is Seq.GAP:
                self._give_up(r, seq)
                verdict = Seq.APPLY
        if verdict is Seq.APPLY:
            self._apply(r, seq, batch)

    def _give_up(self, r: _Rank, seq: int) -> None:
        """Batches before ``seq`` are lost: what they said is unknown, so start over."""
        if r.seq.expected is not None:
            self._restart("gap_not_filled")
        r.seq.skip_to(seq)

    def _apply(self, r: _Rank, seq: int, batch: Batch) -> None:
        self.index.apply(batch)
        r.seq.applied(seq)
        for i in range(len(batch.events)):
            self._metrics.events.labels(self.engine, _event_name(batch, i)).inc()
        if self.listening.published():
            self._moved(Mode.PRECISE)

    def _restart(self, reason: str) -> None:
        self.index.reset()
        self._metrics.restarts.labels(self.engine, reason).inc()
        now = self._clock()
        held = self._warn.due(now)
        if held is None:
            return
        also = f"; {held} more since the last line" if held else ""
        log.warning("engine %s: KV-event index emptied (%s%s)", self.engine,
                    reason.replace("_", " "), also)

    async def _replay(self, r: _Rank, start: int) -> None:
        """Ask the rank's replay socket for every batch from ``start`` on and apply them."""
        if r.replay is None:
            return
        sock = self._socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_message_bytes)
        outcome = "filled"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.replay_timeout_s
        try:
            sock.connect(r.replay)
            async with asyncio.timeout_at(deadline):
                await sock.send_multipart([b"", start.to_bytes(8, "big")])
                while True:
                    frames = await sock.recv_multipart()
                    if len(frames) == 4 and frames[0] == b"" and frames[2] == END_SEQ:
                        break
                    if not self._replayed(r, frames):
                        outcome = "partial"
                    # A receive that finds a batch queued returns without yielding: the deadline
                    # is checked here, and the loop gets its turn between batches.
                    if loop.time() >= deadline:
                        raise TimeoutError
                    await asyncio.sleep(0)
        except (TimeoutError, zmq.ZMQError):
            outcome = "failed"
            self._replay_failed_at = self._clock()
        finally:
            sock.close(linger=0)
        self._metrics.replays.labels(self.engine, outcome).inc()

    def _replayed(self, r: _Rank, frames: list[bytes]) -> bool:
        """Apply one replayed batch in order; False when one was missing before it."""
        decoded = self._decode(frames[1:]) if frames and frames[0] == b"" else None
        if decoded is None:
            return True
        seq, batch = decoded
        expected = r.seq.expected
        if expected is not None and seq < expected:
            return True
        complete = expected is None or seq == expected
        if not complete:
            self._give_up(r, seq)
        self._apply(r, seq, batch)
        return complete

    # -- state ----------------------------------------------------------------------------------

    def _move(self, to: Mode, why: str) -> None:
        if self.listening.change(to):
            self._moved(to, why)

    def _moved(self, to: Mode, why: str = "") -> None:
        if to is Mode.PRECISE:
            log.info("engine %s: KV events in sync (%s): routed from its exact index",
                     self.engine, why or "publishing again")
            return
        if to in _FALLBACKS:
            self._metrics.fallbacks.labels(self.engine, to.value).inc()
        why = why or "nothing published since prompt blocks were sent"
        log.warning("engine %s: KV events %s (%s): routed from the approximate index",
                    self.engine, to.value, why)

    def dispatched(self, new_blocks: list[int], now: float) -> None:
        """The proxy sent this engine a prompt whose ``new_blocks`` it did not hold."""
        if new_blocks:
            self.index.provisional(new_blocks, now)
            self.listening.sent_new_blocks(now)
