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

import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from proxy.cache_key import CacheConfig
from proxy.configload import build, parse_scalar, scalar_paths, set_path
from proxy.door_config import AuthConfig, LimitsConfig, RedisConfig
from proxy.errors import ConfigError

PoolName = Literal["draft", "target"]
POOL_NAMES: tuple[str, ...] = ("draft", "target")
POLICIES: tuple[str, ...] = ("round_robin", "least_load", "prefix_affinity")
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

    def __post_init__(self) -> None:
        _require(0 <= self.port <= 65535, "port", "must be in 0..65535")
        _require(bool(self.host), "host", "must not be empty")
        _positive(self, "max_body_bytes")
        _require(self.drain_timeout_s >= 0, "drain_timeout_s", "must be >= 0")


@dataclass(frozen=True)
class TelemetryConfig:
    interval_s: float = 0.2
    timeout_s: float = 0.15
    stale_after_s: float = 1.0
    unhealthy_after_failures: int = 3

    def __post_init__(self) -> None:
        _positive(self, "interval_s", "timeout_s", "stale_after_s", "unhealthy_after_failures")
        # A scrape that may outlive its interval would pile up behind the next one.
        _require(self.timeout_s < self.interval_s, "timeout_s", "must be < telemetry.interval_s")
        _require(
            self.stale_after_s >= self.interval_s,
            "stale_after_s",
            "must be >= telemetry.interval_s",
        )


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = "prefix_affinity"
    load_factor: float = 2.0
    # An engine carrying fewer requests than this is never over the bound (idle pools don't spill).
    min_load_bound: int = 2
    block_chars: int = 256
    max_blocks: int = 512
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

    def __post_init__(self) -> None:
        _require(self.policy in POLICIES, "policy", f"must be one of {', '.join(POLICIES)}")
        _require(self.load_factor >= 1.0, "load_factor", "must be >= 1.0")
        _positive(self, "min_load_bound", "block_chars", "max_blocks")
        _positive(self, "affinity_blocks", "min_match_blocks")
        _require(self.index_blocks >= 0, "index_blocks", "must be >= 0")
        _require(self.place_new in PLACE_NEW, "place_new", f"must be one of {', '.join(PLACE_NEW)}")
        _require(self.seed >= 0, "seed", "must be >= 0")


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
    """The KV overcommit guard (``proxy.pressure``); counts are in scrape intervals."""

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
    # output still to come) on top of the engine's reported usage (``proxy.commitment``).
    reserve_output: bool = True
    # A pool's expected answer length: the mean completion tokens of its last ``output_window``
    # answers; ``prior_output_tokens`` until ``output_min_samples`` answers are known.
    output_window: int = 256
    output_min_samples: int = 16
    prior_output_tokens: int = 512

    def __post_init__(self) -> None:
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


@dataclass(frozen=True)
class UpstreamConfig:
    connect_timeout_s: float = 2.0
    first_byte_timeout_s: float = 60.0
    # A non-streamed answer arrives whole, only once generated: its budget covers the generation.
    response_timeout_s: float = 600.0
    idle_timeout_s: float = 60.0
    max_connections_per_engine: int = 256
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
class EngineConfig:
    name: str
    url: str
    metrics_url: str | None = None
    # Name of the environment variable that holds the engine's API key (vLLM ``--api-key``);
    # the key itself never sits in a config file.
    api_key_env: str | None = None

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
    name: str
    model: str
    engines: tuple[EngineConfig, ...]
    priority_scheduling: bool = False

    def __post_init__(self) -> None:
        _require(self.name in POOL_NAMES, "name", "must be 'draft' or 'target'")
        _require(bool(self.model.strip()), "model", "must not be empty")
        _require(len(self.engines) > 0, "engines", "must list at least one engine")


@dataclass(frozen=True)
class AliasConfig:
    name: str
    pool: str
    tiering: bool = False

    def __post_init__(self) -> None:
        _require(bool(self.name.strip()), "name", "must not be empty")
        _require(self.pool in POOL_NAMES, "pool", "must be 'draft' or 'target'")


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    pressure: PressureConfig = field(default_factory=PressureConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    pools: tuple[PoolConfig, ...] = ()
    aliases: tuple[AliasConfig, ...] = ()
    auth: AuthConfig = field(default_factory=AuthConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)

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
    if len(pools) == 2:
        _require(pools[0].model != pools[1].model, "pools[1].model", "both pools serve one model")


def _check_aliases(aliases: tuple[AliasConfig, ...], pools: tuple[PoolConfig, ...]) -> None:
    models = {p.model for p in pools}
    pool_names = {p.name for p in pools}
    seen: set[str] = set()
    for i, alias in enumerate(aliases):
        where = f"aliases[{i}]"
        _require(alias.name not in models, f"{where}.name", "collides with a pool's model name")
        _require(alias.name not in seen, f"{where}.name", f"duplicate alias {alias.name!r}")
        _require(alias.pool in pool_names, f"{where}.pool", f"no pool {alias.pool!r} configured")
        seen.add(alias.name)
        if alias.tiering:
            _require(
                "draft" in pool_names, f"{where}.tiering", "tiering needs a draft pool configured"
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
    "auth",
    "cache",
    "redis",
    "limits",
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
