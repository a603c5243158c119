"""Reading a proxied request's body, bounded.

Rules: the body is read within ``limit`` bytes (else ``PayloadTooLarge``, refused from its
``Content-Length`` before any byte is read when it declares one) and ``timeout_s`` for what did
not come with the head (else ``RequestTimeout``); framing or encoding that aiohttp's parser finds
wrong is a ``MalformedBody`` (400, the connection closed); a ``Content-Encoding`` aiohttp does not
decode (it passes such a body on as it came) is an ``UnsupportedEncoding`` (415, closed). A body
that came whole with the head is taken without a timer.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.compression_utils import HAS_BROTLI, HAS_ZSTD
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestPayloadError

from proxy.core.errors import MalformedBody, PayloadTooLarge, RequestTimeout, UnsupportedEncoding

# The content codings aiohttp's parser decodes here (brotli and zstd only with their libraries).
DECODED = frozenset({"identity", "gzip", "deflate"} | ({"br"} if HAS_BROTLI else set())
                    | ({"zstd"} if HAS_ZSTD else set()))


async def read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    coding = request.headers.get("Content-Encoding")
    if coding is not None and (coding.strip().lower() not in DECODED
                               or len(request.headers.getall("Content-Encoding")) > 1):
        # aiohttp decodes one coding it knows and passes anything else on as it came: read as
        # JSON, "compress" or "gzip, gzip" bytes would be misread, not refused.
        raise UnsupportedEncoding(
            "request body Content-Encoding must be gzip, deflate or none, not "
            f"{coding.strip()[:40]!r}")
    length = request.content_length
    if length is not None and length > limit:
        raise PayloadTooLarge(f"request body of {length} bytes exceeds the limit of {limit} bytes")
    content = request.content
    try:
        if content.is_eof():
            # The whole body came with the head (the usual case): nothing to wait for, so no
            # timer; ``read_nowait`` raises what the parser found wrong, as a read would.
            body = content.read_nowait()
            if len(body) > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            return body
        return await _read_rest(content, limit, timeout_s)
    except RequestPayloadError:
        # Bad chunked framing, a body shorter than its Content-Length or one that does not
        # decode as its Content-Encoding says, as aiohttp parses it. The connection closes: its
        # rest cannot be told from a next request (and aiohttp, draining it, would log a trace).
        raise MalformedBody("request body is malformed (framing, length or encoding)") from None


async def _read_rest(content: StreamReader, limit: int, timeout_s: float) -> bytes:
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in content.iter_any():
                body += chunk
                if len(body) > limit:
                    raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
    except TimeoutError:
        raise RequestTimeout(f"request body not received within {timeout_s:g}s") from None
    return bytes(body)
