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
  ``proxy.core.conncap``). A connection that opens past the cap serves one request and is closed:
  a proxied request is answered 503 (shed reason ``connections``, ``Retry-After``) without reaching
  the app, and the proxy's own probes (``/health``, ``/ready``, ``/metrics``) are answered as usual
  with ``Connection: close``, so an orchestrator does not restart a proxy that a flood of
  connections holds at its cap. Refusals are counted and logged as a count, once a minute at most.
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

from proxy.core.errors import NoCapacity
from proxy.observe.metrics import ProxyMetrics
from proxy.observe.throttle import Throttle

log = logging.getLogger(__name__)

SERVER_NAME = "kvproxy"
REASON_CONNECTIONS = "connections"
_SLOW_HEADS = Throttle(60.0)  # connections closed for a slow head: a count a minute at most
_REFUSALS = Throttle(60.0)  # connections past the cap: a count a minute at most
# Answered on a connection past the cap as on any other: an orchestrator's probes and scrapes.
_PROBES = frozenset({"/health", "/ready", "/metrics"})
_RETRY_AFTER_S = 1.0


class GuardedHandler(RequestHandler):
    """One client connection, with a deadline on each request head."""

    def __init__(self, manager: web.Server, *, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        # True between requests: the next bytes to come are a request head.
        self._awaiting_head = True
        self._past_cap = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._arm_head_timer()
        self._past_cap = cast(GuardedServer, self._manager).opened()
        super().connection_made(transport)

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
        if self._past_cap:
            args = (*args[:2], self._only_probes(args[2]))
        try:
            return await super()._handle_request(*args, **kwargs)
        finally:
            self._awaiting_head = True

    def _only_probes(self, app_handler: Any) -> Any:
        """The request handler of a connection past the cap: one probe answered, then closed;
        anything else refused at once."""
        server = cast(GuardedServer, self._manager)

        async def handle(request: web.BaseRequest) -> web.StreamResponse:
            if request.path in _PROBES:
                response: web.StreamResponse = await app_handler(request)
            else:
                response = server.refusal()
            if not response.prepared:
                response.force_close()
            return response

        return handle

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

    def opened(self) -> bool:
        """Count a new connection; True when it is past the cap."""
        self.open += 1
        if self._metrics is not None:
            self._metrics.client_connections.inc()
        return self.cap is not None and self.open > self.cap

    def closed(self) -> None:
        self.open -= 1
        if self._metrics is not None:
            self._metrics.client_connections.dec()

    def refusal(self) -> web.Response:
        """The answer to a proxied request on a connection past the cap."""
        if self._metrics is not None:
            self._metrics.client_connections_refused.inc()
        held = _REFUSALS.due(asyncio.get_running_loop().time())
        if held is not None:
            log.warning("refused %d request(s) on client connections past server.max_connections "
                        "= %s (since the last such line)", held + 1, self.cap)
        exc = NoCapacity(
            f"the proxy holds its limit of {self.cap} client connections; retry later",
            reason=REASON_CONNECTIONS, retry_after_s=_RETRY_AFTER_S,
        )
        headers = {**exc.headers(), "Server": SERVER_NAME, "X-Request-Id": uuid.uuid4().hex,
                   "X-Cache": "BYPASS"}
        return web.Response(status=exc.status, body=exc.body(), content_type="application/json",
                            headers=headers)


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
