"""The overhead benchmark's Markdown report (from ``bench/results/overhead.json``).

Rules: every number comes from the results; ratios are against ``direct`` at the same
concurrency; verdicts come from ``bench.targets``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from bench.markdown import fmt, ms, num, stamp, table
from bench.stats import ratio
from bench.targets import cpu_targets, high_concurrency_targets, overhead_targets

OVERHEAD_HEADER = ("streams", "path", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "out tok/s",
                   "TTFT p50 x", "TTFT p99 x", "ITL p50 x", "tok/s x", "steady tok/s x",
                   "TTFT p50 x per round", "router CPU ms/req",
                   "requests sent / completed / failed", "cores busy")


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
                k: ratio(num(s.get(k)), num(direct.get(k)))
                for k in ("ttft_p50", "ttft_p99", "itl_p50", "throughput_tok_s")
            }
            out[name][int(conc_text)]["steady_tok_s"] = ratio(
                num(entry.get("steady_tok_s")), num(paths.get("direct", {}).get("steady_tok_s")))
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
                conc_text, name, fmt(ms(s.get("ttft_p50")), 1), fmt(ms(s.get("ttft_p99")), 1),
                fmt(ms(s.get("itl_p50")), 1), fmt(s.get("throughput_tok_s"), 0),
                r.get("ttft_p50", math.nan), r.get("ttft_p99", math.nan),
                r.get("itl_p50", math.nan), r.get("throughput_tok_s", math.nan),
                r.get("steady_tok_s", math.nan), spread_text,
                fmt(num(entry.get("cpu_ms_per_request")), 2), _requests_text(s),
                _busy_text(entry.get("cores_busy")),
            ])
    return rows


def renders_text(data: Mapping[str, object]) -> str:
    """What kvproxy's CPU per request in the results table carries besides serving: the
    sampler's ``/metrics`` renders, which run inside its CPU window (the fit runs no sampler)."""
    levels = data["levels"]
    assert isinstance(levels, dict)
    parts = []
    for conc_text in sorted(levels, key=int):
        for name, entry in levels[conc_text].items():
            per = num(entry.get("cpu_metrics_renders_per_request"))
            watch, summary = entry.get("proxy"), entry.get("summary")
            if math.isnan(per) and isinstance(watch, dict) and isinstance(summary, dict):
                # Older results: the same count from the sampler's tally and the completions.
                done = num(summary.get("completed"))
                renders = num(watch.get("samples")) + num(watch.get("missed_samples"))
                per = renders / done if done > 0 else math.nan
            if not math.isnan(per):
                parts.append(f"`{name}` at {conc_text} streams {per:.3f}")
    if not parts:
        return ""
    return ("kvproxy's `router CPU ms/req` above includes the `/metrics` renders of the sampler "
            "that polls it during its slices (the next section), per request: "
            + "; ".join(parts) + ". The CPU fit below runs no sampler: its a and b are clean.")


def _requests_text(summary: Mapping[str, object]) -> str:
    """Sent, completed and not completed (failed, shed or rate-limited): the percentiles are over
    completed requests only, so what they leave out is shown beside them."""
    sent, done = num(summary.get("requests")), num(summary.get("completed"))
    return f"{sent:.0f} / {done:.0f} / {sent - done:.0f}"


def _busy_text(busy: object) -> str:
    if not isinstance(busy, dict) or not busy:
        return "-"
    return ", ".join(f"{core.removeprefix('cpu')}: {num(v):.2f}" for core, v in busy.items())


def relay_text(data: Mapping[str, object]) -> str:
    relay = data.get("relay")
    if not isinstance(relay, dict) or not relay:
        return "Not measured in this run."
    lines = _relay_lines(relay)
    others = data.get("relay_by_router")
    for name, rates in (others.items() if isinstance(others, dict) else ()):
        if isinstance(rates, dict) and rates is not relay and rates != relay:
            lines += ["", f"`{name}`, the same way:", *_relay_lines(rates)]
    lines.append("")
    lines.append("One kvproxy process pinned to one core; the SSE source (`bench.firehose`) and "
                 "the client share the other core, so where the proxy's core is not saturated the "
                 "per-CPU-second figure is its one-core capacity, the events/s figure what this "
                 "machine reached.")
    return "\n".join(lines)


def _relay_lines(relay: Mapping[str, object]) -> list[str]:
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
    return lines


PROXY_HEADER = ("streams", "router", "event-loop lag p50 ms", "lag p99 ms", "scrape age p99 ms",
                "scrape age max ms", "samples with a stale engine", "/metrics p99 ms",
                "samples missed")


def proxy_rows(data: Mapping[str, object]) -> list[list[object]]:
    """kvproxy's own view of itself under load, per level (from ``bench.proxywatch``)."""
    levels = data["levels"]
    assert isinstance(levels, dict)
    rows: list[list[object]] = []
    for conc_text in sorted(levels, key=int):
        for name, entry in levels[conc_text].items():
            p = entry.get("proxy")
            if not isinstance(p, dict):
                continue
            rows.append([conc_text, name, fmt(ms(p.get("loop_lag_p50_s")), 1),
                         fmt(ms(p.get("loop_lag_p99_s")), 1), fmt(ms(p.get("scrape_age_p99_s")), 0),
                         fmt(ms(p.get("scrape_age_max_s")), 0),
                         f"{num(p.get('stale_samples')):.0f} of {num(p.get('samples')):.0f}",
                         fmt(ms(p.get("metrics_latency_p99_s")), 1),
                         f"{num(p.get('missed_samples')):.0f}"])
    return rows


def fit_text(data: Mapping[str, object]) -> str:
    found = data.get("fit")
    if not isinstance(found, dict) or not found.get("routers"):
        return "Not measured in this run."
    tokens = found.get("tokens", [])
    header = ("router", *(f"CPU ms/req at {t} tokens" for t in tokens), "a (ms per request)",
              "b (us per token)", "idle CPU ms/s", "a net of idle (ms)", "b net of idle (us)",
              "a net, per round", "b net, per round")
    rows = []
    for name, r in found["routers"].items():
        per = r.get("cpu_ms_per_request", {})
        rows.append([name, *(fmt(num(per.get(str(t))), 3) for t in tokens),
                     fmt(num(r.get("a_ms")), 3), fmt(num(r.get("b_us_per_token")), 1),
                     fmt(num(r.get("idle_cpu_ms_per_s")), 1), fmt(num(r.get("a_net_ms")), 3),
                     fmt(num(r.get("b_net_us_per_token")), 1),
                     _per_round(r, "a_net_ms", 3), _per_round(r, "b_net_us_per_token", 1)])
    return (f"At {found.get('concurrency')} streams, interleaved; the line through CPU per "
            f"request at each answer length. Idle CPU: each router's CPU per second over "
            f"{found.get('idle_s', 'n/a')} s with no traffic, measured before the slices; the "
            f"net columns take it off each slice (times the slice's span) before the fit, the "
            f"raw columns include it; the per-round columns are the same fit from each round's "
            f"slices alone (their spread is the figure's noise). `floor/*` are references, not "
            f"routers: the least an aiohttp server and client cost here (`bench/floor.py`)."
            f"\n\n" + table(header, rows))


def _per_round(fitted: Mapping[str, object], key: str, digits: int) -> str:
    rounds = fitted.get("rounds")
    if not isinstance(rounds, list) or not rounds:
        return "-"
    return ", ".join(fmt(num(r.get(key)), digits) for r in rounds if isinstance(r, dict))


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
        f"{s['router_cores'] or 'any'}, load generator {s['loadgen_cores']}; streams ramp up "
        f"over {s.get('ramp_s', 1.0)} s",
        _latency_line(s),
        *_plan_lines(data),
        f"- load average (1, 5, 15 min) before / after: {_load(data.get('load_before'))} / "
        f"{_load(data.get('load_after'))}",
    ])


def _latency_line(settings: Mapping[str, object]) -> str:
    """Which requests the latency percentiles are taken over (older results took every one)."""
    if settings.get("latency_after_ramp"):
        return ("- latency (TTFT, ITL, e2e percentiles and the per-round ratios): only requests "
                "sent at or after their slice's ramp ended, the cut the steady tok/s makes; "
                "request counts and out tok/s: every request")
    return ("- latency percentiles: every request, those sent during the ramp included (results "
            "from before the ramp was cut)")


def _plan_lines(data: Mapping[str, object]) -> list[str]:
    """Each level's own ramp and slice, where the run measured its requests' length first."""
    plans = data.get("level_plans")
    if not isinstance(plans, dict) or not plans:
        return []
    parts = []
    for conc_text in sorted(plans, key=int):
        p = plans[conc_text]
        if isinstance(p, dict):
            wave, ramp = fmt(num(p.get("wave_s")), 1), fmt(num(p.get("ramp_s")), 1)
            parts.append(f"{conc_text} streams: request {wave} s, ramp {ramp} s, slice "
                         f"{fmt(num(p.get('slice_s')), 1)} s")
    waves = data["settings"].get("steady_waves") if isinstance(data["settings"], dict) else None
    return [f"- per level (one unrecorded wave to direct first; the median request's length sets "
            f"a ramp of at least one request and a slice {fmt(num(waves), 1)} requests past it): "
            + "; ".join(parts)]


def _load(value: object) -> str:
    if not isinstance(value, list | tuple):
        return "-"
    return ", ".join(f"{float(v):.2f}" for v in value)


def _engine_cores(data: Mapping[str, object]) -> list[str]:
    settings = data.get("settings")
    cores = settings.get("engine_cores") if isinstance(settings, dict) else None
    return [f"cpu{c.strip()}" for c in str(cores or "").split(",") if c.strip().isdigit()]


def overhead_markdown(data: Mapping[str, object], png: str | None) -> str:
    unavailable = data.get("unavailable") or {}
    assert isinstance(unavailable, dict)
    parts = [
        "# Overhead benchmark", "", stamp(data), "", "## Settings", "", overhead_settings(data),
        "", "## Results", "", table(OVERHEAD_HEADER, overhead_rows(data)), "",
        "`x` columns are ratios to `direct` at the same concurrency over all rounds; "
        "`TTFT p50 x per round` is the range of that ratio over the rounds (its noise); "
        "`cores busy`: each core's busy fraction over that path's slices (`/proc/stat`).", "",
        *([renders_text(data), ""] if renders_text(data) else []),
        "## kvproxy under load: event-loop lag and telemetry age", "",
        table(PROXY_HEADER, proxy_rows(data)) if proxy_rows(data) else "Not measured.", "",
        "Sampled from kvproxy's own `/metrics` every 0.25 s during its slices: "
        "`kvproxy_event_loop_lag_seconds` (the probe's lateness), "
        "`kvproxy_engine_snapshot_age_seconds` (every engine's) and `kvproxy_engine_health`.", "",
        "## Router CPU per request: a + b x tokens", "", fit_text(data), "",
        "## kvproxy relay rate", "", relay_text(data), "",
        "## Targets", "", overhead_targets(data["levels"]),  # type: ignore[arg-type]
        high_concurrency_targets(data["levels"],  # type: ignore[arg-type]
                                 engine_cores=_engine_cores(data)),
        cpu_targets(data.get("fit"), data.get("relay"), data.get("relay_by_router")), "",
        "## Routers that did not run", "",
        "\n".join(f"- **{k}**: `{str(v)[:600]}`" for k, v in unavailable.items())
        or "Every router listed ran.", "",
    ]
    if png:
        parts += [f"![overhead]({png})", ""]
    return "\n".join(parts)
