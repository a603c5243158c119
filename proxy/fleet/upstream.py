"""Talking to engines: the pooled client sessions, header hygiene, and failure classification.

Rules:
- One data-path ``ClientSession`` (keep-alive pool) and one small separate session for scrapes,
  so that a saturated data path never starves telemetry.
- The data-path connector has no connection limit: a request waiting there for a free connection
  would wait silently until its first-byte timeout. The per-engine limit
  (``upstream.max_connections_per_engine``) is enforced by routing instead, which sheds at once.
- Redirects are never followed on the data path (``DATA_POST``): an engine's 3xx would otherwise
  re-send a client's prompt to whatever address the engine names. A 3xx is an engine failure.
- To engines: nothing hop-by-hop, nothing that describes the client's body (``Content-Encoding``,
  digests, ``Expect``: the engine gets JSON the proxy wrote), no client credentials
  (``Authorization``, ``api-key``, ``x-api-key``), no cookies (neither the client's nor any an
  engine set: the sessions keep no cookie jar), no ``Host``, and nothing that describes the
  client's network path
  (``Forwarded``, ``X-Forwarded-*``, ``X-Real-IP``, ``Via`` and the CDN variants of them).
- To clients, an allow-list: of an engine's response headers only ``Content-Type``,
  ``Cache-Control``, ``Retry-After``/``Retry-After-Ms`` and the ``openai-*`` and ``x-ratelimit-*``
  families pass (what the OpenAI SDKs read), each value of a repeated one; engine cookies, server
  banners, internal headers, those the engine names in ``Connection`` and values with a control
  character stay inside.
- Bodies travel as the engine sent them: no automatic decompression, and we never ask for
  compression, so SSE bytes can be passed through without re-encoding.
- Library exceptions are translated here, once, into ``UpstreamError`` / ``UpstreamTimeout``. The
  client's message names the engine by its configured name and the phase only; the library's own
  text (which carries addresses) goes to the log.
"""

from __future__ import annotations

import errno
import logging
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any

import aiohttp
from multidict import CIMultiDict

from proxy.core.config import UpstreamConfig
from proxy.core.errors import UpstreamError, UpstreamTimeout

# RFC 9110 §7.6.1 plus the legacy names that proxies still see in the wild.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# Never forwarded to an engine, on top of the hop-by-hop set.
# The client's credentials are for the proxy; an engine gets only its own (``api_key_env``).
# Where the client sits on the network is none of an engine's business.
# What described the client's body describes nothing the engine gets: the proxy reads the body
# (decoding a compressed one) and sends JSON of its own, so its encoding, digests and any
# ``Expect`` are the client's hop only.
_REQUEST_DROP = frozenset(
    {"host", "authorization", "api-key", "x-api-key", "content-length", "accept-encoding",
     "content-encoding", "content-md5", "content-digest", "repr-digest", "digest", "expect",
     "cookie", "cookie2", "forwarded", "via", "x-real-ip", "x-client-ip", "true-client-ip",
     "cf-connecting-ip", "fastly-client-ip", "x-cluster-client-ip"}
)
_REQUEST_DROP_PREFIXES = ("x-forwarded-",)
# The only engine response headers a client sees (besides the proxy's own).
_RESPONSE_ALLOW = frozenset({"content-type", "cache-control", "retry-after", "retry-after-ms"})
_RESPONSE_ALLOW_PREFIXES = ("openai-", "x-ratelimit-")
# A header value aiohttp's writer refuses (any C0 control but tab, and DEL).
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
# Every data-path request: an engine's 3xx is answered as a failure, never followed.
DATA_POST: dict[str, Any] = {"allow_redirects": False}

log = logging.getLogger(__name__)

SCRAPE_CONNECTIONS_PER_ENGINE = 2


class _CleanPoolConnector(aiohttp.TCPConnector):
    """A connector that never hands out a pooled connection holding bytes nobody asked for.

    An engine's bytes past the end of its answer (a whole extra response in the read that ended
    the answer, or one sent to a connection idle in the pool) are parsed by aiohttp into a
    response that waits in the connection's queue, after the connection went back to the pool:
    the next request sent on it would be answered with them, a 200 that is not its answer.
    Such a connection is closed when it would next be taken from the pool (``should_close``
    sees the queued response), and a clean one, or a new one, is used.

    aiohttp takes the oldest pooled connection that is connected and within the keep-alive,
    closing the ones before it; so are they here, up to that one, which is then checked too:
    per request only the connections aiohttp would look at anyway, not the whole pool."""

    async def _get(self, key: Any, traces: list[Any]) -> Any:
        pooled = self._conns.get(key)
        if pooled:
            now, keepalive = time.monotonic(), self._keepalive_timeout
            while pooled:
                proto, idle_since = pooled[0]
                if proto.should_close:
                    log.warning("closed a pooled engine connection holding bytes after its answer")
                elif proto.is_connected() and (keepalive is None or now - idle_since <= keepalive):
                    break  # the one aiohttp hands out: clean
                pooled.popleft()
                proto.close()
            if not pooled:
                del self._conns[key]
        return await super()._get(key, traces)


def make_data_session(cfg: UpstreamConfig) -> aiohttp.ClientSession:
    """The keep-alive session every proxied request goes through (``cfg``'s per-engine limit is
    routing's to enforce, not the connector's)."""
    # No limit here (0): routing keeps each engine under cfg.max_connections_per_engine.
    connector = _CleanPoolConnector(
        limit=0,
        limit_per_host=0,
        keepalive_timeout=cfg.keepalive_s,
        enable_cleanup_closed=False,
    )
    return _session(connector)


def make_scrape_session() -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=SCRAPE_CONNECTIONS_PER_ENGINE)
    return _session(connector)


def _session(connector: aiohttp.TCPConnector) -> aiohttp.ClientSession:
    # Timeouts are applied per phase by the caller, so the session-wide one is disabled. No
    # cookie jar: an engine's ``Set-Cookie`` would otherwise be kept and sent back with every
    # later client's request to it (and the jar is consulted on every request).
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None),
        auto_decompress=False,
        skip_auto_headers=("Accept-Encoding", "User-Agent"),
        cookie_jar=aiohttp.DummyCookieJar(),
    )


def request_headers(client: Mapping[str, str], request_id: str) -> dict[str, str]:
    """Headers for the engine: the client's, cleaned, plus the request id and content type."""
    out = _filtered(client.items(), _REQUEST_DROP, _connection_tokens(client))
    out = {k: v for k, v in out.items() if not k.lower().startswith(_REQUEST_DROP_PREFIXES)}
    out["Content-Type"] = "application/json"
    out["X-Request-Id"] = request_id
    return out


def response_headers(upstream: Mapping[str, str]) -> CIMultiDict[str]:
    """Headers for the client: those of the engine's that are on the allow-list, every value of
    a repeated one kept (``Cache-Control: no-store`` beside another must still reach the
    client), none the engine named in its ``Connection`` header (hop-by-hop for its hop only),
    and none with a control character in its value (the client's writer would refuse it: the
    answer would break half-written; such a header is dropped, logged at debug level)."""
    out: CIMultiDict[str] = CIMultiDict()
    tokens = _connection_tokens(upstream)
    for name, value in upstream.items():
        low = name.lower()
        if not (low in _RESPONSE_ALLOW or low.startswith(_RESPONSE_ALLOW_PREFIXES)):
            continue
        if low in tokens:
            continue
        if _CONTROL.search(value) is not None:
            log.debug("engine header %r dropped: a control character in its value", name)
            continue
        out.add(name, value)
    return out


def _filtered(
    items: Iterable[tuple[str, str]], drop: frozenset[str], extra: frozenset[str]
) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in items:
        low = name.lower()
        if low in HOP_BY_HOP or low in drop or low in extra:
            continue
        out[name] = value
    return out


def _connection_tokens(headers: Mapping[str, str]) -> frozenset[str]:
    # Headers named in Connection are hop-by-hop for this hop only (RFC 9110 §7.6.1); every
    # Connection header counts where there are several.
    getall = getattr(headers, "getall", None)
    values = getall("Connection", []) if getall is not None else [
        headers.get("Connection") or headers.get("connection") or ""]
    return frozenset(t.strip().lower() for v in values for t in v.split(",") if t.strip())


class AnswerTooLarge(aiohttp.ClientPayloadError):
    """A non-streamed answer past ``upstream.max_response_bytes``."""


def retryable_status(status: int) -> bool:
    return status == 429 or status >= 500


def redirect_status(status: int) -> bool:
    return 300 <= status < 400


def unusable(status: int, headers: Mapping[str, str]) -> bool:
    """A final status that is no answer to relay (a 1xx, 101 included, or one past 599), or a
    body encoded (``Content-Encoding``) although the proxy never asks for an encoding: the client
    would get bytes it cannot read, with no header saying why."""
    if status < 200 or status >= 600:
        return True
    encoding = headers.get("Content-Encoding")
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        return True
    # A transfer coding besides chunked (``gzip, chunked``): the proxy sends no ``TE``, so an
    # engine may not use one, and the body would reach the client still compressed.
    transfer = headers.get("Transfer-Encoding")
    return transfer is not None and any(
        t.strip().lower() not in ("", "chunked", "identity") for t in transfer.split(","))


def translate(exc: BaseException, engine: str, phase: str) -> UpstreamError:
    """The one place aiohttp / timeout exceptions become kvproxy errors."""
    if isinstance(exc, TimeoutError):
        return UpstreamTimeout(f"engine {engine} timed out ({phase})")
    # The library's text names the engine's address: the operator's to read, not the client's.
    log.warning("engine %s failed (%s): %s", engine, phase, loggable(exc))
    return UpstreamError(f"engine {engine} failed ({phase}): {_kind(exc)}")


# The proxy's own resources, not the engine's fault: a connection it could not even open.
_PROXY_SHORT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def proxy_short(exc: BaseException) -> bool:
    """Whether a failed connect is the proxy's own want (no file descriptor, buffer or memory
    left here), which says nothing about the engine."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return exc.os_error.errno in _PROXY_SHORT
    return isinstance(exc, OSError) and exc.errno in _PROXY_SHORT


def loggable(exc: BaseException) -> str:
    """``exc`` for the operator's log: its kind and message, never the request it came from
    (aiohttp's repr of a response error holds the request's headers: the engine's API key and
    the client's headers with them)."""
    if isinstance(exc, aiohttp.ClientResponseError):
        return f"{type(exc).__name__}(status={exc.status}, message={exc.message!r})"
    return repr(exc)


def _kind(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ClientConnectorError | ConnectionRefusedError):
        return "connection refused or unreachable"
    if isinstance(exc, aiohttp.ServerDisconnectedError | ConnectionResetError):
        return "connection closed by the engine"
    if isinstance(exc, AnswerTooLarge):
        return "answer larger than the proxy accepts (upstream.max_response_bytes)"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "malformed response body"
    if isinstance(exc, aiohttp.ClientResponseError):
        return "malformed response"
    return "connection error"
