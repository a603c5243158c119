"""What routing sees: one engine at one instant (``EngineView``) and one request (``RouteKey``).

Rules:
- Pure data and a few pure helpers shared by every policy; no I/O, no clock.
- Token figures are estimates in prompt tokens: a tokenizer's count where one is configured for
  the pool, else characters divided by ``routing.chars_per_token``. Blocks of the prefix chain
  are ``routing.block_chars`` characters each; ``RouteKey.block_tokens`` converts them.
- An engine's own rates (``prefill_tps``, ``step_s``) are None until measured from its metrics;
  the cost model then uses the pool's profile defaults.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from proxy.core.pressure import NO_PRESSURE, Pressure

_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class EngineView:
    """One engine as routing and admission see it at one instant."""

    name: str
    routable: bool  # healthy or stale, breaker allows, not draining
    fresh: bool  # its snapshot is recent
    load: float  # running + waiting + dispatched since the snapshot
    kv_usage: float  # 0..1
    block_size: int | None = None
    # Prompt tokens this proxy sent the engine that it has not answered yet (its prefill backlog).
    prefill: float = 0.0
    # Of ``prefill``, the prompt tokens other proxy processes reported (``proxy.core.sharing``):
    # what a decision serialised through the store reads there instead (``proxy.core.claims``).
    remote_prefill: float = 0.0
    # KV overcommit guard: the classes this engine is closed to, and why (``proxy.core.pressure``).
    pressure: Pressure = NO_PRESSURE
    # From the last snapshot: sequences running and waiting (0 when never scraped).
    running: float = 0.0
    waiting: float = 0.0
    # This proxy's requests at the engine that have not had their first byte (their prompt sizes
    # are known: ``prefill``); the snapshot's other waiting requests are of unknown size.
    pending: int = 0
    # Of those, the ones dispatched before the snapshot was taken (its ``waiting`` or
    # ``running`` counts them; the rest of its ``waiting`` is someone else's).
    pending_seen: int = 0
    # Measured from the engine's metrics; None: not measured (yet), use the profile default.
    prefill_tps: float | None = None  # prompt tokens computed per second
    step_s: float | None = None  # one engine step at its current decode batch (mean ITL)


@dataclass(frozen=True)
class RouteKey:
    """What routing knows of a request: its prefix chain, tenant, model and prompt size."""

    chain: tuple[int, ...]
    tenant: str = "default"
    model: str = ""
    # Prompt tokens of the whole prompt; 0: unknown, taken as the chain's blocks.
    prompt_tokens: float = 0.0
    # Tokens in one chain block (``block_chars / chars_per_token`` without a tokenizer).
    block_tokens: float = 64.0
    # Exact holdings (``proxy.core.exact_holdings``), in prompt tokens, of the engines whose KV
    # events are in sync: for those engines they replace the approximate index's guess.
    held: Mapping[str, float] | None = field(default=None, compare=False)
    # Of ``held``, what those engines' events have reported (computed, not just sent there).
    settled: Mapping[str, float] | None = field(default=None, compare=False)
    # Requests other proxy processes are expected to have sent to the pool that this one has not
    # merged yet (``proxy.core.spread``), and a uniform draw in [0, 1) to spread the pick among
    # the places they could have taken; 0: this process routes alone, the pick is unchanged.
    unseen: float = field(default=0.0, compare=False)
    draw: float = field(default=0.0, compare=False)

    @property
    def tokens(self) -> float:
        """Prompt tokens; when not given, what the chain's blocks hold."""
        return self.prompt_tokens if self.prompt_tokens > 0 else len(self.chain) * self.block_tokens


def candidates(engines: Sequence[EngineView]) -> tuple[list[EngineView], bool]:
    """The engines a request may go to and whether they are all stale (fail-open)."""
    fresh = [e for e in engines if e.routable and e.fresh]
    if fresh:
        return fresh, False
    return [e for e in engines if e.routable], True


def least_loaded(engines: Sequence[EngineView]) -> list[EngineView]:
    """Least load first; KV usage breaks ties, then the name (for determinism)."""
    return sorted(engines, key=lambda e: (e.load, e.kv_usage, e.name))


def mix64(x: int) -> int:
    """splitmix64 finaliser: a cheap, well-spread 64-bit permutation."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def with_exact(
    approx: Mapping[str, float], key: RouteKey, engines: Sequence[str]
) -> dict[str, float]:
    """Held tokens per engine: the exact figure where ``key`` carries one, else ``approx``'s."""
    return overlay(approx, key.held, engines)


def overlay(approx: Mapping[str, float], exact: Mapping[str, float] | None,
            engines: Sequence[str]) -> dict[str, float]:
    """Tokens per engine: ``exact``'s for the engines it knows, else ``approx``'s."""
    if not exact:
        return dict(approx)
    out = {e: t for e, t in approx.items() if e not in exact}
    out.update((e, t) for e, t in exact.items() if t > 0 and e in engines)
    return out
