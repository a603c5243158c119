"""The exact prefix index: per engine, the KV blocks its own events say it holds.

Rules:
- A batch is what vLLM 0.32 publishes, decoded from msgpack by the shell: ``[ts, [event, ...],
  rank]`` (the rank may be missing), each event a map tagged ``"type"``: ``BlockStored``
  (``block_hashes``, ``block_size``), ``BlockRemoved`` (``block_hashes``), ``AllBlocksCleared``.
  Other fields are ignored; an unknown event type is skipped (a newer vLLM), anything malformed
  makes the whole batch a ``BadBatch`` (the shell counts and drops it). Sizes are bounded.
- A hash is keyed by its 64-bit integer form (``blockhash.int_hash``): vLLM's default integer
  hashes as they are, whole 32-byte digests by their low 64 bits.
- Each engine's index is bounded (``capacity`` blocks): past it the oldest stored block is
  forgotten, so the index can under-state what an engine holds, never over-state it. A block is
  held per data-parallel rank; ``AllBlocksCleared`` from a rank clears that rank's blocks.
- ``held_blocks`` is the longest prefix of a request's block keys the engine holds, walking from
  the first block as vLLM's cache lookup does; blocks the proxy just sent there count too for
  ``provisional_s`` (so a burst sharing a new prefix follows its first request before the engine
  has reported the blocks). ``settled_blocks`` counts only the reported blocks (what the
  engine is known to have computed).
- Pure: no I/O; the clock is passed in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from proxy.core.blockhash import int_hash

_MASK64 = (1 << 64) - 1
MAX_RANK = 63


class BadBatch(ValueError):
    """A batch that is not what vLLM publishes; it is dropped whole."""


@dataclass(frozen=True, slots=True)
class Stored:
    keys: tuple[int, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class Removed:
    keys: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class Batch:
    ts: float
    events: tuple[Event, ...]
    rank: int


@dataclass(frozen=True)
class Limits:
    max_events: int = 65_536
    max_hashes: int = 65_536
    # Block hashes in one batch, all events together: a batch storing more than an index holds
    # says nothing an index could keep, and would cost seconds of the event loop to apply.
    max_batch_hashes: int = 262_144


def wire_key(value: object) -> int:
    """The 64-bit key of a hash as events carry it (an integer or a digest)."""
    if isinstance(value, bool):
        raise BadBatch("a block hash is a boolean")
    if isinstance(value, int):
        if not -(1 << 63) <= value <= _MASK64:
            raise BadBatch("a block hash is wider than 64 bits")
        return value & _MASK64
    if isinstance(value, bytes) and 1 <= len(value) <= 64:
        return int_hash(value)
    raise BadBatch("a block hash is neither an integer nor a digest")


def _keys(event: Mapping[object, object], limits: Limits) -> tuple[int, ...]:
    hashes = event.get("block_hashes")
    if not isinstance(hashes, list) or len(hashes) > limits.max_hashes:
        raise BadBatch("block_hashes is not a list of bounded length")
    return tuple(wire_key(h) for h in hashes)


def _event(event: object, limits: Limits) -> Event | None:
    if not isinstance(event, dict):
        raise BadBatch("an event is not a map")
    kind = event.get("type")
    if kind == "BlockStored":
        size = event.get("block_size")
        if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= 1 << 20:
            raise BadBatch("block_size is not a positive integer")
        return Stored(_keys(event, limits), size)
    if kind == "BlockRemoved":
        return Removed(_keys(event, limits))
    if kind == "AllBlocksCleared":
        return Cleared()
    if isinstance(kind, str):
        return None  # an event this proxy does not know (a newer vLLM): skipped
    raise BadBatch("an event has no type")


def parse_batch(body: object, limits: Limits = Limits()) -> Batch:
    """A decoded payload as a ``Batch``; ``BadBatch`` when it is not one."""
    if not isinstance(body, list | tuple) or len(body) not in (2, 3):
        raise BadBatch("a batch is not [ts, events, rank]")
    ts, events = body[0], body[1]
    rank = body[2] if len(body) == 3 else 0
    rank = 0 if rank is None else rank
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise BadBatch("the batch time is not a number")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank <= MAX_RANK:
        raise BadBatch("the rank is not an integer in 0..63")
    if not isinstance(events, list) or len(events) > limits.max_events:
        raise BadBatch("events is not a list of bounded length")
    parsed: list[Event] = []
    hashes = 0
    for e in events:
        event = _event(e, limits)
        if event is None:
            continue
        if not isinstance(event, Cleared):
            hashes += len(event.keys)
            if hashes > limits.max_batch_hashes:
                raise BadBatch("the batch holds more block hashes than an index keeps")
        parsed.append(event)
    return Batch(float(ts), tuple(parsed), rank)


class ExactIndex:
    """One engine's cached blocks as its events report them (see the module rules)."""

    def __init__(self, capacity: int, provisional_s: float = 0.0) -> None:
        self.capacity = capacity
        self.provisional_s = provisional_s
        # key -> bit mask of the ranks holding it; insertion order is storing order.
        self._blocks: dict[int, int] = {}
        self._pending: OrderedDict[int, float] = OrderedDict()  # key -> provisional until
        self.block_size: int | None = None
        self.forgotten = 0  # blocks dropped to stay within capacity

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: int) -> bool:
        return key in self._blocks

    def keys(self) -> set[int]:
        return set(self._blocks)

    def apply(self, batch: Batch) -> None:
        bit = 1 << batch.rank
        cleared = False  # the rank holds nothing since the last clear: another is a no-op
        for event in batch.events:
            if isinstance(event, Stored):
                self._store(event, bit)
                cleared = False
            elif isinstance(event, Removed):
                self._remove(event.keys, bit)
            elif not cleared:
                self._clear(bit)
                cleared = True

    def _store(self, event: Stored, bit: int) -> None:
        self.block_size = event.block_size
        blocks = self._blocks
        for key in event.keys:
            blocks[key] = blocks.get(key, 0) | bit
            self._pending.pop(key, None)
        while len(blocks) > self.capacity:
            del blocks[next(iter(blocks))]
            self.forgotten += 1

    def _remove(self, keys: Sequence[int], bit: int) -> None:
        blocks = self._blocks
        for key in keys:
            mask = blocks.get(key, 0) & ~bit
            if mask:
                blocks[key] = mask
            else:
                blocks.pop(key, None)

    def _clear(self, bit: int) -> None:
        if all(mask == bit for mask in self._blocks.values()):
            self._blocks.clear()
            return
        self._blocks = {k: m & ~bit for k, m in self._blocks.items() if m & ~bit}

    def reset(self) -> None:
        """Forget everything (the publisher restarted, or a gap could not be filled)."""
        self._blocks.clear()
        self._pending.clear()

    def provisional(self, keys: Sequence[int], now: float) -> None:
        """The proxy just sent a prompt with these block keys here."""
        if self.provisional_s <= 0:
            return
        until = now + self.provisional_s
        for key in keys:
            if key not in self._blocks:
                self._pending[key] = until
                self._pending.move_to_end(key)
        while len(self._pending) > self.capacity:
            self._pending.popitem(last=False)

    def _expire(self, now: float) -> None:
        pending = self._pending
        while pending:
            key, until = next(iter(pending.items()))
            if until > now:
                return
            del pending[key]

    def held_blocks(self, keys: Sequence[int], now: float) -> int:
        """How many of ``keys`` (a request's chain, first block first) the engine holds."""
        self._expire(now)
        blocks, pending = self._blocks, self._pending
        for depth, key in enumerate(keys):
            if key not in blocks and key not in pending:
                return depth
        return len(keys)

    def settled_blocks(self, keys: Sequence[int]) -> int:
        """Like ``held_blocks``, counting only the blocks the engine's events reported."""
        blocks = self._blocks
        for depth, key in enumerate(keys):
            if key not in blocks:
                return depth
        return len(keys)
