"""Cache entries: the stored format of one complete answer, and its replay in either shape.

Rules (pure, no I/O):
- An entry holds one complete answer in the non-streamed OpenAI shape, whatever shape the miss was
  relayed in (``proxy.core.recording`` rebuilds it); it is replayed as JSON or as an SSE stream,
  whichever the client asks for now, the stream in the chunk shape the engine itself would send
  (the whole text in one content chunk between the role and the finish). An answer with a field
  no streamed chunk carries (``streamable``: vLLM's ``prompt_token_ids``, a choice's
  ``token_ids``, a ``service_tier``) is replayed as JSON only; a stream asking for it misses.
- Complete means at least one choice and every choice finished with a ``finish_reason`` other than
  ``abort``, ``error`` (vLLM's request-level failure) or ``repetition`` (vLLM cut a degenerate,
  repeating answer: not one to hand every later asker) (``is_finished``); an entry that does not
  hold such an answer does not decode.
- Each replay has an id of its own and the time it was made (``renamed``): the stored answer's
  id and time are those of the first request only.
- An entry names the tenant and model it belongs to; decoding checks both, so even a key collision
  or a corrupted store could not hand an answer across tenants. Garbage decodes to ``EntryError``,
  and so does an answer of the wrong shape (``well_formed``: the fields a replay reads, and the
  answer's own head and usage, of the types the OpenAI API gives them): the store is not trusted
  to hold what the proxy wrote.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson

ENTRY_VERSION = 1
# vLLM 0.32's finish reasons are stop, length, abort, error and repetition (``FinishReason``).
_UNFINISHED = frozenset({None, "abort", "error", "repetition"})
# The answer's own fields, the same in every streamed chunk and in the stored answer.
HEAD_FIELDS: tuple[str, ...] = ("id", "created", "model", "system_fingerprint")
# An answer's fields that both shapes carry (a streamed chunk's, and the stored answer's).
ANSWER_FIELDS = frozenset({*HEAD_FIELDS, "object", "choices", "usage"})


def set_beyond(obj: dict[str, Any], known: frozenset[str]) -> bool:
    """Whether ``obj`` gives a field outside ``known`` a value (vLLM writes unset ones as null)."""
    return not obj.keys() <= known and any(obj[k] is not None for k in obj.keys() - known)


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

    def renamed(self, suffix: str, created: int) -> CachedResponse:
        """The same answer under an id of its own and the time of this replay: two clients
        answered from one entry never share an id (clients key logs, feedback and idempotency
        stores on it). The id keeps the stored one's prefix (``chatcmpl-``, ``cmpl-``)."""
        old = self.response.get("id")
        prefix = old.split("-", 1)[0] + "-" if isinstance(old, str) and "-" in old else ""
        response = {**self.response, "id": prefix + suffix, "created": created}
        return CachedResponse(self.tenant, self.model, self.chat, response)

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
    chat = doc.get("chat")
    if not isinstance(chat, bool) or not well_formed(response, chat=chat):
        raise EntryError("entry holds an answer of the wrong shape")
    return CachedResponse(tenant, model, chat, response)


_HEAD_TYPES: dict[str, type | tuple[type, ...]] = {
    "id": str, "object": str, "created": int, "model": str, "system_fingerprint": (str, type(None)),
}


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def well_formed(response: dict[str, Any], *, chat: bool) -> bool:
    """Whether ``response`` has the shape an answer of its endpoint has, as far as a replay and
    the accounting read it: head fields of their types, integer usage counts, and choices with an
    integer index, text (completions) or a message object (chat) whose role and content are text
    and whose tool calls are objects."""
    for name, kind in _HEAD_TYPES.items():
        if name in response and not isinstance(response[name], kind):
            return False
    usage = response.get("usage")
    if usage is not None and not (isinstance(usage, dict) and all(
            _int(usage[k]) for k in ("prompt_tokens", "completion_tokens", "total_tokens")
            if k in usage)):
        return False
    return all(_choice_well_formed(c, chat) for c in response["choices"])


def _choice_well_formed(choice: dict[str, Any], chat: bool) -> bool:
    if "index" in choice and not _int(choice["index"]):
        return False
    if not isinstance(choice.get("finish_reason"), str):
        return False
    if not chat:
        return isinstance(choice.get("text", ""), str)
    message = choice.get("message")
    if not isinstance(message, dict):
        return False
    if not isinstance(message.get("role", "assistant"), str):
        return False
    if not isinstance(message.get("content") or "", str):
        return False
    calls = message.get("tool_calls")
    return calls is None or (isinstance(calls, list) and all(isinstance(c, dict) for c in calls))


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

# What a streamed replay carries of each choice (of the answer: ``ANSWER_FIELDS``); any other
# field with a value would be lost on the way.
_STREAMED_CHOICE = frozenset({"index", "message", "text", "logprobs", "finish_reason",
                              "stop_reason"})  # fmt: skip


def streamable(response: dict[str, Any]) -> bool:
    """Whether ``replay_sse`` carries everything ``response`` says (unset fields are null)."""
    if set_beyond(response, ANSWER_FIELDS):
        return False
    return not any(set_beyond(choice, _STREAMED_CHOICE) for choice in response["choices"])


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
