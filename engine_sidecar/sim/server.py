"""HTTP surface of one simulated engine: vLLM's OpenAI routes plus ``/admin/*``.

Rules: handlers are thin: ``protocol`` validates, the engine generates, ``responses`` shapes the
bytes, ``streaming`` relays words and injects mid-stream faults. ``ApiError`` becomes a response in
one middleware; anything else becomes a logged, vLLM-shaped 500; ``CancelledError`` (the client went
away) always propagates after the request has been aborted inside the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from engine_sidecar.sim import adaptive, generate
from engine_sidecar.sim.agreement import prompt_logprobs
from engine_sidecar.sim.engine import Sampling, SimEngine
from engine_sidecar.sim.protocol import ApiError, Kind, Limits, ParsedRequest, parse, prompt_ids_of
from engine_sidecar.sim.responses import Identity
from engine_sidecar.sim.streaming import ConnectionResetByFault, relay_full, relay_stream
from engine_sidecar.sim.tokenizer import TOKEN_IDS, chat_prompt, decode, encode
from engine_sidecar.speculation.lease import Lease, LocalLease

log = logging.getLogger(__name__)

ENGINE: web.AppKey[SimEngine] = web.AppKey("engine", SimEngine)
_JSON = "application/json"
VLLM_VERSION = "0.32.0+sim"  # the vLLM API this server imitates; "+sim" tells it apart
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(payload: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type=_JSON)


@web.middleware
async def _errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return web.Response(body=exc.body(), status=exc.status, content_type=_JSON)
    except (ConnectionResetByFault, ConnectionResetError):
        # The transport is already gone; aiohttp drops whatever is returned here.
        return web.Response(status=500)
    except web.HTTPException as exc:
        if exc.status in (404, 405):  # FastAPI's shape, as vLLM answers unknown routes
            return _json({"detail": exc.reason}, status=exc.status)
        raise
    except Exception:
        log.exception("unexpected error serving %s %s", request.method, request.path)
        err = ApiError(500, "Internal server error")
        return web.Response(body=err.body(), status=500, content_type=_JSON)


async def _engine_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["X-Engine-Id"] = request.app[ENGINE].name


def build_app(engine: SimEngine, spec_lease: Lease | None = None) -> web.Application:
    """``spec_lease``: the pool lease the admin speculation route takes (the cluster's)."""
    app = web.Application(middlewares=[_errors], client_max_size=64 * 1024 * 1024)
    app[ENGINE] = engine
    app.on_response_prepare.append(_engine_header)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post(generate.PATH, _generate_tokens)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/version", _version)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    app.router.add_post("/reset_prefix_cache", _reset_prefix_cache)
    app.router.add_get("/admin/state", _state)
    app.router.add_get("/admin/faults", _faults_get)
    app.router.add_post("/admin/faults", _faults_set)
    app.router.add_delete("/admin/faults", _faults_clear)
    adaptive.add_routes(app, engine, spec_lease or LocalLease())
    return app


def _limits(engine: SimEngine) -> Limits:
    cfg = engine.config
    return Limits(model=engine.model, max_model_len=cfg.max_model_len,
                  priority_scheduling=cfg.scheduling_policy == "priority",
                  tokenizer=engine.tokenizer)


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def _generate_tokens(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    if engine.draining:
        raise ApiError(503, "The engine is draining and accepts no new requests.")
    await _inject(engine)
    return await generate.generate(request, engine, _limits(engine))


async def _inject(engine: SimEngine) -> None:
    """The injected faults every generation route suffers before it starts."""
    faults = engine.faults
    if faults.header_delay_s > 0:
        await asyncio.sleep(faults.header_delay_s)
    if faults.error_rate > 0 and engine.fault_rng.random() < faults.error_rate:
        raise ApiError(faults.error_status, "Injected fault: the engine failed this request.")


async def _admit(request: web.Request, engine: SimEngine, kind: Kind) -> ParsedRequest:
    if engine.draining:
        raise ApiError(503, "The engine is draining and accepts no new requests.")
    parsed = parse(kind, await request.read(), _limits(engine))
    if not engine.fits(len(parsed.prompt_ids) + parsed.max_tokens):
        raise ApiError(400, "The request needs more KV-cache blocks than the engine has.",
                       "max_tokens")
    await _inject(engine)
    return parsed


async def _generate(request: web.Request, kind: Kind) -> web.StreamResponse:
    engine = request.app[ENGINE]
    parsed = await _admit(request, engine, kind)
    base_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    ident = Identity(kind=kind, response_id=prefix + base_id, created=int(time.time()),
                     model=engine.model, logprobs=parsed.logprobs)
    sampling = Sampling(max_tokens=parsed.max_tokens, temperature=parsed.temperature,
                        seed=parsed.seed, priority=parsed.priority, ignore_eos=parsed.ignore_eos,
                        cache_salt=parsed.cache_salt,
                        workload=request.headers.get("X-Workload-Class", "")[:64] or None,
                        only=_only(parsed.allowed_token_ids),
                        read_cache=parsed.prompt_logprobs is None)
    stream = engine.submit(ident.response_id, parsed.prompt_ids, sampling, client_id=base_id)
    engine.in_flight += 1
    try:
        if parsed.stream:
            return await relay_stream(request, engine, stream, ident, parsed.include_usage)
        return await relay_full(request, engine, stream, ident,
                                return_token_ids=parsed.return_token_ids,
                                prompt_lp=_prompt_logprobs(engine, parsed, sampling))
    finally:
        engine.in_flight -= 1
        stream.abort()


def _only(allowed: tuple[int, ...] | None) -> int | None:
    """The one word an ``allowed_token_ids`` list forces (the simulator honours one token of
    its own vocabulary; otherwise the list is ignored)."""
    if allowed is None or len(allowed) != 1 or allowed[0] not in TOKEN_IDS:
        return None
    return TOKEN_IDS.index(allowed[0])


def _prompt_logprobs(engine: SimEngine, parsed: ParsedRequest, sampling: Sampling
                     ) -> list[Any] | None:
    if parsed.prompt_logprobs is None:
        return None
    begun, words = engine.answer_stream(parsed.prompt_ids, sampling)
    return prompt_logprobs(parsed.prompt_ids, begun, words, max(1, parsed.prompt_logprobs))


async def _models(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    card = {"id": engine.model, "object": "model", "created": int(time.time()),
            "owned_by": "vllm", "root": engine.model, "parent": None,
            "max_model_len": engine.config.max_model_len,
            "permission": [{"id": f"modelperm-{engine.name}", "object": "model_permission",
                            "allow_sampling": True, "allow_logprobs": True,
                            "allow_view": True, "is_blocking": False}]}
    return _json({"object": "list", "data": [card]})


async def _health(request: web.Request) -> web.StreamResponse:
    return web.Response(status=200)


async def _version(request: web.Request) -> web.StreamResponse:
    return _json({"version": VLLM_VERSION})


async def _metrics(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    engine.metrics_served += 1
    faults = engine.faults
    if faults.metrics_status is not None and faults.metrics_status != 200:
        return web.Response(status=faults.metrics_status, text="injected metrics failure\n")
    if faults.metrics_frozen and engine.last_metrics is not None:
        body = engine.last_metrics
    else:
        body = engine.metrics_text().encode()
        engine.last_metrics = body
    return web.Response(body=body,
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def _json_object(request: web.Request) -> dict[str, Any]:
    """The request body, which must be one JSON object (400 otherwise, as vLLM answers)."""
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object")
    return body


async def _tokenize(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body = await _json_object(request)
    model = body.get("model")
    if model is not None and model != engine.model:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")
    if engine.tokenizer is not None and isinstance(body.get("prompt") or body.get("messages"),
                                                   str | list):
        ids = prompt_ids_of("messages" in body, body, engine.tokenizer)
    elif isinstance(body.get("prompt"), str):
        ids = encode(body["prompt"])
    elif isinstance(body.get("messages"), list):
        try:
            ids = encode(chat_prompt(body["messages"]))
        except (ValueError, AttributeError):
            raise ApiError(400, "messages must be a list of message objects", "messages") from None
    else:
        raise ApiError(400, "Either prompt (a string) or messages must be given", "prompt")
    return _json({"count": len(ids), "max_model_len": engine.config.max_model_len,
                  "tokens": ids.tolist(), "token_strs": None})


async def _detokenize(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body = await _json_object(request)
    model = body.get("model")
    if model is not None and model != engine.model:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in tokens):
        raise ApiError(400, "tokens must be a list of token ids", "tokens")
    return _json({"prompt": decode(tokens)})


async def _reset_prefix_cache(request: web.Request) -> web.StreamResponse:
    return _json({"success": request.app[ENGINE].reset_prefix_cache()})


async def _state(request: web.Request) -> web.StreamResponse:
    return _json(request.app[ENGINE].state())


async def _faults_get(request: web.Request) -> web.StreamResponse:
    return _json(request.app[ENGINE].faults.as_dict())


async def _faults_set(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body = await _json_object(request)
    try:
        engine.faults.update(body)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    if not engine.faults.metrics_frozen:
        engine.last_metrics = None
    return _json(engine.faults.as_dict())


async def _faults_clear(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    engine.faults.clear()
    engine.last_metrics = None
    return _json(engine.faults.as_dict())
