"""Which requests the response cache may answer, and the key an answer is stored under.

Rules (pure, no I/O):
- Only reproducible answers are cached: ``temperature == 0`` or an integer ``seed`` other than
  ``-1`` (vLLM reads ``-1`` as no seed), and ``n == 1``; never a request with
  ``kv_transfer_params`` or ``ec_transfer_params`` (its answer is this request's alone).
  Config can turn the cache off; a request can refuse it with ``Cache-Control``: ``no-store``
  (neither read nor write) or ``no-cache`` (not answered from the cache, but the fresh answer is
  stored).
- A streamed request whose answer the cache could never store bypasses it entirely, so it is not
  made to wait for an identical one either: per-token ``logprobs`` and tool calls cannot be merged
  from stream deltas (see ``recording``), nor the token ids ``return_token_ids`` asks for. The
  same requests without ``stream`` stay cacheable.
- The key leaves the transport fields out, so the cache answers only requests whose transport
  fields the engine would accept as they are: ``stream_options`` only on a stream, as an object of
  the two options vLLM knows with values it reads as booleans; no ``prompt_logprobs`` on a stream;
  no ``continuous_usage_stats`` (a replay carries the usage once, at the end). Anything else
  bypasses the cache, and the engine answers it (its 400, where it refuses).
- The key is an HMAC-SHA256 under a server-side secret over the tenant, the requested model, the
  endpoint and the whole canonical request minus what only shapes the transport (``stream``,
  ``stream_options``) or the scheduling (``priority``). Never a part of the prompt alone: one tenant
  must never be able to produce another tenant's key.
- Each field of the key is length-prefixed, so no two different (tenant, model, body) produce
  the same HMAC input.
- Canonical JSON: the top level's keys sorted and its integral floats written as integers (``0``
  and ``0.0`` are the same temperature); below the top level, exactly as sent (``canonical_body``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from proxy.core.config_checks import positive
from proxy.core.errors import ConfigError
from proxy.core.usage import FALSE_WORDS, TRUE_WORDS

CacheBackendName = Literal["memory", "redis"]
# Fields that change how an answer travels or when it runs, never what it says.
TRANSPORT_FIELDS = frozenset({"stream", "stream_options", "priority"})
# The key format's version: changed whenever the same request would be keyed differently, so
# that replicas of two versions sharing a Redis cache never read each other's entries for
# requests one of them tells apart (v2: only the top level is sorted and normalised).
_KEY_DOMAIN = b"kvproxy-response-cache-v2"
_EXACT_FLOAT_INTS = 2**53
_STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})


@dataclass(frozen=True)
class CacheConfig:
    """``[cache]``: the response cache."""

    enabled: bool = True
    backend: str = "memory"
    ttl_s: float = 300.0
    # In-process backend bounds; the Redis backend relies on TTLs and Redis' own maxmemory policy.
    max_entries: int = 4096
    max_bytes: int = 64 * 1024 * 1024
    # Larger answers are relayed but not stored (in either backend).
    max_entry_bytes: int = 1024 * 1024
    # HMAC secret. Empty with the memory backend: a random one per process. Replicas sharing a Redis
    # cache must share the secret (set KVPROXY_CACHE_SECRET).
    secret: str = field(default="", repr=False)
    # How long identical concurrent misses wait for the first one before going to an engine.
    single_flight_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.backend not in ("memory", "redis"):
            raise ConfigError("backend", "must be 'memory' or 'redis'")
        positive(self, "ttl_s", "single_flight_timeout_s")
        for name in ("max_entries", "max_bytes", "max_entry_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be >= 1")
        if self.backend == "redis" and self.enabled and len(self.secret) < 16:
            raise ConfigError(
                "secret",
                "must be at least 16 characters when backend = 'redis' (shared by replicas)",
            )

    @classmethod
    def from_mapping(cls, raw: Mapping[str, object], field_prefix: str) -> CacheConfig:
        from proxy.core.configload import build  # noqa: PLC0415 - keeps this module's import light

        return build(cls, dict(raw), field_prefix)


@dataclass(frozen=True)
class CachePolicy:
    """What the cache may do for one request; ``reason`` says why when it may do nothing."""

    read: bool
    write: bool
    reason: str

    @property
    def bypass(self) -> bool:
        return not (self.read or self.write)


def decide(body: Mapping[str, Any], cache_control: str | None, *, enabled: bool) -> CachePolicy:
    """The cache policy for a request ``body`` with the given ``Cache-Control`` header."""
    if not enabled:
        return CachePolicy(False, False, "disabled")
    directives = _directives(cache_control)
    if "no-store" in directives:
        return CachePolicy(False, False, "no_store")
    reason = (_irreproducible(body) or _transfer(body) or _unstorable_stream(body)
              or _unusual_transport(body))
    if reason:
        return CachePolicy(False, False, reason)
    if "no-cache" in directives:
        return CachePolicy(False, True, "no_cache")
    return CachePolicy(True, True, "")


def _directives(header: str | None) -> frozenset[str]:
    if not header:
        return frozenset()
    return frozenset(part.split("=", 1)[0].strip().lower() for part in header.split(","))


def _irreproducible(body: Mapping[str, Any]) -> str:
    n = body.get("n", 1)
    if n is not None and n != 1:
        return "n_not_1"
    if body.get("best_of") not in (None, 1):
        return "n_not_1"
    temperature = body.get("temperature")
    greedy = _is_number(temperature) and temperature == 0
    seed = body.get("seed")
    seeded = isinstance(seed, int) and not isinstance(seed, bool) and seed != -1
    return "" if greedy or seeded else "sampling"


def _transfer(body: Mapping[str, Any]) -> str:
    """A disaggregated prefill or encoder request: its answer names blocks the engine keeps for
    this request alone, for a while (vLLM's ``kv_transfer_params``), so it is never replayed."""
    if body.get("kv_transfer_params") is not None or body.get("ec_transfer_params") is not None:
        return "transfer"
    return ""


def _unstorable_stream(body: Mapping[str, Any]) -> str:
    """Why the cache would refuse a streamed answer to ``body``; "" when it may keep it."""
    if body.get("stream") is not True:
        return ""
    # Completions take a count (0 still returns the chosen token's logprob), chat a boolean.
    logprobs = body.get("logprobs")
    if (logprobs is not None and logprobs is not False) or body.get("top_logprobs") is not None:
        return "logprobs"
    if _offered(body, "tools", "tool_choice") or _offered(body, "functions", "function_call"):
        return "tools"
    if body.get("return_token_ids") not in (None, False):
        return "token_ids"
    return ""


def _unusual_transport(body: Mapping[str, Any]) -> str:
    """Why the cache must leave a request's transport fields to the engine; "" when it need not
    (see the rules: the key cannot tell these requests from ones the engine answers)."""
    options = body.get("stream_options")
    stream = body.get("stream") is True
    if options is not None and not (stream and isinstance(options, dict)):
        return "transport"  # vLLM: options only with a stream (an empty one it lets pass)
    if options:
        if not options.keys() <= _STREAM_OPTIONS or not all(
                v is None or _lax_bool(v) for v in options.values()):
            return "transport"
        if options.get("continuous_usage_stats") not in (None, False):
            return "transport"
    if stream and body.get("prompt_logprobs") is not None:
        return "transport"
    return ""


def _lax_bool(value: object) -> bool:
    """A value pydantic's lax mode surely reads as a boolean, as vLLM validates the stream
    options (a doubtful one is left to the engine: bypassing costs a hit, never a wrong answer)."""
    if isinstance(value, bool):
        return True
    if isinstance(value, int):
        return value in (0, 1)
    return isinstance(value, str) and value.lower() in TRUE_WORDS | FALSE_WORDS


def _offered(body: Mapping[str, Any], tools: str, choice: str) -> bool:
    """Tools the model may call: given, and not switched off with a choice of "none"."""
    return bool(body.get(tools)) and body.get(choice) != "none"


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def canonical_body(body: Mapping[str, Any]) -> bytes:
    """The request as the key sees it: transport fields dropped, the top level's keys sorted and
    its integral floats written as integers; everything below the top level exactly as sent.

    Only the top level is loosened: its fields are the request's parameters, which vLLM reads by
    name and as numbers (``0`` and ``0.0`` are the same temperature). Inside them order and
    spelling can change the answer: a JSON schema's property order is the order of the output's
    keys, and a template renders ``tools``, ``documents`` or ``chat_template_kwargs`` with their
    keys in order and ``2.0`` as ``2.0``."""
    kept = {k: _number(body[k]) for k in sorted(body) if k not in TRANSPORT_FIELDS}
    try:
        return orjson.dumps(kept)
    except TypeError:
        # Integers beyond 64 bits: orjson refuses them, the standard library does not (the
        # body's depth is bounded where it is parsed, ``server.max_json_depth``).
        return json.dumps(kept, separators=(",", ":")).encode()


def _number(value: Any) -> Any:
    if isinstance(value, float) and _integral(value):
        return int(value)
    return value


def _integral(value: float) -> bool:
    """A float that is exactly an integer (one an int holds without rounding)."""
    return value.is_integer() and abs(value) < _EXACT_FLOAT_INTS


def cache_key(
    secret: bytes, *, tenant: str, model: str, endpoint: str, body: Mapping[str, Any]
) -> str:
    """The HMAC-SHA256 (hex) a response for this request is stored under."""
    return KeyMaker(secret).key(tenant=tenant, model=model, endpoint=endpoint, body=body)


class KeyMaker:
    """``cache_key`` under one secret, the HMAC's key set up once: every request's key starts
    from a copy of it (measured faster than a new HMAC and than a one-shot ``hmac.digest`` of
    the joined fields, which sets the key up again for every request)."""

    def __init__(self, secret: bytes) -> None:
        self._base = hmac.new(secret, _KEY_DOMAIN, hashlib.sha256)

    def key(self, *, tenant: str, model: str, endpoint: str, body: Mapping[str, Any]) -> str:
        mac = self._base.copy()
        for part in (tenant.encode(), model.encode(), endpoint.encode(), canonical_body(body)):
            mac.update(len(part).to_bytes(8, "big"))
            mac.update(part)
        return mac.hexdigest()
