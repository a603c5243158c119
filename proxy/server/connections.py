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
- What aiohttp answers by itself (a request it cannot parse, an exception outside the app's
  middleware) is answered in the proxy's shape too: an OpenAI-shaped JSON error, ``Server:
  kvproxy``, a request id, and no library text or traceback (those go to the log).
- Open client connections are counted per process against ``server.max_connections`` (unset:
  ``proxy.core.conncap``'s cap from the open-files limit). Past the cap, a grace of a few more
  connections (``conncap.grace``) are each answered one request and closed: a proxied request is
  refused 503 (shed reason ``connections``, counted and logged as every proxied request is, by
  its handler: ``past_cap``), anything else (the probes, ``/metrics``) answered as usual, with
  ``Connection: close``; their head must come within ``_PAST_CAP_HEAD_S``. Past the cap and the
  grace, a connection is closed as soon as it is accepted, so that idle connections cannot take
  the descriptors that clients within the cap need for their engine connections. Refusals and
  closes are logged as counts, once a minute at most.
- Everything else is aiohttp's ``RequestHandler`` as it is; the subclass touches only the hooks
  named above (``connection_made``, ``data_received``, ``_handle_request``, ``finish_response``).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from http import HTTPStatus
from typing import Any, cast

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from proxy.core.conncap import grace
from proxy.core.errors import NoCapacity
from proxy.observe.metrics import ProxyMetrics
from proxy.observe.throttle import Throttle

log = logging.getLogger(__name__)

SERVER_NAME = "kvproxy"
REASON_CONNECTIONS = "connections"
_SLOW_HEADS = Throttle(60.0)  # connections closed for a slow head: a count a minute at most
_REFUSALS = Throttle(60.0)  # requests refused past the cap: a count a minute at most
_DROPS = Throttle(60.0)  # connections closed at once past the cap and its grace: the same
_RETRY_AFTER_S = 1.0
# A connection past the cap holds a descriptor of the grace: its head comes within this, or the
# place goes to the next one.
_PAST_CAP_HEAD_S = 1.0

# What ``GuardedServer.opened`` says of a new connection.
WITHIN, PAST_CAP, DROPPED = 0, 1, 2


class GuardedHandler(RequestHandler):
    """One client connection, with a deadline on each request head."""

    def __init__(self, manager: web.Server, *, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        # True between requests: the next bytes to come are a request head.
        self._awaiting_head = True
        # Opened past the cap, within its grace: one request, then closed.
        self.past_cap = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        place = cast(GuardedServer, self._manager).opened()
        if place == PAST_CAP:
            self.past_cap = True
            self._header_timeout_s = min(self._header_timeout_s, _PAST_CAP_HEAD_S)
        if place != DROPPED:
            self._arm_head_timer()
        super().connection_made(transport)
        if place == DROPPED:
            self.force_close()  # nothing read, nothing buffered: closed at once

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm_head_timer()
        cast(GuardedServer, self._manager).closed()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        heads = self._request_count
        super().data_received(data)
        if self._request_count != heads:
            # A whole head (or a parse error, answered 400) arrived: the handler's turn now.
            self._awaiting_head = False
            self._disarm_head_timer()
        elif self._awaiting_head and data and self._head_timer is None:
            # Part of a head, timed from now. Armed only after parsing: a head that arrives
            # whole in one read (the usual case) needs no timer at all.
            self._arm_head_timer()

    async def _handle_request(self, *args: Any, **kwargs: Any) -> Any:
        # A pipelined request's head may have been parsed while the previous one ran.
        self._awaiting_head = False
        self._disarm_head_timer()
        if self.past_cap:
            args = (*args[:2], _closing(args[2]))
        try:
            return await super()._handle_request(*args, **kwargs)
        finally:
            self._awaiting_head = True

    def refusal(self) -> NoCapacity:
        """Why a proxied request on this connection (past the cap) is refused, counted."""
        return cast(GuardedServer, self._manager).refusal()

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        result = await super().finish_response(request, resp, start_time)
        if not resp.keep_alive:
            # We said Connection: close; reading what is left of a refused body (up to aiohttp's
            # lingering time) would be the very work the refusal was meant to avoid.
            self._lingering_time = 0.0
        return result

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            log.error("unhandled error serving %s", request.remote, exc_info=exc)
        else:
            log.debug("malformed request from %s: %r", request.remote, exc)
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already started; the connection is broken")
        resp = web.Response(
            status=status,
            body=_error_body(status),
            content_type="application/json",
            headers={"Server": SERVER_NAME, "X-Request-Id": uuid.uuid4().hex},
        )
        resp.force_close()
        return resp

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
        # A client opening connections and sending nothing must not write a line per connection.
        held = _SLOW_HEADS.due(asyncio.get_running_loop().time())
        if held is not None:
            log.info("closed %d client connection(s) whose request head did not arrive in "
                     "%.1fs (since the last such line)", held + 1, self._header_timeout_s)
        self.force_close()


def _closing(handler: Any) -> Any:
    """``handler``, its answer saying ``Connection: close`` (one request past the cap)."""

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        response: web.StreamResponse = await handler(request)
        if not response.prepared:
            response.force_close()
        return response

    return handle


def past_cap(request: web.BaseRequest) -> NoCapacity | None:
    """The refusal of a proxied ``request`` whose connection opened past the cap, else None."""
    protocol = request.protocol
    if isinstance(protocol, GuardedHandler) and protocol.past_cap:
        return protocol.refusal()
    return None


def _error_body(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Error"
    if status >= 500:
        error = {"message": "internal error in the proxy", "type": "internal_error",
                 "param": None, "code": None}
    else:
        error = {"message": f"malformed HTTP request ({phrase})",
                 "type": "invalid_request_error", "param": None,
                 "code": phrase.lower().replace(" ", "_")}
    return orjson.dumps({"error": error})


class GuardedServer(web.Server):
    """aiohttp's connection factory, making ``GuardedHandler`` connections, counting them."""

    def __init__(self, plain: web.Server, *, header_timeout_s: float, cap: int | None = None,
                 metrics: ProxyMetrics | None = None) -> None:
        # Rebuilt from the server aiohttp's runner made, so every setting it chose is kept.
        super().__init__(
            plain.request_handler,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            loop=plain._loop,
            **plain._kwargs,
        )
        self._header_timeout_s = header_timeout_s
        self.cap = cap
        self.open = 0
        self._metrics = metrics
        if metrics is not None:
            metrics.client_connections_limit.set(float("inf") if cap is None else cap)

    def __call__(self) -> RequestHandler:
        return GuardedHandler(
            self, loop=self._loop, header_timeout_s=self._header_timeout_s, **self._kwargs
        )

    def opened(self) -> int:
        """Count a new connection: ``WITHIN`` the cap, ``PAST_CAP`` (within its grace) or
        ``DROPPED``."""
        self.open += 1
        if self._metrics is not None:
            self._metrics.client_connections.inc()
        cap = self.cap
        if cap is None or self.open <= cap:
            return WITHIN
        if self.open <= cap + grace(cap):
            return PAST_CAP
        if self._metrics is not None:
            self._metrics.client_connections_dropped.inc()
        held = _DROPS.due(asyncio.get_running_loop().time())
        if held is not None:
            log.warning("closed %d client connection(s) as soon as accepted: past "
                        "server.max_connections = %d and its grace of %d (since the last such "
                        "line)", held + 1, cap, grace(cap))
        return DROPPED

    def closed(self) -> None:
        self.open -= 1
        if self._metrics is not None:
            self._metrics.client_connections.dec()

    def refusal(self) -> NoCapacity:
        """Why a proxied request on a connection past the cap is refused, counted."""
        if self._metrics is not None:
            self._metrics.client_connections_refused.inc()
        held = _REFUSALS.due(asyncio.get_running_loop().time())
        if held is not None:
            log.warning("refused %d request(s) on client connections past server.max_connections "
                        "= %s (since the last such line)", held + 1, self.cap)
        return NoCapacity(
            f"the proxy holds its limit of {self.cap} client connections; retry later",
            reason=REASON_CONNECTIONS,
            retry_after_s=_RETRY_AFTER_S,
        )


class GuardedRunner(web.AppRunner):
    """``AppRunner`` whose connections enforce the request-head deadline and the cap."""

    def __init__(self, app: web.Application, *, header_timeout_s: float, cap: int | None = None,
                 metrics: ProxyMetrics | None = None, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._cap = cap
        self._metrics = metrics

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()
        return GuardedServer(plain, header_timeout_s=self._header_timeout_s, cap=self._cap,
                             metrics=self._metrics)
