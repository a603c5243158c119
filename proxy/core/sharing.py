"""Routing state shared between proxy processes: what each one sent where, and what it has open.

Several kvproxy processes in front of the same engines (replicas behind a load balancer, or the
workers of one ``kvproxy serve --workers N``) route as one only if each knows what the others just
dispatched: the provisional prefix entries (``routing.Policy.observe``) and the requests sent since
the last scrape (``engine_state.EngineState``'s in-flight accounting). This module is the message
format, pure; what a process keeps between messages (its outbox, the other processes' figures)
is ``proxy.core.sharing_state``, and the transports (Redis stream, the workers' local hub) live
in ``tenancy``.

Rules:
- A message carries at most ``dispatches_per_message`` dispatches, so that chains of
  ``routing.max_blocks`` fit a frame, and ``confirmations_per_message`` first bytes.
- A message is one orjson object: ``{"v": 1, "r": sender, "s": seq, "d": [[pool, engine, chain],
  ...], "p": {engine: pending}, "o": {engine: open}, "t": {engine: [tokens, requests, seen]},
  "c": [[seq, position, engine], ...]}``.
  ``pending`` is the sender's requests sent since its last snapshot and still open (what adds to
  an engine's load); ``open``: all it has open; ``t``, its prefill backlog there: the requests
  that have had no first byte, the prompt tokens the engine has still to compute for them, and
  how many of them the sender's last snapshot already counted (sent before it). That is the
  queued work the cost model weighs: a snapshot shows such requests only as counts (a long
  prompt in chunked prefill shows as running). ``t`` is optional: a message without it says
  nothing is pending.
- ``c`` confirms the sender's earlier dispatches (``d`` entry ``position`` of its message
  ``seq``, this one or an earlier one): that request had its first byte from ``engine`` (a
  retry's, when the first one failed), so the engine has computed the prompt and the receiver
  settles it there (``Policy.confirm``) as the sender did. A reference, not a new ``d`` field:
  a receiver of an older version requires every ``d`` entry to be exactly three items and
  ignores unknown keys, so ``c`` passes it by during a rolling upgrade. Optional; sent only when
  not empty. A dispatch dropped from a full outbox, or in a message never sent, has no
  confirmation; a receiver keeps the references it can resolve (``sharing_state.Unconfirmed``)
  and ignores, and counts, the others.
- Messages come from outside the process and are not trusted: ``decode`` refuses anything over
  ``max_bytes``, of the wrong shape, with names or chains out of bounds, or with negative or absurd
  counts. Unknown pools and engines are ignored by the caller, never created.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import orjson

VERSION = 1
MAX_NAME = 256
MAX_COUNT = 1_000_000.0
MAX_TOKENS = 1e12
_MAX_HASH = (1 << 64) - 1
MAX_CONFIRMATIONS = 256  # per message: ``decode`` refuses more
_MAX_POSITION = 1 << 16  # a ``d`` index a confirmation may name (senders put at most 64 there)


@dataclass(frozen=True)
class Dispatch:
    """One request's provisional prefix entry: ``chain`` was sent to ``engine`` of ``pool``."""

    pool: str
    engine: str
    chain: tuple[int, ...]


class Backlog(NamedTuple):
    """One sender's requests at one engine that have had no first byte."""

    tokens: float  # prompt tokens the engine has still to compute for them
    requests: float
    seen: float  # of those, the ones its last snapshot of the engine counted


NO_BACKLOG = Backlog(0.0, 0.0, 0.0)


class Confirmation(NamedTuple):
    """The sender's dispatch ``pos`` of its message ``seq`` had its first byte from ``engine``."""

    seq: int
    pos: int
    engine: str


@dataclass(frozen=True)
class Message:
    sender: str
    seq: int
    dispatches: tuple[Dispatch, ...] = ()
    pending: Mapping[str, float] = field(default_factory=dict)
    open: Mapping[str, float] = field(default_factory=dict)
    prefill: Mapping[str, Backlog] = field(default_factory=dict)
    confirmations: tuple[Confirmation, ...] = ()


def encode(msg: Message) -> bytes:
    doc = {
        "v": VERSION,
        "r": msg.sender,
        "s": msg.seq,
        "d": [[d.pool, d.engine, list(d.chain)] for d in msg.dispatches],
        "p": dict(msg.pending),
        "o": dict(msg.open),
        "t": {name: list(b) for name, b in msg.prefill.items()},
    }
    if msg.confirmations:  # absent when empty: the message is then as an older sender's
        doc["c"] = [list(c) for c in msg.confirmations]
    return orjson.dumps(doc)


class BadMessage(ValueError):
    """A message that is not one this module writes (or one that is out of bounds)."""


def versioned_object(raw: bytes, *, max_bytes: int, version: int,
                     error: type[ValueError]) -> dict[str, object]:
    """The JSON object in ``raw`` if it is at most ``max_bytes`` and says ``"v": version``;
    ``error`` (naming what is wrong) for anything else. Messages between processes are hostile
    input: this is the first check every decoder makes."""
    if len(raw) > max_bytes:
        raise error("too large")
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise error("not JSON") from None
    if not isinstance(doc, dict) or doc.get("v") != version:
        raise error(f"not a version {version} object")
    return doc


def decode(raw: bytes, *, max_bytes: int, max_chain: int) -> Message:
    """The message in ``raw``; ``BadMessage`` for anything else."""
    doc = versioned_object(raw, max_bytes=max_bytes, version=VERSION, error=BadMessage)
    sender, seq = doc.get("r"), doc.get("s")
    if not _name(sender) or not isinstance(seq, int) or isinstance(seq, bool):
        raise BadMessage("bad sender or sequence")
    assert isinstance(sender, str)
    dispatches = tuple(_dispatches(doc.get("d", []), max_chain))
    return Message(
        sender,
        seq,
        dispatches,
        _counts(doc.get("p", {})),
        _counts(doc.get("o", {})),
        _backlogs(doc.get("t", {})),
        _confirmations(doc.get("c", []), seq, len(dispatches)),
    )


def dispatches_per_message(max_chain: int, max_bytes: int) -> int:
    """How many dispatches one message may carry so that it stays under ``max_bytes`` however
    long their chains (up to ``max_chain``) and names are: half the budget for the worst case
    (a hash is at most 20 digits and a comma), at least one, at most 64."""
    worst = max_chain * 21 + 2 * MAX_NAME + 16
    return max(1, min(64, max_bytes // 2 // worst))


def confirmations_per_message(max_bytes: int) -> int:
    """How many confirmations one message may carry: a quarter of the budget for the worst
    case (a 20-digit sequence, a position, a name), at least one, at most
    ``MAX_CONFIRMATIONS``. The counts keep the last quarter."""
    worst = 20 + 6 + MAX_NAME + 8
    return max(1, min(MAX_CONFIRMATIONS, max_bytes // 4 // worst))


def _name(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME


def _dispatches(items: object, max_chain: int) -> Iterable[Dispatch]:
    if not isinstance(items, list):
        raise BadMessage("dispatches are not a list")
    for item in items:
        if not (isinstance(item, list) and len(item) == 3 and _name(item[0]) and _name(item[1])):
            raise BadMessage("bad dispatch")
        chain = item[2]
        if not isinstance(chain, list) or len(chain) > max_chain:
            raise BadMessage("bad chain")
        if not all(type(h) is int and 0 <= h <= _MAX_HASH for h in chain):
            raise BadMessage("bad block hash")
        yield Dispatch(item[0], item[1], tuple(chain))


def _confirmations(items: object, seq: int, dispatches: int) -> tuple[Confirmation, ...]:
    """References to this message's ``d`` entries (of which there are ``dispatches``) or to an
    earlier message's."""
    if not isinstance(items, list) or len(items) > MAX_CONFIRMATIONS:
        raise BadMessage("bad confirmations")
    out: list[Confirmation] = []
    for item in items:
        if not (isinstance(item, list) and len(item) == 3 and _name(item[2])):
            raise BadMessage("bad confirmation")
        at, pos = item[0], item[1]
        if not (type(at) is int and type(pos) is int and 0 <= at <= seq):
            raise BadMessage("bad confirmation")
        if not 0 <= pos < (dispatches if at == seq else _MAX_POSITION):
            raise BadMessage("bad confirmation")
        out.append(Confirmation(at, pos, item[2]))
    return tuple(out)


def _backlogs(doc: object) -> dict[str, Backlog]:
    if not isinstance(doc, dict):
        raise BadMessage("backlogs are not an object")
    out: dict[str, Backlog] = {}
    for name, value in doc.items():
        if not (_name(name) and isinstance(value, list) and len(value) == 3):
            raise BadMessage("bad backlog")
        tokens, requests, seen = value
        if not (_number(tokens, MAX_TOKENS) and _number(requests, MAX_COUNT)
                and _number(seen, requests)):
            raise BadMessage("bad backlog")
        out[name] = Backlog(float(tokens), float(requests), float(seen))
    return out


def _number(value: object, bound: float) -> bool:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return ok and 0 <= value <= bound  # type: ignore[operator]


def _counts(doc: object, bound: float = MAX_COUNT) -> dict[str, float]:
    if not isinstance(doc, dict):
        raise BadMessage("counts are not an object")
    out: dict[str, float] = {}
    for name, value in doc.items():
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (_name(name) and ok and 0 <= value <= bound):
            raise BadMessage("bad count")
        out[name] = float(value)
    return out
