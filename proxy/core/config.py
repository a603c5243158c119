"""Configuration: the settings' sections and the root ``Config`` that holds them all.

Rules:
- Every setting lives in a frozen, typed dataclass that checks itself in ``__post_init__`` and
  raises ``ConfigError`` naming the field; ``Config()`` / ``Config.default()`` is a working
  configuration without pools (the demo adds its own).
- The behaviour sections are defined here; the fleet's shape (engines, pools, aliases) and its
  cross-checks in ``fleet_config``, the front door's sections in ``door_config``, precise
  routing's in ``kv_config``. ``Config`` runs the fleet's cross-checks once it holds them all.
- Reading a file, environment variables and ``--set`` overrides is ``configload.load_config``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.core.cache_key import CacheConfig
from proxy.core.config_checks import at_least_zero
from proxy.core.config_checks import positive as _positive
from proxy.core.config_checks import require as _require
from proxy.core.door_config import AuthConfig, LimitsConfig, RedisConfig
from proxy.core.fleet_config import AliasConfig, PoolConfig, check_aliases, check_pools
from proxy.core.kv_config import KvEventsConfig

POLICIES: tuple[str, ...] = ("round_robin", "least_load", "prefix_affinity", "expected_ttft")
PLACE_NEW: tuple[str, ...] = ("least_load", "prefill", "rendezvous")


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
    # Allocations between two collections of the collector's youngest generation once serving.
    # A young pause is about proportional to it (2000: under 5 ms at p99 at 1024-2048 streams,
    # 20000: about 50 ms); see overhead-notes.md, 2026-11-24 evening.
    gc_young_threshold: int = 2_000
    # Young collections between two collections of the middle generation. A middle collection
    # scans everything that survived a young one since the last: every open stream's state. The
    # product with the young threshold (400,000 allocations) sets how often that happens.
    gc_middle_threshold: int = 200
    # ``--workers N``: a worker whose event loop has sent its parent nothing for this long
    # (stopped, or blocked in one call) is killed and restarted. It beats every fifth of this.
    worker_stuck_after_s: float = 10.0
    # Client connections one process keeps open at once; past it, a few more answer one request
    # each (a proxied one 503, shed reason ``connections``), then connections are closed as soon
    # as accepted. Unset: from the process's open-files limit at start (``proxy.core.conncap``),
    # so that clients run out before the engine side does.
    max_connections: int | None = None

    def __post_init__(self) -> None:
        _require(0 <= self.port <= 65535, "port", "must be in 0..65535")
        # 0 would turn the collector off: reference cycles would then never be freed.
        young = self.gc_young_threshold
        _require(100 <= young <= 1_000_000, "gc_young_threshold", "must be in 100..1000000")
        middle = self.gc_middle_threshold
        _require(1 <= middle <= 10_000, "gc_middle_threshold", "must be in 1..10000")
        _require(bool(self.host), "host", "must not be empty")
        _positive(
            self, "max_body_bytes", "header_timeout_s", "body_timeout_s", "keepalive_timeout_s"
        )
        _require(self.drain_timeout_s >= 0, "drain_timeout_s", "must be >= 0")
        stuck = self.worker_stuck_after_s
        _require(1.0 <= stuck <= 3600.0, "worker_stuck_after_s", "must be in 1..3600")
        cap = self.max_connections
        _require(cap is None or 1 <= cap <= 10_000_000, "max_connections", "must be in 1..10000000")
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
    # expected_ttft: charge a pick the prefill of what another engine is known to have computed
    # of the prompt once more (the cache the move abandons, recomputed later; settled holdings
    # only, never provisional ones); off keeps the plain model.
    charge_abandoned: bool = True
    # expected_ttft: a pick pays its prompt's compute time times this share for every sequence
    # decoding there (each one's next token waits for the steps that carry it: an inter-token
    # stall); 0: only the requests queued for prefill count as delayed.
    decode_charge: float = 0.1

    def __post_init__(self) -> None:
        _require(self.policy in POLICIES, "policy", f"must be one of {', '.join(POLICIES)}")
        _require(self.load_factor >= 1.0, "load_factor", "must be >= 1.0")
        _positive(self, "min_load_bound", "block_chars", "max_blocks")
        _positive(self, "affinity_blocks", "min_match_blocks")
        _require(self.index_blocks >= 0, "index_blocks", "must be >= 0")
        _require(self.place_new in PLACE_NEW, "place_new", f"must be one of {', '.join(PLACE_NEW)}")
        _require(0 <= self.seed < 2**64, "seed", "must be in 0..2**64-1")
        _positive(self, "chars_per_token", "prefill_tokens_per_s", "decode_step_s",
                  "chunk_tokens")
        at_least_zero(self, "decode_seq_step_s")
        _require(0.0 <= self.cost_tolerance <= 1.0, "cost_tolerance", "must be in 0..1")
        _require(0.0 <= self.decode_charge <= 10.0, "decode_charge", "must be in 0..10")


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
        _require(1 <= self.output_window <= 1_000_000, "output_window", "must be in 1..1000000")
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
    # The most bytes of a non-streamed answer (JSON, or an engine's error body) read from an
    # engine: such an answer is held whole before it is passed on. Streams are relayed as they
    # come and are bounded by the client's reading instead.
    max_response_bytes: int = 64 * 1024 * 1024
    # How long an idle engine connection stays in the pool: shorter than the engines' own
    # keep-alive (vLLM's and SGLang's HTTP servers close an idle connection after 5 s), or a
    # request sent just as the engine closes it fails before its answer began.
    keepalive_s: float = 4.0

    def __post_init__(self) -> None:
        _positive(
            self,
            "connect_timeout_s",
            "first_byte_timeout_s",
            "response_timeout_s",
            "idle_timeout_s",
            "max_connections_per_engine",
            "max_response_bytes",
            "keepalive_s",
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
        check_pools(self.pools)
        check_aliases(self.aliases, self.pools)

    @classmethod
    def default(cls) -> Config:
        return cls()

    def pool(self, name: str) -> PoolConfig | None:
        """The pool called ``name``, if configured."""
        return next((p for p in self.pools if p.name == name), None)
