"""HTTP handlers: the proxied OpenAI endpoints and the proxy's own small endpoints.

Rules: a handler performs decisions made by the pure core (pools, admission, routing) in the order
of DESIGN §2 and does nothing clever itself; every refusal is raised as a ``KvproxyError`` and
rendered by the app's error middleware, before any byte of a response. Each proxied request is
counted for drain, and observed in metrics exactly once, whatever way it ends. Every answer to a
proxied request, errors included, carries ``X-Cache`` (``BYPASS`` when the request never reached
the cache) and ``X-Request-Id``. The body is read within ``server.max_body_bytes`` and
``server.body_timeout_s`` (else 413 / 408, and the connection is closed), its tenant's request and
token counters included (``proxy.server.body``). The front door's visit is entered and left in
``_serve``'s own frame: no context manager and no nested coroutine live as long as a stream.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

from proxy.core.admission import Priority, engine_priority, parse_priority
from proxy.core.cache_entry import CachedResponse
from proxy.core.costmodel import typical_prompt
from proxy.core.deadline import FIELD as TIMEOUT_FIELD
from proxy.core.deadline import HEADER as TIMEOUT_HEADER
from proxy.core.deadline import client_timeout
from proxy.core.errors import KvproxyError, NoCapacity, NotFound
from proxy.core.inbound import Endpoint, Inbound, accept_body, named_model, parse_body, rewrite
from proxy.core.isolation import Salting, client_salt
from proxy.core.pools import (
    ModelEntry,
    PoolPlan,
    find_model,
    model_names,
    resolve_model,
    shown,
    upstream_model,
)
from proxy.core.usage import asks_for_usage, usage_of_body, with_usage
from proxy.fleet.engines import HEALTH_STATES
from proxy.fleet.upstream import request_headers
from proxy.observe import accesslog
from proxy.observe.metrics import CONTENT_TYPE
from proxy.server import specanswer
from proxy.server.admit import HOLDING, need_tokens
from proxy.server.body import read_body
from proxy.server.connections import past_cap
from proxy.server.context import DRAIN_CUT, ShellContext
from proxy.server.job import Job, deadline_error
from proxy.server.keys import MODELS, REQUEST_ID, SHELL, WORKER
from proxy.server.pick import rank
from proxy.server.relay import CLIENT_CLOSED, Relay
from proxy.server.specfirst import SPECFIRST
from proxy.tenancy.frontdoor import DOOR, Visit, replay


def request_id(request: web.Request) -> str:
    """The client's ``X-Request-Id`` when it sent a sane one, else a fresh id."""
    given = request.headers.get("X-Request-Id", "").strip()
    if given and len(given) <= 200 and given.isprintable():
        return given
    # 128 random bits as 32 hex digits, as ``uuid4().hex`` gave, at a quarter of its cost (no
    # UUID object per request).
    return os.urandom(16).hex()


async def _proxy(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    ctx = request.app[SHELL]
    job = Job(request[REQUEST_ID], ctx.clock(), cls=Priority.STANDARD.value, path=endpoint.value)
    try:
        ctx.drain.enter(ctx.cfg.admission.retry_after_s)
        try:
            response = await _serve(request, ctx, endpoint, job)
        finally:
            ctx.drain.leave()
    except KvproxyError as exc:
        job.status = exc.status
        exc.context_headers.setdefault("X-Cache", job.extra_headers.get("X-Cache", "BYPASS"))
        if isinstance(exc, NoCapacity):
            job.shed_reason = exc.reason
        raise
    except asyncio.CancelledError as cancelled:
        if cancelled.args[:1] == (DRAIN_CUT,) and _uncancel():
            # The drain timeout came before the engine's answer began: a 503 the client may
            # retry elsewhere, not a connection closed unanswered.
            job.status, job.shed_reason = 503, "draining"
            raise NoCapacity("the proxy is shutting down; the request was not answered in time",
                             reason="draining",
                             retry_after_s=ctx.cfg.admission.retry_after_s) from None
        if not job.delivered:  # a client closing right after the last byte did get its answer
            job.status = CLIENT_CLOSED
        raise
    finally:
        _observe(ctx, job)
    return response


def _uncancel() -> bool:
    """Take back the one cancellation this task had (True), if it had no other."""
    task = asyncio.current_task()
    return task is not None and task.uncancel() == 0


# Partials rather than coroutines that await ``_proxy``: one coroutine fewer held per open stream.
chat_completions = functools.partial(_proxy, endpoint=Endpoint.CHAT)
completions = functools.partial(_proxy, endpoint=Endpoint.COMPLETIONS)


async def _serve(
    request: web.Request, ctx: ShellContext, endpoint: Endpoint, job: Job
) -> web.StreamResponse:
    refused = past_cap(request)
    if refused is not None:  # before anything is read: the connection closes after this answer
        raise refused
    door = request.app[DOOR]
    tenant = await door.identify(request.headers)
    job.tenant = tenant
    server = ctx.cfg.server
    raw = await read_body(request, server.max_body_bytes, server.body_timeout_s)
    body = parse_body(raw, server.max_json_depth)
    size = len(raw)
    del raw
    job.model = named_model(body)  # logged even when another field is refused
    inbound = accept_body(body, endpoint, size=size)
    del body
    priority, salt, plan = _classify(request, ctx, job, inbound)
    visit = await door.enter(
        tenant,
        endpoint=endpoint.value,
        model=_cached_model(ctx, inbound.model, plan.pool),
        body=inbound.body,
        # Repeated header lines are one comma-separated list (RFC 9110, section 5.3).
        cache_control=",".join(request.headers.getall("Cache-Control", ())) or None,
        prompt_chars=len(inbound.prompt_text),
        wait_s=None if job.deadline is None else job.deadline - asyncio.get_running_loop().time(),
    )
    # Entered and left in this frame (no context manager, no nested coroutine per stream).
    completed = False
    try:
        if visit.late:  # its deadline ran out waiting for an identical request's answer
            job.extra_headers["X-Cache"] = visit.x_cache  # looked up: not a BYPASS
            raise deadline_error(job)
        response = await _without_engine(request, ctx, job, visit, inbound=inbound,
                                         priority=priority)
        if response is None:
            ranked, expected = await _prepare(request, ctx, job, plan, priority=priority,
                                              inbound=inbound, salt=salt, visit=visit)
            # What routing needed is dropped before the relay: it would otherwise live, and be
            # scanned by the collector, as long as the stream is open.
            del inbound, plan
            holding = request.app[HOLDING]
            try:
                response = await Relay(ctx, request, job).run(ranked)
            finally:
                holding.ended(job.pool, _freed(job, expected))
        completed = True
    finally:
        await door.leave(visit, completed=completed, engine_asked=job.engine != "none",
                         used=None if job.usage is None else job.usage.total)
    return response


def _cached_model(ctx: ShellContext, asked: str, pool: str) -> str:
    """The model a cache entry is kept under: the name asked for and what it resolves to (the
    pool and the name its engines get), so that an alias pointed elsewhere (a changed config,
    replicas mid-rollout sharing Redis) never answers with the other model's entries."""
    return f"{asked}\x00{pool}\x00{upstream_model(ctx.cfg, pool, asked)}"


def _classify(
    request: web.Request, ctx: ShellContext, job: Job, inbound: Inbound
) -> tuple[Priority, str | None, PoolPlan]:
    """The request's class, its client's salt and the pool plan of its model (noted in ``job``)."""
    _deadline(job, client_timeout(request.headers.get(TIMEOUT_HEADER), inbound.body))
    salt = client_salt(inbound.body)
    priority = parse_priority(request.headers.get("X-Priority"), inbound.body.get("priority"))
    job.cls = priority.value
    job.stream = inbound.stream
    job.model = inbound.model
    plan = resolve_model(ctx.cfg, inbound.model)
    job.pool = plan.pool
    job.asked_pool = plan.pool
    return priority, salt, plan


async def _without_engine(
    request: web.Request, ctx: ShellContext, job: Job, visit: Visit, *, inbound: Inbound,
    priority: Priority,
) -> web.StreamResponse | None:
    """The answer when no engine is asked (a cache hit, or drafted for a speculative-first
    alias); else None, with the job ready for the engine's answer."""
    if visit.entry is not None:
        return await _from_cache(request, job, inbound, visit.entry)
    job.recorder = visit.recorder
    job.extra_headers["X-Cache"] = visit.x_cache
    job.max_tokens = _max_tokens(inbound)
    return await _speculative(request, ctx, job, inbound, priority, visit=visit)


async def _prepare(
    request: web.Request, ctx: ShellContext, job: Job, plan: PoolPlan, *, priority: Priority,
    inbound: Inbound, salt: str | None, visit: Visit,
) -> tuple[tuple[str, ...], float]:
    """Admit, rank and build the engine's request; the ranking and the KV tokens the request is
    expected to take (what ``_freed`` gives back when the answer tells no usage)."""
    holding = request.app[HOLDING]
    job.pool, views = await holding.admit(plan, priority, inbound, job.max_tokens, job.deadline,
                                          on_hold=visit.release)
    if job.pool != plan.pool:
        visit.discard()  # another pool's answer is not the answer for the model asked for
    model = upstream_model(ctx.cfg, job.pool, inbound.model)
    salting = _isolate(ctx, job.pool, job.tenant or "", salt)
    prepared = (None if ctx.precise is None else
                await ctx.precise.prepare(job.pool, inbound, salting.salt))
    ranked = await rank(ctx, job, model, inbound, priority, pool_views=views, salting=salting,
                        tenant=job.tenant or "", prepared=prepared)
    job.body = rewrite(
        _upstream_body(job, inbound.body),
        model=model,
        priority=_engine_priority(ctx, job.pool, priority),
        cache_salt=salting.salt,
    )
    job.headers = request_headers(request.headers, job.request_id)
    return ranked, need_tokens(ctx, job.pool, inbound, job.max_tokens)


async def _speculative(
    request: web.Request, ctx: ShellContext, job: Job, inbound: Inbound, priority: Priority, *,
    visit: Visit,
) -> web.StreamResponse | None:
    """Serve a request for a speculative-first alias by drafting, when it may be (else None:
    the target pool serves it unchanged, like any request; ``X-Speculative`` says why). A
    drafted answer is assembled here, not relayed, and the cache keeps engines' own answers
    only: identical requests waiting for this one are let go before it drafts."""
    sf = request.app[SPECFIRST]
    plan = sf.route(inbound.model, inbound, job.tenant or "", ctx.clock())
    if plan is None:
        return None
    if isinstance(plan, str):
        reason = plan
    else:
        await visit.release()
        try:
            return await specanswer.serve(ctx, request, job, inbound=inbound, plan=plan,
                                          priority=priority, metrics=sf.metrics)
        except specanswer.PassThrough as passing:
            reason = passing.reason
    sf.metrics.requests.labels(inbound.model, reason).inc()
    job.extra_headers["X-Speculative"] = f"target-only; reason={reason}"
    return None


def _deadline(job: Job, timeout_s: float | None) -> None:
    if timeout_s is not None:
        job.timeout_s = timeout_s
        job.deadline = asyncio.get_running_loop().time() + timeout_s


def _upstream_body(job: Job, body: Mapping[str, Any]) -> dict[str, Any]:
    """The client's body minus what is the proxy's (``timeout``), asking a stream for its usage
    (stripped again from the client's stream when the client did not ask for it)."""
    out = {k: v for k, v in body.items() if k != TIMEOUT_FIELD}
    if job.stream:
        out, job.strip_usage = with_usage(out)
    return out


async def _from_cache(
    request: web.Request, job: Job, inbound: Inbound, entry: CachedResponse
) -> web.StreamResponse:
    """Answer from the response cache (no engine involved; ``X-Engine: cache``)."""
    job.engine, job.status = "cache", 200
    job.usage = usage_of_body(entry.json_body())  # the cached answer's, for the access log
    job.first_byte_at = request.app[SHELL].clock()
    usage = asks_for_usage(inbound.body)
    headers = job.client_headers()
    out = await replay(request, entry, stream=inbound.stream, include_usage=usage, headers=headers,
                       request_id=job.request_id)
    job.delivered = inbound.stream
    return out


def _max_tokens(inbound: Inbound) -> int | None:
    """The client's cap on the answer (validated by ``accept``), if it set one."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = inbound.body.get(name)
        if isinstance(value, int):
            return value
    return None


def _freed(job: Job, expected: float) -> float:
    """KV tokens an ended answer gave back to its engine: its usage, else what it was expected
    to take."""
    if job.usage is not None:
        return float(job.usage.total)
    return expected


def _isolate(ctx: ShellContext, pool: str, tenant: str, client: str | None) -> Salting:
    config = ctx.cfg.pool(pool)
    mode = "none" if config is None else config.isolation
    return ctx.salts.salting(mode, tenant, client)


def _engine_priority(ctx: ShellContext, pool: str, priority: Priority) -> int | None:
    config = ctx.cfg.pool(pool)
    if config is None or not config.priority_scheduling:
        return None
    return engine_priority(priority)


def refused_from_head(request: web.Request, request_id: str, error: KvproxyError) -> None:
    """A proxied request refused from its head alone, before its handler runs (``Expect``):
    counted and logged as every other proxied request is, with no tenant (not identified)."""
    ctx = request.app[SHELL]
    job = Job(request_id, ctx.clock(), cls=Priority.STANDARD.value, path=request.path)
    job.status = error.status
    job.extra_headers["X-Cache"] = "BYPASS"
    _observe(ctx, job)


def _observe(ctx: ShellContext, job: Job) -> None:
    m = ctx.metrics
    status = str(job.status or 500)
    m.requests_by(job.pool, job.engine, job.cls, status).inc()
    if job.status == CLIENT_CLOSED:
        m.client_disconnects.labels(job.pool).inc()
    if job.shed_reason is not None:
        m.sheds.labels(job.pool, job.cls, job.shed_reason).inc()
    now = ctx.clock()
    m.duration_by(job.pool, status).observe(now - job.started_at)
    if job.first_byte_at is not None:
        m.ttft_by(job.pool).observe(job.first_byte_at - job.started_at)
    if job.dispatched_at is not None:
        m.dispatch_by(job.pool).observe(job.dispatched_at - job.started_at)
    _account(ctx, job, status)
    if ctx.cfg.log.access:
        accesslog.emit(accesslog.access_fields(job, now))


def _account(ctx: ShellContext, job: Job, status: str) -> None:
    m = ctx.metrics
    tenant = m.tenant_labels(job.tenant or "")  # refused before it was identified: "other"
    m.tenant_requests_by(tenant, job.pool, status).inc()
    usage = job.usage
    # A cache hit cost the engines nothing: its answer's usage was counted when it was generated.
    if usage is not None and job.engine != "cache":
        m.tenant_tokens_by(tenant, job.pool, "prompt").inc(usage.prompt)
        m.tenant_tokens_by(tenant, job.pool, "completion").inc(usage.completion)
        m.tenant_tokens_by(tenant, job.pool, "cached").inc(usage.cached)


# --- the proxy's own endpoints -------------------------------------------------------------------


async def models(request: web.Request) -> web.Response:
    # A key where keys are required, as for completions (vLLM with ``--api-key`` and OpenAI ask
    # for one here too): the names, pools and tiers are not for anyone who can reach the port.
    await request.app[DOOR].identify(request.headers)
    ctx = request.app[SHELL]
    data = [_model_card(ctx, entry) for entry in model_names(ctx.cfg)]
    return _json({"object": "list", "data": data})


async def model(request: web.Request) -> web.Response:
    await request.app[DOOR].identify(request.headers)  # as ``models``
    ctx = request.app[SHELL]
    name = request.match_info["model"]
    entry = find_model(ctx.cfg, name)
    if entry is None:
        raise NotFound(f"The model {shown(name)} does not exist", param="model")
    return _json(_model_card(ctx, entry))


def _model_card(ctx: ShellContext, entry: ModelEntry) -> dict[str, Any]:
    return {
        "id": entry.id,
        "object": "model",
        "created": int(ctx.started_at),
        "owned_by": "kvproxy",
        "pool": entry.pools[0],
        "pools": list(entry.pools),
    }


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
    body = own_metrics(ctx)
    worker = request.app.get(WORKER)
    if worker is not None:
        body = await worker.merged_metrics(body)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def own_metrics(ctx: ShellContext) -> bytes:
    """This process's exposition, engine gauges refreshed now."""
    now = ctx.clock()
    ctx.metrics.refresh_engines(ctx.fleet.gauge_rows(now), HEALTH_STATES)
    typical = {pool: typical_prompt(policy) for pool, policy in ctx.policies.items()}
    ctx.metrics.pools.refresh(ctx.fleet.pool_rows(now, typical), ctx.metrics.sheds, now)
    if ctx.precise is not None:
        ctx.precise.refresh_metrics()
    return ctx.metrics.render()


async def admin_engines(request: web.Request) -> web.Response:
    request.app[DOOR].tenants.check_admin(request.headers.get("Authorization"))
    ctx = request.app[SHELL]
    rows = ctx.fleet.admin_view(ctx.clock())
    discovery = request.app[MODELS]
    for row in rows:
        row["models"] = discovery.view(row["name"])
        row["kv_events"] = (ctx.precise.admin_row(row["name"]) if ctx.precise is not None
                            else {"mode": "approximate", "state": "no_publisher"})
    return _json({"engines": rows, "draining": ctx.drain.draining})


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")
