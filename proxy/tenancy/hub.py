"""The local transport between the workers of one ``kvproxy serve --workers N``: a hub on a Unix
socket owned by the parent process, which forwards every worker's messages to its siblings.

Rules:
- A frame is a 4-byte big-endian length, one kind byte, then the payload. A worker's first frame is
  ``HELLO`` with its index (that is also how the parent learns the worker is serving); every later
  frame is ``DATA`` (routing state, fetched by ``shared_routing``'s rounds, each arrival also
  waking a quiet round through ``HubBus.listen``) or ``TELEMETRY``
  (scrape outcomes, ``proxy.fleet.scrape_share``: handed to ``HubBus.on_telemetry`` as they
  arrive) and is forwarded as it is to every other worker. The hub never parses payloads.
- Bounded everywhere: a frame over ``max_frame`` closes that connection; a sibling whose socket
  buffer already holds ``max_buffer`` bytes misses the frame (counted in ``dropped``) rather than
  growing the hub's memory; a worker's inbound queue keeps at most ``max_queue`` frames (oldest go).
- The socket lives in a directory only the parent's user can enter (``tempfile.mkdtemp``). Even
  so the hub bounds what a connection can hold: one that has not said ``HELLO`` within
  ``HELLO_TIMEOUT_S`` is closed, a ``HELLO`` naming a seat outside ``0..seats-1`` is refused, and
  past ``max_connections`` open at once a new one is closed at once (a process of the same user
  opening connections and saying nothing ran the parent out of file descriptors, and with them
  out of the means to restart a worker).
- A worker that loses the hub keeps serving alone and reconnects with a bounded back-off.
- Liveness: a worker also sends ``BEAT`` (empty, never forwarded) every ``beat_s`` from its event
  loop; the hub keeps when it last heard from each worker (``last_heard``, any frame), which is
  how the parent tells a stuck worker (stopped, or blocked in one call) from a quiet one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections import deque
from collections.abc import Callable

log = logging.getLogger("kvproxy.hub")

HELLO = 1
DATA = 2
TELEMETRY = 3
BEAT = 4
_FORWARDED = frozenset({DATA, TELEMETRY})
MAX_FRAME = 1 << 20
# A worker says hello as soon as it has connected; this leaves a slow start-up room to spare.
HELLO_TIMEOUT_S = 10.0
_HEAD = struct.Struct(">IB")


def beat_interval(stuck_after_s: float) -> float:
    """How often a worker beats, and the parent looks, for a given patience: several beats fit
    in it, so one late wake-up is not a stuck worker."""
    return stuck_after_s / 5


class BusDown(Exception):
    """The transport cannot carry messages now (not connected, Redis failing)."""


def frame(kind: int, payload: bytes) -> bytes:
    return _HEAD.pack(len(payload), kind) + payload


async def read_frame(reader: asyncio.StreamReader, max_frame: int) -> tuple[int, bytes]:
    """The next frame; ``EOFError`` at the end, ``ValueError`` for one over ``max_frame``."""
    try:
        head = await reader.readexactly(_HEAD.size)
        size, kind = _HEAD.unpack(head)
        if size > max_frame:
            raise ValueError(f"frame of {size} bytes")
        return kind, await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise EOFError from None


class Hub:
    """The parent's side: accepts workers and forwards each one's frames to the others."""

    def __init__(self, path: str, *, on_hello: Callable[[int], None] | None = None,
                 seats: int = 1024, max_frame: int = MAX_FRAME,
                 max_buffer: int = 8 * MAX_FRAME, max_connections: int | None = None,
                 hello_timeout_s: float = HELLO_TIMEOUT_S) -> None:
        self.path = path
        self._on_hello = on_hello
        self._seats = seats
        self._max_frame = max_frame
        self._max_buffer = max_buffer
        # Room for every seat twice over (a restarted worker's connection may overlap the old).
        self._max_connections = 2 * seats + 8 if max_connections is None else max_connections
        self._hello_timeout_s = hello_timeout_s
        self._open = 0
        self.refused = 0  # connections closed for the bounds above
        self._workers: dict[int, asyncio.StreamWriter] = {}
        # The loop's time of the last frame from each worker index (kept after a disconnect).
        self.last_heard: dict[int, float] = {}
        self._server: asyncio.Server | None = None
        self.forwarded = 0
        self.dropped = 0

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, self.path)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._workers.values()):
            writer.close()
        self._workers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index: int | None = None
        self._open += 1
        try:
            if self._open > self._max_connections:
                self.refused += 1
                return
            try:
                async with asyncio.timeout(self._hello_timeout_s):
                    kind, payload = await read_frame(reader, self._max_frame)
            except TimeoutError:
                self.refused += 1
                return
            seat = int(payload) if kind == HELLO and payload.isdigit() else -1
            if not 0 <= seat < self._seats:
                self.refused += 1
                return
            index = seat
            clock = asyncio.get_running_loop().time
            self.last_heard[index] = clock()
            old = self._workers.pop(index, None)
            if old is not None:
                old.close()
            self._workers[index] = writer
            if self._on_hello is not None:
                self._on_hello(index)
            while True:
                kind, payload = await read_frame(reader, self._max_frame)
                self.last_heard[index] = clock()
                if kind in _FORWARDED:
                    self._forward(index, frame(kind, payload))
        except (EOFError, ValueError, ConnectionError):
            pass
        finally:
            self._open -= 1
            if index is not None and self._workers.get(index) is writer:
                del self._workers[index]
            writer.close()

    def _forward(self, sender: int, data: bytes) -> None:
        for index, writer in self._workers.items():
            if index == sender:
                continue
            if writer.transport.get_write_buffer_size() > self._max_buffer:
                self.dropped += 1
                continue
            writer.write(data)
            self.forwarded += 1


class HubBus:
    """A worker's side: publishes to the hub and queues what its siblings publish."""

    def __init__(self, path: str, index: int, *, max_frame: int = MAX_FRAME,
                 max_queue: int = 1024, max_buffer: int = 8 * MAX_FRAME,
                 beat_s: float = 2.0) -> None:
        self.path = path
        self.index = index
        self.beat_s = beat_s
        self._max_frame = max_frame
        self._max_buffer = max_buffer
        self._inbox: deque[bytes] = deque(maxlen=max_queue)
        self._writer: asyncio.StreamWriter | None = None
        self.dropped = 0
        # Called with each ``TELEMETRY`` payload as it arrives; it must not raise.
        self.on_telemetry: Callable[[bytes], None] | None = None
        self._on_data: Callable[[], None] | None = None

    def listen(self, wake: Callable[[], None]) -> bool:
        """Call ``wake`` (cheap, must not raise) whenever routing state arrives; True: the
        sharing rounds need not poll this transport."""
        self._on_data = wake
        return True

    @property
    def live(self) -> bool:
        return self._writer is not None and not self._writer.is_closing()

    async def publish(self, payload: bytes) -> None:
        if self._write(DATA, payload) is None:
            raise BusDown("not connected to the workers' hub")

    def send_telemetry(self, payload: bytes) -> bool:
        """Hand ``payload`` to the siblings as ``TELEMETRY``; False when it cannot go now."""
        return bool(self._write(TELEMETRY, payload))

    def _write(self, kind: int, payload: bytes) -> bool | None:
        """Write one frame: True; False when the hub's buffer is full (the frame is dropped and
        counted); None when not connected."""
        writer = self._writer
        if writer is None or writer.is_closing():
            return None
        if writer.transport.get_write_buffer_size() > self._max_buffer:
            self.dropped += 1
            return False
        writer.write(frame(kind, payload))
        return True

    async def fetch(self) -> list[bytes]:
        if not self.live and not self._inbox:
            raise BusDown("not connected to the workers' hub")
        items = list(self._inbox)
        self._inbox.clear()
        return items

    async def run(self) -> None:
        """Stay connected (reconnecting with back-off) until cancelled."""
        delay = 0.05
        while True:
            try:
                await self._session()
                delay = 0.05
            except (OSError, EOFError, ValueError) as exc:
                log.debug("workers' hub connection lost: %s", exc)
            finally:
                if self._writer is not None:
                    self._writer.close()
                    self._writer = None
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 2)

    async def _session(self) -> None:
        reader, writer = await asyncio.open_unix_connection(self.path)
        writer.write(frame(HELLO, str(self.index).encode()))
        await writer.drain()
        self._writer = writer
        beats = asyncio.get_running_loop().create_task(self._beat(), name="kvproxy-hub-beat")
        try:
            await self._receive(reader)
        finally:
            beats.cancel()

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.beat_s)
            self._write(BEAT, b"")

    async def _receive(self, reader: asyncio.StreamReader) -> None:
        while True:
            kind, payload = await read_frame(reader, self._max_frame)
            if kind == DATA:
                if len(self._inbox) == self._inbox.maxlen:
                    self.dropped += 1
                self._inbox.append(payload)
                if self._on_data is not None:
                    self._on_data()
            elif kind == TELEMETRY and self.on_telemetry is not None:
                try:
                    self.on_telemetry(payload)
                except Exception:
                    # A bug in one consumer must not cut the routing state off with it.
                    log.exception("handling a sibling's telemetry failed")

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(ConnectionError):
                await self._writer.wait_closed()
            self._writer = None
