"""vLLM's token-in endpoint ``POST /inference/v1/generate``, as far as speculative-first uses it.

Rules:
- Served as vLLM 0.32 serves it with ``--enable-scale-out`` (else 403) and
  ``--enable-prompt-tokens-details`` (``usage.prompt_tokens_details.cached_tokens``): a JSON body
  ``{"token_ids": [...], "sampling_params": {...}}``, non-streamed, answered with the generated
  ``token_ids`` and, when asked, ``prompt_logprobs`` at the top level.
- ``sampling_params.skip_reading_prefix_cache`` defaults as in vLLM (true when prompt logprobs are
  asked for); set to false, the request reads the prefix cache and vLLM computes no logits for
  the cached positions: their entries hold whatever the buffer held. The simulator makes them
  deliberately wrong (rank 1 is token id 0), so a client that trusts them fails loudly.
- The top-level ``cache_salt`` keys the prompt's first block as on the OpenAI endpoints (so one
  tenant's verification never reads another's cached prefix) and ``priority`` orders it on a
  priority-scheduling engine, both checked as there.
- Only the sampling fields the simulator models are read; others are ignored.
"""

from __future__ import annotations

import time
import uuid
from array import array
from typing import Any

import orjson
from aiohttp import web

from engine_sidecar.sim.agreement import prompt_logprobs
from engine_sidecar.sim.engine import RequestStream, Sampling, SimEngine
from engine_sidecar.sim.protocol import ApiError, Limits, cache_salt_of, priority_of
from engine_sidecar.sim.responses import usage
from engine_sidecar.sim.scheduler import Status
from engine_sidecar.sim.tokenizer import TOKEN_IDS

PATH = "/inference/v1/generate"
_GARBAGE = {"0": {"logprob": 0.0, "rank": 1, "decoded_token": None}}


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def _token_ids(body: dict[str, Any], max_model_len: int) -> array[int]:
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise _bad("token_ids must be a non-empty list of token ids", "token_ids")
    if len(ids) >= max_model_len:
        raise _bad(f"The prompt has {len(ids)} tokens; the model's context is {max_model_len}",
                   "token_ids")
    return array("I", ids)


def _number(params: dict[str, Any], key: str, default: float) -> float:
    value = params.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise _bad(f"sampling_params.{key} must be a non-negative number", key)
    return float(value)


def _sampling(body: dict[str, Any], limits: Limits, workload: str | None
              ) -> tuple[Sampling, int | None]:
    params = body["sampling_params"]
    lp = params.get("prompt_logprobs")
    if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= 20):
        raise _bad("sampling_params.prompt_logprobs must be in 0..20", "prompt_logprobs")
    skip = params.get("skip_reading_prefix_cache")
    read = not skip if isinstance(skip, bool) else lp is None
    seed = params.get("seed")
    return Sampling(max_tokens=max(1, int(_number(params, "max_tokens", 16))),
                    temperature=_number(params, "temperature", 1.0),
                    seed=seed if isinstance(seed, int) else None, workload=workload,
                    read_cache=read, cache_salt=cache_salt_of(body),
                    priority=priority_of(body, limits)), lp


async def generate(request: web.Request, engine: SimEngine, limits: Limits) -> web.Response:
    if not engine.config.scale_out:
        raise ApiError(403, "Scale-out endpoints are disabled. Restart vllm serve with "
                       "--enable-scale-out to enable them.")
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise _bad(f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("sampling_params"), dict):
        raise _bad("sampling_params is required", "sampling_params")
    if body.get("model") not in (None, engine.model):
        raise ApiError(404, f"The model `{body.get('model')}` does not exist.", "model")
    ids = _token_ids(body, engine.config.max_model_len)
    workload = request.headers.get("X-Workload-Class", "")[:64] or None
    sampling, lp = _sampling(body, limits, workload)
    if not engine.fits(len(ids) + sampling.max_tokens):
        raise _bad("The request needs more KV-cache blocks than the engine has.", "max_tokens")
    stream = engine.submit("gen-" + uuid.uuid4().hex, ids, sampling)
    engine.in_flight += 1
    try:
        words: list[int] = []
        while not stream.finished:
            batch = await stream.next_words()
            if not batch:
                break
            words.extend(batch)
        if stream.request.status is not Status.FINISHED:
            raise ApiError(503, "The engine stopped before the request finished.")
        payload = _answer(engine, stream, words)
        if lp is not None:
            payload["prompt_logprobs"] = _prompt_logprobs(engine, ids, sampling, lp,
                                                          stream.cached_tokens)
        return web.Response(body=orjson.dumps(payload), content_type="application/json")
    finally:
        engine.in_flight -= 1
        stream.abort()


def _answer(engine: SimEngine, stream: RequestStream, words: list[int]) -> dict[str, Any]:
    return {
        "request_id": stream.public_id, "model": engine.model, "created": int(time.time()),
        "usage": usage(stream.prompt_tokens, len(words), stream.cached_tokens),
        "choices": [{"index": 0, "logprobs": None, "finish_reason": stream.finish_reason,
                     "stop_reason": None, "token_ids": [TOKEN_IDS[w] for w in words]}],
    }


def _prompt_logprobs(engine: SimEngine, ids: array[int], sampling: Sampling, k: int,
                     cached: int) -> list[Any]:
    begun, words = engine.answer_stream(ids, sampling)
    entries = prompt_logprobs(ids, begun, words, max(1, k))
    # No logits are computed for cached positions: entry j needs position j - 1's.
    return [e if j == 0 or j > cached else dict(_GARBAGE) for j, e in enumerate(entries)]
