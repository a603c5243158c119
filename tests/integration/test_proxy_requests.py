"""Client-facing edges: OpenAI-shaped 400/404/413 errors and what headers reach an engine."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gzip
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from proxy.core.config import Config, ServerConfig
from proxy.core.door_config import AuthConfig, TenantConfig
from proxy.core.errors import ConfigError
from proxy.core.fleet_config import EngineConfig, PoolConfig
from proxy.server.lifecycle import ProxyServer

from .stack import TARGET_MODEL, Stack, StackFactory, chat_body


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": 7, "messages": []}, "model"),
        ({"model": TARGET_MODEL}, "messages"),
        ({"model": TARGET_MODEL, "messages": "hi"}, "messages"),
        ({"model": TARGET_MODEL, "messages": [{"content": "x"}]}, "messages[0].role"),
        (chat_body("x", temperature="hot"), "temperature"),
        (chat_body("x", max_tokens=0), "max_tokens"),
        (chat_body("x", stream="maybe"), "stream"),  # "yes" is a boolean to vLLM, and here
        (chat_body("x", n=0), "n"),
        (chat_body("x", seed=1.5), "seed"),
        (chat_body("x", priority="urgent"), "priority"),
    ],
)
async def test_bad_chat_fields_name_the_param(stack: Stack, body: Any, param: str) -> None:
    resp = await stack.post("/v1/chat/completions", body)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert set(error) == {"message", "type", "param", "code"}


async def test_bad_completion_prompt(stack: Stack) -> None:
    resp = await stack.post("/v1/completions", {"model": TARGET_MODEL, "prompt": {"a": 1}})
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "prompt"


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b""])
async def test_unparsable_body_is_400(stack: Stack, raw: bytes) -> None:
    async with stack.http.post(
        stack.url + "/v1/chat/completions",
        data=raw,
        headers={"Content-Type": "application/json", "X-Request-Id": "bad-json"},
    ) as resp:
        assert resp.status == 400
        assert resp.headers["X-Request-Id"] == "bad-json"
        error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert "JSON" in error["message"] or "empty" in error["message"]


async def test_bad_priority_header_is_400(stack: Stack) -> None:
    resp = await stack.post("/v1/chat/completions", chat_body("x"), **{"X-Priority": "asap"})
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "priority"


async def test_sdk_sees_openai_errors(stack: Stack) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await stack.client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        await stack.client.chat.completions.create(
            model=TARGET_MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=-1
        )
    assert bad.value.param == "max_tokens"


async def test_body_over_limit_is_413(make_stack: StackFactory) -> None:
    stack = await make_stack(server=ServerConfig(port=0, max_body_bytes=2048))
    resp = await stack.post("/v1/chat/completions", chat_body("y" * 4096))
    assert resp.status == 413
    assert (await resp.json())["error"]["type"] == "invalid_request_error"


async def test_unknown_route_and_method_are_openai_shaped(stack: Stack) -> None:
    async with stack.http.get(stack.url + "/v1/nothing") as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["type"] == "invalid_request_error"
    async with stack.http.get(stack.url + "/v1/chat/completions") as resp:
        assert resp.status == 405
        assert "error" in await resp.json()


# --- what reaches the engine ------------------------------------------------------------------

_METRICS = b"""vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.1
vllm:num_requests_running{engine="0",model_name="m"} 0
vllm:num_requests_waiting{engine="0",model_name="m"} 0
"""


@dataclasses.dataclass
class Recorder:
    url: str
    seen: list[tuple[dict[str, str], dict[str, Any]]]


@pytest.fixture
async def recorder() -> AsyncIterator[Recorder]:
    """A minimal engine that records the headers and body of each request it gets."""
    seen: list[tuple[dict[str, str], dict[str, Any]]] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append((dict(request.headers), orjson.loads(await request.read())))
        return web.json_response({"id": "x", "object": "chat.completion", "choices": []})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=_METRICS, content_type="text/plain")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield Recorder(f"http://127.0.0.1:{port}", seen)
    await runner.cleanup()


@contextlib.asynccontextmanager
async def _proxy_before(recorder: Recorder) -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    """A started proxy whose one engine is ``recorder``, once routable, and a client session."""
    pool = PoolConfig("target", "served-name", (EngineConfig("rec", recorder.url),))
    server = ProxyServer(Config(server=ServerConfig(port=0), pools=(pool,)))
    await server.start()
    try:
        async with aiohttp.ClientSession() as http:
            await _wait_routable(http, server.url)
            yield server.url, http
    finally:
        await server.stop()


async def test_hop_by_hop_forwarded_and_authorization_not_passed(recorder: Recorder) -> None:
    async with _proxy_before(recorder) as (url, http):
        headers = {
            "Authorization": "Bearer sk-secret",
            "Proxy-Authorization": "Basic abc",
            "api-key": "sk-azure-style",
            "x-api-key": "sk-anthropic-style",
            "X-Forwarded-For": "10.0.0.1",
            "X-Forwarded-Proto": "https",
            "Forwarded": "for=10.0.0.1",
            "Connection": "keep-alive, X-Hop-Secret",
            "X-Hop-Secret": "hop",
            "Keep-Alive": "timeout=5",
            "TE": "trailers",
            "X-Custom": "kept",
            "X-Request-Id": "rid-7",
        }
        body = {"model": "served-name", "messages": [{"role": "user", "content": "x"}]}
        async with http.post(
            url + "/v1/chat/completions", json=body | {"priority": 3}, headers=headers
        ) as resp:
            assert resp.status == 200
    ((got, sent_body),) = recorder.seen
    lower = {k.lower(): v for k, v in got.items()}
    for gone in ("authorization", "proxy-authorization", "api-key", "x-api-key",
                 "x-forwarded-for", "x-forwarded-proto", "forwarded", "x-hop-secret", "keep-alive",
                 "te"):  # fmt: skip
        assert gone not in lower, gone
    assert lower["x-custom"] == "kept"
    assert lower["x-request-id"] == "rid-7"
    assert lower["host"] == recorder.url.removeprefix("http://")
    assert "priority" not in sent_body  # the pool runs no priority scheduling


async def test_a_compressed_body_reaches_the_engine_as_the_json_the_proxy_wrote(
    recorder: Recorder,
) -> None:
    # The proxy decodes the client's gzip body and sends JSON of its own: were the client's
    # Content-Encoding passed on, the engine would fail to decode plain JSON (a 500 from it, and
    # a few such requests would open every engine's breaker).
    body = {"model": "served-name", "messages": [{"role": "user", "content": "zip"}]}
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json",
               "Content-MD5": "bogus", "Digest": "sha-256=bogus"}
    async with _proxy_before(recorder) as (url, http), http.post(
        url + "/v1/chat/completions", data=gzip.compress(orjson.dumps(body)), headers=headers
    ) as resp:
        assert resp.status == 200, await resp.text()
    ((got, sent_body),) = recorder.seen
    lower = {k.lower() for k in got}
    assert not lower & {"content-encoding", "content-md5", "digest"}
    assert sent_body["messages"] == body["messages"]


async def _wait_routable(http: aiohttp.ClientSession, url: str) -> None:
    for _ in range(200):
        async with http.get(url + "/ready") as resp:
            if resp.status == 200:
                return
        await asyncio.sleep(0.02)
    raise AssertionError("the proxy never became ready")


async def test_engine_api_key_replaces_the_clients_credentials(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPROXY_TEST_ENGINE_KEY", "engine-secret")
    engine = EngineConfig("rec", recorder.url, api_key_env="KVPROXY_TEST_ENGINE_KEY")
    server = ProxyServer(Config(server=ServerConfig(port=0),
                                pools=(PoolConfig("target", "served-name", (engine,)),)))
    await server.start()
    try:
        async with aiohttp.ClientSession() as http:
            await _wait_routable(http, server.url)
            body = {"model": "served-name", "messages": [{"role": "user", "content": "x"}]}
            headers = {"Authorization": "Bearer sk-client", "x-api-key": "sk-client"}
            async with http.post(server.url + "/v1/chat/completions", json=body,
                                 headers=headers) as resp:
                assert resp.status == 200
            async with http.get(server.url + "/admin/engines") as resp:
                assert "engine-secret" not in await resp.text()
    finally:
        await server.stop()
    ((got, _),) = recorder.seen
    lower = {k.lower(): v for k, v in got.items()}
    assert lower["authorization"] == "Bearer engine-secret"
    assert "x-api-key" not in lower


def test_engine_api_key_variable_must_be_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPROXY_TEST_ENGINE_KEY", raising=False)
    engine = EngineConfig("e0", "http://127.0.0.1:9", api_key_env="KVPROXY_TEST_ENGINE_KEY")
    cfg = Config(server=ServerConfig(port=0), pools=(PoolConfig("target", "m", (engine,)),))
    with pytest.raises(ConfigError, match="KVPROXY_TEST_ENGINE_KEY is not set") as err:
        ProxyServer(cfg)
    assert "pools[0].engines[0].api_key_env" in str(err.value)


async def test_admin_view_needs_the_admin_key_when_one_is_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVPROXY_TEST_ADMIN_KEY", "admin-secret")
    auth = AuthConfig(required=True, tenants=(TenantConfig("acme", keys=("sk-acme-tenant-key",)),),
                      admin_key_env="KVPROXY_TEST_ADMIN_KEY")
    pool = PoolConfig("target", "m", (EngineConfig("e0", "http://127.0.0.1:9"),))
    server = ProxyServer(Config(server=ServerConfig(port=0), pools=(pool,), auth=auth))
    await server.start()
    try:
        async with aiohttp.ClientSession() as http:
            for key in (None, "sk-acme-tenant-key", "admin-secret-not"):
                headers = {} if key is None else {"Authorization": f"Bearer {key}"}
                async with http.get(server.url + "/admin/engines", headers=headers) as resp:
                    assert resp.status == 401
                    error = (await resp.json())["error"]
                    assert error["type"] == "authentication_error"
                    assert "admin key" in error["message"]
            headers = {"Authorization": "Bearer admin-secret"}
            async with http.get(server.url + "/admin/engines", headers=headers) as resp:
                assert resp.status == 200
                assert [e["name"] for e in (await resp.json())["engines"]] == ["e0"]
    finally:
        await server.stop()
    monkeypatch.delenv("KVPROXY_TEST_ADMIN_KEY")
    with pytest.raises(ConfigError, match=r"auth\.admin_key_env"):
        ProxyServer(Config(server=ServerConfig(port=0), pools=(pool,), auth=auth))


async def test_the_model_list_needs_a_key_where_keys_are_required() -> None:
    auth = AuthConfig(required=True, tenants=(TenantConfig("acme", keys=("sk-acme-tenant-key",)),))
    pool = PoolConfig("target", "m", (EngineConfig("e0", "http://127.0.0.1:9"),))
    server = ProxyServer(Config(server=ServerConfig(port=0), pools=(pool,), auth=auth))
    await server.start()
    try:
        async with aiohttp.ClientSession() as http:
            for path in ("/v1/models", "/v1/models/m"):
                for key, status in ((None, 401), ("sk-wrong", 401), ("sk-acme-tenant-key", 200)):
                    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
                    async with http.get(server.url + path, headers=headers) as resp:
                        assert resp.status == status, (path, key)
                        if status == 401:
                            assert (await resp.json())["error"]["type"] == "authentication_error"
    finally:
        await server.stop()


async def _raw_post(url: str, head: bytes, body: bytes) -> tuple[int, bytes]:
    """Send a request head and body in one write (so the body arrives with its head); returns the
    status and the response bytes."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head + body)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(65536), 10)
    finally:
        writer.close()
    return int(raw.split(b" ", 2)[1]), raw


def _chunked(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload)


CHUNKED_HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")


async def test_a_chunked_body_that_came_whole_is_read_and_bounded(make_stack: StackFactory) -> None:
    stack = await make_stack(server=ServerConfig(port=0, max_body_bytes=2048))
    ok = orjson.dumps(chat_body("z", max_tokens=2))
    status, raw = await _raw_post(stack.url, CHUNKED_HEAD, _chunked(ok))
    assert status == 200, raw
    big = orjson.dumps(chat_body("y" * 4096))
    status, raw = await _raw_post(stack.url, CHUNKED_HEAD, _chunked(big))
    assert status == 413, raw
    broken = b"zz\r\n" + ok + b"\r\n0\r\n\r\n"  # not a chunk size
    status, raw = await _raw_post(stack.url, CHUNKED_HEAD, broken)
    assert status == 400, raw
