"""Scrape outcomes relayed between the workers of one ``kvproxy serve --workers N``, so that the
engines are scraped once per machine rather than once per worker.

Rules:
- An ``Outcome`` is what one scrape of one engine concluded: a usable snapshot (with the digest
  of the metrics text, so that each worker can run its own frozen-metrics proof), or a failure
  with its reason label and a description that names no address. A scrape that the proxy itself
  was too busy to finish says nothing about the engine and is never relayed.
- A message is one orjson object: ``{"v": 1, "w": sender index, "o": [[engine, url, started,
  fetched, digest, snapshot or null, reason, detail], ...]}``; ``url`` is a 32-bit fingerprint of
  the metrics URL the sender scraped (an outcome about another URL under the same name is not
  applied); ``snapshot`` lists ``EngineSnapshot``'s fields after ``taken_at`` (``started`` is
  that). At most ``MAX_OUTCOMES`` outcomes a message.
- Messages come from another process and are not trusted: ``decode`` refuses anything over
  ``max_bytes``, of the wrong shape, with names, texts or figures out of bounds (the same bounds
  ``telemetry.parse_metrics`` holds an engine's own text to), or from a sender index outside
  ``0..workers-1``. With a ``SnapshotMemo``, a snapshot whose figures equal the last ones checked
  for the same engine is that snapshot restamped (an idle engine's figures repeat every interval;
  equal values pass the same checks), not checked and built again. The memo holds at most
  ``MAX_MEMO`` engines and starts over past that.
- Whom a worker follows, per engine (``Sources``): only lower-index workers, and of those the
  lowest heard from within ``hold_s``. A worker scrapes an engine itself unless it follows
  someone for it, so worker 0 scrapes everything, the others scrape nothing while worker 0's
  outcomes arrive, and take over by themselves ``hold_s`` after they stop (worker 0 died, is
  restarting, lost the hub, or was too busy to scrape), with no election and no message for it.
- No clock is read here: callers pass ``now``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace

import orjson

from proxy.core.sharing import versioned_object
from proxy.core.telemetry import KV_SLACK, MAX_REQUESTS, EngineSnapshot

VERSION = 1
MAX_OUTCOMES = 128
MAX_NAME = 256
MAX_TEXT = 200  # a failure's reason label and description
MAX_MEMO = 4096
_MAX_U32 = (1 << 32) - 1
_MAX_COUNTER = 1e18
_MAX_INFO_INT = 1 << 31
_FIELDS = tuple(f.name for f in fields(EngineSnapshot) if f.name != "taken_at")
_INTS = frozenset({"block_size", "num_gpu_blocks"})
_BOOLS = frozenset({"draining", "ready"})
_OPTIONAL = frozenset({"prefill_tokens_sum", "prefill_seconds_sum", "itl_sum", "itl_count"})


class BadRelay(ValueError):
    """A message that is not one this module writes (or one that is out of bounds)."""


@dataclass(frozen=True)
class Outcome:
    """One scrape of one engine: ``snapshot`` when usable, else the failure's ``reason``."""

    engine: str
    url: int  # fingerprint of the metrics URL scraped
    started: float
    fetched_at: float
    digest: int  # of the metrics text; 0 for a failure
    snapshot: EngineSnapshot | None
    reason: str = ""
    detail: str = ""


def encode(sender: int, outcomes: Sequence[Outcome]) -> list[bytes]:
    """``outcomes`` as messages of at most ``MAX_OUTCOMES`` each."""
    rows = [_row(o) for o in outcomes]
    return [orjson.dumps({"v": VERSION, "w": sender, "o": rows[i : i + MAX_OUTCOMES]})
            for i in range(0, len(rows), MAX_OUTCOMES)]  # fmt: skip


def _row(o: Outcome) -> list[object]:
    snap = None if o.snapshot is None else [getattr(o.snapshot, f) for f in _FIELDS]
    return [o.engine, o.url, o.started, o.fetched_at, o.digest, snap, o.reason, o.detail]


class SnapshotMemo:
    """Per engine, the last snapshot figures checked and the snapshot built from them."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[list[object], EngineSnapshot]] = {}

    def snapshot(self, engine: str, values: object, taken_at: float) -> EngineSnapshot:
        last = self._last.get(engine)
        if last is not None and last[0] == values:
            return replace(last[1], taken_at=float(taken_at))
        snap = _snapshot(values, taken_at)
        if len(self._last) >= MAX_MEMO:
            self._last.clear()
        assert isinstance(values, list)  # _snapshot refused anything else
        self._last[engine] = (values, snap)
        return snap


def decode(raw: bytes, *, max_bytes: int, workers: int,
           memo: SnapshotMemo | None = None) -> tuple[int, list[Outcome]]:
    """(sender index, outcomes) in ``raw``; ``BadRelay`` for anything else."""
    doc = versioned_object(raw, max_bytes=max_bytes, version=VERSION, error=BadRelay)
    sender, rows = doc.get("w"), doc.get("o")
    if type(sender) is not int or not 0 <= sender < workers:
        raise BadRelay("bad sender")
    if not isinstance(rows, list) or len(rows) > MAX_OUTCOMES:
        raise BadRelay("bad outcomes")
    return sender, [_outcome(row, memo) for row in rows]


def _outcome(row: object, memo: SnapshotMemo | None = None) -> Outcome:
    if not (isinstance(row, list) and len(row) == 8):
        raise BadRelay("bad outcome")
    engine, url, started, fetched, digest, snap, reason, detail = row
    if not (_text(engine, MAX_NAME) and engine and _u32(url) and _u32(digest)):
        raise BadRelay("bad outcome")
    if not (_time(started) and _time(fetched) and fetched >= started):
        raise BadRelay("bad scrape times")
    if not (_text(reason, MAX_TEXT) and _text(detail, MAX_TEXT)):
        raise BadRelay("bad failure text")
    if snap is None and not reason:
        raise BadRelay("a failure without a reason")
    if snap is None:
        snapshot = None
    elif memo is None:
        snapshot = _snapshot(snap, started)
    else:
        snapshot = memo.snapshot(engine, snap, started)
    return Outcome(engine, url, float(started), float(fetched), digest, snapshot, reason, detail)


def _snapshot(values: object, taken_at: float) -> EngineSnapshot:
    if not (isinstance(values, list) and len(values) == len(_FIELDS)):
        raise BadRelay("bad snapshot")
    got = dict(zip(_FIELDS, values, strict=True))
    for name, value in got.items():
        if not _field_ok(name, value):
            raise BadRelay(f"bad snapshot field {name}")
    if got["kv_usage"] > 1.0 + KV_SLACK or max(got["running"], got["waiting"]) > MAX_REQUESTS:
        raise BadRelay("implausible snapshot")
    return EngineSnapshot(taken_at=float(taken_at), **got)


def _field_ok(name: str, value: object) -> bool:
    if name in _BOOLS:
        return isinstance(value, bool)
    if name in _INTS:
        return value is None or (type(value) is int and 0 < value < _MAX_INFO_INT)
    if value is None:
        return name in _OPTIONAL
    return _number(value, _MAX_COUNTER)


def _number(value: object, bound: float) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value) and 0 <= value <= bound


def _time(value: object) -> bool:
    return _number(value, 1e15)


def _u32(value: object) -> bool:
    return type(value) is int and 0 <= value <= _MAX_U32


def _text(value: object, bound: int) -> bool:
    return isinstance(value, str) and len(value) <= bound


class Sources:
    """Per engine, the sibling whose scrapes this worker (index ``own``) follows, if any."""

    def __init__(self, own: int, hold_s: float) -> None:
        self.own = own
        self.hold_s = hold_s
        self._heard: dict[str, tuple[int, float]] = {}  # engine -> (sender, last heard)

    def accept(self, sender: int, engine: str, now: float) -> bool:
        """Whether to apply ``sender``'s outcome for ``engine`` (and follow it from now on)."""
        if sender >= self.own:
            return False
        current = self._heard.get(engine)
        if current is not None and current[0] < sender and now - current[1] <= self.hold_s:
            return False  # a lower one is still at it: this one is taking over late or leaving
        self._heard[engine] = (sender, now)
        return True

    def follows(self, engine: str, now: float) -> bool:
        """Whether a lower-index sibling scrapes ``engine``: this worker then need not."""
        current = self._heard.get(engine)
        return current is not None and now - current[1] <= self.hold_s

    def __len__(self) -> int:
        return len(self._heard)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop engines not in ``keep`` (removed from the fleet)."""
        kept = set(keep)
        self._heard = {k: v for k, v in self._heard.items() if k in kept}
