"""The routing benchmark's Markdown report (from ``bench/results/routing.json``).

Rules: every number comes from the results; the wording around them is fixed; verdicts come from
``bench.targets``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from bench.machine import read_json
from bench.markdown import Run, fmt, ms, num, stamp, table
from bench.stats import ratio
from bench.targets import routing_targets

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
            fmt(s["ttft_p90"], 2), ci_text, fmt(s["ttft_p99"], 2), fmt(ms(s["itl_p50"]), 1),
            fmt(ms(s["itl_p99"]), 1), fmt(s["throughput_tok_s"], 0),
            fmt(s["throughput_req_s"], 2), hit, ratio(num(hit), ideal),
            fmt(run.get("share_max_over_mean"), 2),
            f"{s['completed']:.0f}/{s['requests']:.0f}", f"{s['shed']:.0f}", f"{s['failed']:.0f}",
            f"{num(run.get('preemptions')):.0f}",
            *_load_cells(run.get("engine_load")),
            fmt(num(run.get("router_cpu_s")) / num(run.get("duration_s")), 2),
        ])
    return rows


def _load_cells(load: object) -> list[str]:
    if not isinstance(load, dict) or not load:
        return ["n/a", "n/a", "n/a"]
    return [fmt(num(load.get("queued_fraction")), 2), fmt(num(load.get("mean_waiting")), 1),
            fmt(num(load.get("mean_kv_usage")), 2)]


def engine_shares(runs: Sequence[Run]) -> str:
    lines = []
    for run in runs:
        counts = run.get("engine_requests")
        if isinstance(counts, dict) and counts:
            values = " ".join(f"{num(v):.0f}" for v in counts.values())
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
        f"{fmt(num(t.get('rate_per_s')) * num(s['rate_scale']), 2)} req/s), chosen so that "
        f"round-robin runs the fleet near saturation",
        f"- speed: engines and arrivals run {s['time_scale']}x faster than real time (arrival "
        f"times divided by {fmt(num(s['compression']), 2)}); latencies and throughput below are in "
        f"engine time (wall-clock x {s['time_scale']}), so a router's fixed wall-clock delay "
        f"counts {s['time_scale']}x",
        f"- engines: {fleet['engines']} simulated, profile `{fleet['profile']}`, KV cache "
        f"{kv_text(data)}, max_model_len {fleet['max_model_len']}; one process, fresh for "
        f"every run",
        f"- pinning: engines on core(s) {s['engine_cores'] or 'any'}, router on core(s) "
        f"{s['router_cores'] or 'any'}, load generator {s['loadgen_cores']}",
        f"- prefix-cache hit rate of the slice: ideal (one infinite cache) "
        f"{fmt(t.get('ideal_hit_rate'))}; round-robin over {fleet['engines']} infinite caches "
        f"{fmt(t.get('round_robin_infinite_hit_rate'))}",
    ])


def kv_text(data: Mapping[str, object]) -> str:
    """KV size as the engines reported it (``vllm:cache_config_info``) in the first good run."""
    for run in data.get("runs", []):  # type: ignore[attr-defined]
        kv = run.get("engine_kv_config") if isinstance(run, dict) else None
        if kv and kv.get("num_gpu_blocks") and kv.get("block_size"):
            blocks, size = int(kv["num_gpu_blocks"]), int(kv["block_size"])
            return f"{blocks} blocks x {size} tokens = {blocks * size} tokens per engine"
    return "as the profile sizes it"


def routing_markdown(data: Mapping[str, object], png: str | None) -> str:
    runs = data["runs"]
    assert isinstance(runs, list)
    ideal = num(data["trace"]["ideal_hit_rate"])  # type: ignore[index]
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


def calibration_markdown(results: Path) -> str:
    path = results / "calibration.json"
    if not path.exists():
        return ("No calibration results: run `python -m bench.calibrate` to see round-robin's "
                "TTFT against the load scale.")
    data = read_json(path)
    points = data.get("points")
    assert isinstance(points, list)
    rows = [[fmt(num(p["rate_scale"]), 2), fmt(num(p["ttft_p50"]), 2), fmt(num(p["ttft_p90"]), 2),
             fmt(num(p["ttft_p99"]), 2), fmt(num(p["hit_rate"]), 3),
             fmt(num(p["busy_fraction"]), 2), fmt(num(p["preemptions"]), 0)] for p in points]
    header = ("rate scale", "RR TTFT p50 s", "RR TTFT p90 s", "RR TTFT p99 s", "hit rate",
              "busy fraction", "preemptions")
    lines = [
        f"Round-robin on the simulator's own scheduler and step-time model, without wall clock "
        f"(`{data.get('command')}`, {data.get('started_at')}; same slice, caps and engines): the "
        f"load is chosen where round-robin's TTFT turns upward.", "",
        table(header, rows)]
    ceiling = data.get("cache_ceiling")
    if isinstance(ceiling, dict):
        lines += ["", (
            f"The KV cache size is chosen so that the hit-rate target can be met at all: a router "
            f"that knew every engine's cache exactly (longest cached prefix first, load ignored) "
            f"would reach {fmt(num(ceiling['oracle_hit_rate']))} with "
            f"{int(num(ceiling['kv_tokens_per_engine']))} tokens of KV cache per engine, against "
            f"the ideal {fmt(num(ceiling['ideal_hit_rate']))} of one infinite cache "
            f"(`bench.traces.oracle_hit_rate`).")]
    return "\n".join(lines)
