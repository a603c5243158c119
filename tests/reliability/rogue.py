"""An engine that misbehaves on purpose, served on 127.0.0.1:0.

It speaks just enough of vLLM's surface for the proxy (``/metrics``, the two completion endpoints)
and each part can be told to lie, redirect or hang. Everything it received is kept in ``seen`` so
tests can tell what reached it.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field

import orjson
from aiohttp import web

HEALTHY_METRICS = (
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    'vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.1\n'
    'vllm:num_requests_running{model_name="m",engine="0"} 0\n'
    'vllm:num_requests_waiting{model_name="m",engine="0"} 0\n'
)


@dataclass
class Behaviour:
    """What the rogue engine does; tests change the fields between requests."""

    metrics_body: bytes = HEALTHY_METRICS.encode()
    metrics_status: int = 200
    metrics_headers: dict[str, str] = field(default_factory=dict)
    # When > 0: ``/metrics`` streams ``metrics_body`` padded with comment lines to this many bytes,
    # chunked (no Content-Length), and records in ``metrics_bytes_sent`` how much it got out.
    metrics_stream_bytes: int = 0
    # When > 0: ``/metrics`` blocks the whole process (``time.sleep``) this long before answering;
    # since the rogue shares the test's event loop with the proxy, this stalls the proxy's loop in
    # the middle of a scrape (a GC pause, a blocking call).
    metrics_block_s: float = 0.0
    # When set: ``/metrics`` answers only once ``RogueEngine.release`` is set (a slow engine whose
    # answer the test lets out when it wants).
    metrics_hold: bool = False
    # When > 0: ``/metrics`` answers this long after it is asked (a busy but live engine);
    # ``RogueEngine.metrics_open_max`` records how many such answers were ever due at once.
    metrics_delay_s: float = 0.0
    # Completions: "ok" answers normally, "hang" never answers, "hold" answers normally once
    # ``RogueEngine.release`` is set, "status" answers ``completion_status`` with
    # ``completion_headers`` and an empty body, "garbage" writes a head that is not HTTP.
    completions: str = "ok"
    completion_status: int = 200
    completion_headers: dict[str, str] = field(default_factory=dict)
    tokens: int = 4
    # Pause before each streamed chunk (a slow engine); 0 streams at once.
    chunk_delay_s: float = 0.0
    # Characters of content per streamed token (a large answer for flow-control tests).
    token_bytes: int = 1
    # When set, a streamed answer's body is exactly these pieces, each its own HTTP chunk (split
    # mid-event, several events in one, ...), ``chunk_delay_s`` apart; ``stream_sized`` sends
    # them with a Content-Length instead of chunked.
    stream_pieces: list[bytes] = field(default_factory=list)
    stream_sized: bool = False
    # When set, a streamed answer's body is exactly these bytes after a chunked head, framing
    # included (chunked framing made by hand, cut anywhere, ending with its own last chunk, or
    # else the connection is closed after them), ``chunk_delay_s`` apart: what reaches the
    # proxy's reads is under the test's control.
    raw_chunked: list[bytes] = field(default_factory=list)
    # How long the connection stays open after ``raw_chunked`` pieces with no last chunk.
    raw_hold_s: float = 0.0
    # The same for a non-streamed answer (a JSON head, then these bytes as they are).
    raw_plain: list[bytes] = field(default_factory=list)
    # When > 0: only the first this many pieces wait ``chunk_delay_s`` before them; the rest
    # follow at once, in one burst (the proxy reads several chunks at a time).
    burst_after: int = 0
    # When > 0: the send buffer of a streamed answer's socket (a small one makes the engine feel
    # the proxy's backpressure at once instead of after the kernel's buffers fill).
    send_buffer_bytes: int = 0


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class RogueEngine:
    def __init__(self, model: str = "target-model") -> None:
        self.model = model
        self.behaviour = Behaviour()
        self.seen: list[Seen] = []
        # Streams that ended before their last chunk was written (the proxy hung up).
        self.streams_cut = 0
        self.release = asyncio.Event()
        self.metrics_bytes_sent: list[int] = []
        self.metrics_open = self.metrics_open_max = 0
        # Per streamed answer: body bytes whose write had completed (the proxy took them).
        self.stream_bytes_sent: list[int] = []
        self.raw_peers: list[object] = []  # the connection of each ``raw_chunked`` answer
        self._runner: web.AppRunner | None = None
        self.port = 0
        # The host the proxy is given in ``url`` (it always listens on 127.0.0.1): a name rather
        # than an address where a test needs one (e.g. cookie jars take no cookies from an IP).
        self.url_host = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.url_host}:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_route("*", "/{tail:.*}", self._other)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        for address in self._runner.addresses:
            self.port = int(address[1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def requests_to(self, path: str) -> list[Seen]:
        return [s for s in self.seen if s.path == path]

    async def _record(self, request: web.Request) -> None:
        body = await request.read()
        self.seen.append(Seen(request.method, request.path, dict(request.headers), body))

    async def _metrics(self, request: web.Request) -> web.Response:
        await self._record(request)
        b = self.behaviour
        if b.metrics_block_s > 0:
            time.sleep(b.metrics_block_s)  # noqa: ASYNC251 - blocking is the point
        if b.metrics_hold:
            await self.release.wait()
        if b.metrics_delay_s > 0:
            self.metrics_open += 1
            self.metrics_open_max = max(self.metrics_open_max, self.metrics_open)
            try:
                await asyncio.sleep(b.metrics_delay_s)
            finally:
                self.metrics_open -= 1
        if b.metrics_stream_bytes > 0:
            return await self._metrics_stream(request)
        body = b.metrics_body
        if self.raw_peers:  # answers of ``raw_chunked`` are counted, as an engine counts them
            body += b'vllm:request_success_total{model_name="m"} %d\n' % len(self.raw_peers)
        return web.Response(
            body=body, status=b.metrics_status, headers=b.metrics_headers,
            content_type="text/plain",
        )

    async def _metrics_stream(self, request: web.Request) -> web.StreamResponse:
        b = self.behaviour
        out = web.StreamResponse(status=b.metrics_status, headers=b.metrics_headers)
        out.content_type = "text/plain"
        out.enable_chunked_encoding()
        await out.prepare(request)
        pad = b"# " + b"x" * 1021 + b"\n"
        sent = 0
        self.metrics_bytes_sent.append(0)
        try:
            chunk = b.metrics_body
            while sent < b.metrics_stream_bytes:
                await out.write(chunk)
                sent += len(chunk)
                self.metrics_bytes_sent[-1] = sent
                chunk = pad * 64
            await out.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the scraper hung up: what it refused is what the test is about
        return out

    async def _models(self, request: web.Request) -> web.Response:
        listed = {"object": "list", "data": [{"id": self.model, "object": "model"}]}
        return web.Response(body=orjson.dumps(listed), content_type="application/json")

    async def _other(self, request: web.Request) -> web.Response:
        await self._record(request)
        return web.Response(status=404)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        await self._record(request)
        b = self.behaviour
        if b.completions == "hang":
            await asyncio.Event().wait()
        if b.completions == "hold":
            await self.release.wait()
        if b.completions == "status":
            return web.Response(status=b.completion_status, headers=b.completion_headers)
        if b.completions == "garbage":  # a head that is not HTTP, then nothing
            assert request.transport is not None
            request.transport.write(b"SSH-2.0-not-http\r\n\r\n")
            request.transport.close()
            await asyncio.Event().wait()
        body = orjson.loads(self.seen[-1].body or b"{}")
        if body.get("stream"):
            return await self._stream(request)
        if b.raw_plain:
            out = web.StreamResponse(headers={"Content-Type": "application/json",
                                              **b.completion_headers})
            await out.prepare(request)
            await self._raw_chunked(request, out, b.raw_plain)
            return out
        answer = {
            "id": "cmpl-rogue", "object": "chat.completion", "model": self.model,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "x" * b.tokens}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": b.tokens,
                      "total_tokens": 1 + b.tokens},
        }
        return web.Response(body=orjson.dumps(answer), content_type="application/json",
                            headers=b.completion_headers)

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        b = self.behaviour
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                          **b.completion_headers})
        pieces = b.stream_pieces or self._events()
        if b.stream_sized:
            out.content_length = sum(len(p) for p in pieces)
        sock = request.transport.get_extra_info("socket") if request.transport else None
        if b.send_buffer_bytes and sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, b.send_buffer_bytes)
        await out.prepare(request)
        if b.raw_chunked:
            await self._raw_chunked(request, out, b.raw_chunked)
            return out
        finished = False
        self.stream_bytes_sent.append(0)
        try:
            for i, piece in enumerate(pieces):
                if b.chunk_delay_s and not 0 < b.burst_after <= i:
                    await asyncio.sleep(b.chunk_delay_s)
                await out.write(piece)
                self.stream_bytes_sent[-1] += len(piece)
            await out.write_eof()
            finished = True
        finally:
            if not finished:
                self.streams_cut += 1
        return out

    async def _raw_chunked(self, request: web.Request, out: web.StreamResponse,
                           pieces: list[bytes]) -> None:
        b = self.behaviour
        writer, transport = request.writer, request.transport
        assert transport is not None
        self.raw_peers.append(transport.get_extra_info("peername"))
        writer.send_headers()  # type: ignore[attr-defined]  # the head, before the raw bytes
        for piece in pieces:
            if b.chunk_delay_s:
                await asyncio.sleep(b.chunk_delay_s)
            transport.write(piece)
        if not pieces[-1].endswith(b"0\r\n\r\n"):
            if b.raw_hold_s:
                await asyncio.sleep(b.raw_hold_s)  # an engine silent mid-answer, then gone
            transport.close()  # a body without its last chunk: the engine died mid-answer
        out._eof_sent = True  # type: ignore[attr-defined]  # the body's own last chunk was sent

    def _events(self) -> list[bytes]:
        content = "x" * self.behaviour.token_bytes
        chunk = {"id": "cmpl-rogue", "object": "chat.completion.chunk", "model": self.model,
                 "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]}
        event = b"data: " + orjson.dumps(chunk) + b"\n\n"
        return [event] * self.behaviour.tokens + [b"data: [DONE]\n\n"]
