"""Response bodies and SSE events shaped like vLLM 0.32's OpenAI server.

Rules: pure functions from a request's identity and its words to bytes. A streamed chat starts
with a role chunk (``delta: {"role": "assistant", "content": ""}``); every engine step that
produced words sends one chunk carrying all of them (several with speculative decoding, as vLLM
does); the chunk with the last words carries ``finish_reason``; with
``stream_options.include_usage`` a final chunk has empty ``choices`` and the usage;
``data: [DONE]`` ends the stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from engine_sidecar.sim.protocol import ApiError
from engine_sidecar.sim.tokenizer import TOKEN_TEXT as VOCAB
from engine_sidecar.sim.tokenizer import token_logprob, top_logprobs

DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Identity:
    kind: str  # "chat" | "completion"
    response_id: str
    created: int
    model: str
    logprobs: int | None


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
          ) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens,
                           "total_tokens": prompt_tokens + completion_tokens,
                           "completion_tokens": completion_tokens}
    out["prompt_tokens_details"] = (
        None if cached_tokens is None else {"cached_tokens": cached_tokens})
    return out


def _chat_logprobs(words: list[int], start: int, top: int) -> dict[str, Any]:
    content = []
    for offset, w in enumerate(words):
        pos = start + offset
        alternatives = [
            {"token": tok, "logprob": lp, "bytes": list(tok.encode())}
            for tok, lp in top_logprobs(w, pos, top)
        ]
        tok = VOCAB[w]
        content.append({"token": tok, "logprob": token_logprob(w, pos),
                        "bytes": list(tok.encode()), "top_logprobs": alternatives})
    return {"content": content}


def _completion_logprobs(words: list[int], start: int, top: int, text_offset: int
                         ) -> dict[str, Any]:
    tokens = [VOCAB[w] for w in words]
    return {
        "text_offset": [text_offset + 4 * i for i in range(len(words))],
        "token_logprobs": [token_logprob(w, start + i) for i, w in enumerate(words)],
        "tokens": tokens,
        "top_logprobs": [
            dict(top_logprobs(w, start + i, max(1, top))) for i, w in enumerate(words)
        ],
    }


def _logprobs(ident: Identity, words: list[int], start: int, text_offset: int) -> Any:
    if ident.logprobs is None:
        return None
    if ident.kind == "chat":
        return _chat_logprobs(words, start, ident.logprobs)
    return _completion_logprobs(words, start, ident.logprobs, text_offset)


def _head(ident: Identity, obj: str) -> dict[str, Any]:
    return {"id": ident.response_id, "object": obj, "created": ident.created, "model": ident.model}


def role_chunk(ident: Identity) -> bytes:
    payload = _head(ident, "chat.completion.chunk")
    payload["choices"] = [{"index": 0, "delta": {"role": "assistant", "content": ""},
                           "logprobs": None, "finish_reason": None}]
    return sse(payload)


def delta_chunk(ident: Identity, words: list[int], start: int, finish_reason: str | None
                ) -> bytes:
    """One step's words; ``start`` is the output position of the first of them."""
    text = "".join([VOCAB[w] for w in words])
    logprobs = _logprobs(ident, words, start, 4 * start)
    if ident.kind == "chat":
        payload = _head(ident, "chat.completion.chunk")
        choice: dict[str, Any] = {"index": 0, "delta": {"content": text} if text else {},
                                  "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        payload = _head(ident, "text_completion")
        choice = {"index": 0, "text": text, "logprobs": logprobs,
                  "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = None
    payload["choices"] = [choice]
    return sse(payload)


def usage_chunk(ident: Identity, prompt_tokens: int, completion_tokens: int) -> bytes:
    obj = "chat.completion.chunk" if ident.kind == "chat" else "text_completion"
    payload = _head(ident, obj)
    payload["choices"] = []
    payload["usage"] = usage(prompt_tokens, completion_tokens)
    return sse(payload)


def error_event(message: str, status: int = 500) -> bytes:
    """A mid-stream error, as vLLM sends one once the stream has started."""
    return b"data: " + ApiError(status, message).body() + b"\n\n"


def full_response(ident: Identity, words: list[int], finish_reason: str, prompt_tokens: int,
                  cached_tokens: int, *, token_ids: list[int] | None = None,
                  prompt_logprobs: list[Any] | None = None) -> bytes:
    """The whole answer; ``token_ids`` (``return_token_ids``) and ``prompt_logprobs`` are where
    vLLM puts them: in the choice, and for chat the prompt logprobs at the top level."""
    text = "".join([VOCAB[w] for w in words])
    logprobs = _logprobs(ident, words, 0, 0)
    if ident.kind == "chat":
        payload = _head(ident, "chat.completion")
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None,
                                   "tool_calls": [],
                   "reasoning_content": None}
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": logprobs}
    else:
        payload = _head(ident, "text_completion")
        choice = {"index": 0, "text": text, "logprobs": logprobs}
    choice["finish_reason"] = finish_reason
    choice["stop_reason"] = None
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if ident.kind == "chat":
        payload["prompt_logprobs"] = prompt_logprobs
    else:
        choice["prompt_logprobs"] = prompt_logprobs
    payload["choices"] = [choice]
    payload["usage"] = usage(prompt_tokens, len(words), cached_tokens)
    return orjson.dumps(payload)
