"""Markdown reports and PNGs from the benchmarks' JSON results; regenerates docs/benchmarks.md.

Usage: ``python -m bench.report [--results bench/results] [--docs docs/benchmarks.md]``.

Rules:
- Every number in a report comes from a results file; nothing is typed in. Text around the
  numbers (method, targets) is fixed wording; verdicts are computed.
- Each report states its command, machine, versions and settings next to its figures.
- A missing results file leaves its section out and says which command produces it.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from bench import plots
from bench.docs import benchmarks_doc
from bench.machine import now_utc, read_json
from bench.stats import ratio
from bench.targets import overhead_targets, routing_targets

RESULTS = Path(__file__).resolve().parent / "results"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
ROUTING_CMD = "python -m bench.routing"
OVERHEAD_CMD = "python -m bench.overhead"

Run = Mapping[str, object]


def fmt(value: object, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in row) + " |"
              for row in rows]
    return "\n".join(lines)


def stamp(data: Mapping[str, object]) -> str:
    """The provenance block every report starts with."""
    m = data.get("machine", {})
    assert isinstance(m, dict)
    versions = data.get("versions", {})
    assert isinstance(versions, dict)
    vers = ", ".join(f"{k} {v}" for k, v in versions.items())
    return "\n".join([
        f"- command: `{data.get('command')}`",
        f"- run: {data.get('started_at')} → {data.get('finished_at', 'unfinished')}",
        f"- machine: {m.get('nproc')} x {m.get('cpu_model')}, {m.get('memory_gib')} GiB, "
        f"Linux {m.get('kernel')}, Python {m.get('python')}, load average at start "
        f"{fmt_list(m.get('load_avg_at_start'))}",
        f"- versions: {vers}",
    ])


def fmt_list(values: object) -> str:
    if not isinstance(values, list):
        return "n/a"
    return " ".join(fmt(float(v), 2) for v in values)


def footer_text(data: Mapping[str, object]) -> str:
    m = data.get("machine", {})
    assert isinstance(m, dict)
    runs = data.get("runs")
    routers = ""
    if isinstance(runs, list):
        routers = " | routers: " + ", ".join(f"{r.get('router')} {r.get('version')}" for r in runs)
    return (f"{data.get('command')} | {data.get('started_at')} | {m.get('nproc')}x "
            f"{m.get('cpu_model')} | {data.get('versions')}{routers} | "
            f"settings: {data.get('settings')}")


# -- routing -------------------------------------------------------------------------------------

ROUTING_HEADER = ("router", "version", "TTFT p50 s", "TTFT p90 s", "p90 95% CI", "TTFT p99 s",
                  "ITL p50 ms", "ITL p99 ms", "out tok/s", "req/s", "hit rate", "hit / ideal",
                  "req share max/mean", "done", "shed", "failed", "preempt", "queued",
                  "mean waiting", "KV use", "router CPU")


def routing_rows(runs: Sequence[Run], ideal: float) -> list[list[object]]:
    rows: list[list[object]] = []
    for run in runs:
        if run.get("status") != "ok":
            continue
        s = run["summary"]
        assert isinstance(s, dict)
        ci = s.get("ttft_p90_ci")
        ci_text = f"{fmt(ci[0], 2)}-{fmt(ci[1], 2)}" if isinstance(ci, list) else "-"
        hit = run.get("hit_rate")
        rows.append([
            str(run["router"]), str(run.get("version", "")), fmt(s["ttft_p50"], 2),
            fmt(s["ttft_p90"], 2), ci_text, fmt(s["ttft_p99"], 2), fmt(_ms(s["itl_p50"]), 1),
            fmt(_ms(s["itl_p99"]), 1), fmt(s["throughput_tok_s"], 0),
            fmt(s["throughput_req_s"], 2), hit, ratio(_f(hit), ideal),
            fmt(run.get("share_max_over_mean"), 2),
            f"{s['completed']:.0f}/{s['requests']:.0f}", f"{s['shed']:.0f}", f"{s['failed']:.0f}",
            f"{_f(run.get('preemptions')):.0f}",
            *_load_cells(run.get("engine_load")),
            fmt(_f(run.get("router_cpu_s")) / _f(run.get("duration_s")), 2),
        ])
    return rows


def _load_cells(load: object) -> list[str]:
    if not isinstance(load, dict) or not load:
        return ["n/a", "n/a", "n/a"]
    return [fmt(_f(load.get("queued_fraction")), 2), fmt(_f(load.get("mean_waiting")), 1),
            fmt(_f(load.get("mean_kv_usage")), 2)]


def _f(v: object) -> float:
    return float(v) if isinstance(v, int | float) else math.nan


def _ms(v: object) -> float:
    return _f(v) * 1000.0


def engine_shares(runs: Sequence[Run]) -> str:
    lines = []
    for run in runs:
        counts = run.get("engine_requests")
        if isinstance(counts, dict) and counts:
            values = " ".join(f"{_f(v):.0f}" for v in counts.values())
            lines.append(f"- {run['router']}: {values}")
    return "\n".join(lines) if lines else "n/a"


def failures(runs: Sequence[Run]) -> str:
    bad = [r for r in runs if r.get("status") != "ok"]
    if not bad:
        return "Every router listed ran."
    return "\n".join(f"- **{r['router']}** ({r.get('status')}): `{str(r.get('error'))[:600]}`"
                     for r in bad)


def error_samples(runs: Sequence[Run]) -> str:
    lines = []
    for r in runs:
        errs = r.get("errors")
        if isinstance(errs, list) and errs:
            lines.append(f"- {r['router']}: " + "; ".join(f"`{e}`" for e in errs))
    return "\n".join(lines) if lines else "No request failed."


def routing_settings(data: Mapping[str, object]) -> str:
    s = data["settings"]
    t = data["trace"]
    assert isinstance(s, dict) and isinstance(t, dict)
    fleet = s["fleet"]
    caps = s["caps"]
    return "\n".join([
        f"- trace: `{s['trace']}`, slice [{s['slice_start_s']:.0f} s, "
        f"{s['slice_start_s'] + s['slice_duration_s']:.0f} s) of trace time: "
        f"{t.get('requests', 0):.0f} requests, {fmt(t.get('rate_per_s'), 2)} req/s, "
        f"mean input {fmt(t.get('mean_input_tokens'), 0)} tokens "
        f"(max {t.get('max_input_tokens')}), "
        f"mean output {fmt(t.get('mean_output_tokens'), 0)} tokens",
        f"- lengths capped for this machine: input ≤ {caps['max_input_tokens']} tokens (hash ids "
        f"truncated), output x {caps['output_scale']} then ≤ {caps['max_output_tokens']} tokens",
        f"- load: the slice's arrival rate x {s['rate_scale']} (offered "
        f"{fmt(_f(t.get('rate_per_s')) * _f(s['rate_scale']), 2)} req/s), chosen so that "
        f"round-robin runs the fleet near saturation",
        f"- speed: engines and arrivals run {s['time_scale']}x faster than real time (arrival "
        f"times divided by {fmt(_f(s['compression']), 2)}); latencies and throughput below are in "
        f"engine time (wall-clock x {s['time_scale']}), so a router's fixed wall-clock delay "
        f"counts {s['time_scale']}x",
        f"- engines: {fleet['engines']} simulated, profile `{fleet['profile']}`, KV blocks "
        f"{fleet['num_gpu_blocks'] or 'from the profile'}, max_model_len {fleet['max_model_len']}; "
        f"one process, fresh for every run",
        f"- pinning: engines on core(s) {s['engine_cores'] or 'any'}, router on core(s) "
        f"{s['router_cores'] or 'any'}, load generator {s['loadgen_cores']}",
        f"- prefix-cache hit rate of the slice: ideal (one infinite cache) "
        f"{fmt(t.get('ideal_hit_rate'))}; round-robin over {fleet['engines']} infinite caches "
        f"{fmt(t.get('round_robin_infinite_hit_rate'))}",
    ])


def routing_markdown(data: Mapping[str, object], png: str | None) -> str:
    runs = data["runs"]
    assert isinstance(runs, list)
    ideal = _f(data["trace"]["ideal_hit_rate"])  # type: ignore[index]
    parts = [
        "# Routing benchmark", "", stamp(data), "", "## Settings", "", routing_settings(data), "",
        "## Results", "", table(ROUTING_HEADER, routing_rows(runs, ideal)), "",
        "TTFT and ITL over completed requests; `hit rate` from the engines' "
        "`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` over the run; "
        "`req share` "
        "from `vllm:request_success_total` per engine; `p90 95% CI` is a bootstrap interval over "
        "the run's requests (sampling noise only; each router ran once); `queued` is the share "
        "of once-a-second samples of the engines' `vllm:num_requests_waiting` that were above "
        "zero, `mean waiting` that gauge's mean and `KV use` the mean of "
        "`vllm:kv_cache_usage_perc` (how hard the run drove the fleet); `router CPU` is the "
        "router process's CPU time over the run's wall-clock time (1.0 = one core busy).", "",
        "## Requests per engine", "", engine_shares(runs), "",
        "## Targets", "", routing_targets(runs, ideal), "",
        "## How the load was chosen", "", str(data.get("calibration", "")), "",
        "## Routers that did not run", "", failures(runs), "",
        "## Request errors (first kinds)", "", error_samples(runs), "",
    ]
    if png:
        parts += [f"![routing]({png})", ""]
    return "\n".join(parts)


# -- overhead ------------------------------------------------------------------------------------

OVERHEAD_HEADER = ("streams", "path", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "out tok/s",
                   "TTFT p50 x", "TTFT p99 x", "ITL p50 x", "tok/s x", "TTFT p50 x per round",
                   "router CPU ms/req", "requests")


def overhead_ratios(data: Mapping[str, object]) -> dict[str, dict[int, dict[str, float]]]:
    levels = data["levels"]
    assert isinstance(levels, dict)
    out: dict[str, dict[int, dict[str, float]]] = {}
    for conc_text, paths in levels.items():
        direct = paths.get("direct", {}).get("summary", {})
        for name, entry in paths.items():
            if name == "direct":
                continue
            s = entry.get("summary", {})
            out.setdefault(name, {})[int(conc_text)] = {
                k: ratio(_f(s.get(k)), _f(direct.get(k)))
                for k in ("ttft_p50", "ttft_p99", "itl_p50", "throughput_tok_s")
            }
    return out


def overhead_rows(data: Mapping[str, object]) -> list[list[object]]:
    levels = data["levels"]
    assert isinstance(levels, dict)
    ratios = overhead_ratios(data)
    rows: list[list[object]] = []
    for conc_text in sorted(levels, key=int):
        for name, entry in levels[conc_text].items():
            s = entry.get("summary", {})
            r = ratios.get(name, {}).get(int(conc_text), {})
            spread = entry.get("round_ttft_p50_ratios")
            spread_text = ("-" if not spread else
                           f"{min(spread):.3f}-{max(spread):.3f}")
            rows.append([
                conc_text, name, fmt(_ms(s.get("ttft_p50")), 1), fmt(_ms(s.get("ttft_p99")), 1),
                fmt(_ms(s.get("itl_p50")), 1), fmt(s.get("throughput_tok_s"), 0),
                r.get("ttft_p50", math.nan), r.get("ttft_p99", math.nan),
                r.get("itl_p50", math.nan), r.get("throughput_tok_s", math.nan), spread_text,
                fmt(_f(entry.get("cpu_ms_per_request")), 2), f"{_f(s.get('completed')):.0f}",
            ])
    return rows


def relay_text(data: Mapping[str, object]) -> str:
    relay = data.get("relay")
    if not isinstance(relay, dict) or not relay:
        return "Not measured in this run."
    lines = []
    for mode, r in relay.items():
        if not isinstance(r, dict):
            continue
        if r.get("error"):
            lines.append(f"- {mode}: failed: `{r['error']}`")
            continue
        lines.append(
            f"- {mode} ({r.get('streams')} streams, {fmt(r.get('interval_ms'), 1)} ms between a "
            f"stream's events): {fmt(r.get('events_per_s'), 0)} SSE events/s relayed with the "
            f"proxy at {fmt(r.get('proxy_cpu_util'), 2)} of its core, i.e. "
            f"**{fmt(r.get('events_per_cpu_s'), 0)} events per proxy CPU-second**")
    lines.append("")
    lines.append("One kvproxy process pinned to one core; the SSE source (`bench.firehose`) and "
                 "the client share the other core, so where the proxy's core is not saturated the "
                 "per-CPU-second figure is its one-core capacity, the events/s figure what this "
                 "machine reached.")
    return "\n".join(lines)


def overhead_settings(data: Mapping[str, object]) -> str:
    s = data["settings"]
    assert isinstance(s, dict)
    fleet = s["fleet"]
    return "\n".join([
        f"- engines: {fleet['engines']} simulated, profile `{fleet['profile']}`, time scale "
        f"{fleet['time_scale']} (latencies are wall-clock)",
        f"- requests: chat, {s['prompt_tokens']}-token unique prompts, {s['output_tokens']} "
        f"output tokens, streamed; closed loop at each concurrency",
        f"- interleaving: {s['rounds']} rounds; in each, every path (direct first) gets a "
        f"{s['slice_s']} s slice; direct = the client round-robins over the engines itself",
        f"- pinning: engines core(s) {s['engine_cores'] or 'any'}, routers core(s) "
        f"{s['router_cores'] or 'any'}, load generator {s['loadgen_cores']}",
    ])


def overhead_markdown(data: Mapping[str, object], png: str | None) -> str:
    unavailable = data.get("unavailable") or {}
    assert isinstance(unavailable, dict)
    parts = [
        "# Overhead benchmark", "", stamp(data), "", "## Settings", "", overhead_settings(data),
        "", "## Results", "", table(OVERHEAD_HEADER, overhead_rows(data)), "",
        "`x` columns are ratios to `direct` at the same concurrency over all rounds; "
        "`TTFT p50 x per round` is the range of that ratio over the rounds (its noise).", "",
        "## kvproxy relay rate", "", relay_text(data), "",
        "## Targets", "", overhead_targets(overhead_ratios(data)), "",
        "## Routers that did not run", "",
        "\n".join(f"- **{k}**: `{str(v)[:600]}`" for k, v in unavailable.items())
        or "Every router listed ran.", "",
    ]
    if png:
        parts += [f"![overhead]({png})", ""]
    return "\n".join(parts)


# -- driver ----------------------------------------------------------------------------------------


def calibration_markdown(results: Path) -> str:
    path = results / "calibration.json"
    if not path.exists():
        return ("No calibration results: run `python -m bench.calibrate` to see round-robin's "
                "TTFT against the load scale.")
    data = read_json(path)
    points = data.get("points")
    assert isinstance(points, list)
    rows = [[fmt(_f(p["rate_scale"]), 2), fmt(_f(p["ttft_p50"]), 2), fmt(_f(p["ttft_p90"]), 2),
             fmt(_f(p["ttft_p99"]), 2), fmt(_f(p["hit_rate"]), 3),
             fmt(_f(p["busy_fraction"]), 2), fmt(_f(p["preemptions"]), 0)] for p in points]
    header = ("rate scale", "RR TTFT p50 s", "RR TTFT p90 s", "RR TTFT p99 s", "hit rate",
              "busy fraction", "preemptions")
    return "\n".join([
        f"Round-robin on the simulator's own scheduler and step-time model, without wall clock "
        f"(`{data.get('command')}`, {data.get('started_at')}; same slice, caps and engines): the "
        f"load is chosen where round-robin's TTFT turns upward.", "",
        table(header, rows)])


def write_routing(results: Path) -> str | None:
    path = results / "routing.json"
    if not path.exists():
        return None
    data = read_json(path)
    data["calibration"] = calibration_markdown(results)
    png = _figure(lambda p: plots.routing_figure(
        data["runs"], _f(data["trace"]["ideal_hit_rate"]), footer_text(data), p),  # type: ignore[arg-type,index]
        results / "routing.png")
    text = routing_markdown(data, png)
    (results / "routing.md").write_text(text)
    return text


def write_overhead(results: Path) -> str | None:
    path = results / "overhead.json"
    if not path.exists():
        return None
    data = read_json(path)
    png = _figure(lambda p: plots.overhead_figure(overhead_ratios(data), footer_text(data), p),
                  results / "overhead.png")
    text = overhead_markdown(data, png)
    (results / "overhead.md").write_text(text)
    return text


def _figure(draw: object, path: Path) -> str | None:
    if plots.available() is not None:
        return None
    draw(path)  # type: ignore[operator]
    return path.name


def report_args(results: Path) -> list[str]:
    """Arguments for ``main`` after a benchmark run: docs/benchmarks.md is rewritten only from
    the default results folder; results elsewhere get their page next to them."""
    if results.resolve() == RESULTS.resolve():
        return ["--results", str(results)]
    return ["--results", str(results), "--docs", str(results / "benchmarks.md")]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--docs", type=Path, default=DOCS)
    args = p.parse_args(argv)
    routing = write_routing(args.results)
    overhead = write_overhead(args.results)
    args.docs.parent.mkdir(parents=True, exist_ok=True)
    args.docs.write_text(benchmarks_doc(routing, overhead, args.results, args.docs, now_utc(),
                                        plots.available()))
    print(f"wrote {args.docs} and reports under {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
