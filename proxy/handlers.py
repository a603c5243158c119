"""HTTP handlers: the proxied OpenAI endpoints and the proxy's own small endpoints.

Rules: a handler performs decisions made by the pure core (pools, admission, routing) in the order
of DESIGN §2 and does nothing clever itself; every refusal is raised as a ``KvproxyError`` and
rendered by the app's error middleware, before any byte of a response. Each proxied request is
counted for drain, and observed in metrics exactly once, whatever way it ends.
"""

from __future__ import annotations

import asyncio
import uuid

import orjson
from aiohttp import web

from proxy.admission import REASON_NO_ENGINE, Admit, Priority, engine_priority, parse_priority
from proxy.cache_entry import CachedResponse
from proxy.context import ShellContext
from proxy.errors import KvproxyError, NoCapacity, PayloadTooLarge
from proxy.fleet import HEALTH_STATES
from proxy.frontdoor import CHARS_PER_TOKEN, DOOR, replay, wants_usage
from proxy.inbound import Endpoint, Inbound, accept, rewrite
from proxy.keys import REQUEST_ID, SHELL
from proxy.metrics import CONTENT_TYPE
from proxy.pools import PoolPlan, model_names, resolve_model, upstream_model
from proxy.prefix import prefix_chain
from proxy.relay import CLIENT_CLOSED, Job, Relay
from proxy.routing import RouteKey
from proxy.upstream import request_headers


def request_id(request: web.Request) -> str:
    """The client's ``X-Request-Id`` when it sent a sane one, else a fresh id."""
    given = request.headers.get("X-Request-Id", "").strip()
    if given and len(given) <= 200 and given.isprintable():
        return given
    return uuid.uuid4().hex


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, Endpoint.CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, Endpoint.COMPLETIONS)


async def _proxy(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    ctx = request.app[SHELL]
    job = Job(request[REQUEST_ID], ctx.clock(), cls=Priority.STANDARD.value, path=endpoint.value)
    try:
        with ctx.drain.track(ctx.cfg.admission.retry_after_s):
            response = await _serve(request, ctx, endpoint, job)
    except KvproxyError as exc:
        job.status = exc.status
        if isinstance(exc, NoCapacity):
            job.shed_reason = exc.reason
        raise
    except asyncio.CancelledError:
        job.status = CLIENT_CLOSED
        raise
    finally:
        _observe(ctx, job)
    return response


async def _serve(
    request: web.Request, ctx: ShellContext, endpoint: Endpoint, job: Job
) -> web.StreamResponse:
    door = request.app[DOOR]
    tenant = await door.identify(request.headers)
    inbound = accept(await _read_body(request, ctx.cfg.server.max_body_bytes), endpoint)
    priority = parse_priority(request.headers.get("X-Priority"), inbound.body.get("priority"))
    job.cls = priority.value
    job.stream = inbound.stream
    plan = resolve_model(ctx.cfg, inbound.model)
    job.pool = plan.pool
    async with door.visit(
        tenant,
        endpoint=endpoint.value,
        model=inbound.model,
        body=inbound.body,
        cache_control=request.headers.get("Cache-Control"),
        prompt_chars=len(inbound.prompt_text),
    ) as visit:
        if visit.entry is not None:
            return await _from_cache(request, job, inbound, visit.entry)
        job.recorder = visit.recorder
        job.extra_headers["X-Cache"] = visit.x_cache
        job.max_tokens = _max_tokens(inbound)
        job.pool = _admit(ctx, plan, priority, inbound, job.max_tokens)
        if job.pool != plan.pool:
            visit.discard()  # another pool's answer is not the answer for the model asked for
        model = upstream_model(ctx.cfg, job.pool)
        ranked = _rank(ctx, job, model, inbound, priority, tenant=tenant)
        job.body = rewrite(
            inbound.body, model=model, priority=_engine_priority(ctx, job.pool, priority)
        )
        job.headers = request_headers(request.headers, job.request_id)
        return await Relay(ctx, request, job).run(ranked)


async def _from_cache(
    request: web.Request, job: Job, inbound: Inbound, entry: CachedResponse
) -> web.StreamResponse:
    """Answer from the response cache (no engine involved; ``X-Engine: cache``)."""
    job.engine, job.status = "cache", 200
    job.first_byte_at = request.app[SHELL].clock()
    usage = wants_usage(inbound.body)
    headers = job.client_headers()
    return await replay(request, entry, stream=inbound.stream, include_usage=usage, headers=headers)


async def _read_body(request: web.Request, limit: int) -> bytes:
    length = request.content_length
    if length is not None and length > limit:
        raise PayloadTooLarge(f"request body of {length} bytes exceeds the limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.content.iter_any():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
    return bytes(body)


def _max_tokens(inbound: Inbound) -> int | None:
    """The client's cap on the answer (validated by ``accept``), if it set one."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = inbound.body.get(name)
        if isinstance(value, int):
            return value
    return None


def _need(ctx: ShellContext, pool: str, inbound: Inbound, max_tokens: int | None) -> float:
    """KV tokens the request is expected to take: its prompt and its expected answer."""
    prompt = len(inbound.prompt_text) / CHARS_PER_TOKEN
    return prompt + ctx.fleet.estimate(pool).expected(max_tokens)


def _admit(
    ctx: ShellContext, plan: PoolPlan, priority: Priority, inbound: Inbound, max_tokens: int | None
) -> str:
    """The pool that serves the request, or ``NoCapacity`` (shed) with the reason."""
    now = ctx.clock()
    need = _need(ctx, plan.pool, inbound, max_tokens)
    decision = ctx.admission.decide(plan.pool, priority, ctx.fleet.views(plan.pool, now), need)
    if isinstance(decision, Admit):
        return _admitted(ctx, plan.pool, decision)
    fallback = _fallback(ctx, plan, priority)
    if fallback is not None:
        need = _need(ctx, fallback, inbound, max_tokens)
        second = ctx.admission.decide(fallback, priority, ctx.fleet.views(fallback, now), need)
        if isinstance(second, Admit):
            ctx.metrics.degraded.labels(plan.pool, fallback).inc()
            return _admitted(ctx, fallback, second)
    raise NoCapacity(
        f"{plan.pool} pool is overloaded for {priority.value} requests ({decision.reason})",
        reason=decision.reason,
        retry_after_s=decision.retry_after_s,
    )


def _fallback(ctx: ShellContext, plan: PoolPlan, priority: Priority) -> str | None:
    """Where a request the pool would shed may go instead: only sheddable tiering traffic."""
    if priority is Priority.SHEDDABLE and ctx.cfg.admission.degrade_to_draft:
        return plan.fallback
    return None


def _admitted(ctx: ShellContext, pool: str, decision: Admit) -> str:
    if decision.stale_fail_open:
        ctx.metrics.stale_fail_open.labels(pool).inc()
    return pool


def _rank(
    ctx: ShellContext, job: Job, model: str, inbound: Inbound, priority: Priority, *, tenant: str
) -> tuple[str, ...]:
    pool = job.pool
    routing = ctx.cfg.routing
    chain = prefix_chain(
        inbound.prompt_text,
        model=model,
        tenant=tenant,
        block_chars=routing.block_chars,
        max_blocks=routing.max_blocks,
    )
    key = RouteKey(chain=chain, tenant=tenant, model=model)
    policy = ctx.policies[pool]
    need = _need(ctx, pool, inbound, job.max_tokens)
    views = ctx.admission.eligible(priority, ctx.fleet.views(pool, ctx.clock()), need)
    ranked = policy.rank(key, views)
    if not ranked:
        raise NoCapacity(f"no routable engine in the {pool} pool", reason=REASON_NO_ENGINE)
    # The prompt work each engine that may get the request would do, counted while it waits
    # for its first byte (asked before ``observe`` records the pick as holding the prompt).
    job.prefill = {
        name: float(policy.uncached(key, name)) for name in ranked[: 1 + ctx.cfg.upstream.retries]
    }
    job.prompt_tokens = _uncached_tokens(len(inbound.prompt_text), len(chain), job.prefill,
                                         routing.block_chars)
    policy.observe(key, ranked[0])
    return ranked


def _uncached_tokens(
    chars: int, chain: int, uncached: dict[str, float], block_chars: int
) -> dict[str, float]:
    """Per engine: prompt tokens it does not hold (the prompt less its cached chain blocks)."""
    tokens, per_block = chars / CHARS_PER_TOKEN, block_chars / CHARS_PER_TOKEN
    return {name: max(0.0, tokens - (chain - n) * per_block) for name, n in uncached.items()}


def _engine_priority(ctx: ShellContext, pool: str, priority: Priority) -> int | None:
    config = ctx.cfg.pool(pool)
    if config is None or not config.priority_scheduling:
        return None
    return engine_priority(priority)


def _observe(ctx: ShellContext, job: Job) -> None:
    m = ctx.metrics
    status = str(job.status or 500)
    m.requests.labels(job.pool, job.engine, job.cls, status).inc()
    if job.status == CLIENT_CLOSED:
        m.client_disconnects.labels(job.pool).inc()
    if job.shed_reason is not None:
        m.sheds.labels(job.pool, job.cls, job.shed_reason).inc()
    m.duration.labels(job.pool, status).observe(ctx.clock() - job.started_at)
    if job.first_byte_at is not None:
        m.ttft.labels(job.pool).observe(job.first_byte_at - job.started_at)


# --- the proxy's own endpoints -------------------------------------------------------------------


async def models(request: web.Request) -> web.Response:
    ctx = request.app[SHELL]
    created = int(ctx.started_at)
    data = [
        {"id": name, "object": "model", "created": created, "owned_by": "kvproxy", "pool": pool}
        for name, pool in model_names(ctx.cfg)
    ]
    return _json({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    ctx = request.app[SHELL]
    if ctx.drain.draining:
        return _json({"ready": False, "reason": "draining"}, status=503)
    if not ctx.fleet.any_routable(ctx.clock()):
        return _json({"ready": False, "reason": "no routable engine"}, status=503)
    return _json({"ready": True})


async def metrics(request: web.Request) -> web.Response:
    ctx = request.app[SHELL]
    ctx.metrics.refresh_engines(ctx.fleet.gauge_rows(ctx.clock()), HEALTH_STATES)
    return web.Response(body=ctx.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def admin_engines(request: web.Request) -> web.Response:
    request.app[DOOR].tenants.check_admin(request.headers.get("Authorization"))
    ctx = request.app[SHELL]
    return _json({"engines": ctx.fleet.admin_view(ctx.clock()), "draining": ctx.drain.draining})


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")
