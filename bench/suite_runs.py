"""The routing suite's runs, read from ``bench/results/suite.json``: figures, peers, rounds.

Rules:
- Each (workload, round) is judged on its own, and each figure against the *best peer on that
  figure*: the peer policy (any router but kvproxy) with the lowest value of it (the highest,
  for the hit rate) in that workload and round. A peer best on p90 need not be best on p50, and
  a target "p50 ≤ the best peer's" means the lowest p50 any peer reached.
- A run that did not finish reads as NaN, never as a figure.
- A run's percentiles are over its completed requests only (``bench.stats.summarize``), so a
  run that shed or failed some reads faster than it served: ``lost`` gives the count, for the
  verdicts and tables to show beside the figures.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from bench.markdown import Run, num


def figure(run: Run, key: str) -> float:
    """A run's figure by key: a summary latency or ``hit_rate``; NaN when it did not run."""
    if run.get("status") != "ok":
        return math.nan
    if key == "hit_rate":
        return num(run.get("hit_rate"))
    summary = run.get("summary")
    return num(summary.get(key)) if isinstance(summary, Mapping) else math.nan


def lost(run: Run) -> tuple[float, float]:
    """(requests not completed: failed, shed or rate-limited; requests sent) of a finished run;
    NaN where the summary lacks the counts."""
    summary = run.get("summary")
    if run.get("status") != "ok" or not isinstance(summary, Mapping):
        return math.nan, math.nan
    sent = num(summary.get("requests"))
    return sent - num(summary.get("completed")), sent


def lost_text(run: Run) -> str:
    """``k of n failed or shed``, as the verdicts and tables print it."""
    missing, sent = lost(run)
    return f"{missing:.0f} of {sent:.0f} failed or shed"


def is_peer(run: Run) -> bool:
    return not str(run.get("router", "")).startswith("kvproxy/")


HIGHER_IS_BETTER = frozenset({"hit_rate"})


def best_peer(runs: Sequence[Run], key: str = "ttft_p90") -> Run | None:
    """The peer run best on ``key`` among ``runs`` (one workload, one round): the lowest
    latency, or the highest hit rate."""
    peers = [r for r in runs if is_peer(r) and not math.isnan(figure(r, key))]
    if not peers:
        return None
    if key in HIGHER_IS_BETTER:
        return max(peers, key=lambda r: figure(r, key))
    return min(peers, key=lambda r: figure(r, key))


def group(runs: Sequence[Run]) -> dict[tuple[str, int], list[Run]]:
    """Runs by (workload, round), in the order they ran."""
    out: dict[tuple[str, int], list[Run]] = {}
    for run in runs:
        rnd = run.get("round", 0)
        out.setdefault((str(run.get("workload")), rnd if isinstance(rnd, int) else 0),
                       []).append(run)
    return out
