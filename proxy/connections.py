"""Client connections: aiohttp's server protocol with the time limits a public listener needs.

Rules:
- The whole request head must arrive within ``server.header_timeout_s``, counted from the
  connection's start or, on a kept-alive connection, from the first byte of the next request; a
  connection that has not finished its head by then is closed (slowloris). An idle kept-alive
  connection (no byte of a next request) is bounded by ``server.keepalive_timeout_s`` instead, so
  that pooled client connections are not cut while they wait for their next request.
- A response that says ``Connection: close`` is never followed by reading (lingering over) the rest
  of a body the proxy refused: after a 413 or 408 the connection is closed, not drained.
- The body's own time limit is the handler's (``handlers``), which answers 408.
- Everything else is aiohttp's ``RequestHandler`` as it is; the subclass touches only the hooks
  named above (``connection_made``, ``data_received``, ``_handle_request``, ``finish_response``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger(__name__)


class GuardedHandler(RequestHandler):
    """One client connection, with a deadline on each request head."""

    def __init__(self, manager: web.Server, *, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        # True between requests: the next bytes to come are a request head.
        self._awaiting_head = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._arm_head_timer()
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._awaiting_head and data and self._head_timer is None:
            self._arm_head_timer()
        heads = self._request_count
        super().data_received(data)
        if self._request_count != heads:
            # A whole head (or a parse error, answered 400) arrived: the handler's turn now.
            self._awaiting_head = False
            self._disarm_head_timer()

    async def _handle_request(self, *args: Any, **kwargs: Any) -> Any:
        # A pipelined request's head may have been parsed while the previous one ran.
        self._awaiting_head = False
        self._disarm_head_timer()
        try:
            return await super()._handle_request(*args, **kwargs)
        finally:
            self._awaiting_head = True

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        result = await super().finish_response(request, resp, start_time)
        if not resp.keep_alive:
            # We said Connection: close; reading what is left of a refused body (up to aiohttp's
            # lingering time) would be the very work the refusal was meant to avoid.
            self._lingering_time = 0.0
        return result

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        loop = asyncio.get_running_loop()
        self._head_timer = loop.call_later(self._header_timeout_s, self._head_expired)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        if not self._awaiting_head or self._messages:
            return
        log.info("closing a client connection: request head not received in %.1fs",
                 self._header_timeout_s)
        self.force_close()


class GuardedServer(web.Server):
    """aiohttp's connection factory, making ``GuardedHandler`` connections."""

    def __init__(self, plain: web.Server, *, header_timeout_s: float) -> None:
        # Rebuilt from the server aiohttp's runner made, so every setting it chose is kept.
        super().__init__(
            plain.request_handler,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            loop=plain._loop,
            **plain._kwargs,
        )
        self._header_timeout_s = header_timeout_s

    def __call__(self) -> RequestHandler:
        return GuardedHandler(
            self, loop=self._loop, header_timeout_s=self._header_timeout_s, **self._kwargs
        )


class GuardedRunner(web.AppRunner):
    """``AppRunner`` whose connections enforce the request-head deadline."""

    def __init__(self, app: web.Application, *, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._header_timeout_s = header_timeout_s

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()
        return GuardedServer(plain, header_timeout_s=self._header_timeout_s)
