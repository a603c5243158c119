"""Accepting a client request body: parse, validate, and describe it for the router.

Rules: pure and synchronous (no aiohttp, no I/O). Only the fields the proxy itself uses are
validated; everything else in the body is the engine's business and is passed on untouched.
Those fields are read as vLLM reads them (pydantic's lax mode), so that what the engine would
take the proxy takes too: an integer also as a float without a fraction (``5.0``) or a string of
one (``"5"``), a number also as a string of one, ``stream`` also as ``0``/``1`` or a word
(``"true"``, ``"no"``, ...); such a value is written back in its own type, so everything after
(routing, the cache key, the engine) sees one spelling. A boolean is never a number here.
Every rejection is a ``BadRequest`` whose ``param`` names the offending field, so that clients get
the same kind of 400 that the OpenAI API would give them. A body nested deeper than ``max_depth``
levels (the top-level object is level 1) is refused at parse, by an iterative walk, so no later
step (re-encoding, the cache key) ever meets one.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.core.errors import BadRequest
from proxy.core.prefix import canonical_chat, canonical_prompt
from proxy.core.usage import FALSE_WORDS, TRUE_WORDS


class Endpoint(enum.Enum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"


@dataclass(frozen=True)
class Inbound:
    """A validated request: the body as parsed plus what routing needs from it."""

    endpoint: Endpoint
    body: dict[str, Any]
    model: str
    stream: bool
    prompt_text: str
    # The body's size in bytes as received (0 when not known): a bound on everything a chat
    # template can render from it, tools and tool-call arguments included.
    size: int = 0


DEFAULT_MAX_DEPTH = 64
_BOM = b"\xef\xbb\xbf"


def parse_body(raw: bytes, max_depth: int = DEFAULT_MAX_DEPTH) -> dict[str, Any]:
    """Parse a JSON object; the error message names what is wrong with it."""
    if raw[:3] == _BOM:
        raw = raw[3:]  # a UTF-8 byte order mark: JSON readers (vLLM's among them) skip it
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object", param=None)
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if "depth" in str(exc) or "recursion" in str(exc):
            raise _too_deep_error(max_depth) from None  # beyond orjson's own limit, and ours
        raise BadRequest(_syntax_error(exc), param=None) from None
    if not isinstance(value, dict):
        kind = _JSON_KINDS.get(type(value), "a JSON value")
        raise BadRequest(f"request body must be a JSON object, not {kind}", param=None)
    # Each level opens with a bracket, so a body with no more brackets than the limit (strings'
    # included) cannot be too deep: the usual body is not walked at all.
    if raw.count(b"[") + raw.count(b"{") > max_depth and too_deep(value, max_depth):
        raise _too_deep_error(max_depth)
    return value


# What a client sent, named in JSON's words (not Python's).
_JSON_KINDS: dict[type, str] = {list: "an array", str: "a string", int: "a number",
                                float: "a number", bool: "a boolean", type(None): "null"}


def _syntax_error(exc: orjson.JSONDecodeError) -> str:
    """Where a body stops being JSON, in the proxy's own words (the parser's text is not a
    message for clients)."""
    if "utf-8" in exc.msg.lower():
        return "request body is not valid UTF-8 text"
    return f"request body is not valid JSON (line {exc.lineno}, column {exc.colno})"


def _too_deep_error(max_depth: int) -> BadRequest:
    return BadRequest(f"request body is nested more than {max_depth} levels deep", param=None)


_CONTAINERS = (dict, list)  # a tuple: ``dict | list`` would build a union object on every test


def too_deep(value: object, limit: int) -> bool:
    """Whether ``value`` has more than ``limit`` levels of objects and arrays (iterative)."""
    level: list[dict[Any, Any] | list[Any]] = [value] if isinstance(value, _CONTAINERS) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        below: list[dict[Any, Any] | list[Any]] = []
        for node in level:
            items: Iterable[Any] = node.values() if isinstance(node, dict) else node
            below.extend(v for v in items if isinstance(v, _CONTAINERS))
        level = below
    return False


def accept(raw: bytes, endpoint: Endpoint, *, max_depth: int = DEFAULT_MAX_DEPTH) -> Inbound:
    """Parse and validate ``raw`` for ``endpoint``."""
    return accept_body(parse_body(raw, max_depth), endpoint, size=len(raw))


def named_model(body: Mapping[str, Any]) -> str | None:
    """The model a parsed body names, if it names one as a string (for the access log of a
    request refused for another field)."""
    model = body.get("model")
    return model if isinstance(model, str) else None


def accept_body(body: dict[str, Any], endpoint: Endpoint, *, size: int = 0) -> Inbound:
    """Validate a parsed body (``parse_body``, ``size`` bytes of it) for ``endpoint``."""
    model = _model(body)
    if endpoint is Endpoint.CHAT:
        prompt_text = canonical_chat(_messages(body))
    else:
        prompt_text = canonical_prompt(_prompt(body))
    _check_sampling(body)
    return Inbound(endpoint, body, model, _flag(body, "stream"), prompt_text, size)


def rewrite(
    body: Mapping[str, Any], *, model: str, priority: int | None, cache_salt: str | None = None
) -> bytes:
    """The upstream body: the client's, with the pool's served model and, if set, the priority
    and the engine cache salt (which replaces the client's: see ``proxy.core.isolation``)."""
    out = dict(body)
    out["model"] = model
    if priority is None:
        out.pop("priority", None)
    else:
        out["priority"] = priority
    if cache_salt is not None:
        out["cache_salt"] = cache_salt
    return orjson.dumps(out)


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise BadRequest("you must provide a model parameter", param="model")
    if not isinstance(model, str) or not model.strip():
        raise BadRequest("'model' must be a non-empty string", param="model")
    return model


def _messages(body: Mapping[str, Any]) -> list[dict[str, object]]:
    messages = body.get("messages")
    if messages is None:
        raise BadRequest("'messages' is a required property", param="messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"'messages[{i}]' must be an object", param=f"messages[{i}]")
        if not isinstance(message.get("role"), str):
            raise BadRequest(f"'messages[{i}].role' must be a string", param=f"messages[{i}].role")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest(
                f"'messages[{i}].content' must be a string or an array",
                param=f"messages[{i}].content",
            )
    return messages


def _prompt(body: Mapping[str, Any]) -> str | list[Any]:
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest("'prompt' is a required property", param="prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(_prompt_item(p) for p in prompt):
        return prompt
    raise BadRequest(
        "'prompt' must be a string, an array of strings, or an array of token ids", param="prompt"
    )


def _prompt_item(item: object) -> bool:
    if isinstance(item, str):
        return True
    if _is_int(item):
        return True
    return isinstance(item, list) and all(_is_int(t) for t in item)


def _check_sampling(body: dict[str, Any]) -> None:
    _read_lax(body)
    _flag(body, "stream")
    for name in ("max_tokens", "max_completion_tokens"):
        _positive_int(body, name)
    _positive_int(body, "n")
    temperature = body.get("temperature")
    if temperature is not None and (not _is_number(temperature) or temperature < 0):
        raise BadRequest("'temperature' must be a number >= 0", param="temperature")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise BadRequest("'seed' must be an integer", param="seed")


_INT_FIELDS = ("max_tokens", "max_completion_tokens", "n", "seed", "priority")


def _read_lax(body: dict[str, Any]) -> None:
    """The fields the proxy uses in their own types where vLLM would take another spelling (see
    the rules); a value vLLM would refuse is left as it is, for the checks to refuse."""
    for name in _INT_FIELDS:
        value = body.get(name)
        if isinstance(value, float | str) and (whole := _lax_int(value)) is not None:
            body[name] = whole
    temperature = body.get("temperature")
    if isinstance(temperature, str):
        try:
            read = float(temperature.strip())
        except ValueError:
            pass
        else:
            if math.isfinite(read):
                body["temperature"] = read
    stream = body.get("stream")
    if isinstance(stream, str) and stream.strip().lower() in TRUE_WORDS | FALSE_WORDS:
        body["stream"] = stream.strip().lower() in TRUE_WORDS
    elif _is_int(stream) and stream in (0, 1):
        body["stream"] = bool(stream)


# vLLM's integer fields are 64-bit: a larger value is its 400, and the proxy could not write it
# back into the upstream body either.
_INT64 = 2**63 - 1


def _lax_int(value: float | str) -> int | None:
    if isinstance(value, float):
        # A JSON integer past 64 bits reads as a float: too large, left for the checks to refuse.
        return int(value) if value.is_integer() and abs(value) <= _INT64 else None
    text = value.strip()
    digits = text[1:] if text[:1] in "+-" else text
    if not digits.isascii() or not digits.isdigit() or len(digits) > 19:
        return None
    whole = int(text)
    return whole if abs(whole) <= _INT64 else None


def _flag(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be a boolean", param=name)
    return value


def _positive_int(body: Mapping[str, Any], name: str) -> None:
    value = body.get(name)
    if value is not None and (not _is_int(value) or value < 1):
        raise BadRequest(f"'{name}' must be an integer >= 1", param=name)


def _is_int(value: object) -> bool:
    # bool is an int subclass in Python but never a valid count in JSON terms.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
