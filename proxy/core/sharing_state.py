"""What a proxy process keeps of the routing state it shares (``proxy.core.sharing``): its outbox
of dispatches and first bytes, the other processes' figures, and their dispatches waiting for a
confirmation.

Rules:
- The request path only appends to ``Outbox`` (no I/O, no encoding) and pokes ``on_dispatch``
  (which may wake a quiet round); a background task packs the batch at most every
  ``sharing.interval_s``. An outbox holds at most ``max_batch`` dispatches and as many first
  bytes; more in one interval are dropped and counted (routing then merely learns less).
- A sender's counts hold until ``ttl_s`` after its last message (senders repeat them at least every
  ``ttl_s / 4``): a process that dies or loses the transport stops counting by itself.
- Quiet rounds (``next_round``): a process with nothing in flight, whose round took no dispatch
  and merged none from a peer, over a transport that says when messages arrive, has nothing to share
  until a dispatch or a peer's message wakes it: its next round is due at its heartbeat or when
  the first peer's figures expire, whichever is first. Anything else: one interval on.
- A receiver keeps the dispatches it merged (``Unconfirmed``, bounded: the oldest go first)
  until a confirmation names them.
- No clock is read here: callers pass ``now``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

from proxy.core.sharing import (
    NO_BACKLOG,
    Backlog,
    Confirmation,
    Dispatch,
    Message,
)

# Dispatches the sender remembers the place of until their first byte: far more than it has open
# at once; past it the oldest (never answered) are forgotten.
MAX_PLACED = 1 << 16


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


def next_round(now: float, *, quiet: bool, interval_s: float, heartbeat_at: float,
               expiry: float | None) -> float:
    """When the next round is due unless woken first: one interval on, or for a quiet round
    the heartbeat or the first peer expiry (never sooner than one interval: rounds batch)."""
    if not quiet:
        return now + interval_s
    due = heartbeat_at if expiry is None else min(heartbeat_at, expiry)
    return max(due, now + interval_s)


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
