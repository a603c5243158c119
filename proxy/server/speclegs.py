"""The engine calls of a speculative-first answer: render, draft, verify, ask, detokenize.

Rules:
- A ``Leg`` is one engine of one pool, kept for the whole answer: every round's prompt extends
  the last one, so the engine that computed it holds it in its prefix cache.
- Each call is a dispatch like any other: it must be allowed by the engine's breaker and under
  ``upstream.max_connections_per_engine``, it is counted in the engine's in-flight state until it
  settles, and its outcome feeds the breaker and the outlier detector. A 4xx is the request's
  fault (neutral for the engine), a 429/503 backpressure, any other failure the engine's.
- Bodies are JSON both ways and bounded (``MAX_ANSWER_BYTES``); one timeout covers a whole call.
  Redirects are never followed. Library exceptions become ``LegFailed`` here, once, naming the
  engine by its configured name only.
- Cancellation (the client went away) closes the engine's connection, so the engine aborts; it is
  re-raised, always.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from proxy.core.breaker import Outcome, classify_status
from proxy.core.errors import KvproxyError, UpstreamError
from proxy.core.jsondoc import json_object
from proxy.core.specfirst import cached_covers
from proxy.fleet.engines import Engine
from proxy.fleet.upstream import DATA_POST, translate
from proxy.server.context import ShellContext

# A verification answer holds one log-probability entry per prompt token: ~100 bytes each.
MAX_ANSWER_BYTES = 64 * 1024 * 1024
Entry = Mapping[str, Any] | None


class LegFailed(UpstreamError):
    """A draft or target call failed; ``client_fault`` when the engine refused the request
    itself (4xx: retrying elsewhere would not help)."""

    def __init__(self, message: str, *, client_fault: bool = False, status: int = 502,
                 detail: str | None = None) -> None:
        super().__init__(message)
        self.client_fault = client_fault
        self.upstream_status = status
        self.detail = detail  # the engine's own words, for a refusal (cut to ``_DETAIL_CHARS``)


@dataclass(frozen=True)
class Drafted:
    tokens: tuple[int, ...]
    finish: str
    entries: tuple[Entry, ...] = ()  # the draft's own top-k per token (approximate mode)


@dataclass(frozen=True)
class Verified:
    entries: tuple[Entry, ...]  # the target's prompt logprobs at the drafted positions
    bonus: int | None  # the token the target generated after the whole chunk
    bonus_finish: str | None


class Leg:
    def __init__(self, ctx: ShellContext, engine: Engine, model: str, headers: dict[str, str],
                 timeout_s: float) -> None:
        self.ctx = ctx
        self.engine = engine
        self.model = model
        self._headers = headers
        self._timeout_s = timeout_s

    @property
    def name(self) -> str:
        return self.engine.name

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` (the model filled in) and return the engine's JSON object."""
        engine, now = self.engine, self.ctx.clock()
        if engine.full(self.ctx.cfg.upstream.max_connections_per_engine) or \
                not engine.allows(now):
            raise LegFailed(f"engine {engine.name} cannot take a request now")
        ticket = engine.state.on_dispatch(now, 0.0)
        try:
            return await self._exchange(path, {"model": self.model, **body}, ticket, now)
        finally:
            engine.state.on_settle(ticket)

    async def _exchange(self, path: str, body: dict[str, Any], ticket: int,
                        sent_at: float) -> dict[str, Any]:
        engine = self.engine
        headers = self._headers | engine.auth if engine.auth else self._headers
        try:
            async with asyncio.timeout(self._timeout_s):
                resp = await self.ctx.session.post(engine.cfg.url + path,
                                                   data=orjson.dumps(body), headers=headers,
                                                   **DATA_POST)
                try:
                    engine.state.on_first_byte(ticket, self.ctx.clock())
                    raw = await _read(resp)
                finally:
                    resp.close()
        except asyncio.CancelledError:
            self._record(Outcome.CLIENT_ERROR, sent_at)
            raise
        except (TimeoutError, aiohttp.ClientError) as exc:
            self._record(Outcome.FAILURE, sent_at)
            raise LegFailed(translate(exc, engine.name, "speculative_first").message) from None
        return self._judge(resp.status, raw, sent_at)

    def _judge(self, status: int, raw: bytes, sent_at: float) -> dict[str, Any]:
        name = self.engine.name
        self._record(classify_status(status), sent_at)
        if status != 200:
            refused = 400 <= status < 500 and status != 429
            raise LegFailed(f"engine {name} answered HTTP {status}", client_fault=refused,
                            status=status, detail=_engine_message(raw) if refused else None)
        data = json_object(raw)
        if data is None:
            self._record(Outcome.FAILURE, sent_at)
            raise LegFailed(f"engine {name} sent a malformed answer")
        return data

    def _record(self, outcome: Outcome, sent_at: float) -> None:
        metrics = self.ctx.metrics
        for out in self.engine.record(outcome, self.ctx.clock(), None, sent_at):
            metrics.outlier_ejections_by(out.pool, out.engine, out.reason).inc()


_DETAIL_CHARS = 1000


def _engine_message(raw: bytes) -> str | None:
    """The message of an engine's OpenAI-shaped error body (``{"error": {"message": ...}}``, or
    vLLM's older ``{"message": ...}``), cut to ``_DETAIL_CHARS``; None when there is none."""
    doc = json_object(raw)
    if doc is None:
        return None
    inner = doc.get("error")
    message = inner.get("message") if isinstance(inner, dict) else doc.get("message")
    return message[:_DETAIL_CHARS] if isinstance(message, str) and message else None


async def _read(resp: aiohttp.ClientResponse) -> bytes:
    body = bytearray()
    async for chunk in resp.content.iter_any():
        body += chunk
        if len(body) > MAX_ANSWER_BYTES:
            raise aiohttp.ClientPayloadError("answer too large")
    return bytes(body)


# --- the calls ---------------------------------------------------------------------------------


def _choice(data: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        raise LegFailed(f"engine {name} sent an answer without choices")
    return choices[0]


def _ids(value: object, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise LegFailed(f"engine {name} sent no token ids")
    return tuple(value)


async def render(leg: Leg, body: dict[str, Any]) -> tuple[int, ...]:
    """The prompt's token ids, as the engine's ``/tokenize`` renders it (chat template applied
    to ``messages`` with the generation prompt; a completions ``prompt`` with special tokens)."""
    data = await leg.post("/tokenize", body)
    return _ids(data.get("tokens"), leg.name)


async def detokenize(leg: Leg, ids: Sequence[int]) -> str:
    if not ids:
        return ""
    data = await leg.post("/detokenize", {"tokens": list(ids)})
    text = data.get("prompt")
    if not isinstance(text, str):
        raise LegFailed(f"engine {leg.name} sent no text")
    return text


def _sampling(temperature: float, extra: Mapping[str, Any]) -> dict[str, Any]:
    return {"temperature": temperature, **extra}


async def draft(leg: Leg, ids: Sequence[int], n: int, *, temperature: float,
                extra: Mapping[str, Any], top_k: int = 0) -> Drafted:
    """Up to ``n`` tokens after ``ids``; with ``top_k``, the draft's own top-k per token."""
    body: dict[str, Any] = {"prompt": list(ids), "max_tokens": n, "return_token_ids": True,
                            "stream": False, **_sampling(temperature, extra)}
    if top_k:
        body |= {"logprobs": top_k, "return_tokens_as_token_ids": True}
    choice = _choice(await leg.post("/v1/completions", body), leg.name)
    tokens = _ids(choice.get("token_ids"), leg.name)
    entries = _draft_entries(choice.get("logprobs"), len(tokens)) if top_k else ()
    return Drafted(tokens, str(choice.get("finish_reason") or "length"), entries)


def _draft_entries(logprobs: object, n: int) -> tuple[Entry, ...]:
    """Completions ``top_logprobs`` ({"token_id:<id>": logprob}) as prompt-logprob entries."""
    tops = logprobs.get("top_logprobs") if isinstance(logprobs, Mapping) else None
    if not isinstance(tops, list):
        return (None,) * n
    out: list[Entry] = []
    for top in tops[:n]:
        entry: dict[str, Any] = {}
        if isinstance(top, Mapping):
            ranked = sorted(top.items(), key=lambda kv: -float(kv[1]))
            for rank, (key, lp) in enumerate(ranked, start=1):
                entry[str(key).removeprefix("token_id:")] = {"logprob": lp, "rank": rank}
        out.append(entry or None)
    return (*out, *(None,) * (n - len(out)))


async def verify(leg: Leg, ids: Sequence[int], n_draft: int, *, temperature: float,
                 extra: Mapping[str, Any], top_k: int = 1) -> Verified:
    """The target's log-probabilities at the last ``n_draft`` positions of ``ids`` (one prefill
    pass) and the one token it generates after them. vLLM reads no prefix cache for a request
    with ``prompt_logprobs``: the whole of ``ids`` is computed again (``verify_cached`` is not)."""
    body: dict[str, Any] = {"prompt": list(ids), "max_tokens": 1, "prompt_logprobs": top_k,
                            "return_token_ids": True, "stream": False,
                            **_sampling(temperature, extra)}
    choice = _choice(await leg.post("/v1/completions", body), leg.name)
    return _verified(leg, choice.get("prompt_logprobs"), choice, len(ids), n_draft)


class NoCachedVerify(Exception):
    """The target does not serve cache-reading verification (vLLM without ``--enable-scale-out``
    or ``--enable-prompt-tokens-details``, or not vLLM 0.32+)."""


GENERATE = "/inference/v1/generate"
_SAMPLING_FIELDS = ("top_p", "top_k", "min_p", "seed", "skip_special_tokens")


async def verify_cached(leg: Leg, ids: Sequence[int], n_draft: int, *, temperature: float,
                        extra: Mapping[str, Any], top_k: int = 1) -> Verified | None:
    """``verify`` through vLLM's token-in endpoint with the prefix cache read: only the positions
    past the cached part are computed (None: the answer cannot be used, because the cache covered
    a drafted position or vLLM could not serialise the uncomputed ones; ``NoCachedVerify``: the
    endpoint is not there)."""
    params = {"max_tokens": 1, "temperature": temperature, "prompt_logprobs": top_k,
              "skip_reading_prefix_cache": False, "detokenize": False,
              **{k: v for k, v in extra.items() if k in _SAMPLING_FIELDS}}
    body: dict[str, Any] = {"token_ids": list(ids), "sampling_params": params,
                            **{k: v for k, v in extra.items() if k in ("priority", "cache_salt")}}
    try:
        data = await leg.post(GENERATE, body)
    except LegFailed as exc:
        if exc.upstream_status in (403, 404, 405):
            raise NoCachedVerify(f"engine {leg.name} answered HTTP {exc.upstream_status}") from None
        if exc.upstream_status == 400:
            # vLLM fills the uncomputed (cached) positions with whatever its buffer held and
            # may then fail to serialise them ("Out of range float values"): the request was
            # not at fault, the cache-free verification answers it (or refuses it in turn).
            return None
        raise
    usage = data.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, Mapping) else None
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    if not isinstance(cached, int) or isinstance(cached, bool):
        raise NoCachedVerify(f"engine {leg.name} does not report cached prompt tokens")
    if not cached_covers(len(ids), n_draft, cached):
        return None
    return _verified(leg, data.get("prompt_logprobs"), _choice(data, leg.name), len(ids), n_draft)


def _verified(leg: Leg, lps: object, choice: Mapping[str, Any], n_ids: int, n_draft: int
              ) -> Verified:
    if not isinstance(lps, list) or len(lps) != n_ids:
        raise LegFailed(f"engine {leg.name} sent no prompt_logprobs for the draft")
    entries = tuple(e if isinstance(e, Mapping) else None for e in lps[n_ids - n_draft:])
    generated = _ids(choice.get("token_ids"), leg.name)
    finish = choice.get("finish_reason")
    return Verified(entries, generated[0] if generated else None,
                    finish if isinstance(finish, str) else None)


async def stops_on(leg: Leg, ids: Sequence[int], token: int,
                   extra: Mapping[str, Any]) -> bool:
    """Whether the target stops on ``token`` after ``ids``: it is asked to generate exactly that
    token (``allowed_token_ids``) and says how it finished. It carries the pool's cache salt and
    priority (``extra``) as every call with the answer's context does."""
    body: dict[str, Any] = {"prompt": list(ids), "max_tokens": 1, "temperature": 0,
                            "allowed_token_ids": [token], "return_token_ids": True,
                            "stream": False,
                            **{k: v for k, v in extra.items() if k in ("priority", "cache_salt")}}
    choice = _choice(await leg.post("/v1/completions", body), leg.name)
    got = _ids(choice.get("token_ids"), leg.name)
    if got[:1] != (token,):
        raise LegFailed(f"engine {leg.name} did not honour allowed_token_ids")
    return choice.get("finish_reason") == "stop" and choice.get("stop_reason") is None


def is_client_fault(exc: KvproxyError) -> bool:
    return isinstance(exc, LegFailed) and exc.client_fault
