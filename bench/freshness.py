"""Freshness benchmark: what scraping every engine's metrics costs the proxy, per interval and
fleet size, to choose ``telemetry.interval_s``.

Usage: ``python -m bench.freshness [--quick]``; writes ``bench/results/freshness.{json,md}``.

Rules:
- One simulated fleet process per fleet size (``python -m engine_sidecar sim --engines N``),
  idle (no requests: the cost measured is the scrape alone, which does not depend on traffic),
  and one real proxy process (``kvproxy serve``) per interval, pinned to its own core where the
  machine has two (engines on the other).
- Proxy CPU share: its ``/proc/<pid>/stat`` CPU time over a measuring window divided by the
  window (1.0 = one core busy). Scrapes achieved and failed are read from the proxy's own
  ``/metrics``; the fresh share is the engines the proxy holds HEALTHY at the window's end.
- The machine is shared: its load average is reported with every row.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import orjson

from bench import machine
from bench.fleet import Fleet, FleetSpec
from bench.procs import Managed, free_port, http_get
from bench.report import RESULTS

SIZES = (8, 64, 256)
INTERVALS = (0.05, 0.2)


def _config(urls: list[str], port: int, interval: float) -> str:
    engines = "\n".join(f'  [[pools.engines]]\n  name = "e{i}"\n  url = "{u}"\n'
                        for i, u in enumerate(urls))
    # Timeout below the interval (required); staleness after a few intervals, never under 1 s.
    return (f'[server]\nport = {port}\n\n[telemetry]\ninterval_s = {interval}\n'
            f'timeout_s = {0.75 * interval}\nstale_after_s = {max(1.0, 5 * interval)}\n\n'
            f'[[pools]]\nname = "target"\nmodel = "llama-70b"\n{engines}')


def _sum_metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _counts(url: str) -> tuple[float, float]:
    status, text = http_get(url + "/metrics", timeout_s=10.0)
    if status != 200:
        return float("nan"), float("nan")
    return (_sum_metric(text, "kvproxy_scrape_duration_seconds_count"),
            _sum_metric(text, "kvproxy_scrape_failures_total"))


def _fresh_share(url: str) -> float:
    status, text = http_get(url + "/admin/engines", timeout_s=10.0)
    if status != 200:
        return float("nan")
    rows = orjson.loads(text)["engines"]
    return sum(1 for r in rows if r["health"] == "healthy") / max(1, len(rows))


def measure(fleet: Fleet, interval: float, window_s: float, logs: Path,
            cores: tuple[str | None, str | None]) -> dict[str, float]:
    port = free_port()
    cfg = logs / f"kvproxy-{len(fleet.urls)}-{interval}.toml"
    cfg.write_text(_config(fleet.urls, port, interval))
    proxy = Managed("kvproxy", [str(Path(sys.executable).with_name("kvproxy")), "serve",
                                "--config", str(cfg)], logs / "kvproxy.log", cores=cores[0])
    proxy.start()
    url = f"http://127.0.0.1:{port}"
    try:
        proxy.wait_http(url + "/health", timeout_s=60.0)
        time.sleep(max(2.0, 10 * interval))  # every engine scraped a few times
        scrapes0, failed0 = _counts(url)
        cpu0, sim0, t0 = proxy.cpu_seconds(), fleet.proc.cpu_seconds() if fleet.proc else 0.0, \
            time.monotonic()
        time.sleep(window_s)
        cpu1, sim1, t1 = proxy.cpu_seconds(), fleet.proc.cpu_seconds() if fleet.proc else 0.0, \
            time.monotonic()
        scrapes1, failed1 = _counts(url)
        fresh = _fresh_share(url)
    finally:
        proxy.stop()
    wall = t1 - t0
    expected = len(fleet.urls) * wall / interval
    return {"engines": len(fleet.urls), "interval_s": interval, "window_s": round(wall, 2),
            "proxy_cpu_share": (cpu1 - cpu0) / wall, "engines_cpu_share": (sim1 - sim0) / wall,
            "scrapes_per_s": (scrapes1 - scrapes0) / wall,
            "scrapes_expected_per_s": expected / wall,
            "scrape_failures_per_s": (failed1 - failed0) / wall, "fresh_share": fresh,
            "proxy_cpu_us_per_scrape": 1e6 * (cpu1 - cpu0) / max(1.0, scrapes1 - scrapes0),
            "load_avg": os.getloadavg()[0]}


def run(quick: bool) -> dict[str, object]:
    window = 6.0 if quick else 15.0
    two = (os.cpu_count() or 1) >= 2
    cores = ("0", "1") if two else (None, None)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvproxy-freshness-") as tmp:
        logs = Path(tmp)
        for n in SIZES:
            fleet = Fleet(FleetSpec(engines=n), logs, cores=cores[1]).start(timeout_s=120.0)
            try:
                for interval in INTERVALS:
                    row = measure(fleet, interval, window, logs, cores)
                    rows.append(row)
                    print(f"{n:4} engines, {interval * 1000:4.0f} ms: proxy CPU "
                          f"{100 * row['proxy_cpu_share']:5.1f} %, {row['scrapes_per_s']:7.0f} "
                          f"scrapes/s of {row['scrapes_expected_per_s']:7.0f}, failures "
                          f"{row['scrape_failures_per_s']:.1f}/s, fresh "
                          f"{100 * row['fresh_share']:.0f} %, load {row['load_avg']:.1f}",
                          file=sys.stderr)
            finally:
                fleet.stop()
    return {"benchmark": "freshness", "when": machine.now_utc(),
            "command": machine.command_line(), "environment": machine.environment(),
            "window_s": window, "pinned": two, "rows": rows}


def markdown(result: dict[str, object]) -> str:
    env = result["environment"]
    rows = result["rows"]
    assert isinstance(env, dict) and isinstance(rows, list)
    lines = [
        "# Scrape cost (freshness)", "",
        f"{result['when']}, `{result['command']}`; {env['cpu_model']} ({env['nproc']} cores, "
        f"shared), Python {env['python']}; proxy and engines pinned to separate cores: "
        f"{result['pinned']}; {result['window_s']} s measuring window per row. Idle engines "
        "(`kvproxy-sidecar sim`, one process); the proxy is `kvproxy serve`.", "",
        "| engines | interval | proxy CPU (share of one core) | µs CPU per scrape | scrapes/s "
        "(expected) | failed scrapes/s | engines fresh at end | load average |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['engines']} | {r['interval_s'] * 1000:.0f} ms | "
            f"{100 * r['proxy_cpu_share']:.1f} % | {r['proxy_cpu_us_per_scrape']:.0f} | "
            f"{r['scrapes_per_s']:.0f} ({r['scrapes_expected_per_s']:.0f}) | "
            f"{r['scrape_failures_per_s']:.1f} | {100 * r['fresh_share']:.0f} % | "
            f"{r['load_avg']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.freshness",
                                description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="6 s windows instead of 15 s")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    result = run(args.quick)
    machine.write_json(args.out / "freshness.json", result)
    (args.out / "freshness.md").write_text(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
