"""Fuzzing the proxied endpoints: whatever a client sends, the proxy itself never answers 5xx, and
every 4xx is an OpenAI-shaped JSON error.

One stack (two healthy simulated engines behind a proxy) serves every example: it runs in its own
event loop on a background thread, and the examples talk to it with a plain blocking HTTP client,
so hypothesis drives ordinary synchronous tests. A 5xx is allowed only where it was an engine's:
a 502 that says the engine answered HTTP 5xx, or a 503 passed on for a busy engine.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from integration.stack import DRAFT_MODEL, TARGET_MODEL, proxy_config, sim

from engine_sidecar.sim.cluster import SimCluster, start_cluster
from proxy.server.lifecycle import ProxyServer

from .shell import CHAT, COMPLETIONS, server_config

EXAMPLES = 300


@dataclass
class _Reply:
    status: int
    headers: dict[str, str]  # names lower-cased
    body: bytes


class _Background:
    """The stack, served from an event loop that runs on a thread of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fuzz-stack")
        self.cluster: SimCluster | None = None
        self.server: ProxyServer | None = None
        self.port = 0

    def __enter__(self) -> _Background:
        self._thread.start()
        self._call(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._call(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            self.loop.close()

    def _call(self, work: Any) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(work, self.loop)
        return future.result(timeout=30)

    async def _start(self) -> None:
        names, pools = ["t0", "t1"], ["target", "target"]
        configs = [sim(TARGET_MODEL, n, seed=i) for i, n in enumerate(names)]
        self.cluster = await start_cluster(configs, host="127.0.0.1", port=0)
        cfg = proxy_config(
            self.cluster.urls, names, pools, server=server_config(body_timeout_s=2.0)
        )
        self.server = ProxyServer(cfg)
        await self.server.start()
        self.port = self.server.port
        async with asyncio.timeout(10):
            while not await self._ready():  # noqa: ASYNC110 (polls over HTTP)
                await asyncio.sleep(0.05)

    async def _ready(self) -> bool:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(b"GET /ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        line = await reader.readline()
        writer.close()
        await writer.wait_closed()
        return b" 200 " in line

    async def _stop(self) -> None:
        if self.server is not None:
            await self.server.stop()
        if self.cluster is not None:
            await self.cluster.close()

    def send(self, path: str, body: bytes, headers: dict[str, str]) -> _Reply:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=20)
        try:
            conn.request("POST", path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            return _Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, data)
        finally:
            conn.close()


@pytest.fixture(scope="module")
def background() -> Iterator[_Background]:
    with _Background() as stack:
        yield stack


# --- strategies -----------------------------------------------------------------------------------

def _text(max_size: int) -> st.SearchStrategy[str]:
    # No lone surrogates: a body with one is refused at parse and would hide every other path
    # (invalid UTF-8 has a body branch of its own).
    return st.text(st.characters(exclude_categories=("Cs",)), max_size=max_size)


_huge_ints = st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**30, -(10**30)])
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | _huge_ints
    | st.floats(allow_nan=False, allow_infinity=False)
    | _text(20)
)
_json = st.recursive(
    _scalars,
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(_text(6), children, max_size=3),
    max_leaves=12,
)
_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]) | _json},
        optional={"content": _text(40) | _json},
    ),
    max_size=3,
)
def _mostly(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A field's value: usually one the proxy accepts, otherwise any JSON at all."""
    return st.one_of(valid, valid, _json)


_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": _mostly(st.sampled_from([TARGET_MODEL, DRAFT_MODEL, "chat", "nope", ""])),
    "messages": _mostly(_messages),
    "prompt": _mostly(_text(40) | st.lists(st.integers(0, 50), min_size=1, max_size=5)),
    "stream": _mostly(st.booleans()),
    "stream_options": _mostly(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "max_tokens": _mostly(st.integers(1, 12)),
    "max_completion_tokens": _mostly(st.integers(1, 12)),
    "n": _mostly(st.just(1)),
    "best_of": _json,
    "temperature": _mostly(st.sampled_from([0, 0.0, 0.7])),
    "seed": _mostly(st.integers(0, 2**31)),
    "priority": _json,
    "logprobs": _json,
    "top_logprobs": _json,
    "tools": _json,
    "tool_choice": _json,
    "functions": _json,
    "function_call": _json,
}
_VALID = {
    "model": TARGET_MODEL,
    "messages": [{"role": "user", "content": "hi"}],
    "prompt": "hi",
    "max_tokens": 4,
}


@st.composite
def _body_object(draw: st.DrawFn) -> dict[str, Any]:
    # Mostly a request that gets to an engine, with some of its fields changed.
    body = dict(_VALID) if draw(st.integers(0, 3)) else {}
    for name in sorted(draw(st.sets(st.sampled_from(sorted(_FIELDS)), max_size=4))):
        body[name] = draw(_FIELDS[name])
    body.update(draw(st.dictionaries(_text(6), _json, max_size=2)))
    return body


def _encode(value: object) -> bytes:
    # The standard library writes integers of any size; orjson refuses those beyond 64 bits.
    return json.dumps(value, ensure_ascii=False).encode()


def _deep(depth: int) -> bytes:
    """A request that is valid but for an extra field nested ``depth`` levels deep."""
    valid = _encode({**_VALID, "temperature": 0})
    return valid[:-1] + b',"x":' + b"[" * depth + b"]" * depth + b"}"


_objects = _body_object().map(_encode)
_BODY_KINDS: list[st.SearchStrategy[bytes]] = [
    *[_objects] * 8,  # most bodies are JSON objects, the ones that reach field validation
    _objects.map(lambda b: b[: len(b) // 2]),  # cut short
    _objects.map(lambda b: b.replace(b"hi", b"h\xff\xfei", 1)),  # invalid UTF-8
    st.integers(1, 3000).map(_deep),
    st.sampled_from([b"", b"null", b"[]", b"1e999", b'{"model": 1e999}', b"\x00\xff", b"{"]),
    st.binary(max_size=64),
]
_bodies = st.sampled_from(_BODY_KINDS).flatmap(lambda kind: kind)
_header_text = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30
)
_HEADERS: dict[str, st.SearchStrategy[str]] = {
    "X-Priority": st.sampled_from(["critical", "standard", "sheddable", "", "0", "-1"])
    | _header_text,
    "X-Request-Id": _header_text,
    "Cache-Control": st.sampled_from(["no-cache", "no-store", "max-age=0, no-cache"])
    | _header_text,
    "Authorization": st.sampled_from(["Bearer sk-x", "Bearer ", "Basic Zm9v"]) | _header_text,
    "Content-Type": st.sampled_from(["application/json", "text/plain", "multipart/form-data"])
    | _header_text,
}


@st.composite
def _headers(draw: st.DrawFn, body: bytes) -> dict[str, str]:
    names = draw(st.sets(st.sampled_from(sorted(_HEADERS)), max_size=len(_HEADERS)))
    headers = {name: draw(_HEADERS[name]) for name in sorted(names)}
    headers["Content-Length"] = str(len(body))
    if body and draw(st.integers(1, 20)) == 7:  # rare (hypothesis favours the bounds, not 7)
        # Shorter than the body: the rest is read as a (garbage) next request on the connection.
        headers["Content-Length"] = str(draw(st.integers(0, len(body) - 1)))
    return headers


@st.composite
def _requests(draw: st.DrawFn) -> tuple[str, bytes, dict[str, str]]:
    path = draw(st.sampled_from([CHAT, COMPLETIONS]))
    body = draw(_bodies)
    return path, body, draw(_headers(body))


# --- the property ---------------------------------------------------------------------------------


def _engine_made(reply: _Reply) -> bool:
    """A 5xx that an engine produced (the engines are healthy, but may refuse odd requests)."""
    try:
        error = orjson.loads(reply.body)["error"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return False
    message = str(error.get("message", ""))
    if reply.status == 502:
        return "answered HTTP 5" in message
    return reply.status == 503 and reply.headers.get("x-kvproxy-shed-reason") == "engine_busy"


def _check(reply: _Reply) -> None:
    if reply.status >= 500:
        assert _engine_made(reply), (reply.status, reply.body[:300])
    if 400 <= reply.status < 500:
        assert reply.headers.get("content-type", "").startswith("application/json"), reply
        error = orjson.loads(reply.body)["error"]
        assert {"message", "type", "param", "code"} <= set(error), error
        assert isinstance(error["message"], str) and error["message"]
    if reply.status >= 400:
        assert "x-request-id" in reply.headers


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(request=_requests())
def test_no_request_makes_the_proxy_fail(
    background: _Background, request: tuple[str, bytes, dict[str, str]]
) -> None:
    path, body, headers = request
    reply = background.send(path, body, headers)
    event(f"HTTP {reply.status}")  # the spread shows with --hypothesis-show-statistics
    _check(reply)
