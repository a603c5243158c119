"""Latency objectives and goodput as the serving literature defines it (DistServe, OSDI'24).

Goodput is the rate of work that met its latency objectives: here, the output tokens of the
requests that completed within their class's time-to-first-token bound *and* the time-per-output-
token bound, per second. Raw throughput counts every completed token however late; a system can
raise it by letting latency go, which is what an SLO-bound figure does not reward.

Rules:
- A request meets its objectives when it completed, its TTFT (counted from the client's first
  send, retries included) is at most its class's bound, and its TPOT is at most the TPOT bound.
- TPOT = (last token - first token) / (output tokens - 1), the mean time per output token after
  the first (DistServe's definition); a one-token answer has no TPOT and meets that bound.
- Pure functions over records; the bounds are data, stated with the results that use them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from bench.stats import RequestRecord


@dataclass(frozen=True)
class Objectives:
    """Per-class TTFT bounds and one TPOT bound, in seconds."""

    ttft_s: Mapping[str, float]
    tpot_s: float

    def as_dict(self) -> dict[str, object]:
        return {"ttft_s": dict(self.ttft_s), "tpot_s": self.tpot_s}


def tpot(rec: RequestRecord) -> float | None:
    """Mean seconds per output token after the first; None without two tokens."""
    if rec.output_tokens < 2 or not rec.itl:
        return None
    return sum(rec.itl) / (rec.output_tokens - 1)


def meets(rec: RequestRecord, cls: str, slo: Objectives) -> bool:
    """Whether ``rec`` completed within its class's TTFT bound and the TPOT bound."""
    if not rec.ok or rec.ttft is None or rec.ttft > slo.ttft_s[cls]:
        return False
    per_token = tpot(rec)
    return per_token is None or per_token <= slo.tpot_s
