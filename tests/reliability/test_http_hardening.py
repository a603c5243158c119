"""What engines and clients can make the proxy do: redirects are never followed, deep JSON is a 400,
nothing internal leaks either way, and every proxied answer carries ``X-Cache`` and a request id.

Real servers on loopback: the proxy in front of rogue engines (or the simulated stack).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from integration.stack import TARGET_MODEL, Stack, StackFactory, chat_body
from multidict import CIMultiDict

from proxy.core.cache_key import canonical_body
from proxy.core.config import LogConfig, TelemetryConfig, UpstreamConfig
from proxy.core.door_config import AuthConfig, LimitsConfig, TenantConfig
from proxy.core.errors import UpstreamError
from proxy.server.app import error_middleware

from .rogue import RogueEngine
from .shell import (
    CHAT,
    COMPLETIONS,
    chat,
    close,
    closed_by_peer,
    connect,
    head,
    proxy_for,
    read_response,
    server_config,
)


async def _post(
    url: str, body: object, **headers: str
) -> tuple[int, CIMultiDict[str], bytes]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    headers.setdefault("Content-Type", "application/json")
    async with (
        aiohttp.ClientSession() as http,
        http.post(url, data=data, headers=headers) as resp,
    ):
        return resp.status, CIMultiDict(resp.headers), await resp.read()


def _error(body: bytes) -> dict[str, Any]:
    error: dict[str, Any] = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# --- redirects ------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("status", [302, 307])
async def test_an_engine_redirect_is_a_502_and_is_never_followed(
    rogue: RogueEngine, stream: bool, status: int
) -> None:
    elsewhere = RogueEngine()
    await elsewhere.start()
    rogue.behaviour.completions = "status"
    rogue.behaviour.completion_status = status
    rogue.behaviour.completion_headers = {"Location": elsewhere.url + CHAT}
    try:
        async with proxy_for(rogue) as proxy:
            code, headers, body = await _post(proxy.url + CHAT, chat(stream=stream))
    finally:
        await elsewhere.stop()
    assert code == 502
    error = _error(body)
    assert "rogue0" in error["message"] and "redirected" in error["message"]
    assert elsewhere.url not in error["message"]
    assert elsewhere.seen == []
    assert len(rogue.requests_to(CHAT)) == 1
    assert headers["X-Cache"] and headers["X-Request-Id"]


async def test_a_redirect_counts_as_an_engine_failure(rogue: RogueEngine) -> None:
    rogue.behaviour.completions = "status"
    rogue.behaviour.completion_status = 307
    rogue.behaviour.completion_headers = {"Location": rogue.url + "/elsewhere"}
    async with proxy_for(rogue) as proxy:
        await _post(proxy.url + CHAT, chat())
        async with aiohttp.ClientSession() as http, http.get(proxy.url + "/metrics") as resp:
            text = await resp.text()
    assert 'kvproxy_upstream_errors_total{engine="rogue0",kind="http_307"} 1.0' in text
    assert rogue.requests_to("/elsewhere") == []


# --- deep JSON ------------------------------------------------------------------------------------


def _nested(depth: int) -> object:
    value: object = "leaf"
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def _nested_json(depth: int) -> bytes:
    """``_nested(depth)`` as JSON, written without recursion (encoders refuse such depths)."""
    opens = [b"[" if i % 2 else b'{"k":' for i in reversed(range(depth))]
    closes = [b"]" if i % 2 else b"}" for i in range(depth)]
    return b"".join(opens) + b'"leaf"' + b"".join(closes)


def _depth(value: object) -> int:
    depth = 0
    while isinstance(value, dict | list):
        depth += 1
        value = value["k"] if isinstance(value, dict) else value[0]
    return depth


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("depth", [100, 300, 5000])
async def test_deeply_nested_bodies_are_a_400_naming_the_problem(
    stack: Stack, path: str, depth: int
) -> None:
    plain = chat_body("hi") if path == CHAT else {"model": TARGET_MODEL, "prompt": "hi"}
    start = orjson.dumps(plain)[:-1]  # the object left open for one more member
    body = start + b',"metadata":' + _nested_json(depth) + b"}"
    status, headers, raw = await _post(stack.url + path, body)
    assert status == 400
    assert "nested more than 64 levels" in _error(raw)["message"]
    assert headers["X-Cache"] == "BYPASS"


async def test_the_depth_limit_is_configurable(make_stack: StackFactory) -> None:
    stack = await make_stack(targets=1, server=server_config(max_json_depth=8))
    # The top-level object is level 1, chat_body's "metadata" value starts at level 2.
    status, _, raw = await _post(stack.url + CHAT, chat_body("hi", metadata=_nested(7)))
    assert status == 200, raw
    status, _, raw = await _post(stack.url + CHAT, chat_body("hi", metadata=_nested(8)))
    assert status == 400
    assert "nested more than 8 levels" in _error(raw)["message"]


def test_the_cache_key_takes_a_body_as_deep_as_the_parser_lets_through() -> None:
    # server.max_json_depth is at most 200; big integers take the standard library's path.
    for leaf in (1, 2**70):
        body = {"metadata": _nested(199), "big": leaf}
        assert canonical_body(body).startswith(b'{"big":')


# --- leaks ----------------------------------------------------------------------------------------

_CLIENT_HEADERS = {
    "X-Real-IP": "203.0.113.7",
    "Via": "1.1 edge-7",
    "Forwarded": "for=203.0.113.7",
    "X-Forwarded-For": "203.0.113.7",
    "X-Forwarded-Host": "api.example",
    "Cookie": "session=client-secret",
    "Authorization": "Bearer sk-client",
    "X-Custom": "kept",
}
_ENGINE_HEADERS = {
    "Set-Cookie": "engine-session=internal",
    "X-Internal-Node": "gpu-17.cluster.local",
    "Server": "uvicorn",
    "X-Powered-By": "vllm",
    "openai-processing-ms": "12",
    "x-ratelimit-remaining-requests": "99",
    "Cache-Control": "no-cache",
}


@pytest.mark.parametrize("stream", [False, True])
async def test_nothing_internal_crosses_the_proxy(rogue: RogueEngine, stream: bool) -> None:
    rogue.behaviour.completion_headers = dict(_ENGINE_HEADERS)
    async with proxy_for(rogue) as proxy:
        status, headers, _ = await _post(proxy.url + CHAT, chat(stream=stream), **_CLIENT_HEADERS)
    assert status == 200
    sent = {k.lower() for k in rogue.requests_to(CHAT)[0].headers}
    for name in ("x-real-ip", "via", "forwarded", "x-forwarded-for", "x-forwarded-host",
                 "cookie", "authorization"):
        assert name not in sent
    assert "x-custom" in sent
    got = {k.lower(): v for k, v in headers.items()}
    assert "set-cookie" not in got
    assert "x-internal-node" not in got
    assert "x-powered-by" not in got
    assert got["server"] == "kvproxy"
    assert got["openai-processing-ms"] == "12"
    assert got["x-ratelimit-remaining-requests"] == "99"
    assert got["x-cache"] and got["x-request-id"]


async def test_the_proxy_names_itself_plainly_everywhere(stack: Stack) -> None:
    for method, path in (("GET", "/health"), ("GET", "/nowhere"), ("POST", CHAT)):
        async with stack.http.request(method, stack.url + path, json={}) as resp:
            assert resp.headers["Server"] == "kvproxy"


async def test_engine_failures_name_the_engine_but_not_its_address(rogue: RogueEngine) -> None:
    # Scrapes far apart: the proxy still believes in the engine after it has gone.
    telemetry = TelemetryConfig(interval_s=5.0, timeout_s=1.0, stale_after_s=30.0)
    async with proxy_for(rogue, telemetry=telemetry) as proxy:
        port = rogue.port
        await rogue.stop()
        status, _, raw = await _post(proxy.url + CHAT, chat())
    assert status == 502
    message = _error(raw)["message"]
    assert "rogue0" in message
    assert "127.0.0.1" not in message and str(port) not in message
    assert "Cannot connect" not in message


# --- X-Cache and X-Request-Id on every proxied answer ---------------------------------------------

_FULL_KV = (
    b'vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.99\n'
    b'vllm:num_requests_running{model_name="m",engine="0"} 0\n'
    b'vllm:num_requests_waiting{model_name="m",engine="0"} 0\n'
)


async def test_a_shed_503_carries_x_cache_and_the_request_id(rogue: RogueEngine) -> None:
    rogue.behaviour.metrics_body = _FULL_KV
    async with proxy_for(rogue) as proxy:
        body = chat(temperature=0)
        status, headers, _ = await _post(
            proxy.url + CHAT, body, **{"X-Priority": "sheddable", "X-Request-Id": "shed-1"}
        )
    assert status == 503
    assert headers["X-Cache"] == "MISS"
    assert headers["X-Request-Id"] == "shed-1"


async def test_a_rate_limited_429_carries_x_cache(rogue: RogueEngine) -> None:
    async with proxy_for(rogue, limits=LimitsConfig(enabled=True, requests_per_min=1)) as proxy:
        first, _, _ = await _post(proxy.url + CHAT, chat())
        status, headers, _ = await _post(proxy.url + CHAT, chat())
    assert (first, status) == (200, 429)
    assert headers["X-Cache"] == "BYPASS"
    assert headers["X-Request-Id"]


async def test_an_upstream_504_carries_x_cache(rogue: RogueEngine) -> None:
    rogue.behaviour.completions = "hang"
    cfg = UpstreamConfig(connect_timeout_s=1.0, first_byte_timeout_s=0.3, response_timeout_s=0.3,
                         idle_timeout_s=0.3)
    async with proxy_for(rogue, upstream=cfg) as proxy:
        status, headers, _ = await _post(proxy.url + CHAT, chat(temperature=0))
    assert status == 504
    assert headers["X-Cache"] == "MISS"
    assert headers["X-Request-Id"]


async def test_an_engine_cookie_is_never_sent_back_to_it(rogue: RogueEngine) -> None:
    # By name, not address: a cookie jar would keep a cookie set by ``localhost``.
    rogue.url_host = "localhost"
    rogue.behaviour.completion_headers = {"Set-Cookie": "engine-session=internal; Path=/"}
    async with proxy_for(rogue) as proxy:
        for _ in range(2):
            status, headers, _ = await _post(proxy.url + CHAT, chat())
            assert status == 200
            assert "Set-Cookie" not in headers
    sent = rogue.requests_to(CHAT)
    assert len(sent) == 2
    assert all("cookie" not in {k.lower() for k in s.headers} for s in sent)


async def test_a_request_without_an_id_gets_a_fresh_one_the_engine_sees_too(
    rogue: RogueEngine,
) -> None:
    async with proxy_for(rogue) as proxy:
        ids = []
        for _ in range(2):
            status, headers, _ = await _post(proxy.url + CHAT, chat())
            assert status == 200
            ids.append(headers["X-Request-Id"])
    assert all(len(i) == 32 and all(c in "0123456789abcdef" for c in i) for i in ids)
    assert ids[0] != ids[1]
    sent = [{k.lower(): v for k, v in s.headers.items()} for s in rogue.requests_to(CHAT)]
    assert [s.get("x-request-id") for s in sent] == ids, sent


# --- Expect ---------------------------------------------------------------------------------------


async def _exchange(url: str, request: bytes) -> bytes:
    """What the proxy writes back on one connection until it closes it."""
    reader, writer = await connect(url)
    writer.write(request)
    try:
        async with asyncio.timeout(5):
            return await reader.read(-1)
    finally:
        await close(writer)


async def _requests_counted(url: str, status: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvproxy_requests_total{") and f'status="{status}"' in line)


async def test_an_unknown_expectation_is_an_openai_shaped_417(
    rogue: RogueEngine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvproxy.access")
    async with proxy_for(rogue, log=LogConfig(access=True)) as proxy:
        raw = await _exchange(proxy.url, head("POST", CHAT, Expect="200-ok",
                                              Content_Type="application/json",
                                              Content_Length="2") + b"{}")
        # Counted and logged as every proxied request, however it ended.
        assert await _requests_counted(proxy.url, "417") == 1
    lines = [r for r in caplog.records if r.name == "kvproxy.access"]
    assert [(r.status, r.path, r.tenant, r.cache) for r in lines] == [  # type: ignore[attr-defined]
        (417, CHAT, None, "BYPASS")]
    status_line, _, rest = raw.partition(b"\r\n")
    assert status_line.split()[1] == b"417"
    headers, _, body = rest.partition(b"\r\n\r\n")
    assert b"x-request-id: " in headers.lower()
    assert b"x-cache: bypass" in headers.lower()  # as every refusal of a proxied path
    assert "100-continue" in _error(body)["message"]
    assert rogue.requests_to(CHAT) == []


async def test_a_body_announced_too_large_is_refused_before_it_is_invited(
    rogue: RogueEngine,
) -> None:
    async with proxy_for(rogue) as proxy:
        raw = await _exchange(proxy.url, head("POST", CHAT, Expect="100-continue",
                                              Content_Type="application/json",
                                              Content_Length=str(10**9)))
        assert await _requests_counted(proxy.url, "413") == 1
    assert raw.startswith(b"HTTP/1.1 413 ")  # no "100 Continue" first: nothing was invited
    assert b"x-cache: bypass" in raw.partition(b"\r\n\r\n")[0].lower()
    assert _error(raw.partition(b"\r\n\r\n")[2])["code"] == "payload_too_large"


async def test_a_continued_body_is_answered_as_usual(rogue: RogueEngine) -> None:
    body = orjson.dumps(chat())
    async with proxy_for(rogue) as proxy:
        reader, writer = await connect(proxy.url)
        writer.write(head("POST", CHAT, Expect="100-continue", Content_Type="application/json",
                          Content_Length=str(len(body)), Connection="close"))
        async with asyncio.timeout(5):
            assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(body)
            raw = await reader.read(-1)
        await close(writer)
    assert raw.startswith(b"HTTP/1.1 200 ")
    assert len(rogue.requests_to(CHAT)) == 1


@pytest.mark.parametrize("pipelined", [False, True])
async def test_a_chunked_request_is_the_last_on_its_connection_so_its_trailers_reach_no_other(
    rogue: RogueEngine, pipelined: bool,
) -> None:
    # aiohttp's C parser carries a chunked body's last trailer field into the next request's
    # headers on the connection: a client could put a key (or an id, a priority) on a request
    # that follows it, another client's behind a balancer that reuses connections.
    auth = AuthConfig(required=True, tenants=(TenantConfig("t1", keys=("key-one-12345",)),))
    body = orjson.dumps(chat("hi"))
    first = (head("POST", CHAT, Content_Type="application/json", Transfer_Encoding="chunked")
             + f"{len(body):x}\r\n".encode() + body
             + b"\r\n0\r\nAuthorization: Bearer key-one-12345\r\n\r\n")
    second = (head("POST", CHAT, Content_Type="application/json",
                   Content_Length=str(len(body))) + body)
    async with proxy_for(rogue, auth=auth) as proxy:
        reader, writer = await connect(proxy.url)
        try:
            writer.write(first + second if pipelined else first)
            answer = await read_response(reader)
            assert answer.status == 401 and answer.headers.get("connection") == "close"
            if not pipelined:
                with contextlib.suppress(ConnectionError):
                    writer.write(second)
            assert await closed_by_peer(reader, 5.0)
        finally:
            await close(writer)
    assert rogue.requests_to(CHAT) == []  # the second request never ran, keyed or not


@pytest.mark.parametrize("coding", ["compress", "gzip, gzip", "x-custom"])  # br: parser 400s
async def test_a_content_coding_the_proxy_does_not_decode_is_a_415_not_misread(
    rogue: RogueEngine, coding: str,
) -> None:
    body = orjson.dumps(chat("hi"))
    async with proxy_for(rogue) as proxy:
        raw = await _exchange(proxy.url, head("POST", CHAT, Content_Type="application/json",
                                              Content_Encoding=coding,
                                              Content_Length=str(len(body))) + body)
    head_part, _, answer = raw.partition(b"\r\n\r\n")
    assert head_part.startswith(b"HTTP/1.1 415 ")
    assert _error(answer)["code"] == "unsupported_content_encoding"
    assert rogue.requests_to(CHAT) == []


async def test_a_request_pipelined_behind_an_ignored_upgrade_is_not_left_waiting(
    rogue: RogueEngine,
) -> None:
    # aiohttp's parser drops what follows an h2c upgrade request in the same read: the proxy
    # closes the connection after the answer, so the client sees it end instead of waiting.
    async with proxy_for(rogue) as proxy:
        reader, writer = await connect(proxy.url)
        try:
            writer.write(head("GET", "/v1/models", Connection="Upgrade", Upgrade="h2c")
                         + head("GET", "/health"))
            answer = await read_response(reader)
            assert answer.status == 200 and answer.headers.get("connection") == "close"
            assert await closed_by_peer(reader, 5.0)
        finally:
            await close(writer)


async def test_a_body_that_does_not_decode_closes_its_connection_without_a_trace(
    rogue: RogueEngine, caplog: pytest.LogCaptureFixture,
) -> None:
    async with proxy_for(rogue) as proxy:
        # Kept alive as far as the client is concerned: the proxy must close it all the same.
        raw = await _exchange(proxy.url, head("POST", CHAT, Content_Type="application/json",
                                              Content_Encoding="gzip", Content_Length="5")
                              + b"hello")
    head_part, _, body = raw.partition(b"\r\n\r\n")
    assert head_part.startswith(b"HTTP/1.1 400 ")
    assert b"connection: close" in head_part.lower()
    assert "malformed" in _error(body)["message"]
    assert rogue.requests_to(CHAT) == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.records


async def test_a_handler_failing_after_its_answer_began_closes_the_connection() -> None:
    # No handler of the proxy should do this; if one ever does, the client must see its answer
    # cut off, not a second HTTP response inside the body it is reading.
    async def half(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: {}\n\n")
        raise UpstreamError("the engine went away")

    app = web.Application(middlewares=[error_middleware])
    app.router.add_post("/half", half)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        raw = await _exchange(f"http://127.0.0.1:{port}",
                              head("POST", "/half", Content_Length="0"))
    finally:
        await runner.cleanup()
    assert raw.count(b"HTTP/1.1 ") == 1 and b"data: {}" in raw
    assert not raw.endswith(b"0\r\n\r\n")  # cut off: no last chunk that would say it is whole
