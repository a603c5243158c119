"""Relaying one request to an engine and its answer back to the client.

Rules:
- Nothing is sent to the client until the engine has produced its first body byte (or, for a plain
  JSON answer, the whole body). Until then a connect failure, a 5xx or a 429 may be retried on the
  next engine of the ranking (``upstream.retries`` times); after it, never.
- SSE bytes are written as they arrive (``iter_any``), never re-encoded.
- Redirects are not followed: an engine's 3xx is a failure (502, retried like a 5xx).
- A stream still open when the drain times out is cut by the proxy like any broken stream: one SSE
  error event, no ``[DONE]``, and the engine's connection closed so it aborts.
- Timeouts: connect (retryable), first byte (504, not retried: the engine may just be busy), and
  between chunks. A failure after the first byte ends the stream with one SSE error event.
- A client deadline (``Job.deadline``) caps the first-byte budget and the whole stream; when it is
  what ran out, the answer is a 504 (or the SSE error event) naming the deadline, and the engine's
  breaker is not charged: the engine was not at fault.
- Token usage is read from the engine's bytes once the answer is over (``proxy.core.usage``); a
  usage event the proxy asked for on the client's behalf is stripped from the client's stream. The
  recorder sees the engine's bytes as they came, usage event included.
- The upstream response is always closed (``close``, not ``release``) when the exchange ends early,
  so the engine sees the disconnect and aborts the generation; cancellation by a client disconnect
  goes through the same ``finally``. ``CancelledError`` is re-raised, always.
- Every dispatch is settled exactly once and every engine exchange reports one outcome, to the
  engine's breaker and its pool's outlier detector (a first-byte timeout is backpressure for the
  breaker but a failure for outlier detection, which judges an engine against its pool).
- An engine with ``upstream.max_connections_per_engine`` requests open is not sent another (the
  retry target included): nothing ever queues inside the proxy's connection pool.
- KV commitments (``proxy.core.commitment``): each dispatch is booked as a flight on its engine
  until it settles; the pump adds each chunk's length to it (nothing more per chunk), and the
  answer's length is learned once, at its end, from the engine's ``usage``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from proxy.core.admission import REASON_NO_ENGINE
from proxy.core.breaker import Outcome, classify_status
from proxy.core.cache_entry import Recorder
from proxy.core.commitment import Flight
from proxy.core.errors import KvproxyError, NoCapacity, UpstreamError, UpstreamTimeout
from proxy.core.outlier import Result
from proxy.core.usage import StreamTail, Usage, UsageStrip, usage_of_body
from proxy.fleet.engines import Engine
from proxy.fleet.upstream import (
    DATA_POST,
    redirect_status,
    response_headers,
    retryable_status,
    translate,
)
from proxy.server.context import ShellContext

log = logging.getLogger(__name__)

REASON_CONNECTIONS_FULL = "engine_connections_full"

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
    # For the access log and accounting: who asked for what, retries made, the engine's usage.
    tenant: str | None = None
    model: str | None = None
    asked_pool: str | None = None
    retries: int = 0
    # The whole stream reached the client: a disconnect after that is not an abort (499).
    delivered: bool = False
    # The client's own limit: seconds it gave, and when that ends on the event loop's clock.
    timeout_s: float | None = None
    deadline: float | None = None
    strip_usage: bool = False  # the engine was asked for usage the client did not ask for
    usage: Usage | None = None
    # Per engine name: prompt tokens it does not hold yet; the client's output cap (KV commitments).
    prompt_tokens: dict[str, float] = field(default_factory=dict)
    max_tokens: int | None = None

    def client_headers(self) -> dict[str, str]:
        ids = {"X-Request-Id": self.request_id, "X-Engine": self.engine, "X-Served-By": self.pool}
        return ids | self.extra_headers


class DeadlinePassed(TimeoutError):
    """The client's deadline, not one of the proxy's own limits, ran out."""


def deadline_error(job: Job) -> UpstreamTimeout:
    return UpstreamTimeout(
        f"the request's deadline of {job.timeout_s:g} s passed before the answer was complete"
    )


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
        self._sent_at: float | None = None
        self._deadline_binds = False

    async def run(self, ranked: Sequence[str]) -> web.StreamResponse:
        """Try ranked engines in order (at most ``1 + retries``), first good one answers."""
        attempts = ranked[: 1 + self._up.retries]
        error: KvproxyError = NoCapacity(
            "no engine could take the request", reason=REASON_NO_ENGINE
        )
        for i, name in enumerate(attempts):
            self._job.engine, self._job.retries = name, i
            try:
                return await self._exchange(self._ctx.fleet.get(name))
            except _Retry as retry:
                error = retry.error
                if i + 1 < len(attempts):
                    self._ctx.metrics.retries.labels(self._job.pool, retry.reason).inc()
        raise error

    async def _exchange(self, engine: Engine) -> web.StreamResponse:
        self._sent_at = self._gate(engine)
        async with self._dispatched(engine):
            resp = await self._open(engine)
            try:
                return await self._answer(engine, resp)
            finally:
                resp.close()

    def _gate(self, engine: Engine) -> float:
        """Check that ``engine`` may take the request now (taking a probe slot if it is on
        trial) and return the dispatch time; ``_Retry`` if not."""
        if engine.full(self._up.max_connections_per_engine):
            # Only a retry target can be full here: the ranking leaves full engines out.
            full = NoCapacity(
                f"engine {engine.name} has as many requests open as allowed",
                reason=REASON_CONNECTIONS_FULL,
                retry_after_s=self._ctx.cfg.admission.retry_after_s,
            )
            raise _Retry(full, "connections_full")
        now = self._ctx.clock()
        if not engine.allows(now):
            # Another request took the half-open or probation probe slot since the ranking.
            busy = NoCapacity(f"engine {engine.name} is cooling down", reason=REASON_NO_ENGINE)
            raise _Retry(busy, "breaker")
        return now

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
                # Ended without a verdict (client gone, cancelled): neutral for the breaker and
                # outlier detection, but it frees a half-open or probation probe slot.
                self._outcome(engine, Outcome.CLIENT_ERROR, None)

    def _book(self, engine: Engine, ticket: int) -> Flight:
        """The flight of this dispatch, counted in the engine's commitments when they are kept."""
        job = self._job
        if engine.estimate is None:
            return Flight(0.0, 0.0)
        flight = Flight(job.prompt_tokens.get(engine.name, 0.0),
                        engine.estimate.expected(job.max_tokens))
        return engine.commitments.dispatch(ticket, flight)

    def _learn(self, engine: Engine, size: int, *, streamed: bool) -> None:
        """Teach the pool's answer-length estimate from a complete answer of ``size`` bytes."""
        if engine.estimate is not None:
            usage = self._job.usage
            tokens = None if usage is None else usage.completion
            engine.estimate.learn_answer(tokens, size, streamed=streamed,
                                         max_tokens=self._job.max_tokens)

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
        if job.deadline is not None and job.deadline <= self._first_byte_deadline:
            self._first_byte_deadline, self._deadline_binds = job.deadline, True
        try:
            async with asyncio.timeout_at(self._first_byte_deadline):
                headers = job.headers | engine.auth if engine.auth else job.headers
                resp = await self._ctx.session.post(
                    engine.cfg.url + job.path,
                    data=job.body,
                    headers=headers,
                    timeout=connect,
                    **DATA_POST,
                )
        except aiohttp.ClientConnectionError as exc:
            # Refused, reset, connect timeout, or dropped before any response head: nothing of the
            # answer exists yet, so another engine may serve it.
            self._outcome(engine, Outcome.FAILURE, "connect", Result.CONNECT)
            raise _Retry(translate(exc, engine.name, "connect"), "connect") from None
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise self._failed(engine, exc, "first_byte") from None
        if retryable_status(resp.status):
            raise await self._refused(engine, resp)
        if redirect_status(resp.status):
            raise self._redirected(engine, resp)
        return resp

    def _redirected(self, engine: Engine, resp: aiohttp.ClientResponse) -> _Retry:
        """An engine's 3xx: never followed (it would re-send the prompt elsewhere); a failure."""
        status = resp.status
        resp.close()
        self._outcome(engine, Outcome.FAILURE, f"http_{status}")
        error = UpstreamError(f"engine {engine.name} redirected (HTTP {status}); not followed")
        return _Retry(error, f"http_{status}")

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
        if isinstance(exc, DeadlinePassed) or (timed_out and self._deadline_binds):
            self._outcome(engine, Outcome.CLIENT_ERROR, None)
            return deadline_error(self._job)
        # An engine slow to start answering is queueing work, not broken: that timeout is
        # backpressure, or a hot fleet would be ejected engine by engine. Dead engines still fail
        # to connect and to answer their scrapes.
        # Outlier detection still counts it: it ejects only an engine that times out where the
        # rest of its pool answers.
        slow = timed_out and phase != "mid_stream"
        outcome = Outcome.BACKPRESSURE if slow else Outcome.FAILURE
        result = Result.TIMEOUT if slow else None
        self._outcome(engine, outcome, "timeout" if timed_out else phase, result)
        return translate(exc, engine.name, phase)

    def _outcome(
        self, engine: Engine, outcome: Outcome, kind: str | None, result: Result | None = None
    ) -> None:
        metrics = self._ctx.metrics
        for out in engine.record(outcome, self._ctx.clock(), result, self._sent_at):
            metrics.outlier_ejections.labels(out.pool, out.engine, out.reason).inc()
            log.warning("engine %s ejected from the %s pool as an outlier (%s) for %.1f s",
                        out.engine, out.pool, out.reason, out.duration_s)
        self._recorded = True
        if kind is not None and outcome is not Outcome.SUCCESS:
            metrics.upstream_errors.labels(engine.name, kind).inc()

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
        elif self._job.deadline is not None and self._job.deadline <= deadline:
            deadline, self._deadline_binds = self._job.deadline, True
        try:
            async with asyncio.timeout_at(deadline):
                body = await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise self._failed(engine, exc, "body") from None
        self._outcome(engine, classify_status(resp.status), f"http_{resp.status}")
        if resp.status < 300:
            engine.state.on_complete(self._ticket, self._ctx.clock())
        self._answered(engine)
        self._job.status = resp.status
        if resp.status == 200:
            self._job.usage = usage_of_body(body)
            self._learn(engine, len(body), streamed=False)
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
        pump = _Pump(
            out,
            self._up.idle_timeout_s,
            None if recorder is None else recorder.feed,
            strip=UsageStrip() if self._job.strip_usage else None,
            deadline=self._job.deadline,
            flight=self._flight,
        )
        with self._ctx.drain.cuttable(pump.cut):
            failure = await pump.run(chunks) if await pump.write(first) else None
        self._job.delivered = not pump.client_gone
        self._settle_stream(engine, pump, failure)
        return out

    def _settle_stream(self, engine: Engine, pump: _Pump, failure: BaseException | None) -> None:
        if pump.client_gone:
            self._job.status = CLIENT_CLOSED
        elif pump.was_cut:
            # The proxy's own shutdown ended it: no verdict on the engine.
            log.warning("stream from %s cut off by the drain timeout", engine.name)
        elif isinstance(failure, DeadlinePassed):
            self._outcome(engine, Outcome.CLIENT_ERROR, None)
            log.info("stream from %s cut at the client's deadline", engine.name)
        elif failure is not None:
            self._failed(engine, failure, "mid_stream")
            log.warning("stream from %s broke after the first byte: %r", engine.name, failure)
        else:
            self._outcome(engine, Outcome.SUCCESS, None)
            engine.state.on_complete(self._ticket, self._ctx.clock())
            self._job.usage = pump.tail.usage()
            self._learn(engine, self._flight.relayed, streamed=True)


class _Pump:
    """Copies SSE bytes to the client; turns a mid-stream failure into one SSE error event.

    Reading from the engine and writing to the client fail differently and are guarded apart:
    an engine failure is reported to the client, a client failure ends the relay silently.
    ``tap`` and ``tail`` see the engine's bytes; the client gets them through ``strip``, if set.
    """

    def __init__(
        self,
        out: web.StreamResponse,
        idle_timeout_s: float,
        tap: Callable[[bytes], None] | None = None,
        *,
        strip: UsageStrip | None = None,
        deadline: float | None = None,
        flight: Flight | None = None,
    ) -> None:
        self._out = out
        self._tap = tap
        self._strip = strip
        self._flight = flight if flight is not None else Flight(0.0, 0.0)
        self._idle = idle_timeout_s
        self._deadline = deadline
        self._at_event_boundary = True
        self._waiting: asyncio.Timeout | None = None
        self.client_gone = False
        self.was_cut = False
        self.tail = StreamTail()

    def cut(self) -> None:
        """End the stream now (drain timeout): the pending read gives up, the client is told."""
        self.was_cut = True
        if self._waiting is not None:
            self._waiting.reschedule(asyncio.get_running_loop().time())

    async def write(self, chunk: bytes) -> bool:
        """Send ``chunk``; False once the client is gone."""
        sent = chunk if self._strip is None else self._strip(chunk)
        if sent and not await self._send(sent):
            return False
        self.tail.feed(chunk)
        self._flight.relayed += len(chunk)
        if self._tap is not None:
            self._tap(chunk)
        return True

    async def _send(self, data: bytes) -> bool:
        try:
            await self._out.write(data)
        except ConnectionResetError:
            self.client_gone = True
            return False
        self._at_event_boundary = data.endswith(b"\n\n")
        return True

    def _read_deadline(self) -> tuple[float, bool]:
        """When the next read must have arrived, and whether that is the client's deadline."""
        idle_end = asyncio.get_running_loop().time() + self._idle
        if self._deadline is not None and self._deadline <= idle_end:
            return self._deadline, True
        return idle_end, False

    async def run(self, chunks: AsyncIterator[bytes]) -> BaseException | None:
        """Relay until the engine's EOF; return the engine failure that cut the stream, if any."""
        while not self.was_cut:
            until, is_deadline = self._read_deadline()
            try:
                async with asyncio.timeout_at(until) as self._waiting:
                    chunk = await anext(chunks, b"")
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                if self.was_cut:
                    break
                failure = DeadlinePassed() if is_deadline and isinstance(exc, TimeoutError) else exc
                await self._error_event(failure)
                return failure
            finally:
                self._waiting = None
            if not chunk:
                break
            if not await self.write(chunk):
                return None
        if self.was_cut:
            draining = NoCapacity(
                "the proxy is shutting down; the answer is incomplete", reason="draining"
            )
            await self._send_error(draining)
            return None
        await self._finish()
        return None

    async def _error_event(self, exc: BaseException) -> None:
        error = UpstreamTimeout if isinstance(exc, TimeoutError) else UpstreamError
        kind = "stalled between chunks" if isinstance(exc, TimeoutError) else "broke off"
        event = error(f"the engine's stream {kind}; the answer is incomplete")
        if isinstance(exc, DeadlinePassed):
            event = UpstreamTimeout("the request's deadline passed; the answer is incomplete")
        await self._send_error(event)

    async def _send_error(self, event: KvproxyError) -> None:
        if self._strip is not None:
            self._strip.flush()  # a held-back partial event: incomplete, never sent
        # A cut mid-event would glue our event onto a partial line; end that event first.
        lead = b"" if self._at_event_boundary else b"\n\n"
        if await self.write(lead + b"data: " + event.body() + b"\n\n"):
            await self._finish()

    async def _finish(self) -> None:
        rest = b"" if self._strip is None else self._strip.flush()
        if rest and not await self._send(rest):
            return
        try:
            await self._out.write_eof()
        except ConnectionResetError:
            self.client_gone = True
