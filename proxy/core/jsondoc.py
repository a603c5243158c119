"""A JSON document from outside the process, taken only if it is one object."""

from __future__ import annotations

from typing import Any

import orjson


def json_object(raw: bytes) -> dict[str, Any] | None:
    """``raw`` parsed, when it is a JSON object; None for anything else (not JSON, an array, a
    string...). orjson bounds nesting, so a deep document is refused, never a RecursionError."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) else None
