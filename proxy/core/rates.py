"""An engine's own speeds, measured from the counters in its metrics between two snapshots.

Rules:
- Prefill speed: prompt tokens computed (``vllm:request_prefill_kv_computed_tokens``, cached
  tokens excluded) over the time requests spent in prefill (``vllm:request_prefill_time_seconds``),
  both histogram sums, differenced between snapshots. Requests prefilled together each count the
  shared time, so under concurrent prefills this is the speed one request sees, lower than the
  engine's throughput: a conservative figure, as a wait estimate should be.
- Step time: the mean inter-token latency (``vllm:inter_token_latency_seconds`` sum over count)
  over the same interval: one engine step at the decode batch it ran.
- A rate changes only when its interval saw work (a growing count); a counter that went down
  (engine restarted) gives no sample. Samples are smoothed (moving average), and a rate once
  measured stays until a new sample replaces it. vLLM 0.32 exports both families; an exporter
  without them (the simulator lacks the prefill ones) leaves the rate unmeasured (None).
- Pure: snapshots in, rates out; no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# Weight of the newest interval's sample in the moving average.
_ALPHA = 0.3


class _Counters(Protocol):
    @property
    def prefill_tokens_sum(self) -> float | None: ...
    @property
    def prefill_seconds_sum(self) -> float | None: ...
    @property
    def itl_sum(self) -> float | None: ...
    @property
    def itl_count(self) -> float | None: ...


@dataclass(frozen=True)
class EngineRates:
    prefill_tps: float | None = None  # prompt tokens per second of prefill
    step_s: float | None = None  # seconds per engine step (mean inter-token latency)


def _ratio(num: tuple[float | None, float | None],
           den: tuple[float | None, float | None]) -> float | None:
    """Δnum / Δden between an older and a newer reading, or None without a usable interval."""
    (n0, n1), (d0, d1) = num, den
    if n0 is None or n1 is None or d0 is None or d1 is None:
        return None
    dn, dd = n1 - n0, d1 - d0
    if dd <= 0 or dn <= 0:
        return None
    return dn / dd


def _blend(old: float | None, sample: float | None) -> float | None:
    if sample is None:
        return old
    return sample if old is None else old + _ALPHA * (sample - old)


def update_rates(old: EngineRates, prev: _Counters | None, snap: _Counters) -> EngineRates:
    """``old`` moved toward the rates measured between ``prev`` and ``snap``."""
    if prev is None:
        return old
    tps = _ratio((prev.prefill_tokens_sum, snap.prefill_tokens_sum),
                 (prev.prefill_seconds_sum, snap.prefill_seconds_sum))
    step = _ratio((prev.itl_sum, snap.itl_sum), (prev.itl_count, snap.itl_count))
    return EngineRates(_blend(old.prefill_tps, tps), _blend(old.step_s, step))
