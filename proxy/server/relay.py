"""Relaying one request to an engine and its answer back to the client.

Rules:
- Nothing is sent to the client until the engine has produced its first body byte (or, for a plain
  JSON answer, the whole body). Until then a connect failure, a 5xx or a 429 may be retried on the
  next engine of the ranking (``upstream.retries`` times); after it, never.
- SSE bytes are written as they arrive, never re-encoded (``splice``: after the first read, the
  engine connection's parser callback writes each decoded piece to the client's transport).
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
  until it settles; the splice adds each read's length to it (nothing more per read), and the
  answer's length is learned once, at its end, from the engine's ``usage``.
- The response cache and the limits' token count (the recorder) get a stream's bytes once, at
  its end, from a bounded list of references kept only for a request that has a recorder.

Design of a streamed answer (why it is not aiohttp's stream classes end to end): relaying through
``StreamReader.readany`` and ``StreamResponse.write`` costs a task wake-up, a future and a
coroutine chain per SSE event, about twice the bare cost of the two system calls. aiohttp still
does everything else here (the client request and its pooled connection, the engine's response
head and its HTTP framing in the C parser, the server, the client's request and response head);
only the body's hand-over moves down a level:

1. The response head and the first body read are awaited the ordinary way, under the first-byte
   budget, so the retry rules above see exactly what they saw before.
2. The first read goes to the client through the ``StreamResponse`` (which sends its head, chunked
   for HTTP/1.1, close-delimited for HTTP/1.0).
3. ``splice.Splice`` then takes over the body reader: the parser's body callback writes straight
   to the client's transport, framed like aiohttp's writer would, with flow control both ways,
   one idle timer per stream, and the client's deadline as one more timer. The relay's coroutine
   sleeps until the splice ends (EOF, engine failure, timeout, client gone, drain cut).
4. The ending (the last chunk, or an SSE error event) is written through the ``StreamResponse``
   again; once per stream.
There is no fallback path: a body that ended with its first read is simply finished.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Coroutine, Sequence
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.streams import StreamReader

from proxy.core.admission import REASON_NO_ENGINE
from proxy.core.breaker import Outcome, classify_status
from proxy.core.commitment import Flight
from proxy.core.costmodel import ExpectedTTFT
from proxy.core.errors import KvproxyError, NoCapacity, UpstreamError
from proxy.core.outlier import Result
from proxy.core.usage import UsageStrip, usage_of_body
from proxy.fleet.engines import Engine
from proxy.fleet.upstream import (
    DATA_POST,
    AnswerTooLarge,
    loggable,
    proxy_short,
    redirect_status,
    response_headers,
    retryable_status,
    translate,
    unusable,
)
from proxy.observe.throttle import Throttle
from proxy.server.context import DRAIN_CUT, ShellContext
from proxy.server.ending import Ending, StreamEnd, cut_event, tell_recorder
from proxy.server.job import Job, deadline_error
from proxy.server.splice import Capture, DeadlinePassed, Splice
from proxy.server.tap import BodyWatch

log = logging.getLogger(__name__)

REASON_CONNECTIONS_FULL = "engine_connections_full"
SHORT_REASON = "proxy_resources"
_SHORT_WARN = Throttle(60.0)  # the proxy's own want: one line a minute, not one per request

CLIENT_CLOSED = 499  # nginx's convention for "client went away", used as a metrics label only


@functools.cache
def _connect_timeout(seconds: float) -> aiohttp.ClientTimeout:
    """The connect limit as aiohttp takes it: one frozen object per setting, not per request."""
    return aiohttp.ClientTimeout(total=None, connect=None, sock_connect=seconds)


class _Retry(Exception):
    """The engine failed in a way that another engine may fix; carries what the client would get."""

    def __init__(self, error: KvproxyError, reason: str) -> None:
        super().__init__(str(error))
        self.error = error
        self.reason = reason


async def _read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body of ``resp``, refused (``AnswerTooLarge``) past ``limit`` bytes: by its
    announced length before anything is read, else as it arrives."""
    length = resp.content_length
    if length is not None and length > limit:
        raise AnswerTooLarge(f"answer of {length} bytes announced, over {limit}")
    content = resp.content
    chunks: list[bytes] = []
    size = 0
    while chunk := await content.readany():
        size += len(chunk)
        if size > limit:
            raise AnswerTooLarge(f"answer over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)  # one chunk: that very object, not a copy


class Relay:
    def __init__(self, ctx: ShellContext, request: web.Request, job: Job) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
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
        """Try ranked engines in order (at most ``1 + retries``), first good one answers. An
        engine that has left the fleet since the ranking (discovery) is passed over: it gets
        no new request, and costs no attempt."""
        error: KvproxyError | None = None  # built only when needed: most requests never fail
        fleet, tries, reason = self._ctx.fleet, 0, ""
        # Until its answer begins, the drain's cut ends the request as a 503 (``DRAIN_CUT``).
        self._ctx.drain.add_cut(self._cut_before_answer)
        try:
            # By index: an enumerate and its tuple iterator would live as long as the stream.
            for i in range(len(ranked)):
                engine = fleet.live(ranked[i])
                if engine is None:
                    continue
                if tries > self._up.retries:
                    break
                if tries:
                    self._ctx.metrics.retries.labels(self._job.pool, reason).inc()
                self._job.engine, self._job.retries = ranked[i], tries
                tries += 1
                try:
                    return await self._exchange(engine)
                except _Retry as retry:
                    error, reason = retry.error, retry.reason
        finally:
            self._ctx.drain.discard_cut(self._cut_before_answer)
        if error is None:
            error = NoCapacity("no engine could take the request", reason=REASON_NO_ENGINE)
        raise error

    async def _exchange(self, engine: Engine) -> web.StreamResponse:
        self._sent_at = self._gate(engine)
        if self._job.dispatched_at is None:
            self._job.dispatched_at = self._sent_at
        ticket = self._dispatch(engine)
        # try/finally rather than an async context manager: the same settling, without an async
        # generator and its two steps per request.
        try:
            resp = await self._open(engine)
            try:
                return await self._answer(engine, resp)
            finally:
                resp.close()
        finally:
            self._settle(engine, ticket)

    def _cut_before_answer(self) -> None:
        """The drain's cut before the answer begins: the handler's task is cancelled with
        ``DRAIN_CUT``, which the handler answers as a 503 (``handlers._proxy``)."""
        self._task.cancel(DRAIN_CUT)

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

    def _dispatch(self, engine: Engine) -> int:
        """Book the request on ``engine``; ``_settle`` with the ticket returned, always."""
        ticket = engine.state.on_dispatch(
            self._ctx.clock(), self._job.prefill.get(engine.name, 0.0)
        )
        self._ticket = ticket
        self._recorded = False
        self._first_byte_deadline = 0.0
        self._flight = self._book(engine, ticket)
        return ticket

    def _settle(self, engine: Engine, ticket: int) -> None:
        engine.state.on_settle(ticket)
        engine.commitments.settle(ticket)
        if not self._recorded:
            # Ended without a verdict (client gone, cancelled): neutral for the breaker and
            # outlier detection, but it frees a half-open or probation probe slot.
            self._outcome(engine, Outcome.CLIENT_ERROR, None)

    def _book(self, engine: Engine, ticket: int) -> Flight:
        """The flight of this dispatch, booked in the engine's commitments: what it owes the KV
        cache when they are counted (else nothing), and what it relayed (a sign of life)."""
        job = self._job
        if engine.estimate is None:
            return engine.commitments.dispatch(ticket, Flight(0.0, 0.0))
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

    def _answered(self, engine: Engine, refused: bool = False) -> None:
        """The engine answered; ``refused``: with a 4xx (it computed nothing)."""
        self._job.first_byte_at = self._ctx.clock()
        engine.state.on_first_byte(self._ticket, self._job.first_byte_at)
        engine.commitments.first_byte(self._ticket)
        policy = self._ctx.policies.get(self._job.pool)
        if not isinstance(policy, ExpectedTTFT):  # else announced by ``pick.rank``, this token
            return
        if refused:
            policy.refused(id(self._job), engine.name)
        else:
            policy.first_byte(id(self._job), engine.name)
            self._ctx.outbox.answered(id(self._job), engine.name)

    async def _open(self, engine: Engine) -> aiohttp.ClientResponse:
        """Send the request and wait for the response head; raise ``_Retry`` where allowed."""
        job = self._job
        connect = _connect_timeout(self._up.connect_timeout_s)
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
            if proxy_short(exc):
                raise self._short(exc) from None
            # Refused, reset, connect timeout, or dropped before any response head: nothing of the
            # answer exists yet, so another engine may serve it.
            self._outcome(engine, Outcome.FAILURE, "connect", Result.CONNECT)
            raise _Retry(translate(exc, engine.name, "connect"), "connect") from None
        except aiohttp.ClientResponseError as exc:
            # A head that is not HTTP (garbage, oversized, contradictory framing): no answer
            # exists either, and the engine is at fault.
            self._outcome(engine, Outcome.FAILURE, "malformed_head")
            raise _Retry(translate(exc, engine.name, "first_byte"), "malformed_head") from None
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise self._failed(engine, exc, "first_byte") from None
        if retryable_status(resp.status):
            raise await self._refused(engine, resp)
        if redirect_status(resp.status):
            raise self._redirected(engine, resp)
        if unusable(resp.status, resp.headers):
            raise self._unusable(engine, resp)
        return resp

    def _short(self, exc: aiohttp.ClientConnectionError) -> NoCapacity:
        """The proxy could not open a connection for want of its own resources (file descriptors
        taken by client connections, say): no verdict on the engine, no retry elsewhere (every
        engine would meet the same want), a 503 the client may retry, one warning a minute."""
        self._ctx.metrics.proxy_short.inc()
        if _SHORT_WARN.due(self._ctx.clock()) is not None:
            log.warning("the proxy cannot open connections to engines: %s (raise the open-files "
                        "limit, or bound client connections)", loggable(exc))
        return NoCapacity("the proxy is short of resources (open connections); try again",
                          reason=SHORT_REASON, retry_after_s=1.0)

    def _unusable(self, engine: Engine, resp: aiohttp.ClientResponse) -> _Retry:
        """A final status that is no answer (1xx, 101 included, or past 599), or a body in an
        encoding the proxy never asked for: relayed, the client could not read it; a failure."""
        status = resp.status
        headers = resp.headers
        encoding = headers.get("Content-Encoding") or headers.get("Transfer-Encoding") or ""
        resp.close()
        self._outcome(engine, Outcome.FAILURE, f"http_{status}")
        # A status in 200..599 that is unusable is so for its encoding (``unusable``).
        what = f"answered HTTP {status}" if not 200 <= status < 600 else (
            f"answered in an encoding it was not asked for ({encoding[:32]!r})")
        return _Retry(UpstreamError(f"engine {engine.name} {what}"), f"http_{status}")

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
            metrics.outlier_ejections_by(out.pool, out.engine, out.reason).inc()
            log.warning("engine %s ejected from the %s pool as an outlier (%s) for %.1f s",
                        out.engine, out.pool, out.reason, out.duration_s)
        self._recorded = True
        if kind is not None and outcome is not Outcome.SUCCESS:
            metrics.upstream_errors_by(engine.name, kind).inc()

    def _answer(
        self, engine: Engine, resp: aiohttp.ClientResponse
    ) -> Coroutine[Any, Any, web.StreamResponse]:
        # Not a coroutine itself: the one it returns is awaited in its place, so an open stream
        # holds one coroutine fewer.
        content_type = resp.headers.get("Content-Type", "")
        if resp.status == 200 and self._job.stream and content_type.startswith("text/event-stream"):
            return self._stream(engine, resp)
        return self._whole(engine, resp)

    async def _whole(self, engine: Engine, resp: aiohttp.ClientResponse) -> web.Response:
        """A plain answer (JSON, or an engine's 4xx): read it all, then pass it on as it is."""
        deadline = asyncio.get_running_loop().time() + self._up.idle_timeout_s
        if not self._job.stream:
            deadline = self._first_byte_deadline
        elif self._job.deadline is not None and self._job.deadline <= deadline:
            deadline, self._deadline_binds = self._job.deadline, True
        # Most plain answers came whole with their head: only a body still to come is watched.
        watch = None if resp.content.is_eof() else BodyWatch(resp.content)
        try:
            async with asyncio.timeout_at(deadline):
                body = await _read_capped(resp, self._up.max_response_bytes)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise self._failed(engine, exc, "body") from None
        finally:
            if watch is not None:
                watch.release()
        self._outcome(engine, classify_status(resp.status), f"http_{resp.status}")
        if resp.status < 300:
            engine.state.on_complete(self._ticket, self._ctx.clock())
        self._answered(engine, refused=400 <= resp.status < 500)
        self._job.status = resp.status
        if resp.status == 200:
            self._job.usage = usage_of_body(body)
            self._learn(engine, len(body), streamed=False)
        if self._job.recorder is not None:
            self._job.recorder.start(resp.status, streamed=False)
            self._job.recorder.feed(body)
        headers = response_headers(resp.headers)
        headers.update(self._job.client_headers())
        return web.Response(status=resp.status, body=body, headers=headers)

    async def _stream(self, engine: Engine, resp: aiohttp.ClientResponse) -> web.StreamResponse:
        reader = resp.content
        watch = None if reader.is_eof() else BodyWatch(reader)
        try:
            async with asyncio.timeout_at(self._first_byte_deadline):
                first = await reader.readany()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise self._failed(engine, exc, "first_byte") from None
        finally:
            if watch is not None:
                watch.release()
        headers = response_headers(resp.headers)
        headers.update(self._job.client_headers())
        # The answer begins: from here on the splice's own cut ends it (with an error event).
        self._ctx.drain.discard_cut(self._cut_before_answer)
        out = web.StreamResponse(status=resp.status, headers=headers)
        await out.prepare(self._request)
        self._job.status = resp.status
        self._answered(engine)
        recorder = self._job.recorder
        capture = None
        if recorder is not None:
            recorder.start(resp.status, streamed=True)
            capture = Capture(recorder.max_bytes)
        try:
            # The engine's chunked framing, if plain, can go to the client as it is (``Splice``).
            chunked = resp.headers.get("Transfer-Encoding", "").lower() == "chunked"
            outcome = await self._relay(out, reader, first, capture, chunked)
        finally:
            if recorder is not None and capture is not None:
                tell_recorder(recorder, capture)
        self._job.delivered = not outcome.client_gone
        self._settle_stream(engine, outcome)
        return out

    async def _relay(
        self, out: web.StreamResponse, reader: StreamReader, first: bytes, capture: Capture | None,
        chunked: bool = False,
    ) -> StreamEnd:
        """The first read through the response object, the rest spliced, then the ending."""
        strip = UsageStrip() if self._job.strip_usage else None
        ending = Ending(out, strip)
        try:
            splice = Splice(self._request, idle_timeout_s=self._up.idle_timeout_s,
                            deadline=self._job.deadline, strip=strip, flight=self._flight,
                            capture=capture, on_pause=self._ctx.metrics.relay_pauses.inc,
                            upstream_chunked=chunked)
        except ConnectionResetError:
            return StreamEnd(client_gone=True)
        splice.record(first)
        sent = first if strip is None else strip(first)
        if sent and not await ending.send(sent):
            return StreamEnd(client_gone=True)
        cut = splice.cut
        self._ctx.drain.add_cut(cut)
        try:
            failure = await splice.run(reader)
        finally:
            self._ctx.drain.discard_cut(cut)
            if splice.went_raw:  # also a stream the client left (its handler is cancelled)
                self._ctx.metrics.relay_raw.inc()
        outcome = StreamEnd(splice.client_gone, splice.was_cut, failure, splice.tail)
        if splice.client_gone:
            return outcome
        boundary = splice.at_event_boundary
        if splice.was_cut:
            draining = NoCapacity(
                "the proxy is shutting down; the answer is incomplete", reason="draining"
            )
            outcome.client_gone = not await ending.error(draining, boundary)
        elif failure is not None:
            outcome.client_gone = not await ending.error(cut_event(failure), boundary)
        else:
            outcome.client_gone = not await ending.finish()
        return outcome

    def _settle_stream(self, engine: Engine, outcome: StreamEnd) -> None:
        failure = outcome.failure
        if outcome.client_gone:
            self._job.status = CLIENT_CLOSED
        elif outcome.was_cut:
            # The proxy's own shutdown ended it: no verdict on the engine.
            log.warning("stream from %s cut off by the drain timeout", engine.name)
        elif isinstance(failure, DeadlinePassed):
            self._outcome(engine, Outcome.CLIENT_ERROR, None)
            log.info("stream from %s cut at the client's deadline", engine.name)
        elif failure is not None:
            self._failed(engine, failure, "mid_stream")
            log.warning("stream from %s broke after the first byte: %s", engine.name,
                        loggable(failure))
        else:
            self._outcome(engine, Outcome.SUCCESS, None)
            engine.state.on_complete(self._ticket, self._ctx.clock())
            self._job.usage = outcome.tail.usage()
            self._learn(engine, self._flight.relayed, streamed=True)
