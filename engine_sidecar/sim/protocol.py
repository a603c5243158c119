"""OpenAI request validation of the simulated server, with vLLM 0.32's rules and error shapes.

Rules: pure functions from a decoded body to a ``ParsedRequest`` or an ``ApiError``; no I/O. Errors
are rendered as vLLM renders them: ``{"error": {"message", "type", "param", "code"}}`` with ``type``
the exception class name vLLM reports (``BadRequestError``, ``NotFoundError``, ...) and ``code`` the
HTTP status.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Literal

import orjson

from engine_sidecar.sim.tokenizer import chat_prompt, encode
from proxy.fleet.tokenizer import PromptTokenizer

ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 413: "BadRequestError",
               429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}
MAX_LOGPROBS = 20
_MAX_CACHE_SALT = 128
_SALT_FORBIDDEN = frozenset("@/\\\x00")


class ApiError(Exception):
    """An error answered as vLLM answers it; ``status`` is the HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> bytes:
        err_type = ERROR_TYPES.get(self.status, "InternalServerError" if self.status >= 500
                                   else "BadRequestError")
        return orjson.dumps({"error": {"message": self.message, "type": err_type,
                                       "param": self.param, "code": self.status}})


Kind = Literal["chat", "completion"]


@dataclass(frozen=True)
class ParsedRequest:
    kind: Kind
    model: str
    prompt_ids: array[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    temperature: float
    seed: int | None
    priority: int
    ignore_eos: bool
    logprobs: int | None  # top alternatives wanted (0: only the chosen token); None: no logprobs
    cache_salt: str | None = None
    prompt_logprobs: int | None = None  # top tokens per prompt position (vLLM's field)
    return_token_ids: bool = False  # the answer's token ids in the response (non-streamed)
    allowed_token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Limits:
    model: str
    max_model_len: int
    priority_scheduling: bool
    # A real model's tokenizer (``SimEngineConfig.tokenizer``); None: the simulator's own.
    tokenizer: PromptTokenizer | None = None


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def _opt_int(body: dict[str, object], key: str, low: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{key} must be an integer", key)
    if low is not None and value < low:
        raise _bad(f"{key} must be at least {low}, got {value}.", key)
    return value


def _opt_bool(body: dict[str, object], key: str, default: bool = False) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(f"{key} must be a boolean", key)
    return value


def _temperature(body: dict[str, object]) -> float:
    value = body.get("temperature")
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise _bad("temperature must be a non-negative number", "temperature")
    return float(value)


def parse(kind: Kind, raw: bytes, limits: Limits) -> ParsedRequest:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _bad(f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise _bad("The request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != limits.model:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")
    prompt_ids = prompt_ids_of(kind == "chat", body, limits.tokenizer)
    stream = _opt_bool(body, "stream")
    _check_n(body)
    return ParsedRequest(
        kind=kind, model=limits.model, prompt_ids=prompt_ids,
        max_tokens=_max_tokens(kind, body, len(prompt_ids), limits),
        stream=stream, include_usage=_include_usage(body, stream),
        temperature=_temperature(body), seed=_opt_int(body, "seed"),
        priority=priority_of(body, limits), ignore_eos=_opt_bool(body, "ignore_eos"),
        logprobs=_logprobs(kind, body), cache_salt=cache_salt_of(body),
        prompt_logprobs=_prompt_logprobs(body, stream),
        return_token_ids=_opt_bool(body, "return_token_ids"),
        allowed_token_ids=_allowed(body),
    )


def _allowed(body: dict[str, object]) -> tuple[int, ...] | None:
    value = body.get("allowed_token_ids")
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise _bad("allowed_token_ids must be a non-empty list of token ids",
                   "allowed_token_ids")
    return tuple(value)


def _prompt_logprobs(body: dict[str, object], stream: bool) -> int | None:
    wanted = _opt_int(body, "prompt_logprobs")
    if wanted is None:
        return None
    if stream and wanted != 0:
        raise _bad("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    if wanted < 0 or wanted > MAX_LOGPROBS:
        raise _bad(f"`prompt_logprobs` must be in 0..{MAX_LOGPROBS}", "prompt_logprobs")
    return wanted


def cache_salt_of(body: dict[str, object]) -> str | None:
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise _bad("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    if len(salt) > _MAX_CACHE_SALT or any(c in _SALT_FORBIDDEN for c in salt):
        raise _bad("Parameter 'cache_salt' must be at most 128 characters and must not contain "
                   "'@', '/', '\\\\', or NUL.", "cache_salt")
    return salt


def _check_n(body: dict[str, object]) -> None:
    n = _opt_int(body, "n", low=1)
    if n is not None and n != 1:
        raise _bad("The simulated engine serves n=1 only", "n")


def prompt_ids_of(chat: bool, body: dict[str, object],
                  tokenizer: PromptTokenizer | None) -> array[int]:
    """The prompt's token ids, with the model's tokenizer when the engine has one."""
    if tokenizer is None:
        return _chat_ids(body) if chat else _completion_ids(body)
    if chat:
        _chat_ids(body)  # the same checks of the messages
    param = "messages" if chat else "prompt"
    ids = tokenizer.request_ids(chat, body)
    if ids is None:
        raise _bad("the prompt cannot be tokenized", param)
    low, high = (min(ids), max(ids)) if ids else (0, 0)
    if low < 0 or high >= tokenizer.vocab_size:  # refused in vLLM's words
        raise _bad(f"Token id {low if low < 0 else high} is out of vocabulary", param)
    return array("I", ids)


def _chat_ids(body: dict[str, object]) -> array[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _bad("each message must be an object with a string role", "messages")
    try:
        return encode(chat_prompt(messages))
    except ValueError as exc:
        raise _bad(str(exc), "messages") from None


def _completion_ids(body: dict[str, object]) -> array[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return encode(prompt)
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in prompt):
        return array("I", prompt)
    raise _bad("prompt must be a string, a list of token ids, or a one-element list of either",
               "prompt")


def _max_tokens(kind: Kind, body: dict[str, object], prompt_len: int, limits: Limits) -> int:
    max_len = limits.max_model_len
    if prompt_len >= max_len:
        raise _bad(
            f"This model's maximum context length is {max_len} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input messages.",
            "messages" if kind == "chat" else "prompt")
    wanted = _opt_int(body, "max_completion_tokens", low=1) if kind == "chat" else None
    if wanted is None:
        wanted = _opt_int(body, "max_tokens", low=1)
    if wanted is None:
        return max_len - prompt_len
    if wanted + prompt_len > max_len:
        raise _bad(
            f"'max_tokens' or 'max_completion_tokens' is too large: {wanted}. This model's maximum "
            f"context length is {max_len} tokens and your request has {prompt_len} input tokens "
            f"({wanted} > {max_len} - {prompt_len}).", "max_tokens")
    return wanted


def _include_usage(body: dict[str, object], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise _bad("Stream options can only be defined when `stream=True`.", "stream_options")
    if not isinstance(options, dict):
        raise _bad("stream_options must be an object", "stream_options")
    return _opt_bool(options, "include_usage")


def priority_of(body: dict[str, object], limits: Limits) -> int:
    # vLLM 0.32 accepts a priority on an fcfs engine and ignores it; so does the simulator.
    priority = _opt_int(body, "priority") or 0
    return priority if limits.priority_scheduling else 0


def _logprobs(kind: Kind, body: dict[str, object]) -> int | None:
    if kind == "chat":
        wanted = _opt_bool(body, "logprobs")
        top = _opt_int(body, "top_logprobs", low=0)
        if top is not None and top > 0 and not wanted:
            raise _bad("when using `top_logprobs`, `logprobs` must be set to true.",
                       "top_logprobs")
        if not wanted:
            return None
        count = top or 0
    else:
        completion_lp = _opt_int(body, "logprobs", low=0)
        if completion_lp is None:
            return None
        count = completion_lp
    if count > MAX_LOGPROBS:
        raise _bad(f"Requested logprobs of {count}, which is greater than max allowed: "
                   f"{MAX_LOGPROBS}", "logprobs")
    return count
