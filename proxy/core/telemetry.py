"""Engine telemetry: parsing an engine's Prometheus text into an ``EngineSnapshot``.

Rules (pure, no I/O):
- ``parse_metrics`` reads only the families the proxy uses; everything else is skipped before its
  labels are parsed (it runs every 200 ms per engine). Samples are summed over the ``engine`` label
  (data-parallel ranks); KV usage, a fraction, is averaged instead. ``vllm:kv_cache_usage_perc`` is
  preferred, ``vllm:gpu_cache_usage_perc`` (vLLM <= 0.10) is the fallback. NaN samples are ignored.
- The text comes from outside and is not believed blindly: a negative or infinite sample of a
  family we read, a KV usage above 1 (plus ``KV_SLACK``) or more than ``MAX_REQUESTS`` running or
  waiting makes the whole snapshot unusable (``ImplausibleMetrics``); routing on part of a lying
  exposition would be worse than routing without it.
- A snapshot carries the time it was taken (``taken_at``, passed in: no clock is read here); what
  its age means for the engine is ``proxy.core.engine_state``'s business.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# Bounds past which a figure is a lie or a bug, not a reading: KV usage is a 0-1 fraction (a little
# rounding slack allowed); an engine runs hundreds of sequences, a million queued is already absurd.
KV_SLACK = 0.01
MAX_REQUESTS = 1_000_000.0
# Cache-config figures outside this range are ignored rather than believed.
_MAX_INFO_INT = 1 << 31


class MetricsError(ValueError):
    """The metrics text cannot be used (missing KV usage, running or waiting)."""

    reason = "unparsable"  # the scrape-failure label


class ImplausibleMetrics(MetricsError):
    """A figure no engine can report: negative, infinite, KV usage above 1, absurd queues."""

    reason = "out_of_range"


@dataclass(frozen=True)
class EngineSnapshot:
    taken_at: float
    kv_usage: float
    running: float
    waiting: float
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    preemptions: float = 0.0
    spec_drafts: float = 0.0
    spec_draft_tokens: float = 0.0
    spec_accepted: float = 0.0
    draining: bool = False
    ready: bool = True
    # Histogram sums and counts for the engine's own rates (``proxy.core.rates``); None: absent.
    prefill_tokens_sum: float | None = None
    prefill_seconds_sum: float | None = None
    itl_sum: float | None = None
    itl_count: float | None = None


# sample name -> snapshot field. Counters appear with ``_total``; bare names are accepted as well.
_SUMMED: dict[str, str] = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:gpu_prefix_cache_queries_total": "prefix_queries_legacy",
    "vllm:gpu_prefix_cache_hits_total": "prefix_hits_legacy",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:spec_decode_num_drafts_total": "spec_drafts",
    "vllm:spec_decode_num_draft_tokens_total": "spec_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "spec_accepted",
    "vllm:request_prefill_kv_computed_tokens_sum": "prefill_tokens_sum",
    "vllm:request_prefill_time_seconds_sum": "prefill_seconds_sum",
    "vllm:inter_token_latency_seconds_sum": "itl_sum",
    "vllm:inter_token_latency_seconds_count": "itl_count",
    "kvproxy_sidecar_draining": "draining",
    "kvproxy_sidecar_ready": "ready",
}
_SUMMED.update(
    {k.removesuffix("_total"): v for k, v in list(_SUMMED.items()) if k.endswith("_total")}
)
_MEANED: dict[str, str] = {
    "vllm:kv_cache_usage_perc": "kv",
    "vllm:gpu_cache_usage_perc": "kv_legacy",
}
_INFO = "vllm:cache_config_info"
_WANTED = frozenset(_SUMMED) | frozenset(_MEANED) | {_INFO}
# str.startswith with a tuple runs in C: most lines (histogram buckets, help text) are dropped
# before any Python-level parsing. Samples are expected at the start of a line, as exporters write.
_PREFIXES = tuple(sorted(_WANTED))
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return (
        value.replace("\\\\", "\x00").replace('\\"', '"').replace("\\n", "\n").replace("\x00", "\\")
    )


def parse_labels(text: str) -> dict[str, str]:
    """Labels of one sample's ``{...}`` body (without the braces), escapes undone."""
    return {m.group(1): _unescape(m.group(2)) for m in _LABEL_RE.finditer(text)}


def _info_int(labels: dict[str, str], key: str) -> int | None:
    try:
        value = int(float(labels[key]))
    except (KeyError, ValueError, OverflowError):
        return None
    return value if 0 < value <= _MAX_INFO_INT else None


def _check_sample(name: str, value: float) -> None:
    """Every family we read is non-negative and finite; a KV usage sample is at most 1."""
    if value < 0 or math.isinf(value):
        raise ImplausibleMetrics(f"{name} is {value:g}")
    if name in _MEANED and value > 1.0 + KV_SLACK:
        raise ImplausibleMetrics(f"{name} is {value:g}, above 1")


def _split_sample(line: str) -> tuple[str, str, str] | None:
    """(name, label text, value text) of a sample line, or None when it is not one."""
    brace = line.find("{")
    space = line.find(" ")
    if brace < 0 or 0 <= space < brace:
        parts = line.split()
        return (parts[0], "", parts[1]) if len(parts) >= 2 else None
    # Label values may contain anything, but the value and timestamp after the set cannot hold "}".
    close = line.rfind("}")
    rest = line[close + 1 :].split()
    if close < brace or not rest:
        return None
    return line[:brace].rstrip(), line[brace + 1 : close], rest[0]


def _collect(text: str) -> tuple[dict[str, float], dict[str, list[float]], dict[str, str]]:
    sums: dict[str, float] = {}
    means: dict[str, list[float]] = {}
    info: dict[str, str] = {}
    for line in text.split("\n"):
        if not line.startswith(_PREFIXES):
            continue
        sample = _split_sample(line)
        if sample is None or sample[0] not in _WANTED:
            continue  # a longer name that merely starts like a wanted one
        name, labels, value_text = sample
        if name == _INFO:
            info = parse_labels(labels)
            continue
        try:
            value = float(value_text)
        except ValueError:
            continue
        if math.isnan(value):
            continue
        _check_sample(name, value)
        if name in _MEANED:
            means.setdefault(_MEANED[name], []).append(value)
        else:
            key = _SUMMED[name]
            sums[key] = sums.get(key, 0.0) + value
    return sums, means, info


def parse_metrics(text: str, *, taken_at: float) -> EngineSnapshot:
    """The snapshot in ``text`` (Prometheus text format); ``MetricsError`` if it is unusable."""
    sums, means, info = _collect(text)
    kv_samples = means.get("kv") or means.get("kv_legacy")
    if not kv_samples:
        raise MetricsError("no vllm:kv_cache_usage_perc or vllm:gpu_cache_usage_perc")
    for need in ("running", "waiting"):
        if need not in sums:
            raise MetricsError(f"no vllm:num_requests_{need}")
        if sums[need] > MAX_REQUESTS:
            raise ImplausibleMetrics(f"vllm:num_requests_{need} is {sums[need]:g}")
    return EngineSnapshot(
        taken_at=taken_at,
        kv_usage=sum(kv_samples) / len(kv_samples),
        running=sums["running"],
        waiting=sums["waiting"],
        prefix_queries=sums.get("prefix_queries", sums.get("prefix_queries_legacy", 0.0)),
        prefix_hits=sums.get("prefix_hits", sums.get("prefix_hits_legacy", 0.0)),
        block_size=_info_int(info, "block_size"),
        num_gpu_blocks=_info_int(info, "num_gpu_blocks"),
        preemptions=sums.get("preemptions", 0.0),
        spec_drafts=sums.get("spec_drafts", 0.0),
        spec_draft_tokens=sums.get("spec_draft_tokens", 0.0),
        spec_accepted=sums.get("spec_accepted", 0.0),
        draining=sums.get("draining", 0.0) > 0,
        ready=sums.get("ready", 1.0) > 0,
        prefill_tokens_sum=sums.get("prefill_tokens_sum"),
        prefill_seconds_sum=sums.get("prefill_seconds_sum"),
        itl_sum=sums.get("itl_sum"),
        itl_count=sums.get("itl_count"),
    )
