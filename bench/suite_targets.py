"""The routing suite's targets, judged per workload and round from the results: computed
verdicts, never typed ones.

Targets (kvproxy's default policy, and the same policy in precise mode where it ran):
- on a workload with prefix reuse: TTFT p90 ≤ ``P90_SHARE`` x the best peer's, TTFT p50 ≤ the
  best peer's, hit rate ≥ ``HIT_SHARE`` x the oracle's (``HIT_SHARE_PRECISE`` in precise mode);
- on a workload without reuse (oracle hit rate 0): TTFT p90 ≤ ``NO_REUSE_P90`` x the lowest of
  every router's.

Rules:
- Each percentile is held against the best peer on that percentile (``suite_runs.best_peer``
  with its key): p90 against the peer with the lowest p90, p50 against the peer with the
  lowest p50, in that workload and round; the goal reads "the best peer's" for each, and one
  peer fast at p90 but slow at p50 would otherwise make the p50 target easier than stated.
  A figure that is missing is "not measured", never met.
- Every request must complete: the percentiles are over completed requests only, so a run that
  shed or failed some (``suite_runs.lost``) is "not met (k of n failed or shed)" whatever its
  percentiles, which are then named beside it as well; the table's ``not completed`` column
  gives the count. A run whose summary lacks the counts is "not measured".
- A target is also set against the workload's idle floor (``bench.idle_floor``): where the
  target p90 (``P90_SHARE`` x the best peer's) is below the floor's p90, no router can meet it
  on that workload, and the verdict says so next to the miss; the floor never turns a miss
  into a pass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from bench.markdown import Run, fmt, num, table
from bench.peers import PRECISE
from bench.stats import ratio
from bench.suite_runs import best_peer, figure, lost, lost_text
from bench.targets import DEFAULT_KVPROXY

P90_SHARE = 0.85
HIT_SHARE = 0.95
HIT_SHARE_PRECISE = 0.98
NO_REUSE_P90 = 1.05
JUDGED = (DEFAULT_KVPROXY, DEFAULT_KVPROXY + PRECISE)
HEADER = ("workload", "round", "router", f"p90 ÷ best peer on p90 (≤ {P90_SHARE:g})",
          "p50 ÷ best peer on p50 (≤ 1)", "hit ÷ oracle", "target p90 ÷ idle floor p90",
          "not completed", "verdict")


def judge(run: Run, runs: Sequence[Run], oracle: float, floor_p90: float) -> list[object]:
    """One row: ``run`` (a judged kvproxy run) against its round's ``runs``."""
    precise = str(run.get("router", "")).endswith(PRECISE)
    if not oracle > 0.0:  # no reuse: against the best of all routers, p90 only
        lowest = min((figure(r, "ttft_p90") for r in runs
                      if not math.isnan(figure(r, "ttft_p90"))), default=math.nan)
        p90 = ratio(figure(run, "ttft_p90"), lowest)
        misses = _misses([("p90", p90, NO_REUSE_P90, True)])
        return [fmt(p90, 3) + f" (÷ best of all, ≤ {NO_REUSE_P90:g})", "n/a", "n/a", "n/a",
                *_completion(run, misses)]
    best90 = best_peer(runs, "ttft_p90")
    best50 = best_peer(runs, "ttft_p50")
    p90 = ratio(figure(run, "ttft_p90"), figure(best90 or {}, "ttft_p90"))
    p50 = ratio(figure(run, "ttft_p50"), figure(best50 or {}, "ttft_p50"))
    hit = ratio(figure(run, "hit_rate"), oracle)
    share = HIT_SHARE_PRECISE if precise else HIT_SHARE
    target = P90_SHARE * figure(best90 or {}, "ttft_p90")
    reach = ratio(target, floor_p90)
    verdict = _misses([("p90", p90, P90_SHARE, True), ("p50", p50, 1.0, True),
                       ("hit", hit, share, False)])
    if "p90" in verdict and reach < 1.0:
        verdict += (f"; the p90 target ({fmt(target, 2)} s) is below the idle floor "
                    f"({fmt(floor_p90, 2)} s): no router can meet it")
    return [fmt(p90, 3), fmt(p50, 3), f"{fmt(hit, 3)} (≥ {share:g})", fmt(reach, 2),
            *_completion(run, verdict)]


def _completion(run: Run, verdict: str) -> list[str]:
    """The ``not completed`` cell and the verdict once incomplete runs are failed."""
    missing, sent = lost(run)
    if math.isnan(missing):
        return ["n/a", "not measured"]
    if missing == 0:
        return [f"0 of {sent:.0f}", verdict]
    rest = {"met": "", "not measured": "; figures not measured"}.get(
        verdict, "; " + verdict.removeprefix("not met: ") + " also missed")
    return [lost_text(run), f"not met ({lost_text(run)}){rest}"]


def _misses(checks: Sequence[tuple[str, float, float, bool]]) -> str:
    if any(math.isnan(value) for _, value, _, _ in checks):
        return "not measured"
    missed = [name for name, value, limit, below in checks
              if not (value <= limit if below else value >= limit)]
    return "met" if not missed else "not met: " + ", ".join(missed)


def targets_section(workloads: Sequence[Mapping[str, object]],
                    groups: Mapping[tuple[str, int], list[Run]]) -> str:
    rows: list[list[object]] = []
    for w in workloads:
        name = str(w["name"])
        trace = w.get("trace")
        oracle = num(trace.get("oracle_hit_rate")) if isinstance(trace, Mapping) else math.nan
        floor = w.get("idle_floor")
        floor_p90 = num(floor.get("ttft_p90")) if isinstance(floor, Mapping) else math.nan
        for (wname, rnd), runs in groups.items():
            if wname != name:
                continue
            for run in runs:
                if run.get("router") in JUDGED and run.get("status") == "ok":
                    rows.append([f"`{name}`", str(rnd + 1), f"`{run['router']}`",
                                 *judge(run, runs, oracle, floor_p90)])
    if not rows:
        return "No run of the judged policies."
    return table(HEADER, rows)
