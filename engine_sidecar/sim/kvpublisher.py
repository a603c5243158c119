"""Publishes one engine's KV events over ZMQ the way vLLM's ``ZmqEventPublisher`` does.

Rules:
- ``publish`` is called by the engine's step loop with one step's events and never waits: the batch
  gets the next sequence number and goes into a bounded queue; when the queue is full the batch is
  dropped and counted (its sequence number is skipped, so subscribers see the gap). vLLM blocks its
  scheduler instead; a simulated engine must never stall on a slow subscriber.
- One named task drains the queue: it encodes each batch, sends ``[topic, seq, payload]`` on the
  PUB socket (which drops at its high-water mark rather than block) and keeps the last
  ``buffer_steps`` messages for replay (ROUTER drops for a peer that reads too slowly, so
  replies never block either). A second named task answers replay requests on the ROUTER
  socket from that buffer (``kvevents`` has the framing); replay messages are at most 8 bytes of
  sequence, larger ones are refused by the socket.
- Endpoints bind or connect as vLLM decides (``kvevents.binds``); ``endpoint`` and
  ``replay_endpoint`` report the bound addresses (port 0 resolved). ``close`` cancels both tasks
  and closes the sockets without lingering; it is idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.asyncio

from engine_sidecar.sim.kvevents import (
    END_SEQ,
    KvEvent,
    KvEventsSettings,
    binds,
    encode_batch,
    parse_replay_request,
    seq_bytes,
)

log = logging.getLogger(__name__)
_REPLAY_YIELD_EVERY = 256  # replaying a long buffer must not hold the event loop


class KvEventPublisher:
    def __init__(self, settings: KvEventsSettings, name: str) -> None:
        assert settings.endpoint is not None
        self.settings = settings
        self.name = name
        self.published = 0
        self.dropped = 0
        self._topic = settings.topic.encode("utf-8")
        self._seq = itertools.count()
        self._queue: asyncio.Queue[tuple[int, float, Sequence[KvEvent]]] = asyncio.Queue(
            maxsize=settings.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=settings.buffer_steps)
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.endpoint = settings.endpoint
        self.replay_endpoint = settings.replay_endpoint

    def start(self) -> None:
        """Open the sockets and start the tasks; socket errors (a port in use) propagate."""
        try:
            self._open()
        except BaseException:
            self._close_sockets()
            raise
        self._tasks = [
            asyncio.create_task(self._send_loop(), name=f"kv-events-send:{self.name}"),
        ]
        if self._replay is not None:
            self._tasks.append(
                asyncio.create_task(self._replay_loop(), name=f"kv-events-replay:{self.name}"))

    def _open(self) -> None:
        self._pub.set_hwm(self.settings.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if binds(self.endpoint):
            self._pub.bind(self.endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._pub.connect(self.endpoint)
        if self.settings.replay_endpoint is not None:
            replay = self._ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.setsockopt(zmq.MAXMSGSIZE, 64)
            self._replay = replay
            replay.bind(self.settings.replay_endpoint)
            self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)

    def publish(self, events: Sequence[KvEvent]) -> None:
        """Queue one step's events as one batch; drop (and count) it if the queue is full."""
        seq = next(self._seq)
        try:
            self._queue.put_nowait((seq, time.time(), events))
        except asyncio.QueueFull:
            self.dropped += 1

    async def _send_loop(self) -> None:
        while True:
            seq, ts, events = await self._queue.get()
            payload = encode_batch(ts, events, int_hashes=self.settings.int_hashes)
            frames = (self._topic, seq_bytes(seq), payload)
            # PUB drops at its high-water mark instead of blocking, so this completes at once.
            await self._pub.send_multipart(frames)
            self.published += 1
            self._buffer.append((seq, payload))

    async def _replay_loop(self) -> None:
        assert self._replay is not None
        while True:
            request = parse_replay_request(await self._replay.recv_multipart())
            if request is None:
                log.warning("engine %s: ignored a malformed KV-event replay request", self.name)
                continue
            await self._answer(*request)

    async def _answer(self, identity: bytes, start: int) -> None:
        assert self._replay is not None
        sent = 0
        for seq, payload in list(self._buffer):
            if seq < start:
                continue
            await self._replay.send_multipart((identity, b"", self._topic, seq_bytes(seq),
                                               payload))
            sent += 1
            if sent % _REPLAY_YIELD_EVERY == 0:
                await asyncio.sleep(0)
        await self._replay.send_multipart((identity, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        self._close_sockets()

    def _close_sockets(self) -> None:
        if self._ctx.closed:
            return
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def state(self) -> dict[str, object]:
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                "published": self.published, "dropped": self.dropped,
                "queued": self._queue.qsize()}
