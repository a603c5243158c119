"""vLLM's KV-cache events (``vllm.distributed.kv_events``, vLLM 0.32) as the simulator emits them.

Rules:
- Three events, with vLLM's fields in vLLM's order: ``BlockStored`` (newly cached full blocks of
  one request, chained from ``parent_block_hash``), ``BlockRemoved`` (one evicted block hash per
  event, as vLLM emits them) and ``AllBlocksCleared`` (a prefix-cache reset).
- The wire form is what vLLM's msgspec encoder writes: a batch is the array
  ``[ts, [event, ...], data_parallel_rank]`` (``array_like``); each event is a map tagged
  ``"type": <class name>`` whose fields without a default are always present and whose fields at
  their default (``None``) are left out (``omit_defaults``). The medium is ``"GPU"``, the KV-cache
  group ``0`` and its kind ``"full_attention"`` (vLLM's KV-cache manager annotates stored blocks).
- A hash goes on the wire as vLLM 0.32 sends it by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``
  on): the digest's last 8 bytes as an unsigned big-endian integer; with ``int_hashes`` off, the
  whole 32-byte digest (msgpack bin).
- A ZMQ message is ``[topic, seq (8-byte big-endian), payload]``; a replay request is
  ``[identity, b"", start_seq]`` on a ROUTER socket and is answered by every buffered message from
  ``start_seq`` on, then ``[identity, b"", b"", END_SEQ, b""]``.
- Endpoints follow vLLM's rule: a wildcard (``*``, ``::``) or ``ipc://``/``inproc://`` endpoint is
  bound, any other is connected to (the subscriber binds); the replay endpoint is always bound.
- Pure: no sockets and no clock here; ``kvpublisher`` performs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import msgpack

from proxy.core.blockhash import int_hash

MEDIUM_GPU = "GPU"
SPEC_KIND = "full_attention"
WireHash = Callable[[bytes], bytes | int]


def bytes_hash(digest: bytes) -> bytes:
    return digest
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    extra_keys: list[tuple[str, ...] | None]

    def wire(self, h: WireHash) -> dict[str, object]:
        parent = self.parent_block_hash
        return {
            "type": "BlockStored", "block_hashes": [h(b) for b in self.block_hashes],
            "parent_block_hash": None if parent is None else h(parent),
            "token_ids": self.token_ids, "block_size": self.block_size, "lora_id": None,
            "medium": MEDIUM_GPU, "lora_name": None, "extra_keys": self.extra_keys,
            "group_idx": 0, "kv_cache_spec_kind": SPEC_KIND,
        }


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hash: bytes

    def wire(self, h: WireHash) -> dict[str, object]:
        return {"type": "BlockRemoved", "block_hashes": [h(self.block_hash)],
                "medium": MEDIUM_GPU, "group_idx": 0}


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    def wire(self, h: WireHash) -> dict[str, object]:
        return {"type": "AllBlocksCleared"}


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


def encode_batch(ts: float, events: Sequence[KvEvent], data_parallel_rank: int = 0, *,
                 int_hashes: bool = True) -> bytes:
    """The payload frame of one batch, byte for byte what vLLM's publisher sends."""
    h = int_hash if int_hashes else bytes_hash
    body = [ts, [e.wire(h) for e in events], data_parallel_rank]
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def parse_replay_request(frames: Sequence[bytes]) -> tuple[bytes, int] | None:
    """``(identity, start_seq)`` of a replay request, or ``None`` if it is malformed."""
    if len(frames) != 3 or frames[1] != b"" or len(frames[2]) > 8:
        return None
    return frames[0], int.from_bytes(frames[2], "big")


def binds(endpoint: str) -> bool:
    """Whether the publisher binds ``endpoint`` (else it connects), as vLLM decides."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint(endpoint: str | None, index: int) -> str | None:
    """The endpoint of the ``index``-th engine of a process: a TCP port moves up by ``index``
    (port 0 stays 0), an inproc name gets ``_dp<index>``; vLLM does this per data-parallel rank."""
    if endpoint is None or index == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{index}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + index}"
    return endpoint


def _check_endpoint(name: str, endpoint: str) -> None:
    if not endpoint.startswith(_SCHEMES):
        raise ValueError(f"{name} must start with tcp://, ipc:// or inproc://")
    if endpoint.startswith("tcp://"):
        port = endpoint.rpartition(":")[2]
        if not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"{name} must end with a TCP port")


@dataclass(frozen=True)
class KvEventsSettings:
    """Publishing of KV events (vLLM's ``--kv-events-config``); off unless ``endpoint`` is set."""

    endpoint: str | None = None
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    max_queue_size: int = 100_000
    hwm: int = 100_000
    int_hashes: bool = True  # vLLM's default; False: whole digests, as VLLM_KV_EVENTS_..._HASHES=0

    def __post_init__(self) -> None:
        if self.endpoint is not None:
            _check_endpoint("kv_events.endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            if self.endpoint is None:
                raise ValueError("kv_events.replay_endpoint needs kv_events.endpoint")
            _check_endpoint("kv_events.replay_endpoint", self.replay_endpoint)
        for name in ("buffer_steps", "max_queue_size", "hwm"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv_events.{name} must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None

    def for_engine(self, index: int) -> KvEventsSettings:
        """These settings for the ``index``-th engine of a process (ports offset by ``index``)."""
        return replace(self, endpoint=offset_endpoint(self.endpoint, index),
                       replay_endpoint=offset_endpoint(self.replay_endpoint, index))
