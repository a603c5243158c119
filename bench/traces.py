"""Request traces: loading, slicing, capping, and the cache hit rates a trace allows.

Rules:
- A trace is a list of :class:`TraceRequest` with arrival times in *trace seconds* from the start of
  the slice; replay compression is the load generator's business, not the loader's.
- Mooncake ``hash_ids`` are chained ids of 512-token blocks: a repeated id means the whole prefix
  up to and including that block repeats. Caps keep that property by truncating the id list,
  never by dropping ids from the middle.
- Hit rates are token-weighted (hit tokens / prompt tokens), like vLLM's prefix-cache counters.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512


def _find_trace_dir() -> Path:
    """``$KVPROXY_TRACE_DIR``, else the nearest ``shared/traces`` above the repository (a git
    worktree may sit deeper than the main checkout)."""
    env = os.environ.get("KVPROXY_TRACE_DIR")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parent.parent
    for parent in repo.parents:
        if (parent / "shared" / "traces").is_dir():
            return parent / "shared" / "traces"
    return repo.parent / "shared" / "traces"


TRACE_DIR = _find_trace_dir()


@dataclass(frozen=True)
class TraceRequest:
    index: int  # position in the original trace
    arrival_s: float  # trace seconds
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()  # empty when the trace carries no prefix information


@dataclass(frozen=True)
class Caps:
    """Length limits applied to a slice so that it can be replayed on a small machine."""

    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    min_output_tokens: int = 1
    output_scale: float = 1.0  # output lengths are multiplied by this before capping


def default_trace_path(name: str) -> Path:
    return TRACE_DIR / name


def load_mooncake(path: Path | str) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            if not line.strip():
                continue
            row = json.loads(line)
            out.append(
                TraceRequest(
                    index=i,
                    arrival_s=float(row["timestamp"]) / 1000.0,
                    input_tokens=int(row["input_length"]),
                    output_tokens=int(row["output_length"]),
                    hash_ids=tuple(int(h) for h in row["hash_ids"]),
                )
            )
    return out


def _parse_azure_time(text: str) -> float:
    # Seven fractional digits do not parse with %f; keep microseconds.
    head, _, frac = text.partition(".")
    stamp = datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp()
    return stamp + (float("0." + frac) if frac else 0.0)


def load_azure(path: Path | str) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8", newline="") as fh:
        rows = list(csv.DictReader(fh))
    if not rows:
        return out
    t0 = _parse_azure_time(rows[0]["TIMESTAMP"])
    for i, row in enumerate(rows):
        out.append(
            TraceRequest(
                index=i,
                arrival_s=_parse_azure_time(row["TIMESTAMP"]) - t0,
                input_tokens=int(row["ContextTokens"]),
                output_tokens=int(row["GeneratedTokens"]),
            )
        )
    return out


def load_trace(name_or_path: str) -> list[TraceRequest]:
    """Load by file name in the shared trace folder, or by path; the format follows the suffix."""
    path = Path(name_or_path)
    if not path.exists():
        path = default_trace_path(name_or_path)
    if path.suffix == ".jsonl":
        return load_mooncake(path)
    if path.suffix == ".csv":
        return load_azure(path)
    raise ValueError(f"unknown trace format: {path}")


def take_slice(
    reqs: Sequence[TraceRequest],
    *,
    start_s: float = 0.0,
    duration_s: float | None = None,
    max_requests: int | None = None,
) -> list[TraceRequest]:
    """Requests arriving in [start_s, start_s + duration_s), re-based so the slice starts at 0."""
    end = math.inf if duration_s is None else start_s + duration_s
    picked = [r for r in reqs if start_s <= r.arrival_s < end]
    if max_requests is not None:
        picked = picked[:max_requests]
    return [replace(r, arrival_s=r.arrival_s - start_s) for r in picked]


def apply_caps(
    reqs: Iterable[TraceRequest], caps: Caps, block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> list[TraceRequest]:
    return [cap_request(r, caps, block_tokens) for r in reqs]


def cap_request(req: TraceRequest, caps: Caps, block_tokens: int) -> TraceRequest:
    out_tokens = max(caps.min_output_tokens, round(req.output_tokens * caps.output_scale))
    if caps.max_output_tokens is not None:
        out_tokens = min(out_tokens, caps.max_output_tokens)
    in_tokens = req.input_tokens
    hash_ids = req.hash_ids
    if caps.max_input_tokens is not None and in_tokens > caps.max_input_tokens:
        in_tokens = caps.max_input_tokens
        if hash_ids:
            hash_ids = hash_ids[: math.ceil(in_tokens / block_tokens)]
    return replace(req, input_tokens=in_tokens, output_tokens=out_tokens, hash_ids=hash_ids)


def _leading_hits(hash_ids: Sequence[int], seen: AbstractSet[int]) -> int:
    k = 0
    for h in hash_ids:
        if h not in seen:
            break
        k += 1
    return k


def hit_rate(
    reqs: Sequence[TraceRequest], instances: int = 1, block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> float:
    """Token-weighted hit rate with ``instances`` infinite caches fed round-robin.

    ``instances=1`` is the ideal: all traffic on one cache that never evicts.
    """
    caches: list[set[int]] = [set() for _ in range(instances)]
    hits = queries = 0
    for i, req in enumerate(reqs):
        cache = caches[i % instances]
        k = _leading_hits(req.hash_ids, cache)
        hits += min(k * block_tokens, req.input_tokens)
        queries += req.input_tokens
        cache.update(req.hash_ids)
    return hits / queries if queries else 0.0


def oracle_hit_rate(
    reqs: Sequence[TraceRequest], instances: int, capacity_tokens: int,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> float:
    """Token-weighted hit rate of a router that knows every cache exactly, over ``instances``
    LRU caches of ``capacity_tokens`` each: a request goes to the cache holding the longest
    prefix of it beyond the first block (shared by all), else to the one with the fewest tokens
    sent so far. Load and timing are ignored, so no router can do better on these caches; with
    small caches this, not the ideal, is the ceiling.
    """
    capacity = max(1, capacity_tokens // block_tokens)
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(instances)]
    sent = [0] * instances
    hits = queries = 0
    for req in reqs:
        held = [_leading_hits(req.hash_ids, cache.keys()) for cache in caches]
        best = max(held, default=0)
        pool = [i for i in range(instances) if held[i] == best] if best > 1 else range(instances)
        i = min(pool, key=lambda j: sent[j])
        hits += min(held[i] * block_tokens, req.input_tokens)
        queries += req.input_tokens
        sent[i] += req.input_tokens
        cache = caches[i]
        for h in req.hash_ids:
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits / queries if queries else 0.0


def describe(reqs: Sequence[TraceRequest]) -> dict[str, float]:
    """Summary figures of a slice, for the report's settings table."""
    if not reqs:
        return {"requests": 0}
    span = max(r.arrival_s for r in reqs) - min(r.arrival_s for r in reqs)
    n = len(reqs)
    return {
        "requests": n,
        "span_s": span,
        "rate_per_s": n / span if span > 0 else float("nan"),
        "mean_input_tokens": sum(r.input_tokens for r in reqs) / n,
        "max_input_tokens": max(r.input_tokens for r in reqs),
        "mean_output_tokens": sum(r.output_tokens for r in reqs) / n,
        "max_output_tokens": max(r.output_tokens for r in reqs),
    }
