"""Speculative-first aliases in the shell: per-application state, the start-up tokenizer check,
and the decision, per request, between drafting and serving from the target alone.

Rules:
- One ``SpecFirst`` per application (``SPECFIRST``): per alias, the acceptance history, the
  target's token roles (``TokenFacts``) and whether the two pools were found to share a
  tokenizer.
- **Shared tokenizer, checked at start-up**: one engine of each pool renders the same probe
  texts and a chat through ``/tokenize`` (and, where both serve it, ``/tokenizer_info``); any
  difference is a ``ConfigError`` naming the alias and the application does not start. Engines
  not reachable yet leave the alias *unverified*: it is served by the target alone, and the
  check runs again every ``RECHECK_S`` until it passes (or fails, which is then logged loudly
  and keeps the alias target-only).
- Cache-reading verification (``alias.verify = "cached"``) is tried on the target's first
  verification; a target that does not serve it is remembered per alias (logged once) and the
  alias verifies through ``prompt_logprobs`` from then on.
- ``route`` returns a ``Drafting`` plan, or the reason the request goes to the target pool
  unchanged (a pass-through: the normal relay path serves it, the answer is the target's own).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from proxy.core.errors import ConfigError, KvproxyError
from proxy.core.fleet_config import AliasConfig
from proxy.core.inbound import Inbound
from proxy.core.specfirst import AcceptanceHistory, HistoryConfig, TokenFacts, eligibility
from proxy.fleet.engines import Engine
from proxy.observe.specmetrics import SpecFirstMetrics
from proxy.server.context import ShellContext
from proxy.server.keys import SHELL
from proxy.server.specgate import VerifyGate
from proxy.server.speclegs import Leg, LegFailed

log = logging.getLogger(__name__)

RECHECK_S = 5.0
CHECK_TIMEOUT_S = 5.0
PROBES: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "  spaces,\ttabs\nand newlines; digits 0123456789 and 3.14159",
    "accents: café naïve Ærøskøbing; CJK: 東京都; emoji: 🙂🚀",
)
PROBE_CHAT: list[dict[str, str]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hello."},
]


@dataclass
class AliasState:
    alias: AliasConfig
    history: AcceptanceHistory
    facts: TokenFacts
    verified: bool | None = None  # None: not checked yet (engines unreachable)
    # Whether the target serves cache-reading verification: None not tried yet, False not served
    # (every verification then recomputes the context through prompt_logprobs).
    cached_verify: bool | None = None


@dataclass(frozen=True)
class Drafting:
    """A request to answer speculatively through ``state``'s alias."""

    state: AliasState
    key: tuple[str, str]
    sampled: bool
    gate: VerifyGate


@dataclass
class SpecFirst:
    aliases: dict[str, AliasState]
    metrics: SpecFirstMetrics
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    gate: VerifyGate = field(default_factory=VerifyGate)

    def route(self, name: str, inbound: Inbound, tenant: str, now: float
              ) -> Drafting | str | None:
        """None: not a speculative-first alias; a ``Drafting``; or why the target answers alone."""
        state = self.aliases.get(name)
        if state is None:
            return None
        alias = state.alias
        verdict = eligibility(inbound.body, approximate=alias.temperature_policy == "approximate")
        if not verdict.draft:
            return "ineligible"
        if not state.verified:
            return "unverified"
        key = (tenant, alias.name)
        if not state.history.drafting(key, now):
            return "fallback"
        return Drafting(state, key, verdict.sampled, self.gate)


SPECFIRST = web.AppKey("specfirst", SpecFirst)


def build(ctx: ShellContext) -> SpecFirst:
    states = {}
    for alias in ctx.cfg.aliases:
        if alias.speculative:
            cfg = HistoryConfig(window_rounds=alias.history_rounds,
                                min_tokens=alias.fallback_min_tokens,
                                max_rejection=alias.fallback_rejection,
                                retry_s=alias.fallback_retry_s, min_chunk=alias.min_chunk,
                                max_chunk=alias.chunk)
            states[alias.name] = AliasState(alias, AcceptanceHistory(cfg),
                                            TokenFacts(stops=set(alias.eos_token_ids)))
    return SpecFirst(states, SpecFirstMetrics(ctx.metrics.registry))


async def tokenizer_check(app: web.Application) -> AsyncIterator[None]:
    """Cleanup context: check every speculative-first alias once at start-up (a mismatch stops
    the start), then keep re-checking the unverified ones in a named task."""
    sf, ctx = app[SPECFIRST], app[SHELL]
    for state in sf.aliases.values():
        await _check(ctx, state)
    if any(s.verified is None for s in sf.aliases.values()):
        sf.tasks.append(asyncio.create_task(_recheck(ctx, sf), name="kvproxy-specfirst-check"))
    try:
        yield
    finally:
        for task in sf.tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _recheck(ctx: ShellContext, sf: SpecFirst) -> None:
    while any(s.verified is None for s in sf.aliases.values()):
        await asyncio.sleep(RECHECK_S)
        for state in sf.aliases.values():
            if state.verified is None:
                try:
                    await _check(ctx, state)
                except ConfigError as exc:
                    log.error("speculative-first alias disabled (target only): %s", exc)


async def _check(ctx: ShellContext, state: AliasState) -> None:
    alias = state.alias
    try:
        draft = await _fingerprint(ctx, alias.draft)
        target = await _fingerprint(ctx, alias.target)
    except (KvproxyError, TimeoutError, IndexError) as exc:
        log.warning("speculative-first alias %s: tokenizers not checked yet (%s); serving it "
                    "from the target pool alone until they are", alias.name, exc)
        return
    for what, mine in draft.items():
        if target.get(what) != mine:
            state.verified = False
            raise ConfigError(
                f"aliases.{alias.name}",
                f"pools {alias.draft!r} and {alias.target!r} do not share a tokenizer ({what} "
                "differs); speculative_first needs the same tokenizer on both")
    state.verified = True


async def _fingerprint(ctx: ShellContext, pool: str) -> dict[str, Any]:
    """What the first engine of ``pool`` that answers says about its tokenizer (every engine of
    a pool serves the same model: one down must not keep the alias from being checked)."""
    failure: KvproxyError | TimeoutError | None = None
    for engine in ctx.fleet.pool(pool):
        try:
            return await _fingerprint_of(ctx, engine, pool)
        except (KvproxyError, TimeoutError) as exc:
            failure = exc
    if failure is None:
        raise IndexError(f"pool {pool} has no engines")
    raise failure


async def _fingerprint_of(ctx: ShellContext, engine: Engine, pool: str) -> dict[str, Any]:
    """What ``engine`` says about its tokenizer: the probes' ids, and the tokenizer's
    description where the engine serves ``/tokenizer_info``."""
    config = ctx.cfg.pool(pool)
    model = config.model if config is not None else ""
    leg = Leg(ctx, engine, model, {"Content-Type": "application/json"}, CHECK_TIMEOUT_S)
    out: dict[str, Any] = {}
    for i, probe in enumerate(PROBES):
        out[f"probe {i + 1}"] = (await leg.post("/tokenize", {"prompt": probe})).get("tokens")
    chat = {"messages": PROBE_CHAT, "add_generation_prompt": True}
    out["chat rendering"] = (await leg.post("/tokenize", chat)).get("tokens")
    out.update(await _info(leg))
    return out


async def _info(leg: Leg) -> dict[str, Any]:
    session = leg.ctx.session
    try:
        async with asyncio.timeout(CHECK_TIMEOUT_S):
            async with session.get(leg.engine.cfg.url + "/tokenizer_info",
                                   allow_redirects=False) as resp:
                if resp.status != 200:
                    return {}
                info = await resp.json()
    except (TimeoutError, OSError, ValueError, LegFailed):
        return {}
    except Exception:
        return {}
    if not isinstance(info, dict):
        return {}
    keys = ("vocab_size", "eos_token", "bos_token", "tokenizer_class")
    return {f"tokenizer_info.{k}": info.get(k) for k in keys if k in info}
