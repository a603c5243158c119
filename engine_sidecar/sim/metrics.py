"""Prometheus text exposition of one simulated engine, with vLLM 0.32's names and labels.

Rules: the text is rendered by hand from plain counters (several proxies scrape every engine every
200 ms, so a render must cost microseconds, not a registry walk). Every series carries the labels
``engine="0"`` and ``model_name``. Latency histograms hold *simulated* seconds (wall time multiplied
by the engine's time scale), so a sped-up run reports what the modelled GPU would. Metric faults
(missing series, overridden values) are applied here, at render time, never to the counters.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISHED_REASONS = ("stop", "length", "abort")


class Histogram:
    __slots__ = ("bounds", "counts", "n", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1


@dataclass
class LatencyMetrics:
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISHED_REASONS, 0))


@dataclass(frozen=True)
class EngineReading:
    """What one render needs; built by the engine, so this module never touches its internals."""

    model: str
    running: int
    waiting: int
    kv_usage: float
    legacy_kv_metric: bool
    block_size: int
    num_gpu_blocks: int
    prefix_caching: bool
    counters: Mapping[str, float]  # sample name (with _total) -> value
    spec_per_pos: Sequence[int] | None
    draining: bool


class _Writer:
    def __init__(self, labels: str, missing: frozenset[str], overrides: Mapping[str, float]):
        self.labels = labels
        self.missing = missing
        self.overrides = overrides
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> bool:
        if name in self.missing:
            return False
        self.lines.append(f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n")
        return True

    def sample(self, name: str, value: float, extra: str = "") -> None:
        if name in self.missing:
            return
        value = self.overrides.get(name, value)
        labels = f"{self.labels},{extra}" if extra else self.labels
        self.lines.append(f"{name}{{{labels}}} {_fmt(value)}\n")

    def scalar(self, name: str, kind: str, help_text: str, value: float) -> None:
        if self.family(name, kind, help_text):
            self.sample(name, value)

    def histogram(self, name: str, help_text: str, h: Histogram) -> None:
        if not self.family(name, "histogram", help_text):
            return
        cumulative = 0
        for bound, count in zip(h.bounds, h.counts, strict=False):
            cumulative += count
            self.sample(f"{name}_bucket", cumulative, f'le="{bound}"')
        self.sample(f"{name}_bucket", h.n, 'le="+Inf"')
        self.sample(f"{name}_count", h.n)
        self.sample(f"{name}_sum", h.total)


def _fmt(value: float) -> str:
    if value == int(value) and abs(value) < 1e15:
        return f"{int(value)}.0"
    return repr(float(value))


COUNTERS = (
    ("vllm:num_preemptions_total", "Cumulative number of preemption from the engine."),
    ("vllm:prompt_tokens_total", "Number of prefill tokens processed."),
    ("vllm:generation_tokens_total", "Number of generation tokens processed."),
    ("vllm:prefix_cache_queries_total",
     "Prefix cache queries, in terms of number of queried tokens."),
    ("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens."),
)
SPEC_COUNTERS = (
    ("vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts."),
    ("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens."),
    ("vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens."),
)


def render(reading: EngineReading, latency: LatencyMetrics, *, missing: Sequence[str] = (),
           overrides: Mapping[str, float] | None = None) -> str:
    model = reading.model.replace("\\", "\\\\").replace('"', '\\"')
    w = _Writer(f'engine="0",model_name="{model}"', frozenset(missing), overrides or {})
    w.scalar("vllm:num_requests_running", "gauge",
             "Number of requests in model execution batches.", reading.running)
    w.scalar("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
             reading.waiting)
    kv_name = "vllm:kv_cache_usage_perc"
    if reading.legacy_kv_metric:
        kv_name = "vllm:gpu_cache_usage_perc"
    w.scalar(kv_name, "gauge", "KV-cache usage. 1 means 100 percent usage.", reading.kv_usage)
    for name, help_text in COUNTERS:
        w.scalar(name, "counter", help_text, reading.counters.get(name, 0.0))
    _render_requests(w, latency)
    if reading.spec_per_pos is not None:
        _render_spec(w, reading)
    _render_info(w, reading)
    return "".join(w.lines)


def _render_requests(w: _Writer, latency: LatencyMetrics) -> None:
    name = "vllm:request_success_total"
    if w.family(name, "counter", "Count of successfully processed requests."):
        for reason, count in latency.finished.items():
            w.sample(name, count, f'finished_reason="{reason}"')
    w.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                latency.ttft)
    w.histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                latency.itl)
    w.histogram("vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.", latency.e2e)


def _render_spec(w: _Writer, reading: EngineReading) -> None:
    for name, help_text in SPEC_COUNTERS:
        w.scalar(name, "counter", help_text, reading.counters.get(name, 0.0))
    name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    if w.family(name, "counter", "Accepted tokens per draft position."):
        for pos, count in enumerate(reading.spec_per_pos or ()):
            w.sample(name, count, f'position="{pos}"')


def _render_info(w: _Writer, reading: EngineReading) -> None:
    name = "vllm:cache_config_info"
    if w.family(name, "gauge", "Information of the LLMEngine CacheConfig"):
        caching = "True" if reading.prefix_caching else "False"
        w.sample(name, 1.0, f'block_size="{reading.block_size}",cache_dtype="auto",'
                 f'enable_prefix_caching="{caching}",num_gpu_blocks="{reading.num_gpu_blocks}"')
    w.scalar("kvproxy_sidecar_ready", "gauge", "1 while the engine accepts new requests.",
             0.0 if reading.draining else 1.0)
    w.scalar("kvproxy_sidecar_draining", "gauge", "1 while the engine drains before exiting.",
             1.0 if reading.draining else 0.0)
