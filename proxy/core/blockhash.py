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
"""

from __future__ import annotations

import hashlib
import struct
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
    # The hot loop of hashing: token ids are never negative, so the array head and the
    # shortest unsigned forms suffice.
    if ids and max(ids) < _TABLE_SIZE:
        return _head(4, len(ids)) + b"".join(map(_table().__getitem__, ids))
    return _head(4, len(ids)) + b"".join([_head(0, t) for t in ids])


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


def chain_keys(ids: Sequence[int], block_size: int, root: ChainRoot = PLAIN_ROOT,
               max_blocks: int | None = None) -> list[int]:
    """The 64-bit keys of the full blocks of ``ids`` (at most ``max_blocks``), chained as vLLM
    chains them from ``root``: what an engine's ``BlockStored`` events name these blocks."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    count = len(ids) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    if not count:
        return []
    covered = ids[: count * block_size]
    if max(covered) >= _TABLE_SIZE or min(covered) < 0:
        return _chain_keys_slow(covered, block_size, count, root)
    return _chain_keys_fast(covered, block_size, count, root)


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


def _chain_keys_fast(ids: Sequence[int], block_size: int, count: int,
                     root: ChainRoot) -> list[int]:
    """``_chain_keys_slow``'s keys with the per-block work cut to one join and one sha256
    (about 1.5 us a block instead of 4): every id is CBOR-encoded once from the table, and the
    CBOR bytes around a block (the array heads, the parent's byte-string head, the extra keys)
    are constants."""
    encoded = list(map(_table().__getitem__, ids))
    head = b"\x83" + _head(2, len(NONE_HASH))  # [parent, tokens, extra_keys]
    array = _head(4, block_size)
    tail = cbor_dumps(root.extra_keys)
    sha256, join = hashlib.sha256, b"".join
    parent = NONE_HASH
    keys: list[int] = []
    for start in range(0, count * block_size, block_size):
        parent = sha256(join((head, parent, array, join(encoded[start:start + block_size]),
                              tail))).digest()
        tail = _NULL
        keys.append(int.from_bytes(parent[-8:], "big"))
    return keys
