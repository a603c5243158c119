"""The response cache through the proxy: hit/miss/bypass, SSE replay, cut streams, single flight.

Run against both backends; the clients are the official openai SDK and plain aiohttp.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import openai
import orjson
import pytest
from conftest import StackFactory
from multidict import CIMultiDict
from proxystack import KEYS, MODEL, OTHER_MODEL, chat, door_config
from redisproc import RedisServer

from proxy.core.fleet_config import AliasConfig
from proxy.server.app import build_app
from proxy.server.lifecycle import ProxyServer


def content(text: bytes) -> tuple[str, str | None]:
    """Concatenated content and the finish reason of an SSE body."""
    out, finish = "", None
    for line in text.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            for choice in orjson.loads(line[6:]).get("choices", []):
                out += (choice.get("delta") or {}).get("content") or ""
                finish = choice.get("finish_reason") or finish
    return out, finish


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest, redis_server: RedisServer) -> dict[str, Any]:
    if request.param == "memory":
        return {}
    return {"backend": "redis", "redis_url": redis_server.url}


async def test_miss_hit_bypass_with_the_sdk(
    make_stack: StackFactory, backend: dict[str, Any]
) -> None:
    stack = await make_stack(door_config(**backend))
    client = stack.client("acme")
    messages: Any = [{"role": "user", "content": "What is a KV cache?"}]
    seen = []
    for _ in range(2):
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=16
        )
        seen.append((raw.headers["x-cache"], raw.parse().choices[0].message.content))
    assert [s[0] for s in seen] == ["MISS", "HIT"]
    assert seen[0][1] == seen[1][1] and seen[0][1]
    sampled = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0.9, max_tokens=16
    )
    assert sampled.headers["x-cache"] == "BYPASS"
    refused = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=16,
        extra_headers={"Cache-Control": "no-store"},
    )  # fmt: skip
    assert refused.headers["x-cache"] == "BYPASS"
    # The cached JSON answer is replayed as a stream to a client that streams.
    stream = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=16, stream=True
    )
    assert stream.headers["x-cache"] == "HIT"
    text = "".join([c.choices[0].delta.content or "" async for c in stream.parse() if c.choices])
    assert text == seen[0][1]
    assert await stack.metric("kvproxy_cache_lookups_total", result="hit") == 2
    assert await stack.metric("kvproxy_cache_lookups_total", result="miss") == 1
    assert await stack.metric("kvproxy_cache_lookups_total", result="bypass") == 2
    assert await stack.engine_requests() == 3
    await client.close()


async def test_sse_replay_equals_the_original_stream(
    make_stack: StackFactory, backend: dict[str, Any]
) -> None:
    stack = await make_stack(door_config(**backend))
    body = chat("Tell me about paged attention.", stream=True)
    first, raw_first = await stack.post(body)
    second, raw_second = await stack.post(body)
    assert (first.headers["X-Cache"], second.headers["X-Cache"]) == ("MISS", "HIT")
    # Labelled as the relayed stream was (the simulator labels it as vLLM does).
    assert second.headers["Content-Type"] == first.headers["Content-Type"]
    assert content(raw_first) == content(raw_second)
    assert content(raw_first)[0] and content(raw_first)[1] in ("stop", "length")
    assert raw_second.endswith(b"data: [DONE]\n\n")
    # With usage asked for, the replay carries it too.
    _, with_usage = await stack.post({**body, "stream_options": {"include_usage": True}})
    last = [ln for ln in with_usage.split(b"\n") if ln.startswith(b"data: {")][-1]
    assert orjson.loads(last[6:])["usage"]["completion_tokens"] >= 1
    # And a JSON client gets the same answer as JSON.
    resp, raw_json = await stack.post({**body, "stream": False})
    assert resp.headers["X-Cache"] == "HIT"
    answer = orjson.loads(raw_json)["choices"][0]
    assert (answer["message"]["content"], answer["finish_reason"]) == content(raw_first)
    # Every answer has an id of its own, of the engine's form, and the time it was made.
    ids = [_first_chunk(raw)["id"] for raw in (raw_first, raw_second, with_usage)]
    ids.append(orjson.loads(raw_json)["id"])
    assert len(set(ids)) == 4 and all(i.startswith("chatcmpl-") for i in ids), ids
    assert _first_chunk(raw_second)["created"] >= _first_chunk(raw_first)["created"]
    # A replay's id is the one the engine would have given this request: vLLM builds it from
    # the request id, the client's own when it sends one.
    resp, raw = await stack.post(body, **{"X-Request-Id": "trace-7"})
    assert resp.headers["X-Cache"] == "HIT" and _first_chunk(raw)["id"] == "chatcmpl-trace-7"
    resp, raw = await stack.post({**body, "stream": False}, **{"X-Request-Id": "trace-8"})
    assert orjson.loads(raw)["id"] == "chatcmpl-trace-8"


async def test_a_no_store_on_a_second_cache_control_line_is_obeyed(
    make_stack: StackFactory,
) -> None:
    # Repeated header lines are one comma-separated list (RFC 9110, section 5.3).
    stack = await make_stack(door_config())
    body = chat("A second header line.")
    lines = CIMultiDict([("Cache-Control", "max-age=0"), ("Cache-Control", "no-store"),
                         ("Authorization", f"Bearer {KEYS['acme']}")])
    async with stack.http.post(stack.url + "/v1/chat/completions", json=body,
                               headers=lines) as resp:
        assert resp.status == 200 and resp.headers["X-Cache"] == "BYPASS"
        await resp.read()
    resp, _ = await stack.post(body)
    assert resp.headers["X-Cache"] == "MISS"  # nothing was stored


def _first_chunk(raw: bytes) -> dict[str, Any]:
    first = next(ln for ln in raw.split(b"\n") if ln.startswith(b"data: {"))
    doc: dict[str, Any] = orjson.loads(first[6:])
    return doc


async def test_a_stream_cut_midway_is_not_cached(
    make_stack: StackFactory, backend: dict[str, Any]
) -> None:
    stack = await make_stack(door_config(**backend))
    body = chat("A question whose answer breaks off.", stream=True)
    await stack.faults(reset_after_tokens=3)
    resp, raw = await stack.post(body)
    assert resp.status == 200 and b"data: [DONE]" not in raw
    await stack.clear_faults()
    again, raw_again = await stack.post(body)
    assert again.headers["X-Cache"] == "MISS"
    assert raw_again.endswith(b"data: [DONE]\n\n")
    third, _ = await stack.post(body)
    assert third.headers["X-Cache"] == "HIT"
    assert await stack.metric("kvproxy_cache_stores_total", outcome="incomplete") >= 1


async def test_engine_errors_are_not_cached(make_stack: StackFactory) -> None:
    stack = await make_stack(door_config(), engines=1)
    await stack.faults(error_rate=1.0, error_status=500)
    body = chat("Failing question")
    resp, _ = await stack.post(body)
    assert resp.status >= 500
    await stack.clear_faults()
    resp, _ = await stack.post(body)
    assert resp.status == 200 and resp.headers["X-Cache"] == "MISS"


async def test_single_flight_50_identical_requests(
    make_stack: StackFactory, backend: dict[str, Any]
) -> None:
    stack = await make_stack(door_config(**backend))
    await stack.faults(header_delay_s=0.5)  # the first request stays open while the rest arrive
    body = chat("Fifty clients ask the same thing at once.")
    results = await asyncio.gather(*(stack.post(body) for _ in range(50)))
    assert all(r.status == 200 for r, _ in results)
    bodies = {orjson.loads(raw)["choices"][0]["message"]["content"] for _, raw in results}
    assert len(bodies) == 1
    assert sorted(r.headers["X-Cache"] for r, _ in results) == ["HIT"] * 49 + ["MISS"]
    assert await stack.engine_requests() == 1
    assert await stack.metric("kvproxy_cache_coalesced_waits_total", outcome="hit") == 49


async def test_tenants_never_share_answers(
    make_stack: StackFactory, backend: dict[str, Any]
) -> None:
    stack = await make_stack(door_config(**backend))
    body = chat("The same question from two tenants")
    a, _ = await stack.post(body, tenant="acme")
    b, _ = await stack.post(body, tenant="beta")
    a2, _ = await stack.post(body, tenant="acme")
    assert [r.headers["X-Cache"] for r in (a, b, a2)] == ["MISS", "MISS", "HIT"]


async def test_auth_and_keys_stay_out_of_logs(
    make_stack: StackFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG")
    stack = await make_stack(door_config())
    resp, raw = await stack.post(chat("hi"), tenant=None)
    assert resp.status == 401
    assert orjson.loads(raw)["error"]["type"] == "authentication_error"
    resp, _ = await stack.post(chat("hi"), tenant=None, Authorization="Bearer sk-not-a-real-key-42")
    assert resp.status == 401
    wrong = openai.AsyncOpenAI(
        base_url=stack.url + "/v1", api_key="sk-wrong-key-777", max_retries=0
    )
    async with wrong:
        with pytest.raises(openai.AuthenticationError):
            await wrong.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}]
            )
    async with stack.client("acme") as client:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4
        )
    assert "sk-not-a-real-key-42" not in caplog.text and "sk-wrong-key-777" not in caplog.text
    assert "sk-acme" not in caplog.text
    assert await stack.metric("kvproxy_auth_failures_total", reason="missing") == 1
    assert await stack.metric("kvproxy_auth_failures_total", reason="invalid") == 2


async def test_completions_endpoint_replays_too(make_stack: StackFactory) -> None:
    stack = await make_stack(door_config())
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    headers = {"Authorization": "Bearer sk-acme-0000000001"}
    url = stack.url + "/v1/completions"
    texts = []
    for stream in (True, True, False):
        async with stack.http.post(url, json={**body, "stream": stream}, headers=headers) as resp:
            raw = await resp.read()
            texts.append((resp.headers["X-Cache"], raw))
    # The proxy asks engines for usage on every stream, so a streamed miss stores an entry with
    # usage figures that a JSON client can be answered from too.
    assert [x for x, _ in texts] == ["MISS", "HIT", "HIT"]
    assert orjson.loads(texts[2][1])["usage"]["completion_tokens"] >= 1
    streamed = [
        "".join(c["text"] for c in orjson.loads(ln[6:])["choices"])
        for ln in texts[0][1].split(b"\n")
        if ln.startswith(b"data: {")
    ]
    replayed = [
        "".join(c["text"] for c in orjson.loads(ln[6:])["choices"])
        for ln in texts[1][1].split(b"\n")
        if ln.startswith(b"data: {")
    ]
    assert "".join(streamed) == "".join(replayed) != ""
    assert orjson.loads(texts[2][1])["choices"][0]["text"] == "".join(streamed)


async def test_an_alias_pointed_elsewhere_never_answers_from_the_other_models_entries(
    make_stack: StackFactory, redis_server: RedisServer
) -> None:
    # Two replicas sharing Redis mid-rollout: "chat" means the target pool on one and the draft
    # pool on the other. The same body must not be answered across them.
    door = door_config(backend="redis", redis_url=redis_server.url)
    first = await make_stack(door, engines=1, drafts=1)
    servers = []
    try:
        for pool in ("target", "draft"):
            cfg = dataclasses.replace(first.server.cfg, aliases=(AliasConfig("chat", pool),))
            server = ProxyServer(cfg, build_app(cfg, door=door))
            await server.start()
            servers.append(server)
        body = {**chat("Which model are you?"), "model": "chat"}
        key = {"Authorization": f"Bearer {KEYS['acme']}"}
        seen = []
        for server in (*servers, servers[1], servers[0]):
            async with first.http.post(server.url + "/v1/chat/completions", json=body,
                                       headers=key) as r:
                answer = orjson.loads(await r.read())
                seen.append((r.status, r.headers["X-Cache"], r.headers["X-Served-By"],
                             answer["model"]))
        assert seen == [(200, "MISS", "target", MODEL), (200, "MISS", "draft", OTHER_MODEL),
                        (200, "HIT", "draft", OTHER_MODEL), (200, "HIT", "target", MODEL)]
    finally:
        for server in servers:
            await server.stop()
