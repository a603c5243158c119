"""Configuration: one TOML file, then environment variables, then ``--set`` overrides.

Rules:
- Every setting lives in a frozen, typed dataclass; ``Config()`` / ``Config.default()`` is a working
  configuration without pools (the demo adds its own).
- Sources apply in order: TOML file, ``KVPROXY_<SECTION>_<KEY>`` environment variables, then
  ``--set section.key=value`` overrides. Environment variables and overrides reach scalar settings
  of the sections (nested tables included, e.g. ``admission.sheddable.shed_above``); pools and
  aliases are lists and are set in TOML only.
- Unknown keys are errors, so a typo never passes silently. Every error is a ``ConfigError`` whose
  ``field`` is the dotted path of the bad setting, e.g. ``pools[0].engines[1].url``.
- This module reads the file it is given and nothing else; it never looks at ``os.environ`` itself.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.core.cache_key import CacheConfig
from proxy.core.configload import build, parse_scalar, scalar_paths, set_path
from proxy.core.door_config import AuthConfig, LimitsConfig, RedisConfig
from proxy.core.errors import ConfigError
from proxy.core.isolation import ISOLATION_MODES
from proxy.core.kv_config import EngineEvents, KvEventsConfig

# The pool that ``tiering = true`` degrades to: the one meaning the old two-pool layout gave a name.
DRAFT_POOL = "draft"
# Pool names appear in metrics labels, headers and logs: short, plain and printable.
POOL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
POLICIES: tuple[str, ...] = ("round_robin", "least_load", "prefix_affinity", "expected_ttft")
PLACE_NEW: tuple[str, ...] = ("least_load", "prefill", "rendezvous")
ENV_PREFIX = "KVPROXY_"


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ConfigError(name, message)


def _positive(obj: object, *names: str) -> None:
    for name in names:
        _require(getattr(obj, name) > 0, name, "must be > 0")


def _http_url(value: str) -> bool:
    return value.startswith(("http://", "https://")) and len(value.split("://", 1)[1]) > 0


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 4 * 1024 * 1024
    drain_timeout_s: float = 30.0
    # Nesting levels a request body may have (the top-level object is level 1).
    max_json_depth: int = 64
    # The whole request head must arrive within this, counted from the connection's start or, on
    # a kept-alive connection, from the first byte of the next request.
    header_timeout_s: float = 10.0
    # The whole request body must arrive within this once the handler starts reading it (else 408).
    body_timeout_s: float = 30.0
    # How long an idle kept-alive client connection is kept open between requests.
    keepalive_timeout_s: float = 75.0
    # Allocations between two collections of the collector's youngest generation once serving
    # (the interpreter's default is 700, which under load is hundreds of collections a second).
    gc_young_threshold: int = 20_000

    def __post_init__(self) -> None:
        _require(0 <= self.port <= 65535, "port", "must be in 0..65535")
        # 0 would turn the collector off: reference cycles would then never be freed.
        young = self.gc_young_threshold
        _require(100 <= young <= 1_000_000, "gc_young_threshold", "must be in 100..1000000")
        _require(bool(self.host), "host", "must not be empty")
        _positive(
            self, "max_body_bytes", "header_timeout_s", "body_timeout_s", "keepalive_timeout_s"
        )
        _require(self.drain_timeout_s >= 0, "drain_timeout_s", "must be >= 0")
        # orjson refuses to write documents nested deeper than 254 levels.
        _require(2 <= self.max_json_depth <= 200, "max_json_depth", "must be in 2..200")


@dataclass(frozen=True)
class TelemetryConfig:
    interval_s: float = 0.2
    timeout_s: float = 0.15
    stale_after_s: float = 1.0
    unhealthy_after_failures: int = 3
    # A larger /metrics body is a failed scrape, its rest never read (vLLM's is tens of KB).
    max_metrics_bytes: int = 4 * 1024 * 1024

    def __post_init__(self) -> None:
        _positive(self, "interval_s", "timeout_s", "stale_after_s", "unhealthy_after_failures")
        _require(self.max_metrics_bytes >= 1024, "max_metrics_bytes", "must be >= 1024")
        # A scrape that may outlive its interval would pile up behind the next one.
        _require(self.timeout_s < self.interval_s, "timeout_s", "must be < telemetry.interval_s")
        _require(
            self.stale_after_s >= self.interval_s,
            "stale_after_s",
            "must be >= telemetry.interval_s",
        )


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = "expected_ttft"
    load_factor: float = 2.0
    # An engine carrying fewer requests than this is never over the bound (idle pools don't spill).
    min_load_bound: int = 2
    block_chars: int = 256
    # Blocks hashed per prompt at most (2048 x 256 characters: about 128k tokens, a long
    # context). A prompt's tail past it is never matched, so it would count as uncached on its
    # own home engine too and push long documents off the engine holding them.
    max_blocks: int = 2048
    # Depth (in blocks) of the chain hash that orders engines; deeper past a prefix most hold.
    affinity_blocks: int = 2
    # Recently routed block hashes remembered per engine (longest-prefix match); 0: no index.
    index_blocks: int = 16384
    # A remembered prefix attracts a request only if it covers at least this many blocks.
    min_match_blocks: int = 1
    # Where a request goes that shares nothing but a common prefix with what was routed before
    # (a new conversation): the engine with the least prompt work ahead of it ("prefill"), the
    # least loaded ("least_load"), or its rendezvous home ("rendezvous": load-blind within the
    # bound, the same on every replica).
    place_new: str = "prefill"
    seed: int = 0
    # Prompt tokens per character block without a tokenizer: block_chars / chars_per_token.
    chars_per_token: float = 4.0
    # expected_ttft's profile defaults, used until an engine's metrics give its own rates: prompt
    # tokens computed per second, one engine step's seconds (plus per running sequence), and the
    # prompt tokens one step computes at most (vLLM's max_num_batched_tokens).
    prefill_tokens_per_s: float = 12000.0
    decode_step_s: float = 0.02
    decode_seq_step_s: float = 0.00004
    chunk_tokens: int = 8192
    # Expected TTFTs within this fraction of the lowest are equal; the most cached engine wins.
    cost_tolerance: float = 0.1

    def __post_init__(self) -> None:
        _require(self.policy in POLICIES, "policy", f"must be one of {', '.join(POLICIES)}")
        _require(self.load_factor >= 1.0, "load_factor", "must be >= 1.0")
        _positive(self, "min_load_bound", "block_chars", "max_blocks")
        _positive(self, "affinity_blocks", "min_match_blocks")
        _require(self.index_blocks >= 0, "index_blocks", "must be >= 0")
        _require(self.place_new in PLACE_NEW, "place_new", f"must be one of {', '.join(PLACE_NEW)}")
        _require(self.seed >= 0, "seed", "must be >= 0")
        _positive(self, "chars_per_token", "prefill_tokens_per_s", "decode_step_s",
                  "chunk_tokens")
        _require(self.decode_seq_step_s >= 0.0, "decode_seq_step_s", "must be >= 0")
        _require(0.0 <= self.cost_tolerance <= 1.0, "cost_tolerance", "must be in 0..1")


@dataclass(frozen=True)
class ClassThreshold:
    shed_above: float
    admit_below: float

    def __post_init__(self) -> None:
        _require(0.0 <= self.shed_above <= 2.0, "shed_above", "must be in 0..2 (KV usage fraction)")
        _require(self.admit_below >= 0.0, "admit_below", "must be >= 0")
        _require(self.admit_below <= self.shed_above, "admit_below", "must be <= shed_above")


@dataclass(frozen=True)
class AdmissionConfig:
    sheddable: ClassThreshold = ClassThreshold(0.85, 0.75)
    standard: ClassThreshold = ClassThreshold(0.95, 0.90)
    # Above 1.0 means never by threshold: critical work is shed only when nothing can take it.
    critical: ClassThreshold = ClassThreshold(1.01, 1.0)
    retry_after_s: int = 2
    degrade_to_draft: bool = True

    def __post_init__(self) -> None:
        _require(self.retry_after_s >= 1, "retry_after_s", "must be >= 1")


@dataclass(frozen=True)
class PressureConfig:
    """The KV overcommit guard (``proxy.core.pressure``); counts are in scrape intervals."""

    enabled: bool = True
    # KV usage is projected this many scrape intervals ahead at its current growth rate.
    horizon_scrapes: float = 3.0
    # Growth and preemptions are measured over this many of the latest scrape intervals.
    window_scrapes: int = 5
    # Preemptions in this many intervals of the window close the engine to standard work too.
    escalate_scrapes: int = 2
    # A closing caused by preemptions lasts this many intervals after the last preemption.
    hold_scrapes: int = 10
    # Count the KV this proxy's in-flight requests will still take (prompt not yet computed and
    # output still to come) on top of the engine's reported usage (``proxy.core.commitment``).
    reserve_output: bool = True
    # A pool's expected answer length: the mean completion tokens of its last ``output_window``
    # answers; ``prior_output_tokens`` until ``output_min_samples`` answers are known.
    output_window: int = 256
    output_min_samples: int = 16
    prior_output_tokens: int = 512
    # Marks for committed KV (a forecast of the engine's peak, ``proxy.commitment``), a fraction of
    # its capacity. Standard work is committed up to the capacity itself: the forecast counts no
    # block freed before the peak by a request that ends first, so it stands above the peak the
    # engine reaches, and what those requests free is the room left to critical work, never
    # closed. Sheddable work stops a tenth of the capacity earlier: room kept for a burst of
    # standard and critical requests while the sheddable ones already sent run to their end.
    committed_sheddable: ClassThreshold = ClassThreshold(0.90, 0.85)
    committed_standard: ClassThreshold = ClassThreshold(1.00, 0.95)
    # Holding (``proxy.core.holding``): a standard or sheddable request refused for load while
    # this proxy has answers in flight on the pool waits up to this long for room instead of
    # being refused at once; 0: refused at once. Kept short on purpose: the wait adds to the
    # request's time to first token, and under sustained overload a longer queue only turns
    # refused requests into late ones (and late work still takes the room of timely work). One
    # second for interactive (standard) work, a few (two ``admission.retry_after_s``) for
    # background (sheddable) work; a client's own deadline (``X-Request-Timeout`` / ``timeout``)
    # shortens either.
    hold_standard_s: float = 1.0
    hold_sheddable_s: float = 4.0
    # A standard request that only the commitment forecast still refuses at the end of its hold
    # is admitted where the engine's own figures (KV usage, its projection, preemptions) leave
    # room. Off by default: measured on the overcommit benchmark, the forecast is close to the
    # peak the engines reach rather than far above it, and letting standard work past it brought
    # back preemptions (13 to 16 per run against 0 to 1) without serving more of it in time.
    pace_standard: bool = False
    # Requests held at once per pool; one more is refused at once (``hold_queue_full``).
    hold_max_requests: int = 256

    def __post_init__(self) -> None:
        for name in ("hold_standard_s", "hold_sheddable_s"):
            value = getattr(self, name)
            _require(0 <= value <= 300, name, "must be in 0..300 seconds")
        _require(self.hold_max_requests >= 0, "hold_max_requests", "must be >= 0")
        _require(self.horizon_scrapes >= 0, "horizon_scrapes", "must be >= 0")
        _require(self.window_scrapes >= 2, "window_scrapes", "must be >= 2")
        _require(self.escalate_scrapes >= 1, "escalate_scrapes", "must be >= 1")
        _require(self.escalate_scrapes <= self.window_scrapes, "escalate_scrapes",
                 "must be <= pressure.window_scrapes")
        _require(self.hold_scrapes >= 0, "hold_scrapes", "must be >= 0")
        _require(self.output_window >= 1, "output_window", "must be >= 1")
        _require(1 <= self.output_min_samples <= self.output_window, "output_min_samples",
                 "must be in 1..pressure.output_window")
        _require(self.prior_output_tokens >= 1, "prior_output_tokens", "must be >= 1")
        _require(self.committed_sheddable.shed_above <= self.committed_standard.shed_above,
                 "committed_sheddable", "must close no later than committed_standard "
                 "(shed_above <= pressure.committed_standard.shed_above)")


@dataclass(frozen=True)
class UpstreamConfig:
    connect_timeout_s: float = 2.0
    first_byte_timeout_s: float = 60.0
    # A non-streamed answer arrives whole, only once generated: its budget covers the generation.
    response_timeout_s: float = 600.0
    idle_timeout_s: float = 60.0
    # Requests open at once from this proxy process to one engine. An engine at the limit is not
    # eligible for routing; a pool whose engines are all at it sheds at once (503,
    # ``engine_connections_full``). Well above vLLM's own ``max_num_seqs`` (256..1024 by GPU) so
    # that excess work queues in the engine's waiting queue, which the proxy sees and routes by.
    max_connections_per_engine: int = 2048
    retries: int = 1

    def __post_init__(self) -> None:
        _positive(
            self,
            "connect_timeout_s",
            "first_byte_timeout_s",
            "response_timeout_s",
            "idle_timeout_s",
            "max_connections_per_engine",
        )
        _require(0 <= self.retries <= 3, "retries", "must be in 0..3")


@dataclass(frozen=True)
class BreakerConfig:
    failure_threshold: int = 3
    open_s: float = 5.0
    half_open_probes: int = 1

    def __post_init__(self) -> None:
        _positive(self, "failure_threshold", "open_s", "half_open_probes")


@dataclass(frozen=True)
class OutlierConfig:
    """Outlier detection (``proxy.core.outlier``): eject an engine that fails where its pool
    succeeds."""

    enabled: bool = True
    # Failures in a row (timeouts, connect failures, 5xx other than 503, broken streams).
    consecutive_failures: int = 5
    # The rest of the pool must succeed this often in its recent exchanges for an engine to be
    # an outlier: a pool that fails alike (a hot fleet) is never ejected.
    min_pool_success_rate: float = 0.8
    # "Recent": an engine's last ``window_requests`` results, none older than ``window_s``.
    window_s: float = 300.0
    window_requests: int = 100
    # Success-rate ejection: below mean - factor * stdev of the pool's rates.
    success_rate_min_requests: int = 20
    success_rate_min_engines: int = 5
    success_rate_stdev_factor: float = 1.9
    interval_s: float = 1.0
    base_ejection_s: float = 30.0
    max_ejection_s: float = 300.0
    max_ejection_percent: int = 50

    def __post_init__(self) -> None:
        _positive(self, "consecutive_failures", "window_s", "window_requests")
        _require(self.interval_s >= 0, "interval_s", "must be >= 0")
        _positive(self, "success_rate_min_requests", "success_rate_min_engines")
        _positive(self, "success_rate_stdev_factor", "base_ejection_s")
        _require(0.0 <= self.min_pool_success_rate <= 1.0, "min_pool_success_rate",
                 "must be in 0..1")
        _require(self.max_ejection_s >= self.base_ejection_s, "max_ejection_s",
                 "must be >= outlier.base_ejection_s")
        _require(1 <= self.max_ejection_percent <= 100, "max_ejection_percent", "must be in 1..100")


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


ACCESS_FORMATS: tuple[str, ...] = ("json", "logfmt")


@dataclass(frozen=True)
class SharingConfig:
    """Routing state shared between proxy processes (``proxy.core.sharing``): through Redis
    between replicas when ``[redis] url`` is set, else through the parent's hub between the
    workers of one ``kvproxy serve --workers N``; a lone process shares nothing."""

    enabled: bool = True
    # Dispatches are batched and published this often; the request path does no I/O for it.
    interval_s: float = 0.025
    # Another process's in-flight counts hold this long after its last message.
    ttl_s: float = 2.0
    # Dispatches one process publishes per interval at most (more are dropped and counted).
    max_batch: int = 1024
    # Messages kept in the Redis stream (approximately; older ones are trimmed).
    stream_len: int = 10000
    # Spread the picks that other processes' unseen dispatches could have taken too, at random
    # (``proxy.core.spread``); off: every process ranks deterministically on the shared view.
    spread: bool = True
    # With Redis and a live peer, the part of each routing decision that depends on the other
    # replicas' pending prompt work is made in Redis, one decision after another
    # (``proxy.core.claims``); off: every replica decides on its own view alone.
    decisions: bool = True
    # How long a request waits for that decision before deciding locally (spread included).
    decision_timeout_s: float = 0.005

    def __post_init__(self) -> None:
        _positive(self, "interval_s", "ttl_s", "max_batch", "stream_len", "decision_timeout_s")
        _require(self.decision_timeout_s <= 1.0, "decision_timeout_s", "must be <= 1.0")
        _require(self.interval_s <= 1.0, "interval_s", "must be <= 1.0")
        _require(self.ttl_s >= 4 * self.interval_s, "ttl_s", "must be >= 4 * sharing.interval_s")


@dataclass(frozen=True)
class LogConfig:
    """The access log (``proxy.observe.accesslog``): on or off, and its line format."""

    access: bool = False
    access_format: str = "json"

    def __post_init__(self) -> None:
        ok = self.access_format in ACCESS_FORMATS
        _require(ok, "access_format", "must be 'json' or 'logfmt'")


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    pressure: PressureConfig = field(default_factory=PressureConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    outlier: OutlierConfig = field(default_factory=OutlierConfig)
    pools: tuple[PoolConfig, ...] = ()
    aliases: tuple[AliasConfig, ...] = ()
    auth: AuthConfig = field(default_factory=AuthConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    log: LogConfig = field(default_factory=LogConfig)
    sharing: SharingConfig = field(default_factory=SharingConfig)
    kv_events: KvEventsConfig = field(default_factory=KvEventsConfig)

    def __post_init__(self) -> None:
        _check_pools(self.pools)
        _check_aliases(self.aliases, self.pools)

    @classmethod
    def default(cls) -> Config:
        return cls()

    def pool(self, name: str) -> PoolConfig | None:
        """The pool called ``name``, if configured."""
        return next((p for p in self.pools if p.name == name), None)


def _check_pools(pools: tuple[PoolConfig, ...]) -> None:
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


def _check_aliases(aliases: tuple[AliasConfig, ...], pools: tuple[PoolConfig, ...]) -> None:
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


# --- loading -------------------------------------------------------------------------------------

SCALAR_SECTIONS: tuple[str, ...] = (
    "server",
    "telemetry",
    "routing",
    "admission",
    "pressure",
    "upstream",
    "breaker",
    "outlier",
    "auth",
    "cache",
    "redis",
    "limits",
    "log",
    "sharing",
    "kv_events",
)


def load_config(path: str | None, env: Mapping[str, str], overrides: Sequence[str]) -> Config:
    """Read ``path`` (if any), apply ``env`` and ``overrides`` and validate the result."""
    data: dict[str, Any] = _read_toml(path) if path else {}
    paths = scalar_paths(Config, SCALAR_SECTIONS)
    for dotted, raw in _env_settings(env, paths):
        set_path(data, dotted, parse_scalar(raw, paths[dotted], dotted))
    for item in overrides:
        dotted, raw = _split_override(item)
        if dotted not in paths:
            raise ConfigError(dotted, "unknown setting (use --set section.key=value)")
        set_path(data, dotted, parse_scalar(raw, paths[dotted], dotted))
    return build(Config, data, "")


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError("", f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", f"{path}: invalid TOML: {exc}") from None


def _env_settings(env: Mapping[str, str], paths: Mapping[str, type]) -> list[tuple[str, str]]:
    by_env = {ENV_PREFIX + p.replace(".", "_").upper(): p for p in paths}
    sections = {ENV_PREFIX + s.upper() + "_" for s in SCALAR_SECTIONS}
    found: list[tuple[str, str]] = []
    for name in sorted(env):
        if name in by_env:
            found.append((by_env[name], env[name]))
        elif any(name.startswith(s) for s in sections):
            # KVPROXY_<SECTION>_... with a section we own: a typo, not someone else's variable.
            raise ConfigError(name, "unknown environment setting")
    return found


def _split_override(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(item, "override must look like section.key=value")
    return key, value.strip()
