"""One error hierarchy for the proxy, split by whose fault a failure is.

Rules:
- Every error a client can see is a ``KvproxyError``; it knows its HTTP status, its OpenAI error
  ``type``, optional ``code``/``param``, and any extra headers. It is rendered exactly once, by the
  application's error middleware, through ``body()`` and ``headers()``.
- Client faults are 4xx (``ClientError``), lack of capacity is 503 (``NoCapacity``), an engine that
  fails is 502 (``UpstreamError``) and one that is too slow is 504 (``UpstreamTimeout``).
- Messages name an engine by its configured name only: never its address, never library text.
- An error raised while the request body is still unread (``closes_connection``: too large, too
  slow) is answered with ``Connection: close``, and the rest of the body is never read.
- Library exceptions are translated into these at one boundary (the async shell), never here.
- ``ConfigError`` is not an HTTP error: it stops start-up and names the dotted field that is wrong.
"""

from __future__ import annotations

import math
from typing import ClassVar

import orjson


class KvproxyError(Exception):
    """Base of every error that becomes an HTTP response."""

    status: ClassVar[int] = 500
    err_type: ClassVar[str] = "internal_error"
    default_code: ClassVar[str | None] = None
    closes_connection: ClassVar[bool] = False

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code if code is not None else self.default_code
        self.param = param
        # What the shell learnt about the request before it failed (``X-Cache``), sent along.
        self.context_headers: dict[str, str] = {}

    def headers(self) -> dict[str, str]:
        """Extra response headers: the error's own, then what the shell attached."""
        return self.context_headers | self.own_headers()

    def own_headers(self) -> dict[str, str]:
        """Headers this kind of error always carries; most need none."""
        return {}

    def body(self) -> bytes:
        """The OpenAI-shaped JSON error document."""
        return orjson.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": self.err_type,
                    "param": self.param,
                    "code": self.code,
                }
            }
        )


class ClientError(KvproxyError):
    """The request is wrong; retrying it unchanged will not help."""

    status = 400
    err_type = "invalid_request_error"


class BadRequest(ClientError):
    """A field of the request is missing or invalid; ``param`` names it."""


class MalformedBody(BadRequest):
    """The body's framing or encoding is broken (as aiohttp's parser found it): what is left of
    it cannot be told from the next request, so the connection is closed."""

    closes_connection = True


class NotFound(ClientError):
    """The requested model (or resource) does not exist."""

    status = 404
    default_code = "model_not_found"


class PayloadTooLarge(ClientError):
    """The body exceeds the configured size limit."""

    status = 413
    default_code = "payload_too_large"
    closes_connection = True


class ExpectationFailed(ClientError):
    """An ``Expect`` the proxy does not meet (anything but ``100-continue``)."""

    status = 417
    default_code = "expectation_failed"
    closes_connection = True


class UnsupportedEncoding(ClientError):
    """A ``Content-Encoding`` the proxy does not decode: its bytes are not the JSON they would
    be read as. The body is left unread, so the connection is closed."""

    status = 415
    default_code = "unsupported_content_encoding"
    closes_connection = True


class RequestTimeout(ClientError):
    """The client did not send its whole body within ``server.body_timeout_s``."""

    status = 408
    default_code = "request_timeout"
    closes_connection = True


class Unauthorized(ClientError):
    """Missing or unknown API key."""

    status = 401
    err_type = "authentication_error"
    default_code = "invalid_api_key"


def _retry_after_header(seconds: float) -> str:
    # HTTP wants whole seconds; never 0, which clients read as "retry immediately".
    return str(max(1, math.ceil(seconds)))


class RateLimited(ClientError):
    """The tenant is over its request or token rate."""

    status = 429
    err_type = "rate_limit_error"
    default_code = "rate_limit_exceeded"

    def __init__(
        self, message: str, *, retry_after_s: float = 1.0, code: str | None = None
    ) -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s

    def own_headers(self) -> dict[str, str]:
        return {"Retry-After": _retry_after_header(self.retry_after_s)}


class NoCapacity(KvproxyError):
    """The fleet cannot take this request now (shed by admission, or nothing routable)."""

    status = 503
    err_type = "overloaded"
    default_code = "overloaded"

    def __init__(
        self, message: str, *, reason: str, retry_after_s: float = 1.0, code: str | None = None
    ) -> None:
        super().__init__(message, code=code)
        self.reason = reason
        self.retry_after_s = retry_after_s

    def own_headers(self) -> dict[str, str]:
        return {
            "Retry-After": _retry_after_header(self.retry_after_s),
            "X-Kvproxy-Shed-Reason": self.reason,
        }


class NoEngine(NoCapacity):
    """Every engine of the pool is down (unreachable, failing, ejected): not a busy fleet but a
    broken one, and the message says so."""

    err_type = "service_unavailable"
    default_code = "no_engine_reachable"

    def __init__(self, pool: str, *, reason: str, retry_after_s: float = 1.0) -> None:
        super().__init__(
            f"no engine of pool {pool} is reachable", reason=reason, retry_after_s=retry_after_s
        )


class UpstreamError(KvproxyError):
    """The engine failed (connection refused or reset, 5xx, malformed answer)."""

    status = 502
    err_type = "upstream_error"


class UpstreamTimeout(UpstreamError):
    """The engine did not answer in time (connect, first byte or between chunks)."""

    status = 504
    err_type = "timeout"


class ConfigError(Exception):
    """Invalid configuration; ``field`` is the dotted path (``pools[0].engines[1].url``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.reason = message

    def under(self, prefix: str) -> ConfigError:
        """The same error, its field placed under ``prefix`` (used while descending the tree)."""
        if not prefix:
            return self
        if not self.field:
            return ConfigError(prefix, self.reason)
        joiner = "" if self.field.startswith("[") else "."
        return ConfigError(f"{prefix}{joiner}{self.field}", self.reason)
