"""SSE parsing and per-request timing against a real loopback server."""

import asyncio
import time

import orjson
import pytest
from aiohttp import web

from bench.loadgen import (
    Endpoint,
    _StreamReader,
    closed_loop,
    make_session,
    request_body,
    send_one,
    session_header,
)
from bench.traces import TraceRequest


def _chunk(text):
    event = {"choices": [{"index": 0, "delta": {"content": text}}]}
    return b"data: " + orjson.dumps(event) + b"\n\n"


USAGE = b'data: {"choices":[],"usage":{"completion_tokens":3}}\n\n'


def test_reader_handles_events_split_across_reads():
    stream = _chunk("") + _chunk(" a") + _chunk(" b") + _chunk(" c") + USAGE + b"data: [DONE]\n\n"
    reader = _StreamReader(0.0)
    for i in range(0, len(stream), 7):
        reader.feed(stream[i : i + 7], float(i))
    assert len(reader.token_times) == 3  # the empty role chunk carries no token
    assert reader.usage_tokens == 3
    assert reader.done and reader.error is None


def test_reader_reports_error_events():
    reader = _StreamReader(0.0)
    reader.feed(_chunk(" a") + b'data: {"error": {"message": "boom"}}\n\n', 1.0)
    assert reader.error is not None and "boom" in reader.error


def test_completions_text_counts_as_tokens():
    reader = _StreamReader(0.0)
    reader.feed(b'data: {"choices":[{"index":0,"text":" x"}]}\n\ndata: [DONE]\n\n', 1.0)
    assert len(reader.token_times) == 1


def test_request_body_shapes():
    chat = orjson.loads(request_body(Endpoint("e", "http://x", "m"), "hi", 5))
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    assert chat["stream"] is True and chat["max_tokens"] == 5 and chat["ignore_eos"] is True
    comp = orjson.loads(request_body(Endpoint("e", "http://x", "m", api="completions"), "hi", 5))
    assert comp["prompt"] == "hi"
    assert Endpoint("e", "http://x/", "m", api="completions").url == "http://x/v1/completions"


async def _stream_handler(request: web.Request) -> web.StreamResponse:
    body = orjson.loads(await request.read())
    if body["max_tokens"] == 99:
        return web.json_response({"error": {"message": "overloaded"}}, status=503)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Engine": "e7"})
    await resp.prepare(request)
    await asyncio.sleep(0.05)
    for _ in range(body["max_tokens"]):
        await resp.write(_chunk(" w"))
        await asyncio.sleep(0.01)
    await resp.write(b"data: [DONE]\n\n")
    return resp


@pytest.fixture
async def server():
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _stream_handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield Endpoint("srv", f"http://127.0.0.1:{port}", "m")
    await runner.cleanup()


async def test_send_one_times_a_stream(server):
    async with make_session() as session:
        rec = await send_one(session, server, request_body(server, "p", 4), index=1,
                             run_start=time.perf_counter())
    assert rec.ok and rec.engine == "e7" and rec.output_tokens == 4
    assert rec.ttft is not None and rec.ttft >= 0.04
    assert len(rec.itl) == 3
    assert rec.e2e is not None and rec.e2e >= rec.ttft


async def test_send_one_records_http_errors(server):
    async with make_session() as session:
        rec = await send_one(session, server, request_body(server, "p", 99), index=1,
                             run_start=time.perf_counter())
    assert rec.status == 503 and not rec.ok and "overloaded" in (rec.error or "")


async def test_send_one_records_connection_failures():
    dead = Endpoint("dead", "http://127.0.0.1:1", "m")
    async with make_session() as session:
        rec = await send_one(session, dead, request_body(dead, "p", 1), index=0,
                             run_start=time.perf_counter())
    assert rec.status == 0 and rec.error


async def test_closed_loop_keeps_its_streams_busy(server):
    async with make_session() as session:
        recs, span = await closed_loop(session, lambda n: (server, request_body(server, "p", 2)),
                                       concurrency=3, duration_s=0.3,
                                       run_start=time.perf_counter())
    assert len(recs) >= 3 and all(r.ok for r in recs)
    assert span >= 0.3
    # Three streams, each one request at a time: at some moment all three are in flight, never
    # more (one stream would send them one after another).
    spans = [(r.sent_at, r.sent_at + (r.e2e or 0.0)) for r in recs]
    overlap = max(sum(1 for a, b in spans if a <= t < b) for t, _ in spans)
    assert overlap == 3


def test_session_header_names_the_conversation():
    a = session_header(TraceRequest(0, 0.0, 2000, 1, (0, 5, 6)))
    b = session_header(TraceRequest(1, 0.0, 3000, 1, (0, 5, 9, 10)))
    assert a == b == {"X-Session-ID": "conv-0-5"}
    assert session_header(TraceRequest(2, 0.0, 10, 1)) == {}
