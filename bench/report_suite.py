"""The routing suite's Markdown report (from ``bench/results/suite.json``).

Rules:
- Every number comes from the results; the wording around them is fixed.
- Each (workload, round) is judged on its own, and each figure against the *best peer on that
  figure* (``suite_runs.best_peer``): a router's p50 over the lowest p50 of any peer policy
  (any router but kvproxy) in that workload and round, its p90 over the lowest p90, its hit
  rate over the highest, and so on; the peer best on one figure is often not best on
  another. A workload or round where no peer ran has no ratios.
- Percentiles are over completed requests only, so a run that failed or shed some carries the
  count beside its figures in the summary (``suite_runs.lost``), and a kvproxy round that lost
  any is not counted as below the best peer.
- ``hit / oracle`` divides the engines' measured hit rate by ``bench.traces.oracle_hit_rate``
  of the same slice over the fleet's KV size; on ``unique`` (no reuse) it is undefined.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from bench.markdown import Run, fmt, ms, num, stamp, table
from bench.stats import ratio
from bench.suite_runs import best_peer, figure, group, lost, lost_text
from bench.suite_targets import targets_section
from bench.targets import DEFAULT_KVPROXY as KVPROXY

TARGETS_TEXT = (
    "kvproxy's default policy (and its precise mode, where it ran), each workload and round on "
    "its own (`bench.suite_targets`): on a workload with reuse, TTFT p90 ≤ 0.85 x the best "
    "peer's, p50 ≤ the best peer's (each percentile against the peer best on that percentile, "
    "which need not be the same peer), hit rate ≥ 0.95 x the oracle's (0.98 in precise mode); "
    "without reuse, p90 ≤ 1.05 x the lowest of all routers'. The idle floor column is the p90 "
    "target over the lowest p90 any router can reach on that workload: below 1, no router can "
    "meet the target.")
FIGURES = (("TTFT p50", "ttft_p50"), ("TTFT p90", "ttft_p90"), ("TTFT p99", "ttft_p99"),
           ("ITL p99", "itl_p99"))
HEADER = ("router", "round", "TTFT p50 s", "TTFT p90 s", "TTFT p99 s", "ITL p99 ms", "hit rate",
          "hit / oracle", "req/engine max / mean", "p50 / best peer", "p90 / best peer",
          "p99 / best peer", "ITL p99 / best peer", "hit / best peer", "done", "router CPU")


def engine_spread(run: Run) -> str:
    counts = run.get("engine_requests")
    if not isinstance(counts, Mapping) or not counts:
        return "n/a"
    values = [num(v) for v in counts.values()]
    avg = sum(values) / len(values)
    return f"{max(values):.0f} / {avg:.0f} ({fmt(max(values) / avg if avg else math.nan, 2)})"


def _round(run: Run) -> str:
    rnd = run.get("round", 0)
    return str(rnd + 1) if isinstance(rnd, int) else "1"


RELATIVE = ("ttft_p50", "ttft_p90", "ttft_p99", "itl_p99", "hit_rate")


def run_row(run: Run, runs: Sequence[Run], oracle: float) -> list[object]:
    """One run's row; its ratios are to the best peer on each figure among its round's
    ``runs``."""
    if run.get("status") != "ok":
        return [f"`{run.get('router')}`", _round(run), *(["n/a"] * 12), str(run.get("status")),
                "n/a"]
    s = run["summary"]
    assert isinstance(s, Mapping)
    rel = [fmt(_to_best(run, runs, k), 2) if best_peer(runs, k) else "n/a" for k in RELATIVE]
    hit = figure(run, "hit_rate")
    return [f"`{run['router']}`", _round(run),
            fmt(num(s["ttft_p50"]), 2), fmt(num(s["ttft_p90"]), 2), fmt(num(s["ttft_p99"]), 2),
            fmt(ms(s["itl_p99"]), 1), fmt(hit, 3), fmt(ratio(hit, oracle), 2),
            engine_spread(run), *rel, f"{num(s['completed']):.0f}/{num(s['requests']):.0f}",
            fmt(num(run.get("router_cpu_s")) / num(run.get("duration_s")), 2)]


def workload_settings(w: Mapping[str, object]) -> str:
    t, cal = w["trace"], w["calibration"]
    assert isinstance(t, Mapping) and isinstance(cal, Mapping)
    light, knee = cal["light"], cal["knee"]
    assert isinstance(light, Mapping) and isinstance(knee, Mapping)
    wall = num(t.get("span_s")) / num(w.get("compression"))
    return "\n".join([
        f"- slice: {num(t.get('requests')):.0f} requests over {fmt(num(t.get('span_s')), 0)} "
        f"trace s ({fmt(num(t.get('rate_per_s')), 2)} req/s); input mean "
        f"{fmt(num(t.get('mean_input_tokens')), 0)} tokens, max {t.get('max_input_tokens')} "
        f"(cap {w.get('max_input_tokens')}); output mean "
        f"{fmt(num(t.get('mean_output_tokens')), 0)} tokens",
        f"- load: round-robin's knee x{fmt(num(w.get('rate_scale')), 2)} (its TTFT p90 "
        f"{fmt(num(knee.get('ttft_p90')), 2)} s there, {fmt(num(light.get('ttft_p90')), 2)} s "
        f"at the light load x{fmt(num(light.get('rate_scale')), 2)}); arrivals compressed "
        f"x{fmt(num(w.get('compression')), 2)}, so the replay lasts {fmt(wall, 0)} s of wall clock",
        f"- prefix-cache hit rate of the slice: ideal {fmt(num(t.get('ideal_hit_rate')))}, "
        f"oracle over the fleet's KV {fmt(num(t.get('oracle_hit_rate')))}, round-robin over "
        f"infinite caches {fmt(num(t.get('round_robin_infinite_hit_rate')))}",
        *_floor_line(w.get("idle_floor")),
    ])


def _floor_line(floor: object) -> list[str]:
    if not isinstance(floor, Mapping):
        return []
    return [f"- idle floor (`bench.idle_floor`: {floor.get('rule')}): TTFT p50 "
            f"{fmt(num(floor.get('ttft_p50')), 2)} s, p90 {fmt(num(floor.get('ttft_p90')), 2)} s, "
            f"p99 {fmt(num(floor.get('ttft_p99')), 2)} s"]


def workload_section(w: Mapping[str, object], groups: Mapping[tuple[str, int], list[Run]]) -> str:
    name = str(w["name"])
    oracle = num(w["trace"]["oracle_hit_rate"])  # type: ignore[index]
    rows = []
    for (wname, _), runs in groups.items():
        if wname == name:
            rows += [run_row(r, runs, oracle) for r in runs]
    return "\n".join([f"## Workload `{name}`: {w['title']}", "", workload_settings(w), "",
                      table(HEADER, rows) if rows else "No runs.", ""])


def _cells(values: Sequence[str]) -> str:
    return " / ".join(values) if values else "n/a"


def _cell(value: float, run: Run) -> str:
    """A matrix cell: the figure, and the requests the run lost where it lost any (its
    percentiles leave them out, so the figure alone flatters it)."""
    return fmt(value, 2) + (f" ({lost_text(run)})" if lost(run)[0] > 0 else "")


Value = Callable[[str, Run, Sequence[Run]], float]  # (workload, run, its round's runs)


def _to_best(run: Run, runs: Sequence[Run], key: str) -> float:
    return ratio(figure(run, key), figure(best_peer(runs, key) or {}, key))


def to_best_peer(key: str) -> Value:
    """``key`` over the best peer's on ``key`` (not the best peer on p90's)."""
    return lambda _w, run, runs: _to_best(run, runs, key)


def engine_share(_w: str, run: Run, _runs: Sequence[Run]) -> float:
    counts = run.get("engine_requests")
    if run.get("status") != "ok" or not isinstance(counts, Mapping) or not counts:
        return math.nan
    values = [num(v) for v in counts.values()]
    return ratio(max(values), sum(values) / len(values))


def summary_matrix(workloads: Sequence[str], routers: Sequence[str],
                   groups: Mapping[tuple[str, int], list[Run]], value: Value) -> str:
    """Router x workload, one value per round."""
    rows = []
    for name in routers:
        row: list[object] = [f"`{name}`"]
        for w in workloads:
            vals = []
            for (wname, _), runs in groups.items():
                run = next((r for r in runs if r.get("router") == name), None)
                if wname == w and run is not None:
                    vals.append(_cell(value(w, run, runs), run))
            row.append(_cells(vals))
        rows.append(row)
    return table(("router", *(f"`{w}`" for w in workloads)), rows)


def verdicts(workloads: Sequence[str], groups: Mapping[tuple[str, int], list[Run]]) -> str:
    lines = []
    for w in workloads:
        wins = total = incomplete = 0
        for (wname, _), runs in groups.items():
            ours = next((r for r in runs if r.get("router") == KVPROXY), None)
            best = best_peer(runs)
            if wname != w or ours is None or best is None:
                continue
            total += 1
            if lost(ours)[0] != 0:  # a p90 over the requests it kept (or unknown) is no win
                incomplete += 1
                continue
            wins += figure(ours, "ttft_p90") < figure(best, "ttft_p90")
        note = (f" ({incomplete} with failed or shed requests, not counted)" if incomplete
                else "")
        lines.append(f"- `{w}`: `{KVPROXY}` TTFT p90 below the best peer's in {wins} of {total} "
                     f"rounds{note}" if total
                     else f"- `{w}`: not measured (no peer or no kvproxy run)")
    return "\n".join(lines)


def summary_section(data: Mapping[str, object]) -> str:
    runs, ws = data["runs"], data["workloads"]
    assert isinstance(runs, list) and isinstance(ws, list)
    groups = group(runs)
    names = [str(w["name"]) for w in ws]
    routers = list(dict.fromkeys(str(r.get("router")) for r in runs))
    oracle = {str(w["name"]): num(w["trace"]["oracle_hit_rate"]) for w in ws}

    def over_oracle(w: str, run: Run, _runs: Sequence[Run]) -> float:
        return ratio(figure(run, "hit_rate"), oracle[w])

    floors = {str(w["name"]): w.get("idle_floor") for w in ws}

    def over_floor(w: str, run: Run, _runs: Sequence[Run]) -> float:
        floor = floors[w]
        return ratio(figure(run, "ttft_p90"),
                     num(floor.get("ttft_p90")) if isinstance(floor, Mapping) else math.nan)

    def matrix(value: Value) -> str:
        return summary_matrix(names, routers, groups, value)

    return "\n".join([
        "Each cell lists one figure per round (rounds separated by `/`). Best peer: for each "
        "figure, the peer policy best on that figure in that workload and round (lowest "
        "latency, highest hit rate), so the p50 and p90 columns may divide by different "
        "peers.", "",
        "TTFT p90 / the best peer's (below 1: faster than every peer):", "",
        matrix(to_best_peer("ttft_p90")), "",
        "Prefix-cache hit rate / the oracle's (`bench.traces.oracle_hit_rate`; `unique` has no "
        "reuse, so n/a):", "",
        matrix(over_oracle), "",
        "TTFT p90 / the workload's idle floor (`bench.idle_floor`: the p90 no router can beat; "
        "1.00 would be every request as fast as alone on an idle engine):", "",
        matrix(over_floor), "",
        "TTFT p50 / the best peer's:", "", matrix(to_best_peer("ttft_p50")), "",
        "TTFT p99 / the best peer's:", "", matrix(to_best_peer("ttft_p99")), "",
        "ITL p99 / the best peer's:", "", matrix(to_best_peer("itl_p99")), "",
        "Requests per engine, busiest / mean (1.00: even):", "", matrix(engine_share), "",
        "Absolute figures, and every ratio for every run, are in the per-workload tables.", "",
        verdicts(names, groups),
    ])


def suite_settings(data: Mapping[str, object]) -> str:
    s = data["settings"]
    assert isinstance(s, Mapping)
    return "\n".join([
        f"- fleet: {s['engines']} simulated engines, profile `{s['profile']}`, fresh for every "
        f"run; engines on core(s) {s['engine_cores'] or 'any'}, router on core(s) "
        f"{s['router_cores'] or 'any'}, load generator {s['loadgen_cores']}",
        f"- speed: engines and arrivals {s['time_scale']}x faster than real time; latencies in "
        f"engine time (wall clock x {s['time_scale']})",
        f"- outputs: trace output x {s['output_scale']}, then ≤ {s['max_output_tokens']} tokens",
        f"- {'quick' if s['quick'] else 'full'} slices, {s['repeat']} round(s); load per "
        f"workload: {data['workloads'][0]['calibration']['rule']}"  # type: ignore[index]
        if data.get("workloads") else "- no workloads",
    ])


def suite_markdown(data: Mapping[str, object]) -> str:
    ws = data["workloads"]
    assert isinstance(ws, list)
    groups = group(data["runs"])  # type: ignore[arg-type]
    parts = ["# Routing workload suite", "", stamp(data), "", "## Settings", "",
             suite_settings(data), "", "## Summary", "", summary_section(data), "",
             "## Targets, judged per round", "", TARGETS_TEXT, "",
             targets_section(ws, groups), ""]
    parts += [workload_section(w, groups) for w in ws]
    parts += ["Per workload: `req/engine` is the busiest engine's request count over the mean "
              "(from `vllm:request_success_total`); `hit rate` is the engines' own prefix-cache "
              "counters over the run; `router CPU` is the router's CPU time over the run's wall "
              "clock (1.0 = one core busy).", ""]
    return "\n".join(parts)
