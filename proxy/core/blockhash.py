"""Prefix-cache block hashes exactly as vLLM computes them with ``--prefix-caching-hash-algo
sha256_cbor``: the simulator names its blocks with them (so its KV events are a real engine's), and
precise routing hashes a tokenized prompt with them to look its blocks up in what engines report.

Rules:
- A block's hash is ``sha256(cbor((parent, tokens, extra_keys)))`` with canonical CBOR (cbor2's
  ``canonical=True``): ``parent`` is the previous block's hash, or ``NONE_HASH`` for the first
  block; ``tokens`` the block's token ids; ``extra_keys`` ``None`` or a tuple of tagged keys. The
  only extra key the simulator has is ``("cache_salt", salt)``, on the first block only.
- ``NONE_HASH`` is ``sha256_cbor("vllm-none-hash")``, vLLM's seed for cryptographic algorithms when
  ``PYTHONHASHSEED`` is unset (a set ``PYTHONHASHSEED`` would change it in vLLM; the simulator
  always uses the default).
- The CBOR encoder covers exactly the types that occur here (non-negative and negative ints below
  2**64, bytes, str, None, tuples and lists); anything else is a ``TypeError``. Pure functions.
- KV events carry a hash as vLLM 0.32 sends it by default: the digest's low 64 bits as an
  integer (``int_hash``); precise routing keys its index by that form whatever the wire carried.
- Prompts share long prefixes (a system prompt, a document, a resent history), and a chain's
  hashes depend only on the blocks before them: ``chain_keys`` given a ``ChainMemo`` remembers
  each run of ``MEMO_BLOCKS`` blocks by a 128-bit BLAKE2b digest of what its hashes depend on
  (the block size, the parent hash, the first block's extra keys and the run's token ids as
  machine integers) and takes the run's keys from there when it comes again: one digest instead
  of ``MEMO_BLOCKS`` SHA-256 hashes, and no CBOR encoding. A memo is bounded
  (``ChainMemo.max_runs``, least recently used dropped) and belongs to one thread.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

_U8 = struct.Struct(">B").pack
_U16 = struct.Struct(">H").pack
_U32 = struct.Struct(">I").pack
_U64 = struct.Struct(">Q").pack
_NULL = b"\xf6"


def _head(major: int, n: int) -> bytes:
    """The CBOR initial byte(s) for ``major`` with argument ``n``, in the shortest form."""
    mt = major << 5
    if n < 24:
        return bytes((mt | n,))
    if n < 0x100:
        return bytes((mt | 24,)) + _U8(n)
    if n < 0x10000:
        return bytes((mt | 25,)) + _U16(n)
    if n < 0x100000000:
        return bytes((mt | 26,)) + _U32(n)
    if n < 0x10000000000000000:
        return bytes((mt | 27,)) + _U64(n)
    raise TypeError("integers beyond 64 bits are not supported")


def _int(n: int) -> bytes:
    return _head(0, n) if n >= 0 else _head(1, -1 - n)


def cbor_dumps(value: object) -> bytes:
    """Canonical CBOR of ``value`` (see the module rules for the types covered)."""
    if value is None:
        return _NULL
    if isinstance(value, bool):
        return b"\xf5" if value else b"\xf4"
    if isinstance(value, int):
        return _int(value)
    if isinstance(value, bytes):
        return _head(2, len(value)) + value
    if isinstance(value, str):
        data = value.encode("utf-8")
        return _head(3, len(data)) + data
    if isinstance(value, tuple | list):
        return _head(4, len(value)) + b"".join(cbor_dumps(v) for v in value)
    raise TypeError(f"cannot encode {type(value).__name__} as CBOR")


def sha256_cbor(value: object) -> bytes:
    return hashlib.sha256(cbor_dumps(value)).digest()


DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
NONE_HASH = sha256_cbor(DEFAULT_NONE_HASH_SEED)
ExtraKeys = tuple[tuple[str, str], ...] | None


# Token ids below this are encoded from a table built on first use (a few MB, tens of ms once):
# encoding each id with ``_head`` is most of the cost of hashing a prompt, and vocabularies in use
# stay below 2^18. Ids past it (a client's token-id prompt may hold any) are encoded one by one.
_TABLE_SIZE = 1 << 18
_TABLE: list[bytes] = []


def _table() -> list[bytes]:
    if not _TABLE:
        # Built aside and put in place in one step: a thread hashing meanwhile (precise routing
        # hashes long prompts on a thread pool) never sees a half-built table, at worst builds
        # its own.
        _TABLE[:] = [_head(0, t) for t in range(_TABLE_SIZE)]
    return _TABLE


def warm_up() -> None:
    """Build the encoding table now rather than on the first request that hashes."""
    _table()


def _tokens(ids: Sequence[int]) -> bytes:
    # Token ids in use are never negative and below the table; anything else (a client's
    # token-id prompt may hold any integer) is encoded one by one, as CBOR encodes it.
    if ids and min(ids) >= 0 and max(ids) < _TABLE_SIZE:
        return _head(4, len(ids)) + b"".join(map(_table().__getitem__, ids))
    return _head(4, len(ids)) + b"".join([_int(t) for t in ids])


def hash_block_tokens(parent: bytes | None, ids: Sequence[int],
                      extra_keys: ExtraKeys = None) -> bytes:
    """vLLM's ``hash_block_tokens(sha256_cbor, parent, ids, extra_keys)``."""
    parent = parent or NONE_HASH
    body = b"\x83" + _head(2, len(parent)) + parent + _tokens(ids) + cbor_dumps(extra_keys)
    return hashlib.sha256(body).digest()


def salt_keys(cache_salt: str | None) -> ExtraKeys:
    """The extra keys of a request's first block: its ``cache_salt``, tagged as vLLM tags it."""
    return (("cache_salt", cache_salt),) if cache_salt else None


def event_extra_keys(keys: ExtraKeys) -> tuple[str, ...] | None:
    """The untagged form KV events publish (vLLM's ``to_event_extra_keys``): the salt alone."""
    return None if keys is None else tuple(value for _, value in keys)


@dataclass(frozen=True)
class ChainRoot:
    """Where a request's hash chain starts: no parent, and the first block's extra keys."""

    extra_keys: ExtraKeys = None


PLAIN_ROOT = ChainRoot()


def root_for(cache_salt: str | None) -> ChainRoot:
    return ChainRoot(salt_keys(cache_salt)) if cache_salt else PLAIN_ROOT


def int_hash(digest: bytes) -> int:
    """vLLM's ``maybe_convert_block_hash`` with int hashes on: the low 64 bits, big endian."""
    return int.from_bytes(digest[-8:], "big")


# Blocks per run a ``ChainMemo`` remembers: long enough that a lookup (a join and a digest over
# the run's bytes) costs a small part of hashing the run, short enough that a prompt shares whole
# runs with the one before it up to near where they part.
MEMO_BLOCKS = 32


class ChainMemo:
    """Runs of block keys already hashed (module rules): at most ``max_runs``, the least recently
    used dropped first. Not thread-safe: one per thread that hashes."""

    def __init__(self, max_runs: int = 16_384) -> None:
        self.max_runs = max_runs
        self._runs: OrderedDict[bytes, tuple[array[int], bytes]] = OrderedDict()
        self.hits = 0

    def get(self, key: bytes) -> tuple[array[int], bytes] | None:
        found = self._runs.get(key)
        if found is not None:
            self._runs.move_to_end(key)
            self.hits += 1
        return found

    def put(self, key: bytes, keys: array[int], last: bytes) -> None:
        self._runs[key] = (keys, last)
        if len(self._runs) > self.max_runs:
            self._runs.popitem(last=False)

    def __len__(self) -> int:
        return len(self._runs)


def chain_keys(ids: Sequence[int], block_size: int, root: ChainRoot = PLAIN_ROOT,
               max_blocks: int | None = None, memo: ChainMemo | None = None) -> list[int]:
    """The 64-bit keys of the full blocks of ``ids`` (at most ``max_blocks``), chained as vLLM
    chains them from ``root``: what an engine's ``BlockStored`` events name these blocks. With
    ``memo``, runs of blocks hashed before are taken from it (module rules)."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    count = len(ids) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    if not count:
        return []
    covered = ids[: count * block_size]
    data = _table_ids(covered)
    if data is None:
        return _chain_keys_slow(covered, block_size, count, root)
    return _chain_keys_fast(covered, data, block_size, count, root, memo=memo)


def _table_ids(ids: Sequence[int]) -> bytes | None:
    """``ids`` as 4-byte unsigned machine integers when every one is in ``[0, _TABLE_SIZE)``,
    else None. Checked on the bytes (the two high bytes of each), which costs half of ``max`` and
    ``min`` over the list, and the bytes key ``ChainMemo``'s runs."""
    try:
        raw = array("I", ids)
    except OverflowError:  # negative, or 2**32 and past
        return None
    data = raw.tobytes()
    if raw.itemsize != 4:
        return data if max(raw) < _TABLE_SIZE else None
    high, third = (3, 2) if sys.byteorder == "little" else (0, 1)
    # Below 2**18: the high byte is 0 and the third is 0-3.
    if data[high::4].count(0) != len(raw) or data[third::4].translate(None, b"\0\1\2\3"):
        return None
    return data


def _chain_keys_slow(ids: Sequence[int], block_size: int, count: int,
                     root: ChainRoot) -> list[int]:
    keys: list[int] = []
    parent: bytes | None = None
    extra = root.extra_keys
    for i in range(count):
        parent = hash_block_tokens(parent, ids[i * block_size:(i + 1) * block_size], extra)
        extra = None
        keys.append(int_hash(parent))
    return keys


def _chain_keys_fast(ids: Sequence[int], data: bytes, block_size: int, count: int,
                     root: ChainRoot, *, memo: ChainMemo | None = None) -> list[int]:
    """``_chain_keys_slow``'s keys with the per-block work cut to one join and one sha256
    (about 1.5 us a block instead of 4): every id is CBOR-encoded once from the table, and the
    CBOR bytes around a block (the array heads, the parent's byte-string head, the extra keys)
    are constants. With ``memo``, whole runs of ``MEMO_BLOCKS`` blocks are looked up first, by
    the ids' machine bytes ``data`` (``_table_ids``), so a run found there is never
    CBOR-encoded."""
    table = _table()
    tail = cbor_dumps(root.extra_keys)
    parent = NONE_HASH
    keys: list[int] = []
    start, end = 0, count * block_size
    run = MEMO_BLOCKS * block_size
    if memo is not None and end >= run:
        width = len(data) // len(ids)
        size = b"%d:" % block_size
        blake2b, join = hashlib.blake2b, b"".join
        while end - start >= run:
            key = blake2b(join((size, parent, tail, data[start * width:(start + run) * width])),
                          digest_size=16).digest()
            found = memo.get(key)
            if found is None:
                got, last = _hash_blocks(list(map(table.__getitem__, ids[start:start + run])),
                                         block_size, parent, tail)
                found = (array("Q", got), last)
                memo.put(key, *found)
            keys += found[0]
            parent = found[1]
            tail = _NULL
            start += run
    if start < end:
        got, _last = _hash_blocks(list(map(table.__getitem__, ids[start:end])), block_size,
                                  parent, tail)
        keys += got
    return keys


def _hash_blocks(encoded: Sequence[bytes], block_size: int, parent: bytes,
                 tail: bytes) -> tuple[list[int], bytes]:
    """The keys of the full blocks of ``encoded`` (CBOR-encoded ids) chained from ``parent``
    (the first one's extra keys ``tail``), and the last block's digest."""
    head = b"\x83" + _head(2, len(NONE_HASH))  # [parent, tokens, extra_keys]
    array_head = _head(4, block_size)
    sha256, join = hashlib.sha256, b"".join
    keys: list[int] = []
    for at in range(0, len(encoded) - block_size + 1, block_size):
        parent = sha256(join((head, parent, array_head, join(encoded[at:at + block_size]),
                              tail))).digest()
        tail = _NULL
        keys.append(int.from_bytes(parent[-8:], "big"))
    return keys, parent
