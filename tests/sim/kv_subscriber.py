"""A KV-event subscriber for tests: what a router does with vLLM's KV events, written from vLLM's
wire format (``vllm/distributed/kv_events.py``) and hashing rule
(``vllm/v1/core/kv_cache_utils.py`` with ``sha256_cbor``) and sharing no code with the simulator.

The subscriber binds its SUB socket on 127.0.0.1 and the engine connects to it (vLLM connects
when its endpoint names a host), so a test needs no fixed port. Replay goes through a DEALER
socket: ``[b"", start_seq]`` out, ``[b"", topic, seq, payload]`` back until the end marker.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio

END_SEQ = b"\xff" * 8


# -- sha256_cbor, written from RFC 8949's canonical rules ----------------------------------------

def _major(kind: int, n: int) -> bytes:
    for limit, extra, fmt in ((24, None, ""), (1 << 8, 24, ">B"), (1 << 16, 25, ">H"),
                              (1 << 32, 26, ">I"), (1 << 64, 27, ">Q")):
        if n < limit:
            if extra is None:
                return struct.pack(">B", kind << 5 | n)
            return struct.pack(">B", kind << 5 | extra) + struct.pack(fmt, n)
    raise ValueError(n)


def cbor(value: Any) -> bytes:
    if value is None:
        return b"\xf6"
    if isinstance(value, int):
        return _major(0, value) if value >= 0 else _major(1, -1 - value)
    if isinstance(value, bytes):
        return _major(2, len(value)) + value
    if isinstance(value, str):
        raw = value.encode()
        return _major(3, len(raw)) + raw
    if isinstance(value, tuple):
        return _major(4, len(value)) + b"".join(map(cbor, value))
    raise TypeError(type(value))


def sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor(value)).digest()


NONE_HASH = sha256_cbor("vllm-none-hash")


def block_hash(parent: bytes | None, tokens: Sequence[int], cache_salt: str | None = None
               ) -> bytes:
    extra = (("cache_salt", cache_salt),) if cache_salt else None
    return sha256_cbor((parent or NONE_HASH, tuple(tokens), extra))


def prompt_hashes(tokens: Sequence[int], block_size: int, cache_salt: str | None = None
                  ) -> list[bytes]:
    """The hashes of the full blocks of ``tokens``, as vLLM chains them."""
    out: list[bytes] = []
    for i in range(len(tokens) // block_size):
        out.append(block_hash(out[-1] if out else None,
                              tokens[i * block_size:(i + 1) * block_size],
                              cache_salt if i == 0 else None))
    return out


def on_wire(digest: bytes, int_hashes: bool = True) -> bytes | int:
    """A hash as events carry it: by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) the
    digest's low 64 bits as an integer, else the digest."""
    return int.from_bytes(digest[-8:], "big") if int_hashes else digest


def prompt_keys(tokens: Sequence[int], block_size: int, cache_salt: str | None = None,
                int_hashes: bool = True) -> list[bytes | int]:
    return [on_wire(h, int_hashes) for h in prompt_hashes(tokens, block_size, cache_salt)]


def verify_chains(events: list[dict[str, Any]]) -> int:
    """Every ``BlockStored`` event (in sequence order, from the engine's first) carries the hashes
    its token ids, its parent and its extra keys hash to; returns how many events were checked.
    A parent must have been stored by an earlier event (its full digest is needed to chain)."""
    digests: dict[bytes | int, bytes] = {}
    checked = 0
    for event in events:
        if event["type"] != "BlockStored":
            continue
        size, wire_parent = event["block_size"], event["parent_block_hash"]
        tokens, keys = event["token_ids"], event["extra_keys"]
        assert len(tokens) == size * len(event["block_hashes"])
        assert wire_parent is None or wire_parent in digests, "parent never stored"
        parent = None if wire_parent is None else digests[wire_parent]
        for i, got in enumerate(event["block_hashes"]):
            salt = keys[i][0] if keys and keys[i] else None
            parent = block_hash(parent, tokens[i * size:(i + 1) * size], salt)
            assert got == on_wire(parent, isinstance(got, int)), (
                f"block {i} of a BlockStored event has a hash vLLM would not give")
            digests[got] = parent
        checked += 1
    return checked


def reported_blocks(events: list[dict[str, Any]]) -> set[bytes | int]:
    """The blocks the events say the engine holds: stored, less removed, since the last clear."""
    held: set[bytes | int] = set()
    for event in events:
        if event["type"] == "BlockStored":
            held.update(event["block_hashes"])
        elif event["type"] == "BlockRemoved":
            held.difference_update(event["block_hashes"])
        elif event["type"] == "AllBlocksCleared":
            held.clear()
    return held


# -- receiving -----------------------------------------------------------------------------------

@dataclass
class Batch:
    seq: int
    ts: float
    events: list[dict[str, Any]]
    rank: int | None
    payload: bytes


def decode(topic: bytes, seq: bytes, payload: bytes) -> Batch:
    body = msgpack.unpackb(payload, raw=False)
    assert isinstance(body, list) and 2 <= len(body) <= 3, body
    return Batch(int.from_bytes(seq, "big"), body[0], body[1],
                 body[2] if len(body) == 3 else None, payload)


class Subscriber:
    def __init__(self, topic: bytes = b"", bind: str = "tcp://127.0.0.1:0",
                 connect: str | None = None) -> None:
        """Bind ``bind`` (the engine connects), or connect to a publisher that binds."""
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        if connect is not None:
            self._sub.connect(connect)
            self.endpoint = connect
        else:
            self._sub.bind(bind)
            self.endpoint = self._sub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.batches: dict[int, Batch] = {}

    async def receive(self, timeout_s: float) -> Batch | None:
        try:
            frames = await asyncio.wait_for(self._sub.recv_multipart(), timeout_s)
        except TimeoutError:
            return None
        assert len(frames) == 3, frames
        batch = decode(*frames)
        self.batches[batch.seq] = batch
        return batch

    async def until(self, done: Callable[[list[dict[str, Any]]], bool], timeout_s: float = 10.0,
                    replay_endpoint: str | None = None) -> list[dict[str, Any]]:
        """Receive until ``done(events so far, in sequence order)``; a gap in the sequence is
        filled from the replay endpoint (the way a router recovers), so a batch sent before the
        subscription took hold is not lost."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not done(self.events()):
            left = deadline - loop.time()
            assert left > 0, f"no matching KV events in {timeout_s}s; got {self.events()}"
            got = await self.receive(min(left, 0.5))
            if replay_endpoint and (got is None or self._gap()):
                for batch in await replay(replay_endpoint, 0, self._ctx):
                    self.batches.setdefault(batch.seq, batch)
        return self.events()

    def _gap(self) -> bool:
        """Whether a batch since the engine started (sequence 0) is missing."""
        return len(self.batches) != max(self.batches, default=-1) + 1

    def events(self) -> list[dict[str, Any]]:
        return [e for seq in sorted(self.batches) for e in self.batches[seq].events]

    def close(self) -> None:
        self._sub.close(linger=0)
        self._ctx.term()


async def replay(endpoint: str, start: int, ctx: zmq.asyncio.Context | None = None,
                 timeout_s: float = 10.0) -> list[Batch]:
    """Every buffered batch from ``start`` on, asked of a replay endpoint."""
    own = ctx is None
    ctx = ctx or zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    out: list[Batch] = []
    try:
        sock.connect(endpoint)
        await sock.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            frames = await asyncio.wait_for(sock.recv_multipart(), timeout_s)
            assert frames[0] == b"" and len(frames) == 4, frames
            if frames[2] == END_SEQ:
                return out
            out.append(decode(*frames[1:]))
    finally:
        sock.close(linger=0)
        if own:
            with contextlib.suppress(zmq.ZMQError):
                ctx.term()
