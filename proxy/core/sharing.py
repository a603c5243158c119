"""Routing state shared between proxy processes: what each one sent where, and what it has open.

Several kvproxy processes in front of the same engines (replicas behind a load balancer, or the
workers of one ``kvproxy serve --workers N``) route as one only if each knows what the others just
dispatched: the provisional prefix entries (``routing.Policy.observe``) and the requests sent since
the last scrape (``engine_state.EngineState``'s in-flight accounting). This module is the pure part
of that: the outbox the request path appends to, the message format, and the table of what the other
processes reported. The transports (Redis stream, the workers' local hub) live in ``tenancy``.

Rules:
- The request path only appends to ``Outbox`` (no I/O, no encoding) and pokes ``on_dispatch``
  (which may wake a quiet round); a background task packs the batch at most every
  ``sharing.interval_s``. An outbox holds at most ``max_batch`` dispatches and as many first
  bytes; more in one interval are dropped and counted (routing then merely learns less). A
  message carries at most ``dispatches_per_message`` dispatches, so that chains of
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
  confirmation; a receiver keeps the references it can resolve in ``Unconfirmed`` (bounded: the
  oldest go first) and ignores, and counts, the others.
- Messages come from outside the process and are not trusted: ``decode`` refuses anything over
  ``max_bytes``, of the wrong shape, with names or chains out of bounds, or with negative or absurd
  counts. Unknown pools and engines are ignored by the caller, never created.
- A sender's counts hold until ``ttl_s`` after its last message (senders repeat them at least every
  ``ttl_s / 4``): a process that dies or loses the transport stops counting by itself.
- Quiet rounds (``next_round``): a process with nothing in flight, whose round took no dispatch
  and merged none from a peer, over a transport that says when messages arrive, has nothing to share
  until a dispatch or a peer's message wakes it: its next round is due at its heartbeat or when
  the first peer's figures expire, whichever is first. Anything else: one interval on.
- No clock is read here: callers pass ``now``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping
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
# Dispatches the sender remembers the place of until their first byte: far more than it has open
# at once; past it the oldest (never answered) are forgotten.
MAX_PLACED = 1 << 16


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


class Outbox:
    """Dispatches and first bytes waiting for the next publication; the request path's only
    sharing work."""

    def __init__(self, max_batch: int, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self.max_batch = max_batch
        self._items: list[Dispatch] = []
        self._tokens: list[Hashable | None] = []  # the requests of ``_items``, for ``answered``
        self._answers: list[tuple[Hashable, str]] = []
        # Where each published dispatch went out, (seq, position), until its first byte.
        self._placed: OrderedDict[Hashable, tuple[int, int]] = OrderedDict()
        self.dropped = 0
        self.dropped_answers = 0
        # Wakes a quiet sharing round; must be cheap and must not raise.
        self.on_dispatch: Callable[[], None] | None = None

    def dispatched(self, pool: str, engine: str, chain: tuple[int, ...],
                   token: Hashable | None = None) -> None:
        """``chain`` was sent to ``engine``; with ``token`` (the request's identity, unique
        among those open) its first byte is confirmed to the others (``answered``)."""
        if not self.enabled:
            return
        if self.on_dispatch is not None:
            self.on_dispatch()
        if token is not None:  # a token reused: what a finished request left must not answer
            self._placed.pop(token, None)
        if len(self._items) >= self.max_batch:
            self.dropped += 1
            return
        self._items.append(Dispatch(pool, engine, chain))
        self._tokens.append(token)

    def answered(self, token: Hashable, engine: str) -> None:
        """The request dispatched under ``token`` had its first byte from ``engine``. No wake:
        the request is open, so the round that packs this is at most one interval away."""
        if not self.enabled:
            return
        if len(self._answers) >= self.max_batch:
            self.dropped_answers += 1
            return
        self._answers.append((token, engine))

    def take(self) -> list[Dispatch]:
        items, self._items, self._tokens = self._items, [], []
        return items

    def pack(self, sender: str, seq: int, *, per_message: int,
             per_confirm: int) -> list[Message]:
        """This round's messages (at least one), numbered from ``seq``, without counts: the
        dispatches waiting, ``per_message`` to a message; then the first bytes whose dispatches
        have a place, ``per_confirm`` to a message and never in one before their dispatch's
        (a receiver learns a dispatch before its confirmation). Others are dropped: their
        dispatch was dropped, never sent, or forgotten."""
        tokens, items = self._tokens, self.take()
        chunks = [items[i : i + per_message] for i in range(0, len(items), per_message)] or [[]]
        for i, token in enumerate(tokens):
            if token is not None:
                self._placed[token] = (seq + i // per_message, i % per_message)
                self._placed.move_to_end(token)
        while len(self._placed) > MAX_PLACED:
            self._placed.popitem(last=False)
        answers, self._answers = self._answers, []
        found = ((self._placed.pop(t, None), engine) for t, engine in answers)
        confirms = sorted(Confirmation(*at, engine) for at, engine in found if at is not None)
        groups: list[list[Confirmation]] = [[] for _ in chunks]
        at = 0
        for c in confirms:  # in order of their dispatch's message: ``at`` only moves on
            at = max(at, c.seq - seq)
            while at < len(groups) and len(groups[at]) >= per_confirm:
                at += 1
            if at == len(groups):
                groups.append([])
                chunks.append([])
            groups[at].append(c)
        return [Message(sender, seq + i, tuple(chunk), confirmations=tuple(group))
                for i, (chunk, group) in enumerate(zip(chunks, groups, strict=True))]

    def unsent(self, seq: int) -> None:
        """Messages from ``seq`` on were not sent: their dispatches get no confirmation."""
        self._placed = OrderedDict((t, at) for t, at in self._placed.items() if at[0] < seq)


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


def next_round(now: float, *, quiet: bool, interval_s: float, heartbeat_at: float,
               expiry: float | None) -> float:
    """When the next round is due unless woken first: one interval on, or for a quiet round
    the heartbeat or the first peer expiry (never sooner than one interval: rounds batch)."""
    if not quiet:
        return now + interval_s
    due = heartbeat_at if expiry is None else min(heartbeat_at, expiry)
    return max(due, now + interval_s)


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


@dataclass
class _Peer:
    pending: Mapping[str, float]
    open: Mapping[str, float]
    heard_at: float
    seq: int
    prefill: Mapping[str, Backlog]


class PeerTable:
    """What the other processes last said they have in flight, per engine, until it expires."""

    def __init__(self, ttl_s: float, max_peers: int = 1024) -> None:
        self.ttl_s = ttl_s
        self.max_peers = max_peers
        self._peers: dict[str, _Peer] = {}

    def heard(self, msg: Message, now: float) -> bool:
        """Record ``msg``'s counts; False when it is older than what was heard from its sender."""
        known = self._peers.get(msg.sender)
        if known is not None and msg.seq <= known.seq:
            return False
        if known is None and len(self._peers) >= self.max_peers:
            self.expire(now)
            if len(self._peers) >= self.max_peers:
                return False
        self._peers[msg.sender] = _Peer(msg.pending, msg.open, now, msg.seq, msg.prefill)
        return True

    def expire(self, now: float) -> None:
        self._peers = {k: p for k, p in self._peers.items() if now - p.heard_at <= self.ttl_s}

    def next_expiry(self, now: float) -> float | None:
        """When the first peer still counted stops counting (None: none is counted)."""
        ends = (p.heard_at + self.ttl_s for p in self._peers.values())
        return min((t for t in ends if t >= now), default=None)

    def live(self, now: float) -> int:
        """Processes heard from within ``ttl_s``."""
        return sum(now - p.heard_at <= self.ttl_s for p in self._peers.values())

    def totals(self, now: float) -> tuple[dict[str, float], dict[str, float]]:
        """Per engine, the live peers' (pending, open) requests summed."""
        pending: dict[str, float] = {}
        opened: dict[str, float] = {}
        for peer in self._peers.values():
            if now - peer.heard_at > self.ttl_s:
                continue
            for name, n in peer.pending.items():
                pending[name] = pending.get(name, 0.0) + n
            for name, n in peer.open.items():
                opened[name] = opened.get(name, 0.0) + n
        return pending, opened

    def prefill_totals(self, now: float) -> dict[str, Backlog]:
        """Per engine, the live peers' prefill backlogs summed."""
        out: dict[str, Backlog] = {}
        for peer in self._peers.values():
            if now - peer.heard_at <= self.ttl_s:
                for name, b in peer.prefill.items():
                    t, r, k = out.get(name, NO_BACKLOG)
                    out[name] = Backlog(t + b.tokens, r + b.requests, k + b.seen)
        return out


class Unconfirmed:
    """Other processes' dispatches merged here, by (sender, seq, position), until a confirmation
    names them. At most ``max_entries`` of them and ``max_blocks`` chain blocks in all, the
    oldest forgotten first (a request that never had a first byte is never named)."""

    def __init__(self, max_entries: int = 1 << 14, max_blocks: int = 1 << 18) -> None:
        self.max_entries = max_entries
        self.max_blocks = max_blocks
        self._kept: OrderedDict[tuple[str, int, int], Dispatch] = OrderedDict()
        self._blocks = 0

    def merged(self, sender: str, seq: int, pos: int, dispatch: Dispatch) -> None:
        """``dispatch``, entry ``pos`` of ``sender``'s message ``seq``, was merged here."""
        old = self._kept.pop((sender, seq, pos), None)  # the same message again (a replay)
        self._blocks += len(dispatch.chain) - (0 if old is None else len(old.chain))
        self._kept[(sender, seq, pos)] = dispatch
        while self._kept and (len(self._kept) > self.max_entries
                              or self._blocks > self.max_blocks):
            self._blocks -= len(self._kept.popitem(last=False)[1].chain)

    def confirmed(self, msg: Message, pools: Mapping[str, str]) -> tuple[list[Dispatch], int]:
        """The dispatches ``msg`` confirms, each with the engine that answered it (of the
        dispatch's pool, as ``pools`` maps engines), and how many of its confirmations name
        none kept here or an engine outside that pool."""
        found: list[Dispatch] = []
        for c in msg.confirmations:
            d = self._kept.pop((msg.sender, c.seq, c.pos), None)
            if d is not None:
                self._blocks -= len(d.chain)
                if pools.get(c.engine) == d.pool:
                    found.append(Dispatch(d.pool, c.engine, d.chain))
        return found, len(msg.confirmations) - len(found)

    def __len__(self) -> int:
        return len(self._kept)
