"""Streaming load generator for OpenAI-compatible endpoints: open-loop replay and closed loops.

Rules:
- Every request streams (``stream: true``, usage requested) and is timed on the client: TTFT to
  the first event that carries a token, inter-token gaps between such events, end-to-end to the
  end of the stream. Events that arrive in one read share one timestamp, as a client sees them.
- Replay is open-loop: request *i* is sent at ``arrival_s / compression`` after the start whether
  or not earlier ones finished; lateness of the sender itself is recorded (``max_lag_s``).
- The serving engine comes from a response header when the endpoint sets one (``X-Engine`` from
  kvproxy, ``X-Engine-Id`` from a simulated engine, LiteLLM's ``llm_provider-`` copy of it).
- Nothing here retries: a failure is a result (``bench.clients`` retries refusals as SDKs do).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import orjson

from bench.prompts import PromptMapper
from bench.stats import RequestRecord
from bench.traces import TraceRequest

T = TypeVar("T")
ENGINE_HEADERS = ("X-Engine", "X-Engine-Id", "llm_provider-x-engine-id")


@dataclass(frozen=True)
class Endpoint:
    """Where to send, and how: ``base_url`` without ``/v1``."""

    name: str
    base_url: str
    model: str
    api: str = "chat"  # "chat" -> /v1/chat/completions, "completions" -> /v1/completions
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.api == "chat" else "/v1/completions"
        return self.base_url.rstrip("/") + path


def request_body(endpoint: Endpoint, prompt: str, max_tokens: int, **extra: object) -> bytes:
    body: dict[str, object] = {
        "model": endpoint.model,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body.update(extra)
    return orjson.dumps(body)


def parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds; None when absent or not a number (an HTTP date is not sent by
    kvproxy, and the SDKs fall back to their backoff for anything they cannot read)."""
    if value is None:
        return None
    try:
        return float(value.strip())
    except ValueError:
        return None


def _engine_of(headers: Mapping[str, str]) -> str | None:
    for name in ENGINE_HEADERS:
        value = headers.get(name)
        if value:
            return str(value)
    return None


class _StreamReader:
    """Splits SSE bytes into events and keeps the client-side timings of token-bearing ones."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.buf = b""
        self.token_times: list[float] = []
        self.usage_tokens: int | None = None
        self.error: str | None = None
        self.done = False

    def feed(self, data: bytes, now: float) -> None:
        events = (self.buf + data).replace(b"\r\n", b"\n").split(b"\n\n")
        self.buf = events.pop()
        for event in events:
            self._event(event, now)

    def _event(self, event: bytes, now: float) -> None:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                return
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError:
                self.error = "bad event"
                return
            self._chunk(obj, now)

    def _chunk(self, obj: dict, now: float) -> None:  # type: ignore[type-arg]
        if "error" in obj:
            self.error = "stream error: " + str(obj["error"])[:200]
            return
        usage = obj.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            self.usage_tokens = int(usage["completion_tokens"])
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") or {}
            text = delta.get("content") if delta else choice.get("text")
            if text:
                self.token_times.append(now)
                return


async def send_one(
    session: aiohttp.ClientSession,
    endpoint: Endpoint,
    body: bytes,
    *,
    index: int,
    run_start: float,
    timeout_s: float = 600.0,
    headers: Mapping[str, str] | None = None,
) -> RequestRecord:
    t0 = time.perf_counter()
    rec = RequestRecord(index=index, target=endpoint.name, sent_at=t0 - run_start)
    headers = {"Content-Type": "application/json", **dict(endpoint.headers), **(headers or {})}
    reader = _StreamReader(t0)
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(endpoint.url, data=body, headers=headers) as resp:
                rec.status = resp.status
                rec.engine = _engine_of(resp.headers)
                if resp.status != 200:
                    rec.retry_after_s = parse_retry_after(resp.headers.get("Retry-After"))
                    rec.error = (await resp.text())[:300]
                else:
                    async for data in resp.content.iter_any():
                        reader.feed(data, time.perf_counter())
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    end = time.perf_counter()
    _finish(rec, reader, t0, end)
    return rec


def _finish(rec: RequestRecord, reader: _StreamReader, t0: float, end: float) -> None:
    times = reader.token_times
    if times:
        rec.ttft = times[0] - t0
        rec.itl = [b - a for a, b in itertools.pairwise(times)]
    rec.e2e = end - t0
    rec.output_tokens = reader.usage_tokens if reader.usage_tokens is not None else len(times)
    if rec.error is None and rec.status == 200:
        if reader.error:
            rec.error = reader.error
        elif not reader.done:
            rec.error = "stream ended without [DONE]"


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on a fresh event loop, uvloop when installed (chosen here, at the edge)."""
    try:
        import uvloop  # noqa: PLC0415 - optional, chosen at the edge
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def make_session(limit: int = 0) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=limit, force_close=False, keepalive_timeout=60)
    return aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)
    )


SESSION_BLOCKS = 2


def session_header(req: TraceRequest) -> dict[str, str]:
    """``X-Session-ID`` naming the request's conversation: its first two block ids.

    Block 0 is shared by every Mooncake request (a system prompt); block 1 is where conversations
    part. A session-keyed router (vLLM router's ``consistent_hash``) needs such a key, as a chat
    frontend would send; the other routers ignore the header.
    """
    if not req.hash_ids:
        return {}
    key = "-".join(str(h) for h in req.hash_ids[:SESSION_BLOCKS])
    return {"X-Session-ID": f"conv-{key}"}


@dataclass
class ReplayResult:
    records: list[RequestRecord]
    duration_s: float  # wall-clock from the first send to the last completion
    max_lag_s: float  # how late the sender got behind the schedule at worst
    extra: dict[str, float] = field(default_factory=dict)


async def replay(
    endpoint: Endpoint,
    reqs: Sequence[TraceRequest],
    mapper: PromptMapper,
    *,
    compression: float,
    timeout_s: float = 600.0,
    progress: Callable[[int, int], None] | None = None,
) -> ReplayResult:
    """Open-loop replay: each request at its arrival time divided by ``compression``."""
    bodies = [request_body(endpoint, mapper.prompt(r), r.output_tokens) for r in reqs]
    t_first = reqs[0].arrival_s if reqs else 0.0
    lag = 0.0
    tasks: list[asyncio.Task[RequestRecord]] = []
    async with make_session() as session:
        start = time.perf_counter()
        for i, (req, body) in enumerate(zip(reqs, bodies, strict=True)):
            due = start + (req.arrival_s - t_first) / compression
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                lag = max(lag, -delay)
            coro = send_one(session, endpoint, body, index=req.index, run_start=start,
                            timeout_s=timeout_s, headers=session_header(req))
            tasks.append(asyncio.create_task(coro, name=f"req-{req.index}"))
            if progress is not None and i % 100 == 0:
                progress(i, len(reqs))
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    return ReplayResult(records=records, duration_s=duration, max_lag_s=lag)


async def closed_loop(
    session: aiohttp.ClientSession,
    pick: Callable[[int], tuple[Endpoint, bytes]],
    *,
    concurrency: int,
    duration_s: float,
    run_start: float,
    timeout_s: float = 120.0,
    ramp_s: float = 0.0,
) -> tuple[list[RequestRecord], float]:
    """``concurrency`` streams, each sending its next request when the last one ends.

    ``pick(n)`` gives the endpoint and body of the n-th request. Stream k starts after
    ``k * ramp_s / concurrency`` so that the streams do not all arrive in one burst. Requests
    started before the deadline run to completion; returns the records and the wall-clock span.
    """
    counter = iter(range(1 << 62))
    stop_at = time.perf_counter() + duration_s
    records: list[RequestRecord] = []

    async def stream(k: int) -> None:
        await asyncio.sleep(k * ramp_s / concurrency)
        while time.perf_counter() < stop_at:
            n = next(counter)
            endpoint, body = pick(n)
            records.append(
                await send_one(
                    session, endpoint, body, index=n, run_start=run_start, timeout_s=timeout_s
                )
            )

    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for k in range(concurrency):
            group.create_task(stream(k), name=f"stream-{k}")
    return records, time.perf_counter() - t0
