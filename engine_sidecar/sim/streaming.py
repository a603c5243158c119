"""Relaying a request's words to the client, with the mid-stream faults injected on the way.

Rules: words are read from the engine in per-step batches and written as they come; a write to a
closed connection or a cancelled handler aborts the request inside the engine (the caller's
``finally`` does it). Faults are read from the engine's live ``FaultConfig`` at each batch:
``stall_after_tokens`` pauses the relay once for ``stall_s`` wall seconds, ``reset_after_tokens``
sends exactly that many tokens and then resets the TCP connection (RST, not FIN), as a crashing
engine would. A non-streamed response applies the same faults to the tokens it collects.
A chat stream's role chunk goes out with the first batch of words, as vLLM sends it with the
engine's first output (never on receipt: a router reads the first body byte as the end of the
prefill); before a stall or reset fires it is written first, so faults come after it as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Any

from aiohttp import web

from engine_sidecar.sim import responses
from engine_sidecar.sim.engine import RequestStream, SimEngine
from engine_sidecar.sim.protocol import ApiError
from engine_sidecar.sim.responses import Identity
from engine_sidecar.sim.scheduler import Status
from engine_sidecar.sim.tokenizer import TOKEN_IDS

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


class ConnectionResetByFault(Exception):
    """The reset fault fired: the connection is gone and nothing more may be written."""


def reset_connection(request: web.Request) -> None:
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class _FaultGate:
    """Decides, per batch of words, how many may pass and whether to stall or reset."""

    def __init__(self, engine: SimEngine) -> None:
        self.faults = engine.faults
        self.sent = 0
        self.stalled = False

    def allowed(self, n: int) -> tuple[int, bool]:
        """(words to pass now, reset after them)."""
        limit = self.faults.reset_after_tokens
        if limit is not None and self.sent + n >= limit:
            return max(0, limit - self.sent), True
        return n, False

    def stalls_now(self) -> bool:
        after = self.faults.stall_after_tokens
        return not self.stalled and after is not None and self.sent >= after

    async def maybe_stall(self) -> None:
        if self.stalls_now():
            self.stalled = True
            await asyncio.sleep(self.faults.stall_s)


async def relay_stream(request: web.Request, engine: SimEngine, stream: RequestStream,
                       ident: Identity, include_usage: bool) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    try:
        # vLLM sends a chat stream's role chunk with the engine's first output, not on receipt:
        # a client (or router) sees its first body byte when the prefill is done.
        lead = [responses.role_chunk(ident)] if ident.kind == "chat" else []
        await _relay_words(request, stream, ident, resp, _FaultGate(engine), lead=lead)
        if lead:  # no output at all (the engine stopped under the request)
            await resp.write(lead.pop())
        await _end_stream(resp, stream, ident, include_usage)
    except ConnectionResetByFault:
        pass
    except ConnectionResetError:  # the client went away: abort in the engine, answer nothing
        stream.abort()
    return resp


async def _end_stream(resp: web.StreamResponse, stream: RequestStream, ident: Identity,
                      include_usage: bool) -> None:
    if stream.request.status is not Status.FINISHED:
        # The engine stopped under the request: say so, and never look like a complete stream.
        await resp.write(responses.error_event("The engine stopped before the request finished.",
                                               503))
    else:
        if include_usage:
            await resp.write(responses.usage_chunk(ident, stream.prompt_tokens,
                                                   stream.completion_tokens))
        await resp.write(responses.DONE)
    await resp.write_eof()


async def _relay_words(request: web.Request, stream: RequestStream, ident: Identity,
                       resp: web.StreamResponse, gate: _FaultGate, *, lead: list[bytes]) -> None:
    """Write the words as the engine steps produce them; ``lead`` (the role chunk, if any) goes
    out with the first batch, or before a stall or reset fault fires (which come after it)."""
    while True:
        if lead and gate.stalls_now():
            await resp.write(lead.pop())
        await gate.maybe_stall()
        words = await stream.next_words()
        if not words:
            return
        n, reset = gate.allowed(len(words))
        done = stream.finished and not reset and n == len(words)
        finished = done and stream.request.status is Status.FINISHED
        reason = stream.finish_reason if finished else None
        head = lead.pop() if lead else b""
        if n:
            await resp.write(head + responses.delta_chunk(ident, words[:n], gate.sent, reason))
        elif head:
            await resp.write(head)
        gate.sent += n
        if reset:
            stream.abort()
            reset_connection(request)
            raise ConnectionResetByFault
        if stream.finished:
            return


async def relay_full(request: web.Request, engine: SimEngine, stream: RequestStream,
                     ident: Identity, *, return_token_ids: bool = False,
                     prompt_lp: list[Any] | None = None) -> web.StreamResponse:
    gate = _FaultGate(engine)
    words: list[int] = []
    while True:
        await gate.maybe_stall()
        batch = await stream.next_words()
        if not batch:
            break
        n, reset = gate.allowed(len(batch))
        words.extend(batch[:n])
        gate.sent += n
        if reset:
            stream.abort()
            reset_connection(request)
            raise ConnectionResetByFault
        if stream.finished:
            break
    if stream.request.status is not Status.FINISHED:
        raise ApiError(503, "The engine stopped before the request finished.")
    token_ids = [TOKEN_IDS[w] for w in words] if return_token_ids else None
    body = responses.full_response(ident, words, stream.finish_reason, stream.prompt_tokens,
                                   stream.cached_tokens, token_ids=token_ids,
                                   prompt_logprobs=prompt_lp)
    return web.Response(body=body, content_type="application/json")
