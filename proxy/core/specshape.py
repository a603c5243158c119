"""The client's answer for a speculative-first request, in the OpenAI shapes vLLM 0.32 sends.

Rules:
- Chat or completions, SSE or one JSON body, as the client asked; a streamed chat opens with a
  role chunk, each verified piece of text is one chunk, the last chunk carries ``finish_reason``,
  a usage chunk follows only when the client asked for it (``stream_options.include_usage``),
  and ``data: [DONE]`` ends the stream.
- ``usage`` counts what the target alone would have reported: the prompt's tokens and the
  answer's tokens (its EOS token included, as vLLM counts it). Who wrote which tokens is said in
  headers, not in ``usage``.
- Text is emitted only once it is final: a trailing replacement character (a UTF-8 sequence cut
  between tokens) is held back until the next tokens complete it, and dropped at the end of the
  answer, as vLLM's incremental detokenizer does (``visible``).
- Pure: bytes in, bytes out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"
_REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class Shape:
    chat: bool
    response_id: str
    created: int
    model: str


def _head(shape: Shape, obj: str) -> dict[str, Any]:
    return {"id": shape.response_id, "object": obj, "created": shape.created,
            "model": shape.model}


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion}


def role_chunk(shape: Shape) -> bytes:
    payload = _head(shape, "chat.completion.chunk")
    payload["choices"] = [{"index": 0, "delta": {"role": "assistant", "content": ""},
                           "logprobs": None, "finish_reason": None}]
    return _sse(payload)


def text_chunk(shape: Shape, text: str, finish: str | None) -> bytes:
    if shape.chat:
        payload = _head(shape, "chat.completion.chunk")
        choice: dict[str, Any] = {"index": 0, "delta": {"content": text} if text else {},
                                  "logprobs": None, "finish_reason": finish}
    else:
        payload = _head(shape, "text_completion")
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = None
    payload["choices"] = [choice]
    return _sse(payload)


def usage_chunk(shape: Shape, prompt: int, completion: int) -> bytes:
    payload = _head(shape, "chat.completion.chunk" if shape.chat else "text_completion")
    payload["choices"] = []
    payload["usage"] = usage(prompt, completion)
    return _sse(payload)


def error_event(message: str, err_type: str = "upstream_error") -> bytes:
    return _sse({"error": {"message": message, "type": err_type, "param": None, "code": None}})


def whole(shape: Shape, text: str, finish: str, prompt: int, completion: int) -> bytes:
    if shape.chat:
        payload = _head(shape, "chat.completion")
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None,
                                   "tool_calls": []}
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None}
    else:
        payload = _head(shape, "text_completion")
        choice = {"index": 0, "text": text, "logprobs": None}
    choice["finish_reason"] = finish
    choice["stop_reason"] = None
    payload["choices"] = [choice]
    payload["usage"] = usage(prompt, completion)
    return orjson.dumps(payload)


def visible(text: str) -> str:
    """The text vLLM shows for an answer whose detokenized text is ``text``."""
    return text.rstrip(_REPLACEMENT)


@dataclass
class Detok:
    """Turns the detokenized text of the whole answer so far into the part not yet sent."""

    sent: str = ""

    def delta(self, text: str) -> str:
        """The new text of ``text`` (the whole answer so far, detokenized)."""
        ready = visible(text)
        if not ready.startswith(self.sent):
            # Detokenization rewrote text already sent (a tokenizer's clean-up of spaces):
            # what was sent stands, and only what lies beyond it is added.
            ready = self.sent + ready[len(self.sent):]
        out = ready[len(self.sent):]
        self.sent = ready
        return out
