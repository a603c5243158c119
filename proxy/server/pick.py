"""The routing decision, performed: which engines of the pool may take a request, in what order.

Rules: the pure core decides (``proxy.core.admission`` for eligibility, the pool's policy for the
order, ``proxy.core.prefix`` for the prompt's chain); this shell gathers the inputs (the pool's
views, this proxy's open connections per engine, precise holdings, what peer replicas may have
sent unseen) and records the outcome (the policy's index, the sharing outbox, the precise index,
the prompt tokens each candidate would compute). The cost model is told of the dispatch under the
job's identity (unique among open requests, and every relayed job is ranked here first), so that
the relay's first byte settles the prompt where it was answered; so is the sharing outbox, which
confirms that first byte to the other processes. While a peer replica is live and
Redis carries the sharing, the pick among the candidates the cost model leaves open is made in
Redis, one decision after another across replicas (``proxy.tenancy.shared_decision``); otherwise,
and whenever Redis does not answer in time, the local ranking stands. A pool whose routable engines
all hold ``upstream.max_connections_per_engine`` requests from this proxy sheds at once.
"""

from __future__ import annotations

from proxy.core.admission import REASON_NO_ENGINE, Priority
from proxy.core.claims import reorder
from proxy.core.costmodel import ExpectedTTFT
from proxy.core.errors import NoCapacity, NoEngine
from proxy.core.exact_holdings import PreciseHoldings
from proxy.core.inbound import Inbound
from proxy.core.isolation import Salting
from proxy.core.prefix import prefix_chain
from proxy.core.routing import EngineView, Policy, RouteKey
from proxy.server.admit import need_tokens
from proxy.server.context import ShellContext
from proxy.server.job import Job
from proxy.server.relay import REASON_CONNECTIONS_FULL


async def rank(
    ctx: ShellContext,
    job: Job,
    model: str,
    inbound: Inbound,
    priority: Priority,
    *,
    pool_views: list[EngineView],
    salting: Salting,
    tenant: str,
    prepared: PreciseHoldings | None = None,
) -> tuple[str, ...]:
    pool = job.pool
    routing = ctx.cfg.routing
    # Seeded by the isolation scope: requests that can share no engine blocks share no key.
    chain = prefix_chain(
        inbound.prompt_text,
        model=model,
        tenant=salting.scope,
        block_chars=routing.block_chars,
        max_blocks=routing.max_blocks,
    )
    policy = ctx.policies[pool]
    need = need_tokens(ctx, pool, inbound, job.max_tokens)
    views = ctx.admission.eligible(priority, with_room(ctx, pool, pool_views), need)
    holdings = None if ctx.precise is None else ctx.precise.holdings(prepared, views)
    names = [v.name for v in views]
    held = None if holdings is None else holdings.known(names)
    settled = None if holdings is None else holdings.known_settled(names)
    blind = ctx.blindness.get(pool)
    unseen = 0.0 if blind is None else blind.unseen()
    key = RouteKey(chain=chain, tenant=tenant, model=model, held=held, settled=settled,
                   prompt_tokens=len(inbound.prompt_text) / routing.chars_per_token,
                   block_tokens=routing.block_chars / routing.chars_per_token,
                   unseen=unseen, draw=ctx.rng.random() if unseen else 0.0)
    ranked = await _ranked(ctx, policy, key, views)
    if not ranked:
        raise NoEngine(pool, reason=REASON_NO_ENGINE, retry_after_s=ctx.cfg.admission.retry_after_s)
    # The prompt tokens each engine that may get the request would compute, counted while it
    # waits for its first byte (asked before ``observe`` records the pick as holding the prompt).
    job.prefill = {
        name: policy.uncached_tokens(key, name) for name in ranked[: 1 + ctx.cfg.upstream.retries]
    }
    job.prompt_tokens = dict(job.prefill)
    token = None
    if isinstance(policy, ExpectedTTFT):
        # The relay's answer says what the engine did with the prompt (``Relay._answered``):
        # a first byte settles it where it was answered, here and, through the outbox, in the
        # other processes; a 4xx takes this process's record back.
        policy.dispatched(id(job), key, ranked[0])
        token = id(job)
    else:
        policy.observe(key, ranked[0])
    ctx.outbox.dispatched(pool, ranked[0], chain, token)
    if holdings is not None and ctx.precise is not None:
        ctx.precise.dispatched(ranked[0], holdings)
    return ranked


async def _ranked(ctx: ShellContext, policy: Policy, key: RouteKey,
                  views: list[EngineView]) -> tuple[str, ...]:
    """The policy's ranking; while another replica is live, with its pick decided in Redis
    among the candidates the cost model leaves open (``proxy.core.claims``), falling back to the
    local ranking (spread included) when Redis does not answer in time."""
    decider = ctx.decider
    if decider is None or not isinstance(policy, ExpectedTTFT) or not decider.engaged():
        return policy.rank(key, views)
    decision = policy.decide(key, views, claims=True)
    if not decision.claimable:
        return decision.ranked
    pick = await decider.decide(decision.claimable)
    if pick is None:
        return decision.ranked
    return reorder(decision.plain, decision.claimable[pick].name)


def with_room(ctx: ShellContext, pool: str, views: list[EngineView]) -> list[EngineView]:
    """The pool's engines that may take one more request from this proxy. When the pool has
    routable engines but all hold ``upstream.max_connections_per_engine`` requests, the request
    is shed at once: waiting in the proxy's connection pool would only end in a timeout, and the
    engines' own waiting queues are where work should queue."""
    limit = ctx.cfg.upstream.max_connections_per_engine
    room = []
    for view in views:
        engine = ctx.fleet.live(view.name)  # None: it left the fleet since the views were taken
        if engine is not None and not engine.full(limit):
            room.append(view)
    if any(v.routable for v in views) and not any(v.routable for v in room):
        raise NoCapacity(
            f"every engine of the {pool} pool has {limit} requests open from this proxy",
            reason=REASON_CONNECTIONS_FULL,
            retry_after_s=ctx.cfg.admission.retry_after_s,
        )
    return room
