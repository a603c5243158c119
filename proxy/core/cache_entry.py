"""Cache entries: the stored format of one complete answer, and its replay in either shape.

Rules (pure, no I/O):
- An entry holds one complete answer in the non-streamed OpenAI shape, whatever shape the miss was
  relayed in (``proxy.core.recording`` rebuilds it); it is replayed as JSON or as an SSE stream,
  whichever the client asks for now, the stream in the chunk shape the engine itself would send.
- Complete means at least one choice and every choice finished with a ``finish_reason`` other than
  ``abort`` (``is_finished``); an entry that does not hold such an answer does not decode.
- An entry names the tenant and model it belongs to; decoding checks both, so even a key collision
  or a corrupted store could not hand an answer across tenants. Garbage decodes to ``EntryError``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson

ENTRY_VERSION = 1
_UNFINISHED = frozenset({None, "abort"})
# The answer's own fields, the same in every streamed chunk and in the stored answer.
HEAD_FIELDS: tuple[str, ...] = ("id", "created", "model", "system_fingerprint")


class EntryError(ValueError):
    """A stored value that is not a valid entry for this request."""


@dataclass(frozen=True)
class CachedResponse:
    tenant: str
    model: str
    chat: bool
    response: dict[str, Any]

    def encode(self) -> bytes:
        doc = {"v": ENTRY_VERSION, "t": self.tenant, "m": self.model, "chat": self.chat}
        doc["r"] = self.response
        return orjson.dumps(doc)

    def json_body(self) -> bytes:
        return orjson.dumps(self.response)

    def usage_tokens(self) -> int | None:
        return usage_tokens(self.response)


def decode_entry(raw: bytes, *, tenant: str, model: str) -> CachedResponse:
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise EntryError("not JSON") from None
    if not isinstance(doc, dict) or doc.get("v") != ENTRY_VERSION:
        raise EntryError("unknown entry format")
    if doc.get("t") != tenant or doc.get("m") != model:
        raise EntryError("entry belongs to another tenant or model")
    response = doc.get("r")
    if not isinstance(response, dict) or not is_finished(response):
        raise EntryError("entry holds no complete response")
    return CachedResponse(tenant, model, bool(doc.get("chat")), response)


def usage_tokens(response: dict[str, Any]) -> int | None:
    usage = response.get("usage")
    if isinstance(usage, dict):
        total = usage.get("total_tokens")
        if isinstance(total, int) and not isinstance(total, bool):
            return total
    return None


def is_finished(response: dict[str, Any]) -> bool:
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    return all(isinstance(c, dict) and c.get("finish_reason") not in _UNFINISHED for c in choices)


# --- replay ---------------------------------------------------------------------------------------


def replay_sse(entry: CachedResponse, *, include_usage: bool) -> bytes:
    """The entry as one SSE body, in the chunk shape the engine itself would have streamed."""
    return b"".join(_sse(chunk) for chunk in _chunks(entry, include_usage)) + b"data: [DONE]\n\n"


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _chunks(entry: CachedResponse, include_usage: bool) -> Iterator[dict[str, Any]]:
    response = entry.response
    head = {k: response[k] for k in HEAD_FIELDS if k in response}
    head["object"] = "chat.completion.chunk" if entry.chat else "text_completion"
    for choice in response["choices"]:
        for part in _choice_parts(choice, entry.chat):
            yield {**head, "choices": [part]}
    if include_usage and response.get("usage") is not None:
        yield {**head, "choices": [], "usage": response["usage"]}


def _choice_parts(choice: dict[str, Any], chat: bool) -> Iterator[dict[str, Any]]:
    index = choice.get("index", 0)
    end = {"finish_reason": choice.get("finish_reason")}
    if "stop_reason" in choice:
        end["stop_reason"] = choice["stop_reason"]
    if not chat:
        yield {"index": index, "text": choice.get("text", ""), "logprobs": choice.get("logprobs"),
               "finish_reason": None}  # fmt: skip
        yield {"index": index, "text": "", "logprobs": None, **end}
        return
    message = dict(choice.get("message") or {})
    role = message.pop("role", "assistant")
    yield {"index": index, "delta": {"role": role, "content": ""}, "logprobs": None,
           "finish_reason": None}  # fmt: skip
    delta = {k: v for k, v in message.items() if v is not None}
    if isinstance(delta.get("tool_calls"), list):
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
    yield {
        "index": index,
        "delta": delta,
        "logprobs": choice.get("logprobs"),
        "finish_reason": None,
    }
    yield {"index": index, "delta": {}, "logprobs": None, **end}
