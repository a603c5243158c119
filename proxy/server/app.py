"""The aiohttp application: routes, the one error middleware, and owned background resources.

Rules:
- ``build_app`` wires pure-core objects into a ``ShellContext`` reachable only via typed keys.
- The upstream sessions, the named scraper task and the named event-loop lag probe
  (``kvproxy-loop-lag``) are created and destroyed by ``cleanup_ctx``, and so is the garbage
  collector's pause callback (``proxy.observe.gcpause``); nothing outlives the application. A
  worker's scraper shares its scrapes with its siblings over the parent's hub
  (``proxy.fleet.scrape_share``).
- One middleware turns every exception into a response: ``KvproxyError`` renders itself,
  aiohttp's own HTTP errors become OpenAI-shaped errors, anything else is logged and becomes a
  500. ``asyncio.CancelledError`` always propagates. An unknown path or method is answered in the
  same shape by a last, catch-all route, never raised (aiohttp's raised 404 leaves a cycle).
- Every response names its server as plain ``kvproxy`` (no versions, no libraries) and carries
  ``X-Request-Id``; an error that leaves the body unread closes the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

import aiohttp
import orjson
from aiohttp import HttpVersion11, hdrs, web

from proxy.core.admission import Admission
from proxy.core.config import Config
from proxy.core.door_config import DoorConfig
from proxy.core.errors import ExpectationFailed, KvproxyError, PayloadTooLarge
from proxy.core.isolation import TenantSalts
from proxy.core.routing import make_policy
from proxy.core.sharing_state import Outbox
from proxy.core.spread import Blindness
from proxy.fleet.discovery import REFRESH_S, ModelDiscovery
from proxy.fleet.engines import Engine, Fleet
from proxy.fleet.precise import PreciseRouting
from proxy.fleet.scrape_share import ScrapeShare
from proxy.fleet.scraper import Scraper
from proxy.fleet.upstream import make_data_session, make_scrape_session
from proxy.observe.gcpause import GcPauses
from proxy.observe.looplag import LoopLag
from proxy.observe.metrics import ProxyMetrics
from proxy.server import handlers, specfirst
from proxy.server.admit import HOLDING, Holding
from proxy.server.connections import SERVER_NAME
from proxy.server.context import Drain, ShellContext
from proxy.server.keys import (
    FLEET_KNOWN,
    MODELS,
    REQUEST_ID,
    SCRAPER_TASK,
    SHARING,
    SHELL,
    WORKER,
)
from proxy.server.worker import WorkerLink, WorkerSeat
from proxy.tenancy.frontdoor import DOOR, FrontDoor
from proxy.tenancy.hub import MAX_FRAME
from proxy.tenancy.shared_decision import SharedDecider
from proxy.tenancy.shared_routing import Bus, RedisStreamBus, SharedRouting
from proxy.tenancy.shared_state import RegistrySync

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_app(
    cfg: Config,
    *,
    engines_override: Sequence[Engine] | None = None,
    clock: Callable[[], float] = time.monotonic,
    door: DoorConfig | None = None,
    worker: WorkerSeat | None = None,
) -> web.Application:
    """The proxy application for ``cfg`` (``engines_override``: a prepared fleet, for tests;
    ``door``: tenant, limit, cache and Redis settings to use instead of those in ``cfg``;
    ``worker``: this process is one of the workers of ``kvproxy serve --workers N``)."""
    app = web.Application(
        middlewares=[error_middleware], client_max_size=cfg.server.max_body_bytes + 1
    )
    app[SHELL] = _context(cfg, engines_override, clock)
    door_cfg = door if door is not None else DoorConfig.of(cfg)
    app[DOOR] = FrontDoor(door_cfg, registry=app[SHELL].metrics.registry)
    auth = door_cfg.auth
    app[SHELL].salts = TenantSalts(
        door_cfg.cache.secret, tenants_known=bool(auth.tenants) or auth.redis_keys
    )
    app[SHELL].metrics.tenant_labels.know(
        [door_cfg.auth.default_tenant, *(t.name for t in door_cfg.auth.tenants)]
    )
    app[DOOR].gate.tenant_label = app[SHELL].metrics.tenant_labels
    app[MODELS] = make_discovery(app[SHELL])
    if worker is not None:
        app[WORKER] = WorkerLink(worker, cfg.server.worker_stuck_after_s)
    app[specfirst.SPECFIRST] = specfirst.build(app[SHELL])
    app[HOLDING] = Holding(app[SHELL])
    app.cleanup_ctx.append(_upstream_sessions)
    app.cleanup_ctx.append(_scraper)
    app.cleanup_ctx.append(_kv_events)
    app.cleanup_ctx.append(model_discovery)
    app.cleanup_ctx.append(_front_door)
    app.cleanup_ctx.append(_sharing)
    app.cleanup_ctx.append(specfirst.tokenizer_check)
    app.on_response_prepare.append(_server_header)
    _routes(app)
    return app


def _context(
    cfg: Config, engines: Sequence[Engine] | None, clock: Callable[[], float]
) -> ShellContext:
    metrics = ProxyMetrics()
    policies = {pool.name: make_policy(cfg.routing) for pool in cfg.pools}

    def forget(pool: str, engine: str) -> None:
        if pool in policies:
            policies[pool].forget(engine)
        metrics.forget_engine(engine, pool)

    fleet = Fleet(cfg, engines, on_remove=forget,
                  on_add=lambda pool, engine: metrics.engine_back(engine, pool))
    return ShellContext(
        cfg=cfg,
        fleet=fleet,
        policies=policies,
        admission=Admission(cfg.admission, cfg.pressure),
        metrics=metrics,
        drain=Drain(metrics),
        clock=clock,
        started_at=time.time(),
        precise=(PreciseRouting(cfg, metrics.kv_events, clock)
                 if any(p.tokenizer for p in cfg.pools) else None),
    )


def _routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", handlers.chat_completions, expect_handler=_expect)
    app.router.add_post("/v1/completions", handlers.completions, expect_handler=_expect)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_get("/v1/models/{model:.+}", handlers.model)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/ready", handlers.ready)
    app.router.add_get("/metrics", handlers.metrics)
    app.router.add_get("/admin/engines", handlers.admin_engines)
    # Last, so every other route matches first: every other path and method.
    app.router.add_route("*", "/{unrouted:.*}", _unrouted)


async def _unrouted(request: web.Request) -> web.Response:
    """No route for this path (404), or none for this method (405 with ``Allow``). Left to
    aiohttp's router, these are exceptions raised from a route that refers to itself: every such
    request left a cycle (route -> exception -> traceback -> frames -> the request) that only a
    full collection frees, rare under the tuned collector (``server.gc_*``)."""
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource is not request.match_info.route.resource:
            allowed |= (await resource.resolve(request))[1]
    exc = web.HTTPMethodNotAllowed(request.method, allowed) if allowed else web.HTTPNotFound()
    return _http_error(request, exc)


async def _upstream_sessions(app: web.Application) -> AsyncIterator[None]:
    ctx = app[SHELL]
    ctx.data_session = make_data_session(ctx.cfg.upstream)
    ctx.scrape_session = make_scrape_session()
    try:
        yield
    finally:
        await ctx.data_session.close()
        await ctx.scrape_session.close()


async def _scraper(app: web.Application) -> AsyncIterator[None]:
    ctx = app[SHELL]
    assert ctx.scrape_session is not None
    lag = LoopLag(ctx.metrics.loop_lag)
    pauses = GcPauses(ctx.metrics.gc_pause)
    pauses.install()
    probe = asyncio.create_task(lag.run(), name="kvproxy-loop-lag")
    door = app[DOOR]
    first_after = None if door.registry_read is None else (
        door.registry_read, door.cfg.redis.first_read_bound_s)
    scraper = Scraper(ctx.fleet, ctx.scrape_session, ctx.cfg.telemetry, ctx.metrics, ctx.clock,
                      lag=lag, share=_scrape_share(app), first_after=first_after)
    task = asyncio.create_task(scraper.run(), name="kvproxy-scraper")
    app[SCRAPER_TASK] = task
    app[FLEET_KNOWN] = scraper.first_round
    try:
        yield
    finally:
        pauses.remove()
        for owned in (task, probe):
            owned.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await owned


def _scrape_share(app: web.Application) -> ScrapeShare | None:
    """A worker's link to its siblings' scrapes (engines are scraped once per machine)."""
    worker = app.get(WORKER)
    if worker is None:
        return None
    ctx, bus = app[SHELL], worker.bus
    share = ScrapeShare(ctx.fleet, ctx.metrics, ctx.clock, index=worker.seat.index,
                        workers=worker.seat.workers, interval_s=ctx.cfg.telemetry.interval_s,
                        max_bytes=MAX_FRAME, send=bus.send_telemetry)  # fmt: skip
    bus.on_telemetry = share.receive
    return share


async def _kv_events(app: web.Application) -> AsyncIterator[None]:
    """One named listener task per engine that publishes KV events, for the app's lifetime."""
    precise = app[SHELL].precise
    if precise is not None:
        precise.start()
    try:
        yield
    finally:
        if precise is not None:
            await precise.close()


async def _front_door(app: web.Application) -> AsyncIterator[None]:
    ctx = app[SHELL]
    door = app[DOOR]
    pools = {pool.name: pool.model for pool in ctx.cfg.pools}
    guard = ctx.cfg.pressure
    door.start(
        lambda: ctx.fleet,
        open_s=ctx.cfg.breaker.open_s,
        clock=ctx.clock,
        on_registry=RegistrySync(ctx.fleet, pools,
                                 (e.url for pool in ctx.cfg.pools for e in pool.engines)),
        pressure=(lambda: ctx.fleet) if guard.enabled else None,
        pressure_hold_s=guard.hold_scrapes * ctx.cfg.telemetry.interval_s,
    )
    try:
        yield
    finally:
        await door.close()


async def _sharing(app: web.Application) -> AsyncIterator[None]:
    """Share routing state over Redis if there is one, else with the sibling workers if this is
    a worker; a lone process without Redis shares nothing."""
    ctx = app[SHELL]
    sharing = ctx.cfg.sharing
    link, worker = app[DOOR].link, app.get(WORKER)
    bus: Bus | None = None
    if sharing.enabled and link is not None:
        bus = RedisStreamBus(link, maxlen=sharing.stream_len, ttl_s=sharing.ttl_s)
        transport = "redis"
    elif sharing.enabled and worker is not None:
        bus, transport = worker.bus, "the workers' hub"
    if bus is None:
        yield
        return
    ctx.outbox = Outbox(sharing.max_batch)
    if sharing.spread:
        ctx.blindness = {pool: Blindness() for pool in ctx.policies}
    blind = dict(ctx.blindness)

    def merged(peers: int, dispatches: Mapping[str, int]) -> None:
        for pool, b in blind.items():
            b.merged(peers, dispatches.get(pool, 0))

    decider = None
    if sharing.decisions and link is not None and transport == "redis":
        decider = SharedDecider(link, ttl_s=sharing.ttl_s, timeout_s=sharing.decision_timeout_s,
                                tolerance=ctx.cfg.routing.cost_tolerance,
                                registry=ctx.metrics.registry, replica=uuid.uuid4().hex[:16])
    shared = app[SHARING] = SharedRouting(
        bus, ctx.outbox, ctx.policies, lambda: ctx.fleet, ttl_s=sharing.ttl_s,
        interval_s=sharing.interval_s, max_chain=ctx.cfg.routing.max_blocks, clock=ctx.clock,
        registry=ctx.metrics.registry, transport=transport,
        on_merged=merged, claims=decider,
    )  # fmt: skip
    if decider is not None:
        decider.peers = lambda: shared.peers_heard
        ctx.decider = decider
    task = asyncio.create_task(shared.run(), name="kvproxy-shared-routing")
    try:
        yield
    finally:
        ctx.decider = None
        shared.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if decider is not None:
            await decider.close()


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    request[REQUEST_ID] = handlers.request_id(request)
    try:
        response = await handler(request)
    except KvproxyError as exc:
        if _answer_began(request):
            return _abandon(request, exc.message)
        response = render(exc)
        if exc.closes_connection:
            response.force_close()
    except web.HTTPException as exc:
        response = _http_error(request, exc)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        if _answer_began(request):
            return _abandon(request, "internal error in the proxy")
        response = render(KvproxyError("internal error in the proxy"))
    if not response.prepared:
        response.headers.setdefault("X-Request-Id", request[REQUEST_ID])
    return response


def _answer_began(request: web.Request) -> bool:
    """Whether the head of an answer to ``request`` is already out (a ``100 Continue`` is not
    counted: ``_expect`` resets the count after it)."""
    return request.writer.output_size > 0


def _abandon(request: web.Request, why: str) -> web.StreamResponse:
    """A handler failed after its answer began: a second answer cannot follow the first (it
    would be read as part of the body). The connection is closed, so the client sees the answer
    cut off; the response returned is never sent."""
    log.warning("%s %s failed after its answer began (%s); its connection is closed",
                request.method, request.path, why)
    if request.transport is not None:
        request.transport.close()
    return web.StreamResponse()


async def _expect(request: web.Request) -> web.StreamResponse | None:
    """A client's ``Expect``, answered before its body as every refusal is (this runs ahead of the
    middleware): ``100 Continue`` only for a body the proxy would read, a body announced over
    ``server.max_body_bytes`` refused at once (413, before the client sends it), and any other
    expectation refused (417)."""
    if request.headers.get(hdrs.EXPECT, "").lower() == "100-continue":
        limit = request.app[SHELL].cfg.server.max_body_bytes
        length = request.content_length
        if length is None or length <= limit:
            if request.version >= HttpVersion11:
                await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                request.writer.output_size = 0  # the answer's own head is yet to come
            return None
        error: KvproxyError = PayloadTooLarge(
            f"request body of {length} bytes exceeds the limit of {limit} bytes")
    else:
        error = ExpectationFailed("the only expectation the proxy meets is 100-continue")
    response = render(error)
    response.force_close()
    rid = response.headers["X-Request-Id"] = handlers.request_id(request)
    response.headers["X-Cache"] = "BYPASS"  # a proxied path's answer, as its other refusals
    handlers.refused_from_head(request, rid, error)
    return response


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = SERVER_NAME
    if "Transfer-Encoding" in request.headers or "Upgrade" in request.headers:
        # A chunked request is the last on its connection: aiohttp's C parser carries the last
        # trailer field of a chunked body into the next request's headers, so one client could
        # put a key, an id or a priority on the request after its own (another client's, behind
        # a balancer that reuses connections). Also RFC 9112's rule for HTTP/1.0 with chunked.
        # An ``Upgrade`` the proxy ignores (h2c) makes the parser drop what was pipelined behind
        # the request: closing tells the client, who would otherwise wait for it for ever.
        # The head is built before this hook runs: the header is set here too.
        response.force_close()
        response.headers["Connection"] = "close"
    elif request.version < HttpVersion11 and response.content_length is None:
        # An HTTP/1.0 client has no chunked framing: a body without a length (a stream) ends only
        # when the connection closes, so it must close even if the client asked to keep it alive
        # (aiohttp would keep it open until its keep-alive timeout, the client none the wiser).
        response.force_close()


def render(exc: KvproxyError) -> web.Response:
    return web.Response(
        status=exc.status, body=exc.body(), content_type="application/json", headers=exc.headers()
    )


def _http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
    """aiohttp's own refusals (no such route, wrong method, body too large) in OpenAI shape."""
    err_type = "invalid_request_error" if exc.status < 500 else "internal_error"
    message = f"{exc.reason}: {request.method} {request.path}"
    code = exc.reason.lower().replace(" ", "_")
    body = {"error": {"message": message, "type": err_type, "param": None, "code": code}}
    headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
    return web.Response(
        status=exc.status, body=orjson.dumps(body), content_type="application/json", headers=headers
    )


def make_discovery(ctx: ShellContext, *, interval_s: float = REFRESH_S) -> ModelDiscovery:
    """Discovery over ``ctx``'s fleet, asking through the scrape session (opened later, by the
    app's cleanup context, before discovery's own)."""

    def session() -> aiohttp.ClientSession:
        if ctx.scrape_session is None:
            raise RuntimeError("the scrape session is opened by the app's cleanup context")
        return ctx.scrape_session

    return ModelDiscovery(ctx.cfg, ctx.fleet, session, interval_s=interval_s)


async def model_discovery(app: web.Application) -> AsyncIterator[None]:
    """Cleanup context: the discovery task lives exactly as long as the application."""
    discovery = app[MODELS]
    task = asyncio.create_task(discovery.run(), name="kvproxy-model-discovery")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
