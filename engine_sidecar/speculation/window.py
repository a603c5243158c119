"""A sliding window over an engine's metrics: acceptance, batch sizes and measured step time.

Rules:
- A :class:`Snapshot` is read from one vLLM ``/metrics`` text (the same names the simulator
  exports); counters are cumulative, ``running`` is the gauge at that instant, so the window's
  batch-size time shares are the running samples it holds.
- Figures are differences between the newest snapshot and the oldest inside the window; any
  counter going backwards means the engine restarted, and the window starts again.
- ``polls`` gives the per-poll evidence the shift test reads (drafts, first position accepted);
  ``cut`` drops what came before a change point, so the figures describe the new regime only.
- ``load`` is how full the engine ran over the window (mean KV-cache usage or mean batch over
  ``max_num_seqs``, whichever is higher): what the rest of the pool would have to absorb while
  this engine restarts.
- Pure: the caller passes the time each snapshot was taken.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from dataclasses import dataclass

from engine_sidecar.speculation.policy import Figures, estimate_positions, position_reach
from engine_sidecar.speculation.schedule import Schedule
from engine_sidecar.vllm import metrics as m

ITL_SUM = "vllm:inter_token_latency_seconds_sum"
ITL_COUNT = "vllm:inter_token_latency_seconds_count"
GENERATION = "vllm:generation_tokens_total"
PROMPT = "vllm:prompt_tokens_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
REQUESTS = "vllm:request_success_total"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # the latter: vLLM <= 0.10


MIN_REQUESTS = 5  # finished requests a window needs before its prefill share is believed


@dataclass(frozen=True)
class Snapshot:
    at: float
    running: float
    waiting: float
    drafts: float
    accepted_per_pos: tuple[float, ...]
    itl_sum: float
    itl_count: float
    generation_tokens: float
    kv_usage: float = 0.0
    prefill_tokens: float = 0.0  # prompt tokens computed (not served from the prefix cache)
    requests: float = 0.0  # requests finished

    def counters(self) -> tuple[float, ...]:
        return (self.drafts, self.itl_sum, self.itl_count, self.generation_tokens,
                self.prefill_tokens, self.requests, *self.accepted_per_pos)


# The series a window's figures are made of: one implausible value among them and the scrape is
# not used at all (dropping only that sample would read a missing position as no acceptance).
TRUSTED = frozenset({m.RUNNING, m.WAITING, m.SPEC_DRAFTS, m.SPEC_ACCEPTED_PER_POS, ITL_SUM,
                     ITL_COUNT, GENERATION, PROMPT, PREFIX_QUERIES, PREFIX_HITS, REQUESTS,
                     *KV_USAGE})


class ImplausibleMetrics(ValueError):
    """An engine's exposition holds a value no engine reports (not finite, negative, absurd)."""


def snapshot_from_text(text: str, at: float) -> Snapshot:
    """The window's sample of one scrape; ``ImplausibleMetrics`` when one of the series it is
    made of holds a value no engine reports."""
    samples = list(m.parse_samples(text))
    if (bad := m.implausible(samples, TRUSTED)) is not None:
        raise ImplausibleMetrics(f"{bad} holds a value that is not a plausible count")
    spec = m.spec_counters(samples)
    return Snapshot(
        at=at, running=m.total(samples, m.RUNNING) or 0.0,
        waiting=m.total(samples, m.WAITING) or 0.0,
        drafts=spec.drafts if spec else 0.0,
        accepted_per_pos=spec.accepted_per_pos if spec else (),
        itl_sum=m.total(samples, ITL_SUM) or 0.0, itl_count=m.total(samples, ITL_COUNT) or 0.0,
        generation_tokens=m.total(samples, GENERATION) or 0.0, kv_usage=_kv_usage(samples),
        prefill_tokens=_prefill(samples), requests=m.total(samples, REQUESTS) or 0.0)


def _prefill(samples: list[m.Sample]) -> float:
    """Prompt tokens the engine computed: prefix-cache queries (which count recomputation after
    a preemption too) less hits; without the query counter, prompt tokens less hits."""
    hits = m.total(samples, PREFIX_HITS) or 0.0
    queried = m.total(samples, PREFIX_QUERIES)
    if queried is None:
        queried = m.total(samples, PROMPT) or 0.0
    return max(0.0, queried - hits)


def _kv_usage(samples: list[m.Sample]) -> float:
    for name in KV_USAGE:
        values = [s.value for s in samples if s.name == name and m.plausible(s.value)]
        if values:  # data-parallel ranks: the fullest one is what spills first
            return max(values)
    return 0.0


@dataclass(frozen=True)
class WindowFigures:
    figures: Figures
    measured_itl_s: float | None
    tokens_per_busy_second: float | None  # output tokens per second while anything ran
    waiting: float  # mean queue over the window: a moment's queue between steps is no backlog
    load: float = 0.0  # 0..1, see the module rules
    # Prompt tokens computed per output token and per finished request; None: too few requests.
    prefill_per_token: float | None = None
    prefill_chunk: float | None = None


def _went_backwards(new: Snapshot, old: Snapshot) -> bool:
    a, b = new.counters(), old.counters()
    return any(x < y for x, y in zip(a, b, strict=False)) or len(a) < len(b)


class MetricsWindow:
    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        self.window_s = window_s
        self._snaps: deque[Snapshot] = deque()

    def clear(self) -> None:
        self._snaps.clear()

    def add(self, snap: Snapshot) -> None:
        if self._snaps and _went_backwards(snap, self._snaps[-1]):
            self._snaps.clear()
        self._snaps.append(snap)
        while len(self._snaps) >= 2 and self._snaps[1].at <= snap.at - self.window_s:
            self._snaps.popleft()

    def polls(self) -> list[tuple[float, float]]:
        """``(drafts, first position accepted)`` between consecutive snapshots, oldest first."""
        snaps = list(self._snaps)
        return [(new.drafts - old.drafts, _first(new) - _first(old))
                for old, new in itertools.pairwise(snaps)]

    def cut(self, poll: int) -> None:
        """Keep the snapshots from the start of poll ``poll`` (an index into :meth:`polls`)."""
        for _ in range(min(poll, len(self._snaps) - 1)):
            self._snaps.popleft()

    def figures(self, current: Schedule, max_k: int, max_batch: int = 256
                ) -> WindowFigures | None:
        if len(self._snaps) < 2:
            return None
        old, new = self._snaps[0], self._snaps[-1]
        batches = Counter(round(s.running) for s in list(self._snaps)[1:])
        weights = {b: float(n) for b, n in batches.items() if b > 0}
        drafts = new.drafts - old.drafts
        n = len(new.accepted_per_pos)
        before = old.accepted_per_pos + (0.0,) * (n - len(old.accepted_per_pos))
        accepted = tuple(a - b for a, b in zip(new.accepted_per_pos, before, strict=True))
        per_pos = estimate_positions(accepted, drafts, weights, current, max_k)
        count = new.itl_count - old.itl_count
        itl = (new.itl_sum - old.itl_sum) / count if count > 0 else None
        busy = sum(batches[b] for b in weights) / max(1, len(self._snaps) - 1)
        span = new.at - old.at
        tokens = new.generation_tokens - old.generation_tokens
        rate = tokens / (busy * span) if busy > 0 and span > 0 else None
        waiting = sum(s.waiting for s in self._snaps) / len(self._snaps)
        load = max(sum(s.kv_usage for s in self._snaps) / len(self._snaps),
                   sum(s.running for s in self._snaps) / len(self._snaps) / max(1, max_batch))
        prefill = new.prefill_tokens - old.prefill_tokens
        requests = new.requests - old.requests
        measured = requests >= MIN_REQUESTS and tokens > 0
        reach = position_reach(drafts, weights, current, max_k)
        return WindowFigures(Figures(per_pos, weights, drafts, min(1.0, load), reach),
                             itl, rate,
                             waiting, min(1.0, load),
                             prefill / tokens if measured else None,
                             prefill / requests if measured else None)


def _first(snap: Snapshot) -> float:
    return snap.accepted_per_pos[0] if snap.accepted_per_pos else 0.0
