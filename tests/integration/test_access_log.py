"""The access log through a real proxy: one line per proxied request, whatever way it ended.

Each test sends a request with its own ``X-Request-Id`` and reads the one access line for it from a
handler on the ``kvproxy.access`` logger.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from proxy.core.config import LogConfig, UpstreamConfig
from proxy.observe.accesslog import ACCESS_LOGGER, FIELDS

from .stack import ALIAS, DRAFT_MODEL, TARGET_MODEL, Stack, StackFactory, chat_body

ON = {"log": LogConfig(access=True)}
HOT = {"metric_overrides": {"vllm:kv_cache_usage_perc": 0.93}}
SLOW = {"time_scale": 1.0, "stop_len_range": (2000, 2000)}


class AccessLines(logging.Handler):
    """Collects the access log's records as dicts of their fields."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[dict[str, Any]] = []
        self._written = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append({name: getattr(record, name) for name in FIELDS})
        self._written.set()

    def of(self, request_id: str) -> list[dict[str, Any]]:
        return [line for line in self.lines if line["request_id"] == request_id]

    async def one(self, request_id: str, timeout_s: float = 5.0) -> dict[str, Any]:
        """The single line of ``request_id``, once written (a stream's line follows its end)."""
        async with asyncio.timeout(timeout_s):
            while not self.of(request_id):
                self._written.clear()
                await self._written.wait()
        await asyncio.sleep(0.05)  # a second line would be a bug: give it the chance to show
        found = self.of(request_id)
        assert len(found) == 1, found
        return found[0]


@pytest.fixture
def access() -> Iterator[AccessLines]:
    logger = logging.getLogger(ACCESS_LOGGER)
    handler = AccessLines()
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


async def _heat(stack: Stack, *names: str) -> None:
    for name in names:
        await stack.faults(name, **HOT)

    async def seen_hot() -> bool:
        rows = await stack.admin()
        return all(rows[n]["snapshot"]["kv_usage"] == pytest.approx(0.93) for n in names)

    await stack.wait_for(seen_hot)


async def test_success_line_names_who_what_where_and_the_engines_usage(
    make_stack: StackFactory, access: AccessLines
) -> None:
    stack = await make_stack(**ON)
    resp = await stack.post("/v1/chat/completions", chat_body("hello"), **{"X-Request-Id": "ok-1"})
    assert resp.status == 200
    usage = (await resp.json())["usage"]
    line = await access.one("ok-1")
    assert line["tenant"] == "default"
    assert (line["model"], line["pool"], line["engine"]) == (
        TARGET_MODEL, "target", resp.headers["X-Engine"],
    )  # fmt: skip
    assert (line["priority"], line["status"], line["stream"]) == ("standard", 200, False)
    assert line["reason"] is None and line["degraded_from"] is None
    assert (line["cache"], line["retries"]) == ("BYPASS", 0)
    assert line["prompt_tokens"] == usage["prompt_tokens"] > 0
    assert line["output_tokens"] == usage["completion_tokens"] > 0
    assert 0 <= line["dispatch_s"] <= line["ttft_s"] <= line["duration_s"]
    # The API key the SDK client sends never reaches the line.
    await stack.client.chat.completions.create(
        **chat_body("again"), extra_headers={"X-Request-Id": "ok-2"}
    )
    assert "sk-test" not in orjson.dumps(await access.one("ok-2")).decode()


async def test_streams_log_usage_whether_or_not_the_client_asked(
    make_stack: StackFactory, access: AccessLines
) -> None:
    stack = await make_stack(**ON)
    with_usage = chat_body("count", stream=True, stream_options={"include_usage": True})
    resp = await stack.post("/v1/chat/completions", with_usage, **{"X-Request-Id": "s-1"})
    assert resp.status == 200
    last = [ln for ln in (await resp.read()).split(b"\n") if b'"usage"' in ln][-1]
    usage = orjson.loads(last[len(b"data: ") :])["usage"]
    line = await access.one("s-1")
    assert (line["status"], line["stream"]) == (200, True)
    assert (line["prompt_tokens"], line["output_tokens"]) == (
        usage["prompt_tokens"], usage["completion_tokens"],
    )  # fmt: skip
    resp = await stack.post(
        "/v1/chat/completions", chat_body("count", stream=True), **{"X-Request-Id": "s-2"}
    )
    assert resp.status == 200
    assert b'"usage"' not in await resp.read()  # asked for by the proxy, kept from the client
    line = await access.one("s-2")
    assert line["status"] == 200
    assert line["prompt_tokens"] == usage["prompt_tokens"] and line["output_tokens"] > 0


async def test_shed_line_says_why(make_stack: StackFactory, access: AccessLines) -> None:
    stack = await make_stack(**ON)
    await _heat(stack, "t0", "t1")
    headers = {"X-Priority": "sheddable", "X-Request-Id": "shed"}
    resp = await stack.post("/v1/chat/completions", chat_body("x"), **headers)
    assert resp.status == 503
    line = await access.one("shed")
    assert (line["status"], line["reason"], line["priority"]) == (503, "kv_pressure", "sheddable")
    assert (line["pool"], line["engine"], line["ttft_s"]) == ("target", None, None)
    assert line["dispatch_s"] is None  # refused before any engine was asked
    assert (line["prompt_tokens"], line["output_tokens"]) == (None, None)


async def test_degraded_line_names_both_pools(
    make_stack: StackFactory, access: AccessLines
) -> None:
    stack = await make_stack(targets=2, drafts=1, **ON)
    await _heat(stack, "t0", "t1")
    resp = await stack.post(
        "/v1/chat/completions",
        chat_body("hello", model=ALIAS),
        **{"X-Priority": "sheddable", "X-Request-Id": "down"},
    )
    assert resp.status == 200 and (await resp.json())["model"] == DRAFT_MODEL
    line = await access.one("down")
    assert (line["model"], line["pool"], line["engine"]) == (ALIAS, "draft", "d0")
    assert (line["degraded_from"], line["reason"], line["status"]) == ("target", "degraded", 200)


async def test_cache_hit_line(make_stack: StackFactory, access: AccessLines) -> None:
    stack = await make_stack(**ON)
    body = chat_body("what is a KV cache?", temperature=0)
    first = await stack.post("/v1/chat/completions", body, **{"X-Request-Id": "c-1"})
    second = await stack.post("/v1/chat/completions", body, **{"X-Request-Id": "c-2"})
    assert (first.headers["X-Cache"], second.headers["X-Cache"]) == ("MISS", "HIT")
    miss, hit = await access.one("c-1"), await access.one("c-2")
    assert (miss["cache"], hit["cache"]) == ("MISS", "HIT")
    assert (hit["engine"], hit["status"], hit["pool"]) == ("cache", 200, "target")
    assert hit["output_tokens"] == miss["output_tokens"] is not None


async def test_client_abort_line_is_499(make_stack: StackFactory, access: AccessLines) -> None:
    stack = await make_stack(engine_kw=SLOW, **ON)
    resp = await stack.http.post(
        stack.url + "/v1/chat/completions",
        json=chat_body("stream forever", max_tokens=2000, stream=True),
        headers={"X-Request-Id": "gone"},
    )
    assert resp.status == 200
    await resp.content.readany()
    resp.close()
    line = await access.one("gone")
    assert (line["status"], line["engine"], line["stream"]) == (499, resp.headers["X-Engine"], True)
    assert line["ttft_s"] is not None


async def test_engine_error_line_is_502_after_a_retry(
    make_stack: StackFactory, access: AccessLines
) -> None:
    stack = await make_stack(**ON)
    for name in stack.names:
        await stack.faults(name, error_rate=1.0, error_status=500)
    resp = await stack.post("/v1/chat/completions", chat_body("x"), **{"X-Request-Id": "bad"})
    assert resp.status == 502
    line = await access.one("bad")
    assert (line["status"], line["retries"], line["pool"]) == (502, 1, "target")
    assert line["engine"] in stack.names


async def test_first_byte_timeout_line_is_504(
    make_stack: StackFactory, access: AccessLines
) -> None:
    upstream = UpstreamConfig(connect_timeout_s=0.2, first_byte_timeout_s=0.3, idle_timeout_s=1.0)
    stack = await make_stack(upstream=upstream, **ON)
    for name in stack.names:
        await stack.faults(name, header_delay_s=2.0)
    resp = await stack.post(
        "/v1/chat/completions", chat_body("slow", stream=True), **{"X-Request-Id": "late"}
    )
    assert resp.status == 504
    line = await access.one("late")
    assert (line["status"], line["ttft_s"], line["retries"]) == (504, None, 0)
    assert line["duration_s"] > 0


async def test_no_line_when_the_access_log_is_off(stack: Stack, access: AccessLines) -> None:
    resp = await stack.post("/v1/chat/completions", chat_body("x"), **{"X-Request-Id": "quiet"})
    assert resp.status == 200
    await asyncio.sleep(0.05)
    assert access.of("quiet") == []



async def test_deadline_line_is_504(make_stack: StackFactory, access: AccessLines) -> None:
    stack = await make_stack(engine_kw=SLOW, **ON)
    headers = {"X-Request-Timeout": "0.3", "X-Request-Id": "deadline"}
    body = chat_body("take your time", max_tokens=2000)
    resp = await stack.post("/v1/chat/completions", body, **headers)
    assert resp.status == 504
    line = await access.one("deadline")
    assert (line["status"], line["model"], line["pool"]) == (504, TARGET_MODEL, "target")
    assert line["engine"] in stack.names and line["ttft_s"] is None
    # uvloop's clock, which the deadline's timer runs on, counts whole milliseconds from the start
    # of a loop iteration, so the timer may fire up to about a millisecond before 0.3 s by the
    # monotonic clock the log's duration is read from.
    assert 0.3 - 0.002 <= line["duration_s"] < 5


@pytest.mark.parametrize(("body", "headers"), [
    ({"max_tokens": 0}, {}),
    ({}, {"X-Request-Timeout": "-1"}),
    ({}, {"X-Priority": "bogus"}),
])
async def test_a_request_refused_for_another_field_still_logs_its_model(
    make_stack: StackFactory, access: AccessLines, body: dict[str, object],
    headers: dict[str, str],
) -> None:
    stack = await make_stack(**ON)
    resp = await stack.post("/v1/chat/completions", chat_body("x", **body),
                            **headers, **{"X-Request-Id": "bad"})
    assert resp.status == 400
    line = await access.one("bad")
    assert (line["status"], line["model"]) == (400, TARGET_MODEL)
