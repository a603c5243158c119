"""Speculative-first aliases against engines that fail or refuse, and what the engines are sent:
a target that fails once the stream has begun ends it with one SSE error event (never a second
HTTP response inside the body); a refusal by the target reaches the client as a 400 with the
engine's words; each pool gets its own cache salt and priority, as any request to it does."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from engine_sidecar.sim.cluster import start_cluster
from engine_sidecar.sim.config import SimEngineConfig
from proxy.core.door_config import AuthConfig, TenantConfig
from proxy.core.fleet_config import AliasConfig
from proxy.server.lifecycle import ProxyServer

from .stack import FAST, proxy_config

ALIAS, TARGET, DRAFT = "sf", "target-model", "draft-model"
KEYS = {"alice": "sk-alice-0123456789", "bob": "sk-bobby-0123456789"}


REFUSAL = "this engine takes no such request"


@dataclasses.dataclass
class Front:
    """A forwarder in front of one engine: records what it is sent, fails a path on demand."""

    upstream: str
    bodies: list[tuple[str, dict[str, Any]]] = dataclasses.field(default_factory=list)
    fail: dict[str, int] = dataclasses.field(default_factory=dict)  # path -> calls let through
    hang: dict[str, int] = dataclasses.field(default_factory=dict)  # the same, then no answer
    stall_first: set[str] = dataclasses.field(default_factory=set)  # the first call: no answer
    refuse: dict[str, int] = dataclasses.field(default_factory=dict)  # as ``fail``, with a 400
    calls: dict[str, int] = dataclasses.field(default_factory=dict)
    answered: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # path, status

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if request.method == "POST":
            self.bodies.append((request.path, orjson.loads(raw)))
        self.calls[request.path] = self.calls.get(request.path, 0) + 1
        if request.path in self.stall_first and self.calls[request.path] == 1:
            await asyncio.sleep(3600)
        stall = self.hang.get(request.path)
        if stall is not None:
            if stall <= 0:
                await asyncio.sleep(3600)
            self.hang[request.path] = stall - 1
        left = self.fail.get(request.path)
        if left is not None:
            if left <= 0:
                return web.json_response({"error": {"message": "boom"}}, status=500)
            self.fail[request.path] = left - 1
        left = self.refuse.get(request.path)
        if left is not None:
            if left <= 0:
                return web.json_response({"error": {"message": REFUSAL, "type": "BadRequestError",
                                                    "code": 400}}, status=400)
            self.refuse[request.path] = left - 1
        async with aiohttp.ClientSession() as http, http.request(
                request.method, self.upstream + request.path_qs, data=raw or None,
                headers={"Content-Type": "application/json"}) as resp:
            body = await resp.read()
            self.answered.append((request.path, resp.status))
            return web.Response(body=body, status=resp.status,
                                content_type=resp.content_type)


@dataclasses.dataclass
class Stack:
    server: ProxyServer
    target: Front
    draft: Front
    http: aiohttp.ClientSession

    async def post(self, body: dict[str, Any], tenant: str = "alice") -> tuple[int, bytes]:
        headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
        async with self.http.post(self.server.url + "/v1/chat/completions", json=body,
                                  headers=headers, timeout=aiohttp.ClientTimeout(total=20)) as r:
            return r.status, await r.read()


@pytest.fixture
async def stack() -> AsyncIterator[Callable[..., Awaitable[Stack]]]:
    cleanups: list[Callable[[], Awaitable[None]]] = []

    async def make(stop_len: tuple[int, int] = (60, 80)) -> Stack:
        common = {"time_scale": FAST, "stop_len_range": stop_len, "profile": "llama8b-h100",
                  "max_model_len": 2048}
        cluster = await start_cluster(
            [SimEngineConfig(model=TARGET, name="t0", **common),
             SimEngineConfig(model=DRAFT, name="d0", draft_agreement=0.9, **common)],
            host="127.0.0.1", port=0)
        cleanups.append(cluster.close)
        fronts, urls = [], []
        for url in cluster.urls:
            front = Front(url)
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", front.handle)
            runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            cleanups.append(runner.cleanup)
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            fronts.append(front)
            urls.append(f"http://127.0.0.1:{port}")
        base = proxy_config(urls, ["t0", "d0"], ["target", "draft"])
        auth = AuthConfig(required=True, tenants=tuple(
            TenantConfig(name, keys=(key,)) for name, key in KEYS.items()))
        alias = AliasConfig(ALIAS, mode="speculative_first", draft="draft", target="target")
        server = ProxyServer(dataclasses.replace(
            base, aliases=(alias,), auth=auth,
            server=dataclasses.replace(base.server, drain_timeout_s=1.0)))
        await server.start()
        cleanups.append(server.stop)
        http = aiohttp.ClientSession()
        cleanups.append(http.close)
        return Stack(server, fronts[0], fronts[1], http)

    yield make
    for cleanup in reversed(cleanups):
        await cleanup()


def _chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": ALIAS, "messages": [{"role": "user", "content": content}],
            "temperature": 0, "max_tokens": 60, **extra}


@pytest.mark.parametrize("path", ["/detokenize", "/v1/completions"])
async def test_a_target_failing_mid_stream_ends_it_with_one_error_event(
        stack: Callable[..., Awaitable[Stack]], path: str) -> None:
    s = await stack()
    s.target.fail[path] = 3  # the stream has begun by then
    status, raw = await s.post(_chat("a long answer please", stream=True))
    assert status == 200
    assert b"HTTP/1.1" not in raw  # no second response written into the body
    events = [line for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert len(events) >= 2 and b"[DONE]" not in raw
    assert orjson.loads(events[-1][6:])["error"]["type"] == "upstream_error"


async def test_a_refusal_by_the_target_is_a_400_with_the_engines_words(
        stack: Callable[..., Awaitable[Stack]]) -> None:
    s = await stack()
    s.target.refuse["/v1/completions"] = 0  # its verifications, after the drafting began
    status, raw = await s.post(_chat("hello there"))
    assert status == 400, raw
    error = orjson.loads(raw)["error"]
    assert error["code"] == "engine_refused" and REFUSAL in error["message"]
    assert [p for p, _ in s.draft.bodies if p == "/v1/completions"]  # it was drafting
    assert s.target.calls["/v1/completions"] >= 1


async def test_a_prompt_past_the_context_is_a_400_before_any_drafting(
        stack: Callable[..., Awaitable[Stack]]) -> None:
    s = await stack()
    status, raw = await s.post(_chat("word " * 3000))  # longer than the 2048-token context
    assert status == 400, raw
    error = orjson.loads(raw)["error"]
    assert error["code"] == "context_length_exceeded" and "context" in error["message"].lower()
    assert not [p for p, _ in s.draft.bodies if p == "/v1/completions"]


async def test_max_tokens_past_the_context_left_is_a_400_before_any_drafting(
        stack: Callable[..., Awaitable[Stack]]) -> None:
    s = await stack()
    status, raw = await s.post(_chat("hello there", max_tokens=100_000, stream=True))
    assert status == 400, raw
    assert orjson.loads(raw)["error"]["code"] == "context_length_exceeded"
    assert not [p for p, _ in s.draft.bodies if p == "/v1/completions"]


async def test_each_pool_gets_the_tenants_salt_and_its_own_priority(
        stack: Callable[..., Awaitable[Stack]]) -> None:
    s = await stack(stop_len=(10, 12))
    for tenant in ("alice", "bob"):
        status, raw = await s.post(_chat("the same prompt", cache_salt="mine",
                                         priority="sheddable"), tenant)
        assert status == 200, raw
    sent = [b for p, b in s.target.bodies + s.draft.bodies if p == "/v1/completions"]
    salts = {b.get("cache_salt") for b in sent}
    assert "mine" not in salts and None not in salts  # keyed per tenant, never the client's own
    assert len({b["cache_salt"] for p, b in s.draft.bodies if p == "/v1/completions"}) == 2
    assert all(isinstance(b["priority"], int) for p, b in s.target.bodies
               if p == "/v1/completions")  # the target pool schedules by priority
    assert all("priority" not in b for p, b in s.draft.bodies if p == "/v1/completions")


async def test_stream_options_without_a_stream_are_the_targets_to_refuse(
        stack: Callable[..., Awaitable[Stack]]) -> None:
    s = await stack()
    status, _ = await s.post(_chat("hi", stream_options={"include_usage": True}))
    assert not [p for p, _ in s.draft.bodies if p == "/v1/completions"]  # not drafted
    # Passed through to the target as it came, and the target's own answer is the client's.
    passed = [b for p, b in s.target.bodies if p == "/v1/chat/completions"]
    assert len(passed) == 1
    assert passed[0]["stream_options"] == {"include_usage": True} and "stream" not in passed[0]
    assert s.target.answered[-1] == ("/v1/chat/completions", status)


async def test_the_tokenizer_check_asks_past_an_engine_that_is_down() -> None:
    common = {"time_scale": FAST, "stop_len_range": (6, 10), "profile": "llama8b-h100"}
    cluster = await start_cluster(
        [SimEngineConfig(model=TARGET, name="t1", **common),
         SimEngineConfig(model=DRAFT, name="d0", draft_agreement=0.9, **common)],
        host="127.0.0.1", port=0)
    dead = "http://127.0.0.1:9"  # discard: nothing answers
    base = proxy_config([dead, *cluster.urls], ["t0", "t1", "d0"], ["target", "target", "draft"])
    alias = AliasConfig(ALIAS, mode="speculative_first", draft="draft", target="target")
    server = ProxyServer(dataclasses.replace(base, aliases=(alias,)))
    await server.start()
    try:
        async with aiohttp.ClientSession() as http, http.post(
                server.url + "/v1/chat/completions", json=_chat("hello", max_tokens=8)) as resp:
            assert resp.status == 200
            assert resp.headers["X-Speculative"] == "draft-first"
    finally:
        await server.stop()
        await cluster.close()


async def test_a_stream_waiting_on_an_engine_at_the_drain_timeout_ends_at_once(
        stack: Callable[..., Awaitable[Stack]]) -> None:
    s = await stack()
    s.draft.hang["/v1/completions"] = 2  # two drafts, then one that never answers
    headers = {"Authorization": f"Bearer {KEYS['alice']}"}
    async with s.http.post(s.server.url + "/v1/chat/completions", headers=headers,
                           json=_chat("a long answer please", stream=True)) as resp:
        assert resp.status == 200
        await resp.content.readline()  # the stream has begun
        started = time.monotonic()
        drained = asyncio.create_task(s.server.drain())
        async with asyncio.timeout(10):
            raw = await resp.read()
        await drained
    # The drain timeout (1 s) and its grace, not the leg's 60 s timeout.
    assert time.monotonic() - started < 5
    events = [line for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert orjson.loads(events[-1][6:])["error"]["type"] == "overloaded"


async def test_a_drafted_answer_names_the_model_a_passed_through_one_does(
        stack: Callable[..., Awaitable[Stack]]) -> None:
    s = await stack(stop_len=(6, 8))
    _, drafted = await s.post(_chat("name the model"))
    _, passed = await s.post(_chat("name the model", n=1, logprobs=True))  # not draftable
    assert orjson.loads(drafted)["model"] == orjson.loads(passed)["model"] == TARGET


async def test_identical_requests_do_not_wait_for_each_others_drafted_answer(
        stack: Callable[..., Awaitable[Stack]]) -> None:
    # A drafted answer is never cached, so an identical request waiting for it (the cache's
    # single flight) would wait for nothing: here the first one's draft never comes back.
    s = await stack(stop_len=(6, 8))
    s.draft.stall_first.add("/v1/completions")
    first = asyncio.create_task(s.post(_chat("the very same question")))
    while not s.draft.calls.get("/v1/completions"):  # noqa: ASYNC110 (the first one drafts)
        await asyncio.sleep(0.01)
    try:
        async with asyncio.timeout(8):
            status, _ = await s.post(_chat("the very same question"))
        assert status == 200
    finally:
        first.cancel()
