"""The proxy's KV-event listener against a publisher on real ZMQ sockets (127.0.0.1, port 0) that
the test drives batch by batch: a gap is filled from the replay socket, hostile frames are counted
and dropped, a publisher that goes away or refuses moves the engine to the approximate index."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable

import msgpack
import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from engine_sidecar.sim.kvevents import BlockStored, encode_batch
from proxy.core.blockhash import hash_block_tokens, int_hash
from proxy.core.kv_config import EngineEvents, KvEventsConfig
from proxy.core.kvstate import Mode
from proxy.fleet.kvevents import END_SEQ, EngineListener
from proxy.observe.kvmetrics import KvEventMetrics


class Publisher:
    """vLLM's publisher, by hand: PUB for live batches, ROUTER answering replays from a buffer."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:0")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:0")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: list[tuple[int, bytes]] = []
        self.replays = 0
        self._task = asyncio.create_task(self._serve())

    @staticmethod
    def batch(tokens: int) -> tuple[bytes, int]:
        """A one-block BlockStored batch and the key of its block."""
        digest = hash_block_tokens(None, [tokens] * 4)
        return encode_batch(1.0, [BlockStored([digest], None, [tokens] * 4, 4, [None])]), \
            int_hash(digest)

    async def send(self, seq: int, payload: bytes, live: bool = True) -> None:
        self.buffer.append((seq, payload))
        if live:
            await self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    async def _serve(self) -> None:
        while True:
            ident, _, start = await self.router.recv_multipart()
            self.replays += 1
            for seq, payload in self.buffer:
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart(
                        [ident, b"", b"", seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([ident, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.pub.close(linger=0)
        self.router.close(linger=0)


async def until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():  # noqa: ASYNC110 (polls state another task changes)
            await asyncio.sleep(0.01)


async def prime(pub: Publisher, listener: EngineListener) -> int:
    """Publish until a batch got through (a SUB misses what is sent before its subscription
    reaches the PUB, as with vLLM); returns the next sequence number."""
    seq = 0
    async with asyncio.timeout(10):
        while listener.row()["last_seq"] is None:
            await pub.send(seq, Publisher.batch(1000 + seq)[0])
            seq += 1
            await asyncio.sleep(0.05)
    await until(lambda: listener.row()["last_seq"] == seq - 1, "caught up")
    return seq


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.term()


@contextlib.asynccontextmanager
async def listening(ctx: zmq.asyncio.Context, endpoint: str, replay: str | None,
                    **cfg: float) -> AsyncIterator[tuple[EngineListener, KvEventMetrics]]:
    metrics = KvEventMetrics(CollectorRegistry())
    listener = EngineListener("e1", EngineEvents(endpoint, replay),
                              KvEventsConfig(**{"replay_timeout_s": 2.0, **cfg}), metrics,  # type: ignore[arg-type]
                              time.monotonic)
    listener.ctx = ctx
    task = asyncio.create_task(listener.run(), name="test-listener")
    try:
        yield listener, metrics
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def count(metrics: KvEventMetrics, name: str, **labels: str) -> float:
    counter = getattr(metrics, name)
    value = counter.labels(**labels)._value.get()
    return float(value)


async def test_a_gap_is_filled_from_the_replay_socket(ctx: zmq.asyncio.Context) -> None:
    pub = Publisher(ctx)
    try:
        async with listening(ctx, pub.endpoint, pub.replay_endpoint) as (listener, metrics):
            await until(lambda: listener.precise, "in sync")
            n = await prime(pub, listener)
            batches = [Publisher.batch(t) for t in (1, 2)]
            assert count(metrics, "gaps", engine="e1") == 0
            await pub.send(n, batches[0][0], live=False)  # lost on the way
            await pub.send(n + 1, batches[1][0])
            await until(lambda: {k for _, k in batches} <= listener.index.keys(), "replayed")
            assert count(metrics, "gaps", engine="e1") == 1
            assert count(metrics, "replays", engine="e1", outcome="filled") >= 1
            assert listener.row()["last_seq"] == n + 1
            assert listener.precise
    finally:
        await pub.close()


async def test_hostile_frames_are_counted_and_dropped(ctx: zmq.asyncio.Context) -> None:
    pub = Publisher(ctx)
    try:
        async with listening(ctx, pub.endpoint, pub.replay_endpoint) as (listener, metrics):
            await until(lambda: listener.precise, "in sync")
            n = await prime(pub, listener)
            good, _ = Publisher.batch(7)
            for frames in ([b"only-one"], [b"", b"short", good], [b"", (1).to_bytes(8, "big"),
                           b"\xc1\xff not msgpack"], [b"", (1).to_bytes(8, "big"),
                           b"\x93\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00\x91\x01\x00"]):
                await pub.pub.send_multipart(frames)
            late, late_key = Publisher.batch(8)
            await pub.send(n, late)
            await until(lambda: late_key in listener.index, "the next good batch")
            assert count(metrics, "bad", engine="e1") == 4
            assert listener.precise
    finally:
        await pub.close()


async def test_a_publisher_that_goes_away_is_a_fallback(ctx: zmq.asyncio.Context) -> None:
    pub = Publisher(ctx)
    async with listening(ctx, pub.endpoint, pub.replay_endpoint) as (listener, metrics):
        await until(lambda: listener.precise, "in sync")
        await pub.close()
        await until(lambda: listener.listening.mode is Mode.DISCONNECTED, "disconnected")
        assert count(metrics, "fallbacks", engine="e1", state="disconnected") == 1
        assert listener.row()["mode"] == "approximate"


async def test_a_publisher_that_refuses_is_a_fallback_and_a_silent_one_too(
        ctx: zmq.asyncio.Context) -> None:
    with zmq.Context() as probe, probe.socket(zmq.PUB) as s:
        port = s.bind_to_random_port("tcp://127.0.0.1")
    async with listening(ctx, f"tcp://127.0.0.1:{port}", None) as (listener, metrics):
        await until(lambda: listener.listening.mode is Mode.REFUSED, "refused")
        assert count(metrics, "fallbacks", engine="e1", state="refused") == 1
    pub = Publisher(ctx)
    try:
        async with listening(ctx, pub.endpoint, None, silent_after_s=0.2) as (listener, metrics):
            await until(lambda: listener.precise, "in sync")
            listener.dispatched([123], time.monotonic())
            assert listener.index.held_blocks([123], time.monotonic()) == 1  # provisional
            await until(lambda: listener.listening.mode is Mode.SILENT, "silent")
            await prime(pub, listener)
            await until(lambda: listener.precise, "publishing again")
            assert count(metrics, "fallbacks", engine="e1", state="silent") == 1
    finally:
        await pub.close()


async def _turns(seen: list[int], replay: _EndlessReplay, stop: asyncio.Event) -> None:
    """Record how many batches the replay had received each time this task got a turn: a
    replay that holds the loop shows as a jump between entries, whatever the machine's speed."""
    while not stop.is_set():
        seen.append(replay.seq)
        await asyncio.sleep(0)


class _EndlessReplay:
    """A replay socket with a batch always queued: pyzmq then hands back a finished future for
    each receive, so awaiting it never gives the event loop a turn (what a publisher that
    answers a replay for ever, as fast as it can, does to the proxy)."""

    def __init__(self) -> None:
        self.seq = 0
        self.payloads = [Publisher.batch(t)[0] for t in range(64)]

    def setsockopt(self, *args: object) -> None:
        pass

    def connect(self, endpoint: str) -> None:
        pass

    def close(self, linger: int = 0) -> None:
        pass

    def send_multipart(self, frames: list[bytes]) -> asyncio.Future[None]:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    def recv_multipart(self) -> asyncio.Future[list[bytes]]:
        ready: asyncio.Future[list[bytes]] = asyncio.get_running_loop().create_future()
        ready.set_result([b"", b"", self.seq.to_bytes(8, "big"), self.payloads[self.seq % 64]])
        self.seq += 1
        return ready


async def test_a_replay_that_never_ends_stops_at_its_deadline_and_never_holds_the_loop(
    ctx: zmq.asyncio.Context,
) -> None:
    metrics = KvEventMetrics(CollectorRegistry())
    listener = EngineListener("e1", EngineEvents("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"),
                              KvEventsConfig(replay_timeout_s=0.5), metrics, time.monotonic)
    endless = _EndlessReplay()
    listener._socket = lambda kind: endless  # type: ignore[assignment,method-assign,return-value]
    stop = asyncio.Event()
    seen: list[int] = []
    turns = asyncio.create_task(_turns(seen, endless, stop))
    await asyncio.sleep(0)
    started = time.monotonic()
    try:
        await listener._replay(listener.ranks[0], 0)
    finally:
        stop.set()
        await turns
    # The deadline is 0.5 s; the bound only tells "stopped" from "ran on" on a loaded machine.
    assert time.monotonic() - started < 5
    assert count(metrics, "replays", engine="e1", outcome="failed") == 1
    assert endless.seq > 100 and len(seen) > 100
    # Other tasks got a turn after every batch or two, never after a run of them.
    assert max(b - a for a, b in itertools.pairwise(seen)) <= 2, seen[:20]


async def test_numbers_no_publisher_reaches_and_ranks_it_lacks_are_bad_messages(
    ctx: zmq.asyncio.Context,
) -> None:
    pub = Publisher(ctx)
    try:
        async with listening(ctx, pub.endpoint, pub.replay_endpoint) as (listener, metrics):
            await until(lambda: listener.precise, "in sync")
            n = await prime(pub, listener)
            huge, huge_key = Publisher.batch(9)
            await pub.pub.send_multipart([b"", b"\xff" * 8, huge])  # 2**64 - 1
            other = msgpack.packb([1.0, [], 1])  # rank 1 of a one-rank engine
            await pub.pub.send_multipart([b"", n.to_bytes(8, "big"), other])
            late, late_key = Publisher.batch(10)
            await pub.send(n, late)
            await until(lambda: late_key in listener.index, "the next good batch")
            assert count(metrics, "bad", engine="e1") == 2
            assert huge_key not in listener.index and listener.row()["last_seq"] == n
            assert listener.precise
    finally:
        await pub.close()


async def test_a_storm_of_restarts_is_one_log_line(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    pub = Publisher(ctx)
    try:
        async with listening(ctx, pub.endpoint, pub.replay_endpoint) as (listener, metrics):
            await until(lambda: listener.precise, "in sync")
            await prime(pub, listener)
            with caplog.at_level("WARNING", logger="proxy.fleet.kvevents"):
                for i in range(50):  # every one a restart (seq 0 again and again)
                    await pub.pub.send_multipart([b"", (0).to_bytes(8, "big"),
                                                  Publisher.batch(2000 + i)[0]])
                await until(lambda: count(metrics, "restarts", engine="e1",
                                          reason="publisher_restarted") >= 50, "restarts")
            lines = [r for r in caplog.records if "index emptied" in r.getMessage()]
            assert len(lines) == 1
    finally:
        await pub.close()
