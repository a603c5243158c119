"""The fleet's shape: engines, the pools they form and the public model names (aliases) over them.

Rules:
- Names are plain: a pool's name is 1-64 letters, digits, ``.``, ``_`` or ``-`` (it appears in
  metrics labels, headers and logs); engine names are non-empty and unique across all pools, pool
  names unique, alias names unique.
- An engine's ``url`` is its http(s) base URL, kept without a trailing slash and never ending in
  ``/v1`` (the proxy appends the paths); ``metrics_url`` defaults to ``url + "/metrics"``. API keys
  are named by environment variable, never written here.
- A pool serves ``model`` (its own name) and every name in ``models``; a pool with an engine that
  publishes KV events must name its ``tokenizer``, since matching events needs token ids.
- An alias is in one of ``ALIAS_MODES``: ``route`` (one pool, or a chain of pools in degrade order)
  or ``speculative_first`` (a draft pool and a target pool); the settings of the other mode are
  refused, not ignored.
- Cross-checks run on the whole fleet (``check_pools``, ``check_aliases``): every pool an alias
  names exists; a model name served by several pools needs an alias of that name to order them,
  and one served by a single pool may not be an alias. Errors name the dotted field
  (``aliases[1].pool``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass

from proxy.core.config_checks import http_url as _http_url
from proxy.core.config_checks import positive as _positive
from proxy.core.config_checks import require as _require
from proxy.core.errors import ConfigError
from proxy.core.isolation import ISOLATION_MODES
from proxy.core.kv_config import EngineEvents

# The pool that ``tiering = true`` degrades to: the one meaning the old two-pool layout gave a name.
DRAFT_POOL = "draft"
# Pool names appear in metrics labels, headers and logs: short, plain and printable.
POOL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True)
class EngineConfig:
    name: str
    url: str
    metrics_url: str | None = None
    # Name of the environment variable that holds the engine's API key (vLLM ``--api-key``);
    # the key itself never sits in a config file.
    api_key_env: str | None = None
    # Where the engine publishes its KV events (precise routing); None: approximate only.
    kv_events: EngineEvents | None = None

    def __post_init__(self) -> None:
        _require(bool(self.name.strip()), "name", "must not be empty")
        # It is sent in the X-Engine header and written in logs and metric labels.
        _require(self.name.isprintable() and len(self.name) <= 256, "name",
                 "must be printable text (no line breaks or control characters), at most 256 "
                 "characters")
        _require(self.api_key_env is None or bool(self.api_key_env.strip()), "api_key_env",
                 "must name an environment variable")
        _require(_http_url(self.url), "url", "must be an http(s) URL")
        # A trailing slash would double up when paths are appended.
        object.__setattr__(self, "url", self.url.rstrip("/"))
        # The proxy appends /v1/...; a URL that already has it is the most common slip.
        _require(not self.url.endswith("/v1"), "url", "must be the base URL, without /v1")
        if self.metrics_url is None:
            object.__setattr__(self, "metrics_url", self.url + "/metrics")
        _require(_http_url(self.metrics_url or ""), "metrics_url", "must be an http(s) URL")


@dataclass(frozen=True)
class PoolConfig:
    """A pool of engines serving the same model names. ``model`` is the pool's own (primary)
    name; ``models`` lists every name its engines serve (LoRA adapters, aliases set with vLLM's
    ``--served-model-name``). Either may be given; ``model`` defaults to the first of ``models``."""

    name: str
    model: str = ""
    engines: tuple[EngineConfig, ...] = ()
    priority_scheduling: bool = False
    models: tuple[str, ...] = ()
    # "tenant": each tenant's requests carry their own engine cache_salt (no shared KV blocks
    # across tenants); "none": the engines' prefix cache is shared, as without kvproxy.
    isolation: str = "tenant"
    # The engines' tokenizer (a tokenizer.json, or a directory holding one and, for the chat
    # template, tokenizer_config.json): precise routing needs a prompt's token ids.
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        _require(
            POOL_NAME.fullmatch(self.name) is not None,
            "name",
            "must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit",
        )
        _require(
            self.isolation in ISOLATION_MODES,
            "isolation",
            f"must be one of {', '.join(ISOLATION_MODES)}",
        )
        _require(
            bool(self.model.strip()) or bool(self.models),
            "model",
            "is required (or list the names the engines serve in models = [...])",
        )
        for i, name in enumerate(self.models):
            _require(bool(name.strip()), f"models[{i}]", "must not be empty")
            _require(name not in self.models[:i], f"models[{i}]", f"duplicate model {name!r}")
        if not self.model.strip():
            object.__setattr__(self, "model", self.models[0])
        _require(len(self.engines) > 0, "engines", "must list at least one engine")
        _require(self.tokenizer is None or bool(self.tokenizer.strip()), "tokenizer",
                 "must be a path to tokenizer.json or to the directory holding it")
        publishing = [e.name for e in self.engines if e.kv_events is not None]
        if publishing and self.tokenizer is None:
            raise ConfigError("tokenizer", f"is required: engine {publishing[0]!r} publishes KV "
                                           "events, and matching them needs the prompt's token ids")

    @property
    def served(self) -> tuple[str, ...]:
        """Every model name the pool serves, its own ``model`` first."""
        return (self.model, *(m for m in self.models if m != self.model))


ALIAS_MODES: tuple[str, ...] = ("route", "speculative_first")
TEMPERATURE_POLICIES: tuple[str, ...] = ("target", "approximate")
VERIFY_MODES: tuple[str, ...] = ("cached", "prompt_logprobs")


@dataclass(frozen=True)
class AliasConfig:
    """A public model name for one pool (``pool``) or for a tier chain (``pools``, in degrade
    order). ``tiering = true`` on a single-pool alias is the two-pool form of a chain: it adds
    the pool called ``draft``. ``mode = "speculative_first"`` serves the name from two pools
    instead: the ``draft`` pool writes chunks of the answer, the ``target`` pool verifies them
    (``proxy.core.specfirst``; the settings below it apply in that mode only)."""

    name: str
    pool: str = ""
    tiering: bool = False
    pools: tuple[str, ...] = ()
    mode: str = "route"
    draft: str = ""
    target: str = ""
    # Most draft tokens per round; fewer while the draft mostly disagrees (min_chunk at least).
    chunk: int = 8
    min_chunk: int = 2
    # Sampled requests (temperature > 0): "target" serves them from the target pool alone;
    # "approximate" drafts them with the speculative-sampling test on top-k log-probabilities.
    temperature_policy: str = "target"
    # How the target verifies a chunk. "cached": vLLM's token-in endpoint reading the prefix
    # cache, so a round computes only what the last one did not (the target needs vLLM 0.32+
    # with --enable-scale-out --enable-prompt-tokens-details; without them the alias falls back
    # by itself). "prompt_logprobs": /v1/completions, which vLLM serves without reading the
    # prefix cache, so every round recomputes the whole prompt and answer so far.
    verify: str = "cached"
    # Longest a ready verification waits (seconds) for those of other answers still drafting
    # for the same target engine, so that they share one engine step (proxy.core.specbatch);
    # 0 sends each at once. 50 ms: on the benchmark (docs/benchmarks.md) it met the goals at
    # 0.5, 1 and 2 requests/s; 100 ms cost more latency than it saved.
    verify_window_s: float = 0.05
    # A tenant's traffic on this alias goes target-only for fallback_retry_s once more than this
    # share of its drafted tokens (over the last history_rounds rounds, once fallback_min_tokens
    # have been judged) disagreed with the target.
    fallback_rejection: float = 0.6
    fallback_min_tokens: int = 32
    fallback_retry_s: float = 30.0
    history_rounds: int = 64
    # Prompts longer than this (tokens) go to the target alone: each verification returns a
    # log-probability per prompt token.
    max_prompt_tokens: int = 16384
    # One draft or verification call, connect to last byte.
    leg_timeout_s: float = 60.0
    # Token ids on which the target stops (its EOS), when known; others are learned.
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _require(bool(self.name.strip()), "name", "must not be empty")
        _require(self.mode in ALIAS_MODES, "mode", f"must be one of {', '.join(ALIAS_MODES)}")
        if self.mode == "speculative_first":
            self._check_speculative()
            return
        _require(
            bool(self.pool) != bool(self.pools),
            "pool" if not self.pools else "pools",
            'give either pool = "name" or pools = ["first", "next", ...], not both'
            if self.pools
            else "is required (or give a tier chain as pools = [...])",
        )
        _require(
            not (self.tiering and self.pools),
            "tiering",
            "a pools = [...] chain already says where to degrade; remove tiering",
        )
        for i, pool in enumerate(self.pools):
            _require(pool not in self.pools[:i], f"pools[{i}]", f"{pool!r} is listed twice")
        # The other mode's settings are refused, not ignored: a route alias given a draft pool,
        # a chunk or a verify mode would silently do none of it.
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in _SPECULATIVE_ONLY:
            _require(getattr(self, name) == defaults[name], name,
                     'applies to mode = "speculative_first" only')

    def _check_speculative(self) -> None:
        _require(bool(self.draft), "draft", "is required in speculative_first mode")
        _require(bool(self.target), "target", "is required in speculative_first mode")
        _require(self.draft != self.target, "draft", "must differ from target")
        _require(not (self.pool or self.pools or self.tiering), "pool",
                 "speculative_first takes draft and target pools, not pool/pools/tiering")
        _require(1 <= self.chunk <= 64, "chunk", "must be in 1..64")
        _require(1 <= self.min_chunk <= self.chunk, "min_chunk", "must be in 1..chunk")
        _require(self.temperature_policy in TEMPERATURE_POLICIES, "temperature_policy",
                 f"must be one of {', '.join(TEMPERATURE_POLICIES)}")
        _require(0.0 <= self.verify_window_s <= 1.0, "verify_window_s", "must be in 0..1")
        _require(self.verify in VERIFY_MODES, "verify",
                 f"must be one of {', '.join(VERIFY_MODES)}")
        _require(0.0 <= self.fallback_rejection <= 1.0, "fallback_rejection", "must be in 0..1")
        _positive(self, "fallback_min_tokens", "history_rounds", "max_prompt_tokens",
                  "leg_timeout_s")
        _require(self.fallback_retry_s >= 0, "fallback_retry_s", "must be >= 0")
        _require(all(t >= 0 for t in self.eos_token_ids), "eos_token_ids", "must be >= 0")

    @property
    def speculative(self) -> bool:
        return self.mode == "speculative_first"

    def chain(self, configured: Sequence[str]) -> tuple[str, ...]:
        """The pools in degrade order, ``configured`` being the pool names that exist (a
        speculative-first alias: its target pool, which answers when nothing is drafted)."""
        if self.speculative:
            return (self.target,)
        if self.pools:
            return self.pools
        if self.tiering and self.pool != DRAFT_POOL and DRAFT_POOL in configured:
            return (self.pool, DRAFT_POOL)
        return (self.pool,)


# AliasConfig's fields that mean something in speculative_first mode only.
_SPECULATIVE_ONLY = (
    "draft", "target", "chunk", "min_chunk", "temperature_policy", "verify", "verify_window_s",
    "fallback_rejection", "fallback_min_tokens", "fallback_retry_s", "history_rounds",
    "max_prompt_tokens", "leg_timeout_s", "eos_token_ids",
)


def check_pools(pools: tuple[PoolConfig, ...]) -> None:
    seen_pools: set[str] = set()
    seen_engines: set[str] = set()
    for i, pool in enumerate(pools):
        _require(pool.name not in seen_pools, f"pools[{i}].name", f"duplicate pool {pool.name!r}")
        seen_pools.add(pool.name)
        for j, engine in enumerate(pool.engines):
            _require(
                engine.name not in seen_engines,
                f"pools[{i}].engines[{j}].name",
                f"duplicate engine name {engine.name!r}",
            )
            seen_engines.add(engine.name)


def _servers(pools: tuple[PoolConfig, ...]) -> dict[str, list[str]]:
    """Model name -> the pools serving it, in configuration order."""
    out: dict[str, list[str]] = {}
    for pool in pools:
        for model in pool.served:
            out.setdefault(model, []).append(pool.name)
    return out


def _alias_pools(alias: AliasConfig, where: str) -> list[tuple[str, str]]:
    """(field, pool name) of every pool an alias names."""
    if alias.speculative:
        return [(f"{where}.draft", alias.draft), (f"{where}.target", alias.target)]
    if alias.pools:
        return [(f"{where}.pools[{j}]", pool) for j, pool in enumerate(alias.pools)]
    return [(f"{where}.pool", alias.pool)]


def check_aliases(aliases: tuple[AliasConfig, ...], pools: tuple[PoolConfig, ...]) -> None:
    servers = _servers(pools)
    pool_names = [p.name for p in pools]
    names = {a.name for a in aliases}
    seen: set[str] = set()
    for i, alias in enumerate(aliases):
        where = f"aliases[{i}]"
        # A model name several pools serve is routed by an alias of that name (it says the
        # order); one that a single pool serves needs none, so an alias there is a collision.
        _require(
            len(servers.get(alias.name, ())) != 1,
            f"{where}.name",
            "collides with a pool's model name",
        )
        _require(alias.name not in seen, f"{where}.name", f"duplicate alias {alias.name!r}")
        seen.add(alias.name)
        for field_name, pool in _alias_pools(alias, where):
            _require(pool in pool_names, field_name, f"no pool {pool!r} configured")
        _require(
            not alias.tiering or DRAFT_POOL in pool_names,
            f"{where}.tiering",
            f"needs a pool named {DRAFT_POOL!r} to degrade to; with other pool names write "
            f'pools = ["{alias.pool}", "<smaller pool>"] instead of tiering = true',
        )
    for model, serving in servers.items():
        _require(
            len(serving) == 1 or model in names,
            "aliases",
            f"model {model!r} is served by pools {', '.join(serving)}: add an alias named "
            f"{model!r} with pools = [...] in the order to use them",
        )
