"""The soak report (``bench/results/soak.json`` from ``python -m bench.soak``) as Markdown.

Rules: every figure comes from the results file; a scenario that has not run is left out and the
command that produces it is named.
"""

from __future__ import annotations

from collections.abc import Mapping

from bench.markdown import fmt, stamp, table

Run = Mapping[str, object]


def _get(data: Run, *path: str) -> object:
    value: object = data
    for key in path:
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


def _num(value: object, digits: int = 1) -> str:
    return fmt(float(value), digits) if isinstance(value, int | float) else "n/a"


def _settings(run: Run, lines: list[str]) -> str:
    s = _get(run, "settings")
    fleet = _get(run, "settings", "fleet")
    assert isinstance(s, Mapping) and isinstance(fleet, Mapping)
    head = [f"- engines: {fleet.get('engines')} simulated in one process, profile "
            f"`{fleet.get('profile')}`, time scale {fleet.get('time_scale')}",
            f"- pinning: proxy core(s) {s.get('proxy_cores')}, engines core(s) "
            f"{s.get('engine_cores')}, load generator unpinned"]
    overrides = s.get("proxy_set") or []
    assert isinstance(overrides, list)
    if overrides:
        head.append("- proxy overrides: " + ", ".join(f"`{o}`" for o in overrides))
    return "\n".join(head + lines)


def _leftovers(run: Run) -> str:
    after = _get(run, "after")
    assert isinstance(after, Mapping)
    later_key = next(k for k in after if k.startswith("after_"))
    now, later = after["right_after"], after[later_key]
    assert isinstance(now, Mapping) and isinstance(later, Mapping)
    rows = [(label, _num(now.get(key), 0), _num(later.get(key), 0)) for label, key in (
        ("proxy in-flight requests (`kvproxy_inflight_requests`)", "proxy_inflight_requests"),
        ("proxy in-flight per engine, summed (`kvproxy_engine_inflight`)",
         "proxy_engine_inflight"),
        ("engines' running requests (`vllm:num_requests_running`)", "engines_running"),
        ("proxy's TCP connections to the engines", "upstream_connections"),
        ("  of which metrics scrapes (one per engine, kept open)", "of_which_metrics_scrapes"))]
    return table(["after the load", "right after", later_key.replace("_", " ")], rows)


def churn_markdown(key: str, run: Run) -> str:
    s = _get(run, "settings")
    rss = _get(run, "rss")
    assert isinstance(s, Mapping) and isinstance(rss, Mapping)
    settings = _settings(run, [
        f"- load: {s.get('requests')} streamed completions, {s.get('concurrency')} at a time "
        f"(closed loop), {s.get('max_tokens')} tokens each; a share {s.get('abort_share')} of "
        "the clients read the first events and close the connection",
        f"- RSS of the proxy process (`VmRSS`) sampled every {s.get('sample_s')} s"])
    cut = " (**cut short by the time limit**)" if run.get("cut_short") else ""
    results = table(
        ["requests", "seconds", "req/s", "completed", "aborted", "errors", "RSS start MiB",
         "RSS peak MiB", "RSS end MiB", "MiB per 10k requests", "same, second half"],
        [(str(run.get("requests_done")), _num(run.get("elapsed_s")),
          _num(run.get("requests_per_s"), 0), str(run.get("completed")), str(run.get("aborted")),
          str(run.get("errors")), _num(rss.get("start_mib")), _num(rss.get("peak_mib")),
          _num(rss.get("end_mib")), _num(rss.get("slope_mib_per_10k_requests"), 2),
          _num(rss.get("slope_mib_per_10k_requests_second_half"), 2))])
    return "\n".join([
        f"## Churn: many short streams, some abandoned (`{key}`)", "", stamp(run), "", settings,
        "", results + cut, "", "Slopes are least-squares fits of RSS over requests completed.",
        "", _leftovers(run), ""])


def growth_markdown(data: Run) -> str:
    """RSS growth of each churn run side by side: what the routing index accounts for."""
    rows = []
    for key in (k for k in data if k.startswith("churn")):
        rss = _get(data, key, "rss")
        overrides = _get(data, key, "settings", "proxy_set") or []
        if isinstance(rss, Mapping) and isinstance(overrides, list):
            growth = float(rss["end_mib"]) - float(rss["start_mib"])  # type: ignore[arg-type]
            rows.append((f"`{key}`", ", ".join(f"`{o}`" for o in overrides) or "defaults",
                         _num(growth), _num(rss.get("slope_mib_per_10k_requests_second_half"), 2)))
    if len(rows) < 2:
        return ""
    return "\n".join([
        "## Where the memory goes", "",
        table(["run", "proxy settings", "RSS end - start MiB", "MiB per 10k, second half"], rows),
        "", "With `routing.index_blocks = 0` the prefix-routing index is off; the difference "
        "between the runs is that index filling toward its bound (`routing.index_blocks` block "
        "hashes per engine, the least recently routed evicted first). Every request here brings "
        "one new block, so within the run the index is still filling; once full it stays that "
        "size.", ""])


def idle_markdown(run: Run) -> str:
    s = _get(run, "settings")
    assert isinstance(s, Mapping)
    settings = _settings(run, [
        f"- load: {s.get('streams')} streamed completions opened over {s.get('ramp_s')} s; the "
        f"engines send the first token, then hold every stream {s.get('stall_s')} s "
        "(`stall_after_tokens` fault); meanwhile `/health` is timed every 50 ms for "
        f"{s.get('window_s')} s; then every other client closes its stream and the rest "
        "read theirs to the end"])
    streams = table(
        ["streams", "opened", "seconds to open all", "completed", "aborted", "errors",
         "RSS before MiB", "RSS all open MiB", "RSS peak MiB", "KiB per open stream",
         "engine connections while open"],
        [(str(run.get("streams")), str(run.get("opened")), _num(run.get("seconds_to_open_all")),
          str(run.get("completed")), str(run.get("aborted")), str(run.get("errors")),
          _num(run.get("rss_before_mib")), _num(run.get("rss_all_open_mib")),
          _num(run.get("rss_peak_mib")), _num(run.get("rss_per_stream_kib")),
          str(run.get("upstream_connections_while_open")))])
    health = table(["`/health`", "probes", "p50 ms", "p99 ms", "max ms"], [
        (label, _num(_get(run, key, "n"), 0), _num(_get(run, key, "p50"), 2),
         _num(_get(run, key, "p99"), 2), _num(_get(run, key, "max"), 2))
        for label, key in (("before the streams", "health_ms_idle"),
                           ("streams open", "health_ms_streams_open"))])
    return "\n".join(["## Idle streams held open", "", stamp(run), "", settings, "", streams,
                      "", health, "", _leftovers(run), ""])


def soak_markdown(data: Run) -> str:
    parts = ["# Soak benchmark", ""]
    churns = [k for k in data if k.startswith("churn")]
    parts += [churn_markdown(k, data[k]) for k in churns if isinstance(data[k], Mapping)]  # type: ignore[arg-type]
    if not churns:
        parts += ["No churn run yet: `python -m bench.soak churn`.", ""]
    parts += [growth_markdown(data)]
    idle = data.get("idle")
    parts += [idle_markdown(idle) if isinstance(idle, Mapping) else
              "No idle-streams run yet: `python -m bench.soak idle`.", ""]
    return "\n".join(parts)
