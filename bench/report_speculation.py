"""Report of ``bench.speculation``: per-phase tables, the goals checked, JSON and Markdown.

Rules: formatting and arithmetic only; the goals are checked against the numbers in the same
report, and a missed goal is printed as missed, with the figures that missed it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from bench import machine
from bench.markdown import table

if TYPE_CHECKING:
    from bench.speculation import ArmResult, Phase, PhaseStats

WITHIN = 0.05
# The narrative on how the adaptive arm ran and why the goals conflict is about one run, with
# that run's figures: it lives in a notes file next to the results, dated, and the report only
# links to it, so a regenerated report never prints figures its data do not hold.
NOTES = "speculation-notes.md"
NOTES_LINK = (f"[Notes on a past run]({NOTES}) (dated there): how the adaptive arm ran and why "
              "the two goals conflict, with that run's figures; they are not regenerated, and "
              "where they differ from the tables above, the tables hold.")


def weighted_percentile(values: Sequence[float], weights: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    pairs = sorted(zip(values, weights, strict=True))
    total = sum(weights)
    target, acc = q / 100.0 * total, 0.0
    for value, weight in pairs:
        acc += weight
        if acc >= target:
            return value
    return pairs[-1][0]


def phase_figures(st: PhaseStats, seconds: float) -> dict[str, float]:
    ttft = sorted(st.ttft)
    return {
        "itl_p50_ms": 1000 * weighted_percentile(st.itl, st.itl_weight, 50),
        "itl_p99_ms": 1000 * weighted_percentile(st.itl, st.itl_weight, 99),
        "ttft_p90_ms": 1000 * ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))] if ttft
        else math.nan,
        "tokens_per_s": st.tokens / seconds if seconds > 0 else math.nan,
    }


def whole_run(result: ArmResult, seconds: float) -> dict[str, float]:
    merged_itl = [v for st in result.phases for v in st.itl]
    merged_w = [w for st in result.phases for w in st.itl_weight]
    return {"itl_p50_ms": 1000 * weighted_percentile(merged_itl, merged_w, 50),
            "itl_p99_ms": 1000 * weighted_percentile(merged_itl, merged_w, 99),
            "tokens_per_s": sum(st.tokens for st in result.phases) / seconds}


def _goals(data: dict[str, object]) -> list[str]:
    arms = data["arms"]
    assert isinstance(arms, dict)
    if "adaptive" not in arms or len(arms) < 2:
        return ["(the adaptive arm and at least one static arm are needed to check the goals)"]
    adaptive = arms["adaptive"]
    static = {k: v for k, v in arms.items() if k != "adaptive" and not k.startswith("oracle")}
    lines = []
    for i, name in enumerate(data["phase_names"]):  # type: ignore[arg-type]
        best_name = max(static, key=lambda k: static[k]["phases"][i]["tokens_per_s"])
        best = static[best_name]["phases"][i]["tokens_per_s"]
        mine = adaptive["phases"][i]["tokens_per_s"]
        ok = mine >= best * (1 - WITHIN)
        lines.append(f"- {name}: adaptive {mine:.0f} tok/s vs best static {best_name} "
                     f"{best:.0f} ({mine / best - 1:+.1%}) — {'met' if ok else 'MISSED'}")
    for metric, better in (("tokens_per_s", max), ("itl_p99_ms", min)):
        best_name = better(static, key=lambda k: static[k]["whole"][metric])
        best, mine = static[best_name]["whole"][metric], adaptive["whole"][metric]
        ok = mine > best if better is max else mine < best
        lines.append(f"- whole run {metric}: adaptive {mine:.1f} vs best static {best_name} "
                     f"{best:.1f} — {'met' if ok else 'MISSED'}")
    lost = adaptive["lost"]
    lines.append(f"- requests lost by the adaptive arm: {lost} — "
                 f"{'met' if lost == 0 else 'MISSED'}")
    return lines


def write_report(out: Path, plan: list[Phase], results: list[ArmResult],
                 settings: Mapping[str, object], env: Mapping[str, object],
                 command: str) -> None:
    total = plan[-1].end
    data: dict[str, object] = {
        "command": command, "started_at": machine.now_utc(), "machine": env,
        "settings": dict(settings),
        "phase_names": [p.name for p in plan],
        "phases": [{"name": p.name, "start_s": p.start, "end_s": p.end,
                    "users_per_engine": [p.users_from, p.users_to], "workload": p.workload}
                   for p in plan],
        "arms": {r.arm: {"sent": r.sent, "completed": r.completed, "lost": r.lost,
                         "reconfigurations": r.reconfigurations,
                         "phases": [phase_figures(st, p.end - p.start)
                                    for st, p in zip(r.phases, plan, strict=True)],
                         "whole": whole_run(r, total)} for r in results},
    }
    data["goals"] = _goals(data)
    machine.write_json(out.with_suffix(".json"), data)
    out.with_suffix(".md").write_text(render(data), encoding="utf-8")
    print(render(data))


def render(data: Mapping[str, object]) -> str:
    arms = data["arms"]
    assert isinstance(arms, dict)
    m = data.get("machine", {})
    assert isinstance(m, dict)
    parts = ["# Adaptive speculation benchmark", "",
             f"- command: `{data['command']}`", f"- run: {data['started_at']}",
             f"- machine: {m.get('nproc')} x {m.get('cpu_model')}, Python {m.get('python')} "
             "(the engines run on a virtual clock: the figures do not depend on the host)",
             f"- settings: {data['settings']}",
             "- phases (users per engine, workload class): " + "; ".join(
                 f"{p['name']} {p['start_s']:.0f}-{p['end_s']:.0f} s, "  # type: ignore[index]
                 f"{p['users_per_engine'][0]}->{p['users_per_engine'][1]}, "  # type: ignore[index]
                 f"{p['workload']}" for p in data["phases"]),  # type: ignore[index, union-attr]
             "- ITL is per output token (a chunk's gap divided by its tokens); TTFT p90 by "
             "arrival phase; output tok/s over the phase, both engines.", ""]
    for i, name in enumerate(data["phase_names"]):  # type: ignore[arg-type]
        rows = [[arm, *(v["phases"][i][k] for k in
                        ("itl_p50_ms", "itl_p99_ms", "ttft_p90_ms", "tokens_per_s"))]
                for arm, v in arms.items()]
        parts += [f"## {name}", "", table(["arm", "ITL p50 (ms)", "ITL p99 (ms)",
                                            "TTFT p90 (ms)", "output tok/s"], rows), ""]
    rows = [[arm, v["whole"]["itl_p50_ms"], v["whole"]["itl_p99_ms"], v["whole"]["tokens_per_s"],
             v["sent"], v["lost"], v["reconfigurations"]] for arm, v in arms.items()]
    parts += ["## Whole run", "", table(["arm", "ITL p50 (ms)", "ITL p99 (ms)", "output tok/s",
                                         "requests", "lost", "reconfigurations"], rows), "",
              "## Goals", "", *data["goals"], "", NOTES_LINK, ""]  # type: ignore[list-item]
    return "\n".join(parts)


def render_variations(variations: Sequence[Mapping[str, object]]) -> str:
    """The same benchmark under other seeds or phase lengths (``speculation-*.json``): each
    run's goals and whole-run rows, so that no default is judged on one workload alone."""
    grids = sorted((d for d in variations if d.get("kind") == "oracle-grid"),
                   key=lambda d: (len(d["grid"]), -d["settings"]["seed"]),  # type: ignore[arg-type, index]
                   reverse=True)  # the whole grid first
    parts = ["## Variations", ""]
    for data in (d for d in variations if d.get("kind") != "oracle-grid"):
        arms = data["arms"]
        assert isinstance(arms, dict)
        settings = data["settings"]
        assert isinstance(settings, dict)
        rows = [[arm, v["whole"]["itl_p50_ms"], v["whole"]["itl_p99_ms"],
                 v["whole"]["tokens_per_s"], v["sent"], v["lost"], v["reconfigurations"]]
                for arm, v in arms.items()]
        parts += [f"### seed {settings['seed']}, phases x{settings['scale']}", "",
                  f"- command: `{data['command']}`", f"- run: {data['started_at']}", "",
                  table(["arm", "ITL p50 (ms)", "ITL p99 (ms)", "output tok/s", "requests",
                         "lost", "reconfigurations"], rows), "",
                  *data["goals"], ""]  # type: ignore[list-item]
    return "\n".join(parts + [render_grid(g) for g in grids])


def _cell(point: Mapping[str, object], names: Sequence[str]) -> str:
    whole, worst = point["whole"], point["worst"]
    assert isinstance(whole, dict) and isinstance(worst, float)
    where = names[point["worst_phase"]]  # type: ignore[index]
    mark = " **both**" if point["both_goals"] else ""
    return f"{whole['itl_p99_ms']:.1f} / {worst - 1:+.1%} ({where}){mark}"


def render_grid(data: Mapping[str, object]) -> str:
    """``bench.speculation_oracles``: every oracle point's whole-run ITL p99 and its worst phase
    against the best static arm, one row per in-domain choice, one column per shifted one."""
    grid, static, names = data["grid"], data["static"], data["phase_names"]
    settings = data["settings"]
    assert isinstance(grid, list) and isinstance(static, dict) and isinstance(settings, dict)
    assert isinstance(names, list)
    offs = settings["shifted_off_from"]
    cells = {(g["in_domain_k"], g["from_batch"], g["shifted_off_from"]): g for g in grid}
    rows = [[k, t, *(_cell(cells[(k, t, o)], names) if (k, t, o) in cells else "not run"
                     for o in offs)]
            for k in settings["in_domain_ks"] for t in settings["thresholds"]]
    off_p99 = static["off"]["whole"]["itl_p99_ms"]
    below = [g for g in grid if g["p99_below_off"]]
    both = [g for g in grid if g["both_goals"]]
    closest = max(below, key=lambda g: g["worst"], default=None)
    summary = [f"- points run: {len(grid)}; whole-run ITL p99 below speculation off's "
               f"({off_p99:.1f} ms): {len(below)}; of those, every phase within "
               f"{WITHIN:.0%} of the best static arm: {len(both)}"]
    if closest is not None:
        summary.append(f"- closest of those below off's tail: in-domain K "
                       f"{closest['in_domain_k']} from batch {closest['from_batch']}, shifted "
                       f"off from {closest['shifted_off_from']}: {_cell(closest, names)}")
    return "\n".join([
        f"## Oracle grid (seed {settings['seed']}, phases x{settings['scale']})", "",
        f"- command: `{data['command']}`", f"- run: {data['started_at']}", "",
        "Every engine switches for free at the shift and back. In-domain: K 6 to batch 8, 5 to "
        "16, 4 to 32, 2 above, and the row's K from the row's batch up; shifted: K 1 below the "
        "column's batch, speculation off from it. Each cell: whole-run ITL p99 (ms) / the worst "
        "phase's output tok/s against that phase's best static arm (the phase); **both**: "
        "p99 below off's and every phase within 5 %.", "",
        table(["in-domain K", "from batch", *(f"shifted off from {o}" for o in offs)], rows),
        "", *summary, ""])
