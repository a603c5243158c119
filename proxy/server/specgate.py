"""The shell of ``proxy.core.specbatch``: per target engine, who is drafting and who waits.

Rules:
- One ``VerifyGate`` per application; state is keyed by the target engine's configured name.
- ``drafting`` brackets a draft call (whatever its outcome) and learns the draft's seconds per
  token from it (a moving average per target engine); ``ready`` is awaited before the
  verification call. A batch is released all at once, when nobody drafts for its engine any
  more or by its window's timer, so the held verifications reach the engine together.
- No task per batch: one event and one timer handle; a waiter that is cancelled (its client
  left) just stops waiting, the others are not disturbed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from proxy.core.specbatch import eta, hold

_EWMA = 0.2  # weight of the newest draft in the seconds-per-token average


@dataclass
class _Batch:
    opened: float
    window_s: float
    event: asyncio.Event = field(default_factory=asyncio.Event)
    timer: asyncio.TimerHandle | None = None


@dataclass
class _Engine:
    drafts: dict[int, tuple[float, int]] = field(default_factory=dict)  # id -> (began, tokens)
    s_per_token: float | None = None
    batch: _Batch | None = None


class VerifyGate:
    def __init__(self) -> None:
        self._engines: dict[str, _Engine] = {}
        self._ids = itertools.count()

    def _engine(self, name: str) -> _Engine:
        return self._engines.setdefault(name, _Engine())

    @contextlib.contextmanager
    def drafting(self, engine: str, tokens: int) -> Iterator[None]:
        state, me = self._engine(engine), next(self._ids)
        began = asyncio.get_running_loop().time()
        state.drafts[me] = (began, tokens)
        try:
            yield
            took = (asyncio.get_running_loop().time() - began) / max(1, tokens)
            state.s_per_token = took if state.s_per_token is None else \
                (1 - _EWMA) * state.s_per_token + _EWMA * took
        finally:
            del state.drafts[me]
            if not state.drafts:
                self._release(state)

    async def ready(self, engine: str, window_s: float) -> None:
        """Return when this verification may go (at once unless others can join it)."""
        state, now = self._engine(engine), asyncio.get_running_loop().time()
        batch = state.batch
        opened, window = (now, window_s) if batch is None else (batch.opened, batch.window_s)
        etas = [eta(began, n, state.s_per_token, now) for began, n in state.drafts.values()]
        if not hold(etas, now - opened, window, opening=batch is None):
            self._release(state)
            return
        if batch is None:
            batch = state.batch = _Batch(now, window_s)
            batch.timer = asyncio.get_running_loop().call_later(window_s, self._release, state)
        await batch.event.wait()

    @staticmethod
    def _release(state: _Engine) -> None:
        batch, state.batch = state.batch, None
        if batch is not None:
            if batch.timer is not None:
                batch.timer.cancel()
            batch.event.set()
