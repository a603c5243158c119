"""The replica benchmark's Markdown report (from ``bench/results/replicas.json``).

Rules:
- Every number comes from the results; the wording around them is fixed and verdicts computed.
- Each (workload, round) is judged on its own: every ratio divides an arm's figure by the
  *baseline* of the same workload and round, one replica behind HAProxy (``haproxy-1``; the
  direct replica when that arm did not run), from the same source tree (arms ``…@compared``,
  run from ``--compare-tree``, against ``haproxy-1@compared``). Summaries give the median ratio
  over rounds and its spread (lowest-highest).
- The goal (issue 14): with 4 replicas sharing routing state, TTFT p90 within 10 % of one
  replica's (ratio <= 1.10) and the prefix-cache hit rate within 10 % (ratio >= 0.90). A
  workload where either figure is missing is "not measured", never met.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from bench.front import COMPARED
from bench.markdown import Run, fmt, num, stamp, table
from bench.stats import ratio
from bench.suite_runs import figure

BASELINES = ("haproxy-1", "direct-1")
GOAL_ARM = "haproxy-4-shared"
GOAL_P90, GOAL_HIT = 1.10, 0.90


def rounds(runs: Sequence[Run], workload: str) -> dict[int, dict[str, Run]]:
    """Runs of ``workload`` by round, then by arm."""
    out: dict[int, dict[str, Run]] = {}
    for run in runs:
        rnd = run.get("round", 0)
        if run.get("workload") == workload:
            out.setdefault(rnd if isinstance(rnd, int) else 0, {})[str(run.get("arm"))] = run
    return out


def baseline(arms: Mapping[str, Run], arm: str = "") -> Run | None:
    """The baseline of ``arm``: one replica run from the same source tree."""
    suffix = COMPARED if arm.endswith(COMPARED) else ""
    return next((arms[b + suffix] for b in BASELINES if b + suffix in arms), None)


def ratios(runs: Sequence[Run], workload: str, arm: str, key: str) -> list[float]:
    """Per round, ``arm``'s figure over the baseline's (NaN where either is missing)."""
    out = []
    for arms in rounds(runs, workload).values():
        base = baseline(arms, arm)
        if arm in arms:
            out.append(ratio(figure(arms[arm], key), figure(base or {}, key)))
    return out


def spread(values: Sequence[float], digits: int = 2) -> str:
    """``median [lowest-highest]`` over rounds; one value alone; n/a when none is a number."""
    real = [v for v in values if not math.isnan(v)]
    if not real:
        return "n/a"
    mid = fmt(statistics.median(real), digits)
    return mid if len(real) == 1 else f"{mid} [{fmt(min(real), digits)}-{fmt(max(real), digits)}]"


def _figures(runs: Sequence[Run], workload: str, arm: str, key: str) -> list[float]:
    return [figure(a[arm], key) for a in rounds(runs, workload).values() if arm in a]


def arm_rows(runs: Sequence[Run], workload: str, arms: Sequence[str]) -> list[list[object]]:
    rows: list[list[object]] = []
    for arm in arms:
        done = [r for a in rounds(runs, workload).values() if (r := a.get(arm))]
        if not done:
            continue
        ok = sum(1 for r in done if r.get("status") == "ok")
        rows.append([
            f"`{arm}`", spread(_figures(runs, workload, arm, "ttft_p50")),
            spread(_figures(runs, workload, arm, "ttft_p90")),
            spread(_figures(runs, workload, arm, "hit_rate"), 3),
            spread(ratios(runs, workload, arm, "ttft_p50")),
            spread(ratios(runs, workload, arm, "ttft_p90")),
            spread(ratios(runs, workload, arm, "hit_rate")),
            spread([_cpu_share(r) for r in done]), f"{ok}/{len(done)}",
        ])
    return rows


def _cpu_share(run: Run) -> float:
    return ratio(num(run.get("router_cpu_s")), num(run.get("duration_s")))


ARM_HEADER = ("arm", "TTFT p50 s", "TTFT p90 s", "hit rate", "p50 / 1 replica",
              "p90 / 1 replica", "hit / 1 replica", "proxies' CPU (cores)", "runs ok")


def verdict(runs: Sequence[Run], workload: str) -> str:
    p90 = [v for v in ratios(runs, workload, GOAL_ARM, "ttft_p90") if not math.isnan(v)]
    hit = [v for v in ratios(runs, workload, GOAL_ARM, "hit_rate") if not math.isnan(v)]
    # No hits at all (no reuse, as in `unique`): nothing to keep, the p90 alone is judged.
    no_reuse = not any(figure(r, "hit_rate") > 0 for r in runs if r.get("workload") == workload)
    if not p90 or not (hit or no_reuse):
        return f"- `{workload}`: not measured (no `{GOAL_ARM}` or baseline run)"
    p90_ok = sum(v <= GOAL_P90 for v in p90)
    hit_ok = sum(v >= GOAL_HIT for v in hit)
    met = statistics.median(p90) <= GOAL_P90 and (no_reuse or statistics.median(hit) >= GOAL_HIT)
    hits = ("no prefix reuse, so no hit rate to keep" if no_reuse else
            f"hit-rate ratio {spread(hit)} (≥ {GOAL_HIT:.2f} in {hit_ok} of {len(hit)} rounds)")
    return (f"- `{workload}`: {'met' if met else 'missed'} on the medians — p90 ratio "
            f"{spread(p90)} (≤ {GOAL_P90:.2f} in {p90_ok} of {len(p90)} rounds), {hits}")


def run_rows(runs: Sequence[Run]) -> list[list[object]]:
    rows: list[list[object]] = []
    for run in runs:
        rnd = run.get("round", 0)
        head = [f"`{run.get('workload')}`", f"`{run.get('arm')}`",
                str(rnd + 1 if isinstance(rnd, int) else 1)]
        if run.get("status") != "ok":
            rows.append([*head, *(["n/a"] * 6), f"{run.get('status')}: "
                         f"{str(run.get('error', ''))[:80]}"])
            continue
        s = run["summary"]
        assert isinstance(s, Mapping)
        reps = run.get("replica_requests")
        hap = run.get("haproxy_requests")
        rows.append([*head, fmt(num(s["ttft_p50"]), 2), fmt(num(s["ttft_p90"]), 2),
                     fmt(num(s["ttft_p99"]), 2), fmt(figure(run, "hit_rate"), 3),
                     f"{num(s['completed']):.0f}/{num(s['requests']):.0f}",
                     " / ".join(f"{num(v):.0f}" for v in reps) if isinstance(reps, list) else "",
                     " / ".join(f"{num(v):.0f}" for v in hap.values())
                     if isinstance(hap, Mapping) and hap else "direct"])
    return rows


RUN_HEADER = ("workload", "arm", "round", "TTFT p50 s", "TTFT p90 s", "TTFT p99 s", "hit rate",
              "done", "requests per replica (kvproxy)", "requests per server (HAProxy)")


def settings(data: Mapping[str, object]) -> str:
    s = data["settings"]
    assert isinstance(s, Mapping)
    end = data.get("load_avg_at_end")
    load = " ".join(fmt(num(v), 2) for v in end) if isinstance(end, list) else "n/a"
    return "\n".join([
        f"- arms: {', '.join(f'`{a}`' for a in s['arms'])}; policy `{s['policy']}`; HAProxy "
        f"{data['versions'].get('haproxy', '?')}, {s['balance']}",  # type: ignore[union-attr]
        f"- fleet: {s['engines']} simulated engines, profile `{s['profile']}`, fresh for every "
        f"run (cold caches); engines on core(s) {s['engine_cores'] or 'any'}; replicas, HAProxy "
        f"and Redis together on core(s) {s['router_cores'] or 'any'}; load generator unpinned",
        f"- traffic: the routing suite's quick workloads, the leading {s['slice_fraction']:g} of "
        f"each quick slice, at {_load(s)}; "
        f"engines and arrivals {s['time_scale']}x real time, latencies in engine time",
        f"- replica settings beyond the defaults: "
        f"{_overrides(s.get('proxy_set'))}",
        f"- {s['repeat']} round(s); arms interleaved within each workload; load average at the "
        f"end {load}",
    ])


def _overrides(items: object) -> str:
    return ", ".join(f"`{o}`" for o in items) if isinstance(items, list) and items else "none"


def _load(s: Mapping[str, object]) -> str:
    fixed = s.get("rate_scale_override")
    return f"x{fixed} for every workload" if fixed is not None else "round-robin's knee"


NOTES = "replicas-notes.md"


def replicas_markdown(data: Mapping[str, object], link_prefix: str = "") -> str:
    """The report; ``link_prefix``: where the results folder is from the page that shows it."""
    runs, ws = data["runs"], data["workloads"]
    assert isinstance(runs, list) and isinstance(ws, list)
    arms = [str(a) for a in data["settings"]["arms"]]  # type: ignore[index]
    names = [str(w["name"]) for w in ws]
    parts = ["# Replica benchmark: kvproxy replicas behind HAProxy", "", stamp(data), "",
             "## Settings", "", settings(data), "", "## Goal: 4 replicas within 10 % of one", "",
             f"`{GOAL_ARM}` against `haproxy-1`, per workload (median ratio over rounds "
             "[lowest-highest]):", "", *[verdict(runs, w) for w in names], "",
             f"What limits the replicas, what was changed for it and the comparison before and "
             f"after: [{NOTES}]({link_prefix}{NOTES}).", ""]
    for w in names:
        rows = arm_rows(runs, w, arms)
        parts += [f"## Workload `{w}`", "", table(ARM_HEADER, rows) if rows else "No runs.", ""]
    parts += ["## Every run", "", table(RUN_HEADER, run_rows(runs)), "",
              "Figures are medians over rounds with [lowest-highest]; ratios are taken within a "
              "round, then summarised. `hit rate`: the engines' own prefix-cache counters over "
              "the run. `proxies' CPU`: CPU time of every replica and HAProxy over the run's "
              "wall clock (1.0 = one core busy). The per-replica and per-server counts show "
              "HAProxy spread the requests over every replica.", ""]
    return "\n".join(parts)
