"""The expected-TTFT cost model: each engine scored by the seconds a request would wait there for
its first token. Pure: no I/O, no clock, no randomness.

Rules:
- One unit, estimated seconds. A request's time to first token on engine E is the prompt work
  ahead of it there plus its own, and the engine steps that work spans:

      ttft(E) = (queued + uncached) / prefill_tps + (1 + (queued + uncached) / chunk) * step_s

  ``queued``: prompt tokens waiting to be computed at E: this proxy's requests that have had no
  first byte (their uncached sizes are known) plus the snapshot's other waiting requests at the
  pool's mean prompt size.
  ``uncached``: this request's prompt tokens E does not hold
  (``PrefixHoldings``). ``step_s``: one engine step with E's current decode batch: every running
  sequence rides along in every step, so decode work stretches the steps the prefill needs.
- Rates: an engine's own, measured from its metrics, when both are known; otherwise the profile
  defaults of ``[routing]`` (``prefill_tokens_per_s``, ``decode_step_s`` plus
  ``decode_seq_step_s`` per running sequence). Only ratios decide a ranking, so a fleet running
  uniformly faster or slower than its profile is ranked the same.
- What is compared is the wait plus the request's own prefill time counted once for itself and
  once for every request that will queue behind it there: ``cost = wait + own_s * (1 + L)``,
  with ``L`` the pool's mean queue (requests the engines report waiting, per engine, a moving
  average over decisions: the pool's load as the engines see it, which this proxy's own burst
  since the last scrape does not inflate; ``1 + L`` stands for ``1 / (1 - rho)`` of a prefill
  queue of utilisation ``rho``: how much a unit of work added to a busy server stretches its
  busy period, and so delays what queues behind it). On an idle pool this is the request's
  own expected TTFT; under load an engine that must recompute a prompt another engine holds pays
  for the requests that recompute delays, so a conversation is not moved off the engine holding
  its history for a small gain of its own. ``L`` is the average before this decision, so the
  views of one decision enter only through the estimates (monotone in each engine's queue).
- With ``charge_abandoned`` (on by default) a pick holding less of the prompt than an engine
  known to have computed it pays the difference's prefill once more, at the same ``1 + L``:
  the move writes a second copy of that history into the pick's block pool, which in a pool at
  capacity evicts as much of another conversation's cached prefix, and that conversation's next
  turn recomputes it (an upper bound: it counts every evicted token as one that would be
  reused). The charge is ``max(0, top_settled - held(pick))``: only *settled* holdings
  (``PrefixHoldings.settled_tokens``: confirmed by a first byte, or reported by the engine's
  KV events) count, never provisional ones, so a burst of one new prompt is not charged twice
  for spreading before its first request has been computed anywhere. The shell reports first
  bytes with ``first_byte`` for the requests it announced with ``dispatched``, and those of
  other proxy processes' requests, shared with their dispatches, with ``confirm``.
- Each sequence decoding at E waits for the steps that carry the request's prefill: its next
  token comes ``own / prefill_tps`` late (an inter-token stall; a long uncached prompt on an
  engine streaming answers is what makes a fleet's ITL tail). ``cfg.decode_charge`` counts a
  second of that stall, per stream stalled, as that share of a second of first-token wait:
  ``cost += own / prefill_tps * decoding(E) * decode_charge``. A request E holds nearly whole
  stalls little there; a new long prompt goes, among engines about as quick, to one streaming
  fewer answers. The share is small (0.1, chosen on the routing suite): weighed one for one, at
  high load, where every engine streams many answers, the charge outweighs the queues and the
  first-token tail grows.
- The lowest cost wins. Costs within ``cost_tolerance`` (relative) of the lowest are equal
  within the model's accuracy; among them the engine holding the most of the prompt wins (it saves
  the fleet that prefill); among those, waits within the same tolerance of the least are equal,
  and the least loaded of them wins (the decode batch the request joins: ``choose``), then a
  rendezvous order on the prompt (a deterministic spread by content).
- Other proxy processes rank on the same shared view: when the request's key says some of their
  dispatches are unseen (``RouteKey.unseen``), the pick becomes one of the places those and this
  request would take, drawn with ``RouteKey.draw`` (``proxy.core.spread``); with none unseen the
  ranking above is returned unchanged.
- The queued work counts what this proxy sent since the last scrape, so a burst sharing a new
  prefix follows its first request (the holdings record it at dispatch) only as long as the
  growing queue there keeps the estimate within the tolerance; then it opens a second home.
- With live peers and a store to serialise through, the part of the decision that depends on
  their pending prompt work is made there (``proxy.core.claims``): ``decide(claims=True)`` gives
  the candidates with their costs less that part; the cost is linear in it (``queue_step``).
- Unroutable engines never appear; stale engines only when no engine is fresh, least loaded
  first (fail open). Work per decision: O(engines x chain length).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from typing import NamedTuple

from proxy.core.claims import Claimable, claimables
from proxy.core.config import RoutingConfig
from proxy.core.holdings import ApproxHoldings, PrefixHoldings
from proxy.core.rendezvous import Rendezvous
from proxy.core.routeview import (
    EngineView,
    RouteKey,
    candidates,
    least_loaded,
    overlay,
    with_exact,
)
from proxy.core.spread import spread_pick

# Weight of one decision in the pool's moving averages (mean prompt size, mean queue length).
_MEAN_WEIGHT = 1.0 / 32
# Requests dispatched and awaiting their first byte that are remembered for ``first_byte``: far
# more than a pool has open at once; past it the oldest (never answered) are dropped.
MAX_UNCONFIRMED = 1 << 16


class Estimate(NamedTuple):
    """One engine's figures for one request, in seconds and tokens (a tuple: one is made per
    engine per decision, and a frozen dataclass costs several times as much to build)."""

    name: str
    wait_s: float  # the work queued ahead of the request
    ttft_s: float  # wait plus the request's own prefill
    held: float  # prompt tokens the engine holds
    cost_s: float  # wait plus the own prefill times the requests it delays (what is compared)
    load: float = 0.0  # the engine's sequences (``EngineView.load``): the last tie-break


def decoding(e: EngineView) -> float:
    """Sequences decoding at ``e``: its load less what waits for a first token."""
    return max(0.0, e.load - e.waiting - e.pending)


def queued_tokens(e: EngineView, mean_prompt: float) -> float:
    """Prompt tokens ahead of a new request at ``e``: known sizes first, the rest estimated.

    This proxy's requests count whole until their first byte, also those the snapshot shows
    admitted: with chunked prefill an admitted request may still have most of its prompt to
    compute (an engine admits whatever fits the step's token budget, even a token of it), so
    the snapshot's waiting count says little about prefill work. Only the snapshot's other
    waiting requests (another replica's) are of unknown size: the pool's mean prompt each.
    """
    unknown = e.waiting - e.pending_seen
    return (e.prefill if e.prefill > 0.0 else 0.0) + (unknown * mean_prompt if unknown > 0 else 0.0)


def estimate(e: EngineView, held: float, key: RouteKey, mean_prompt: float,
             cfg: RoutingConfig, *, delayed: float = 1.0, abandoned: float = 0.0) -> Estimate:
    """``e``'s figures for ``key`` (the formula in the module docstring; one call per engine
    per decision, so written out flat). ``delayed``: the requests the own prefill delays;
    ``abandoned``: prompt tokens of it another engine holds, charged once more in the cost."""
    if e.prefill_tps and e.step_s:
        tps, step = e.prefill_tps, e.step_s
    else:
        tps = cfg.prefill_tokens_per_s
        step = cfg.decode_step_s + decoding(e) * cfg.decode_seq_step_s
    chunk = cfg.chunk_tokens
    queued = queued_tokens(e, mean_prompt)
    own = key.tokens - held
    total = queued + own if own > 0.0 else queued
    wait = queued / tps + (1.0 + queued / chunk) * step
    ttft = total / tps + (1.0 + total / chunk) * step
    cost = wait + (ttft - wait) * delayed
    if own > 0.0 and cfg.decode_charge:
        cost += own / tps * decoding(e) * cfg.decode_charge
    if abandoned > 0.0:
        cost += (abandoned / tps + abandoned / chunk * step) * delayed
    return Estimate(e.name, wait, ttft, held, cost, e.load)


def queue_step(e: EngineView, tokens: float, cfg: RoutingConfig) -> float:
    """Seconds ``tokens`` more prompt work queued at ``e`` add to a later request's wait."""
    if e.prefill_tps and e.step_s:
        tps, step = e.prefill_tps, e.step_s
    else:
        tps = cfg.prefill_tokens_per_s
        step = cfg.decode_step_s + decoding(e) * cfg.decode_seq_step_s
    return tokens / tps + tokens / cfg.chunk_tokens * step


def choose(estimates: Sequence[Estimate], tolerance: float,
           order: Mapping[str, int]) -> tuple[str, ...]:
    """Engine names best first: the pick among the near-lowest, then the rest by estimate;
    ``order`` (lower first) breaks the remaining ties.

    The pick: of the costs within ``tolerance`` of the lowest, the engine holding the most of the
    prompt; among those, the waits within ``tolerance`` of the least count as equal too, and the
    least loaded of them wins. Equal waits are an idle prefill queue everywhere, which the model
    cannot tell apart; what tells them apart then is the decode batch a request joins: a bigger
    one gives it slower tokens, and one at the engine's sequence limit makes it wait for a slot,
    which no figure of the model shows."""
    if not estimates:
        return ()
    best = min(e.cost_s for e in estimates)
    near = [e for e in estimates if e.cost_s <= best * (1.0 + tolerance)]
    top = max(e.held for e in near)
    holders = [e for e in near if e.held == top]
    quick = min(e.wait_s for e in holders) * (1.0 + tolerance)
    pick = min((e for e in holders if e.wait_s <= quick),
               key=lambda e: (e.load, e.wait_s, e.cost_s, order[e.name]))
    rest = sorted((e for e in estimates if e is not pick),
                  key=lambda e: (e.cost_s, e.wait_s, order[e.name]))
    return (pick.name, *(e.name for e in rest))


class Decision(NamedTuple):
    """One ranking: best first (the spread applied), the cost model's own before the spread,
    and the candidates of a decision serialised between processes (empty unless asked for)."""

    ranked: tuple[str, ...]
    plain: tuple[str, ...] = ()
    claimable: tuple[Claimable, ...] = ()


# A typical prompt in tokens before the pool's own mean is known (no request routed yet by the
# cost model, or another policy in force): a short chat turn with a system prompt.
TYPICAL_PROMPT_TOKENS = 1024.0


def typical_prompt(policy: object) -> float:
    """A pool's typical prompt in tokens: the cost model's running mean once it has one."""
    if isinstance(policy, ExpectedTTFT) and policy.mean_prompt > 0:
        return policy.mean_prompt
    return TYPICAL_PROMPT_TOKENS


def expected_wait(engines: Sequence[EngineView], typical_tokens: float,
                  cfg: RoutingConfig) -> float | None:
    """Seconds a typical new request would wait for its first token in a pool: the lowest
    expected TTFT over the pool's candidates (fresh routable engines, else the stale ones, as
    ``rank`` would take) for ``typical_tokens`` of prompt that no engine holds, the snapshots'
    waiting requests of unknown size counted at ``typical_tokens`` each. On an idle pool this is
    the request's own prefill and one step; queued work only adds to it. None: no engine is
    routable (nothing to wait for; the shed rate tells that story)."""
    cands, _stale = candidates(engines)
    if not cands:
        return None
    typical = max(0.0, typical_tokens)
    key = RouteKey((), prompt_tokens=typical)
    return min(estimate(e, 0.0, key, typical, cfg).ttft_s for e in cands)


class ExpectedTTFT:
    """Lowest expected time to first token, with the engines' caches from ``PrefixHoldings``."""

    name = "expected_ttft"

    def __init__(self, cfg: RoutingConfig, holdings: PrefixHoldings | None = None) -> None:
        self.cfg = cfg
        self.holdings: PrefixHoldings = (
            holdings if holdings is not None else ApproxHoldings(cfg.index_blocks)
        )
        self._rendezvous = Rendezvous(cfg.seed)
        self.mean_prompt = 0.0  # tokens; 0 until the first request
        self.mean_queue = 0.0  # requests waiting for prefill per engine, moving average
        self._unconfirmed: OrderedDict[Hashable, tuple[RouteKey, str, tuple[int, ...]]] = (
            OrderedDict())

    def estimates(self, key: RouteKey, engines: Sequence[EngineView]) -> list[Estimate]:
        names = [e.name for e in engines]
        held = with_exact(self.holdings.held_tokens(key, names), key, names)
        mean, delayed = self.mean_prompt or key.tokens, 1.0 + self.mean_queue
        top = self.top_settled(key, names) if self.cfg.charge_abandoned and held else 0.0
        return [estimate(e, held.get(e.name, 0.0), key, mean, self.cfg, delayed=delayed,
                         abandoned=top - held.get(e.name, 0.0))
                for e in engines]

    def top_settled(self, key: RouteKey, names: Sequence[str]) -> float:
        """The most of ``key``'s prompt any of ``names`` is known to have computed."""
        settled = overlay(self.holdings.settled_tokens(key, names), key.settled, names)
        return max(settled.values(), default=0.0)

    def rank(self, key: RouteKey, engines: Sequence[EngineView]) -> tuple[str, ...]:
        return self.decide(key, engines).ranked

    def decide(self, key: RouteKey, engines: Sequence[EngineView], *,
               claims: bool = False) -> Decision:
        """The ranking (``rank``), and with ``claims`` the candidates of a decision serialised
        between processes (``proxy.core.claims``), taken from the ranking before the spread."""
        cands, stale_only = candidates(engines)
        if stale_only:
            return Decision(tuple(e.name for e in least_loaded(cands)))
        at = key.chain[-1] if key.chain else 0
        order = {e.name: -self._rendezvous.weight(at, e.name) for e in cands}
        estimates = self.estimates(key, cands)
        plain = ranked = choose(estimates, self.cfg.cost_tolerance, order)
        if key.unseen > 0.0:
            ranked = self._spread(key, cands, estimates, ranked)
        shared = self._claimables(key, cands, estimates, plain) if claims else ()
        # After the decision: what this ranking saw weighs only on later ones.
        queue = sum(e.waiting for e in cands) / len(cands)
        self.mean_queue += _MEAN_WEIGHT * (queue - self.mean_queue)
        return Decision(ranked, plain, shared)

    def _slack(self, key: RouteKey) -> float:
        # A cached part under the tolerance's share of the prompt (a common first block) is no
        # hit worth keeping the request for; a longer one keeps it where it is held.
        return max(key.block_tokens, self.cfg.cost_tolerance * key.tokens)

    def _claimables(self, key: RouteKey, cands: Sequence[EngineView], estimates: list[Estimate],
                    plain: tuple[str, ...]) -> tuple[Claimable, ...]:
        slopes = {e.name: queue_step(e, 1.0, self.cfg) for e in cands}
        remote = {e.name: e.remote_prefill for e in cands}
        return claimables(estimates, plain, slopes=slopes, remote=remote,
                          prompt_tokens=key.tokens, held_slack=self._slack(key))

    def _spread(self, key: RouteKey, cands: Sequence[EngineView], estimates: list[Estimate],
                ranked: tuple[str, ...]) -> tuple[str, ...]:
        """Other processes' unseen requests could have taken the pick too: one of the places
        they and this request would take, at random (``proxy.core.spread``)."""
        typical = self.mean_prompt or key.tokens
        steps = {e.name: queue_step(e, typical, self.cfg) for e in cands}
        return spread_pick(ranked, estimates, steps, unseen=key.unseen, draw=key.draw,
                           held_slack=self._slack(key))

    def observe(self, key: RouteKey, engine: str) -> None:
        """Another process's (or a speculative leg's) request with ``key`` went to ``engine``."""
        self.holdings.record(key, engine)
        self._learn_prompt(key.tokens)

    def _learn_prompt(self, tokens: float) -> None:
        self.mean_prompt = tokens if not self.mean_prompt else (
            self.mean_prompt + _MEAN_WEIGHT * (tokens - self.mean_prompt))

    def dispatched(self, token: Hashable, key: RouteKey, engine: str) -> None:
        """This process sent the request known by ``token`` (unique among those open) with
        ``key`` to ``engine``: recorded there at once (provisional), and kept until its answer
        says what the engine did with it: ``first_byte`` (computed: the prompt counts in the
        pool's mean and, with the abandoned charge on, settles where it was answered) or
        ``refused`` (an engine's 4xx: computed nothing, so what this recorded is taken back)."""
        fresh = self.holdings.record(key, engine)
        pending = self._unconfirmed
        pending[token] = (key, engine, fresh)
        pending.move_to_end(token)
        if len(pending) > MAX_UNCONFIRMED:
            pending.popitem(last=False)

    def first_byte(self, token: Hashable, engine: str) -> None:
        """The request known by ``token`` had its first byte from ``engine``: it computed the
        prompt (a retry's engine, when the first one failed)."""
        sent = self._unconfirmed.pop(token, None)
        if sent is None:
            return
        self._learn_prompt(sent[0].tokens)
        if self.cfg.charge_abandoned:
            self.holdings.confirm(sent[0], engine)

    def refused(self, token: Hashable, engine: str) -> None:
        """The request known by ``token`` was answered with a 4xx by ``engine``: no prompt was
        computed. If that engine is where it was recorded, the blocks the record added go
        (blocks recorded there before, by other requests, stay): a prompt one engine refuses
        (a context it cannot take, a model it does not serve) is not drawn back to it."""
        sent = self._unconfirmed.pop(token, None)
        if sent is not None and sent[1] == engine:
            self.holdings.withdraw(engine, sent[2])

    def confirm(self, key: RouteKey, engine: str) -> None:
        """Another process's request with ``key`` had its first byte from ``engine``: settled
        here as that process settled it (``first_byte``), while the charge that reads it is on."""
        if self.cfg.charge_abandoned:
            self.holdings.confirm(key, engine)

    def uncached_tokens(self, key: RouteKey, engine: str) -> float:
        held = with_exact(self.holdings.held_tokens(key, [engine]), key, [engine]).get(engine, 0.0)
        return max(0.0, key.tokens - held)

    def forget(self, engine: str) -> None:
        self.holdings.forget(engine)
        self._rendezvous.forget(engine)
