"""Relaying one request to an engine and its answer back to the client.

Rules:
- Nothing is sent to the client until the engine has produced its first body byte (or, for a plain
  JSON answer, the whole body). Until then a connect failure, a 5xx or a 429 may be retried on the
  next engine of the ranking (``upstream.retries`` times); after it, never.
- SSE bytes are written as they arrive (``iter_any``), never re-encoded.
- Timeouts: connect (retryable), first byte (504, not retried: the engine may just be busy), and
  between chunks. A failure after the first byte ends the stream with one SSE error event.
- The upstream response is always closed (``close``, not ``release``) when the exchange ends early,
  so the engine sees the disconnect and aborts the generation; cancellation by a client disconnect
  goes through the same ``finally``. ``CancelledError`` is re-raised, always.
- Every dispatch is settled exactly once and every engine exchange reports one breaker outcome.
- KV commitments (``proxy.commitment``): each dispatch is booked as a flight on its engine until
  it settles; the pump adds each chunk's length to it (nothing more per chunk) and keeps the last
  two chunks, from which a complete answer's ``usage`` is learned once, at its end.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from proxy.admission import REASON_NO_ENGINE
from proxy.breaker import Outcome, classify_status
from proxy.cache_entry import Recorder
from proxy.commitment import TAIL_BYTES, Flight
from proxy.context import ShellContext
from proxy.errors import KvproxyError, NoCapacity, UpstreamError, UpstreamTimeout
from proxy.fleet import Engine
from proxy.upstream import response_headers, retryable_status, translate

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's convention for "client went away", used as a metrics label only


@dataclass
class Job:
    """One proxied request on its way through; fields fill in as decisions are made."""

    request_id: str
    started_at: float
    cls: str
    pool: str = "none"
    stream: bool = False
    path: str = ""
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    engine: str = "none"
    status: int = 0
    first_byte_at: float | None = None
    # Sees the engine's status and every byte relayed (response cache, token accounting).
    recorder: Recorder | None = None
    extra_headers: dict[str, str] = field(default_factory=dict)
    shed_reason: str | None = None
    # Per engine name: prompt blocks it is expected to compute for this request (routing's view).
    prefill: dict[str, float] = field(default_factory=dict)
    # Per engine name: prompt tokens it does not hold yet; the client's output cap (KV commitments).
    prompt_tokens: dict[str, float] = field(default_factory=dict)
    max_tokens: int | None = None

    def client_headers(self) -> dict[str, str]:
        ids = {"X-Request-Id": self.request_id, "X-Engine": self.engine, "X-Served-By": self.pool}
        return ids | self.extra_headers


class _Retry(Exception):
    """The engine failed in a way that another engine may fix; carries what the client would get."""

    def __init__(self, error: KvproxyError, reason: str) -> None:
        super().__init__(str(error))
        self.error = error
        self.reason = reason


class Relay:
    def __init__(self, ctx: ShellContext, request: web.Request, job: Job) -> None:
        self._ctx = ctx
        self._up = ctx.cfg.upstream
        self._request = request
        self._job = job
        self._recorded = False
        self._ticket = 0
        self._flight = Flight(0.0, 0.0)
        self._first_byte_deadline = 0.0

    async def run(self, ranked: Sequence[str]) -> web.StreamResponse:
        """Try ranked engines in order (at most ``1 + retries``), first good one answers."""
        attempts = ranked[: 1 + self._up.retries]
        error: KvproxyError = NoCapacity(
            "no engine could take the request", reason=REASON_NO_ENGINE
        )
        for i, name in enumerate(attempts):
            self._job.engine = name
            try:
                return await self._exchange(self._ctx.fleet.get(name))
            except _Retry as retry:
                error = retry.error
                if i + 1 < len(attempts):
                    self._ctx.metrics.retries.labels(self._job.pool, retry.reason).inc()
        raise error

    async def _exchange(self, engine: Engine) -> web.StreamResponse:
        if not engine.breaker.allows(self._ctx.clock()):
            # Another request took the half-open probe slot since the ranking was made.
            busy = NoCapacity(f"engine {engine.name} is cooling down", reason=REASON_NO_ENGINE)
            raise _Retry(busy, "breaker")
        async with self._dispatched(engine):
            resp = await self._open(engine)
            try:
                return await self._answer(engine, resp)
            finally:
                resp.close()

    @asynccontextmanager
    async def _dispatched(self, engine: Engine) -> AsyncIterator[None]:
        ticket = engine.state.on_dispatch(
            self._ctx.clock(), self._job.prefill.get(engine.name, 0.0)
        )
        self._ticket = ticket
        self._recorded = False
        self._first_byte_deadline = 0.0
        self._flight = self._book(engine, ticket)
        try:
            yield
        finally:
            engine.state.on_settle(ticket)
            engine.commitments.settle(ticket)
            if not self._recorded:
                # Ended without a verdict (client gone, cancelled): neutral for the breaker, but
                # it frees a half-open probe slot.
                engine.record(Outcome.CLIENT_ERROR, self._ctx.clock())

    def _book(self, engine: Engine, ticket: int) -> Flight:
        """The flight of this dispatch, counted in the engine's commitments when they are kept."""
        job = self._job
        if engine.estimate is None:
            return Flight(0.0, 0.0)
        flight = Flight(job.prompt_tokens.get(engine.name, 0.0),
                        engine.estimate.expected(job.max_tokens))
        return engine.commitments.dispatch(ticket, flight)

    def _answered(self, engine: Engine) -> None:
        self._job.first_byte_at = self._ctx.clock()
        engine.state.on_first_byte(self._ticket)
        engine.commitments.first_byte(self._ticket)

    async def _open(self, engine: Engine) -> aiohttp.ClientResponse:
        """Send the request and wait for the response head; raise ``_Retry`` where allowed."""
        job = self._job
        connect = aiohttp.ClientTimeout(
            total=None, connect=None, sock_connect=self._up.connect_timeout_s
        )
        # One budget from dispatch to the first body byte, whether the head or the body is slow.
        # An engine sends a non-streamed answer only once it is generated, so there the budget
        # covers the whole answer.
        wait = self._up.first_byte_timeout_s if job.stream else self._up.response_timeout_s
        budget = self._up.connect_timeout_s + wait
        self._first_byte_deadline = asyncio.get_running_loop().time() + budget
        try:
            async with asyncio.timeout_at(self._first_byte_deadline):
                headers = job.headers | engine.auth if engine.auth else job.headers
                resp = await self._ctx.session.post(
                    engine.cfg.url + job.path, data=job.body, headers=headers, timeout=connect
                )
        except aiohttp.ClientConnectionError as exc:
            # Refused, reset, connect timeout, or dropped before any response head: nothing of the
            # answer exists yet, so another engine may serve it.
            self._outcome(engine, Outcome.FAILURE, "connect")
            raise _Retry(translate(exc, engine.name, "connect"), "connect") from None
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise self._failed(engine, exc, "first_byte") from None
        if retryable_status(resp.status):
            raise await self._refused(engine, resp)
        return resp

    async def _refused(self, engine: Engine, resp: aiohttp.ClientResponse) -> _Retry:
        """An engine's 5xx / 429: close it, count it, and describe it for the client."""
        status = resp.status
        resp.close()
        self._outcome(engine, classify_status(status), f"http_{status}")
        error: KvproxyError
        if status in (429, 503):
            retry_after = self._ctx.cfg.admission.retry_after_s
            error = NoCapacity(
                f"engine {engine.name} is overloaded (HTTP {status})",
                reason="engine_busy",
                retry_after_s=retry_after,
            )
        else:
            error = UpstreamError(f"engine {engine.name} answered HTTP {status}")
        return _Retry(error, f"http_{status}")

    def _failed(self, engine: Engine, exc: BaseException, phase: str) -> KvproxyError:
        timed_out = isinstance(exc, TimeoutError)
        # An engine slow to start answering is queueing work, not broken: that timeout is
        # backpressure, or a hot fleet would be ejected engine by engine. Dead engines still fail
        # to connect and to answer their scrapes.
        outcome = Outcome.BACKPRESSURE if timed_out and phase != "mid_stream" else Outcome.FAILURE
        self._outcome(engine, outcome, "timeout" if timed_out else phase)
        return translate(exc, engine.name, phase)

    def _outcome(self, engine: Engine, outcome: Outcome, kind: str | None) -> None:
        engine.record(outcome, self._ctx.clock())
        self._recorded = True
        if kind is not None and outcome is not Outcome.SUCCESS:
            self._ctx.metrics.upstream_errors.labels(engine.name, kind).inc()

    async def _answer(self, engine: Engine, resp: aiohttp.ClientResponse) -> web.StreamResponse:
        content_type = resp.headers.get("Content-Type", "")
        if resp.status == 200 and self._job.stream and content_type.startswith("text/event-stream"):
            return await self._stream(engine, resp)
        return await self._whole(engine, resp)

    async def _whole(self, engine: Engine, resp: aiohttp.ClientResponse) -> web.Response:
        """A plain answer (JSON, or an engine's 4xx): read it all, then pass it on as it is."""
        deadline = asyncio.get_running_loop().time() + self._up.idle_timeout_s
        if not self._job.stream:
            deadline = self._first_byte_deadline
        try:
            async with asyncio.timeout_at(deadline):
                body = await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise self._failed(engine, exc, "body") from None
        self._outcome(engine, classify_status(resp.status), f"http_{resp.status}")
        if resp.status < 300:
            engine.completed += 1
            if engine.estimate is not None:
                engine.estimate.learn_tail(body[-TAIL_BYTES:], len(body), streamed=False,
                                           max_tokens=self._job.max_tokens)
        self._answered(engine)
        self._job.status = resp.status
        if self._job.recorder is not None:
            self._job.recorder.start(resp.status, streamed=False)
            self._job.recorder.feed(body)
        headers = response_headers(resp.headers) | self._job.client_headers()
        return web.Response(status=resp.status, body=body, headers=headers)

    async def _stream(self, engine: Engine, resp: aiohttp.ClientResponse) -> web.StreamResponse:
        chunks = resp.content.iter_any()
        try:
            async with asyncio.timeout_at(self._first_byte_deadline):
                first = await anext(chunks, b"")
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise self._failed(engine, exc, "first_byte") from None
        out = web.StreamResponse(
            status=resp.status, headers=response_headers(resp.headers) | self._job.client_headers()
        )
        await out.prepare(self._request)
        self._job.status = resp.status
        self._answered(engine)
        recorder = self._job.recorder
        if recorder is not None:
            recorder.start(resp.status, streamed=True)
        tap = None if recorder is None else recorder.feed
        pump = _Pump(out, self._up.idle_timeout_s, tap, self._flight)
        failure = await pump.run(chunks) if await pump.write(first) else None
        self._settle_stream(engine, pump, failure)
        return out

    def _settle_stream(self, engine: Engine, pump: _Pump, failure: BaseException | None) -> None:
        if pump.client_gone:
            self._job.status = CLIENT_CLOSED
        elif failure is not None:
            self._failed(engine, failure, "mid_stream")
            log.warning("stream from %s broke after the first byte: %r", engine.name, failure)
        else:
            self._outcome(engine, Outcome.SUCCESS, None)
            engine.completed += 1
            if engine.estimate is not None:
                engine.estimate.learn_tail(pump.tail(), self._flight.relayed, streamed=True,
                                           max_tokens=self._job.max_tokens)


class _Pump:
    """Copies SSE bytes to the client; turns a mid-stream failure into one SSE error event.

    Reading from the engine and writing to the client fail differently and are guarded apart:
    an engine failure is reported to the client, a client failure ends the relay silently.
    """

    def __init__(
        self,
        out: web.StreamResponse,
        idle_timeout_s: float,
        tap: Callable[[bytes], None] | None = None,
        flight: Flight | None = None,
    ) -> None:
        self._out = out
        self._tap = tap
        self._flight = flight if flight is not None else Flight(0.0, 0.0)
        self._prev = self._chunk = b""  # the last two chunks: where a stream's usage is
        self._idle = idle_timeout_s
        self._at_event_boundary = True
        self.client_gone = False

    async def write(self, chunk: bytes) -> bool:
        """Send ``chunk``; False once the client is gone."""
        try:
            await self._out.write(chunk)
        except ConnectionResetError:
            self.client_gone = True
            return False
        if self._tap is not None:
            self._tap(chunk)
        self._flight.relayed += len(chunk)
        self._prev, self._chunk = self._chunk, chunk
        self._at_event_boundary = chunk.endswith(b"\n\n")
        return True

    def tail(self) -> bytes:
        """The last bytes relayed (where a stream's ``usage`` event is)."""
        return (self._prev[-TAIL_BYTES:] + self._chunk)[-TAIL_BYTES:]

    async def run(self, chunks: AsyncIterator[bytes]) -> BaseException | None:
        """Relay until the engine's EOF; return the engine failure that cut the stream, if any."""
        while True:
            try:
                async with asyncio.timeout(self._idle):
                    chunk = await anext(chunks, b"")
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                await self._error_event(exc)
                return exc
            if not chunk:
                break
            if not await self.write(chunk):
                return None
        await self._finish()
        return None

    async def _error_event(self, exc: BaseException) -> None:
        error = UpstreamTimeout if isinstance(exc, TimeoutError) else UpstreamError
        kind = "stalled between chunks" if isinstance(exc, TimeoutError) else "broke off"
        event = error(f"the engine's stream {kind}; the answer is incomplete")
        # A cut mid-event would glue our event onto a partial line; end that event first.
        lead = b"" if self._at_event_boundary else b"\n\n"
        if await self.write(lead + b"data: " + event.body() + b"\n\n"):
            await self._finish()

    async def _finish(self) -> None:
        try:
            await self._out.write_eof()
        except ConnectionResetError:
            self.client_gone = True
