"""A client's deadline for one request: ``X-Request-Timeout`` (seconds) or the body's ``timeout``.

Rules (pure, no I/O):
- Either source is a positive, finite number of seconds; anything else is a 400 naming the header
  or the field. When both are given the smaller wins; the proxy's own limits still apply on top
  (the relay enforces whichever ends first).
- The body's ``timeout`` is the proxy's to read, never the engine's: vLLM 0.32's OpenAI protocol
  has no request-level timeout (an unknown field would only be logged there as ignored), so the
  field is removed from the body sent upstream and no remainder is forwarded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from proxy.core.errors import BadRequest

HEADER = "X-Request-Timeout"
FIELD = "timeout"
_MAX_HEADER_CHARS = 32


def client_timeout(header: str | None, body: Mapping[str, Any]) -> float | None:
    """The client's timeout in seconds, or None when it sent none."""
    found = [t for t in (_from_header(header), _from_body(body.get(FIELD))) if t is not None]
    return min(found) if found else None


def _from_header(raw: str | None) -> float | None:
    if raw is None:
        return None
    text = raw.strip()
    try:
        value = float(text) if len(text) <= _MAX_HEADER_CHARS else math.nan
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise BadRequest(f"{HEADER} must be a positive number of seconds", param=HEADER)
    return value


def _from_body(value: object) -> float | None:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value > 0)
    ):
        raise BadRequest("'timeout' must be a positive number of seconds", param=FIELD)
    return float(value)
