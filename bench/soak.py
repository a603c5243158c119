"""Soak benchmarks of the proxy process: its memory over many requests with client aborts
(``churn``), and thousands of idle streams held open at once (``idle``).

Usage: ``python -m bench.soak {churn,idle,all} [options]`` (see ``--help``); writes
``bench/results/soak.json`` (one key per scenario) and prints it.

Rules:
- kvproxy runs as its own process (``python -m proxy serve --config``), the simulated engines in
  another (``python -m engine_sidecar sim --engines N``), each pinned (proxy core 0, engines core 1
  by default); the load comes from this process, unpinned. Every process is stopped by its PID.
- RSS is ``VmRSS`` of the proxy process from ``/proc/<pid>/status``, sampled every ``--sample-s``.
- Request loops are bounded in count and in time (``--max-s``); a run cut short says so.
- Afterwards the proxy's in-flight gauges, its TCP connections to the engines (``/proc``) and the
  engines' running requests are read; all should be 0, bar the one metrics-scrape connection per
  engine (the idle keep-alive connections of the upstream pool are counted again once its
  keep-alive timeout has passed twice).
- Benchmarks are not tests: nothing here asserts on time; the figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench import machine
from bench.fleet import Fleet, FleetSpec, parse_counters
from bench.procs import Managed, free_port
from bench.report import RESULTS
from bench.report_soak import soak_markdown
from bench.stats import percentile

KEEPALIVE_S = 30.0  # proxy.fleet.upstream's keep-alive timeout for idle engine connections
MODEL = "soak-model"


@dataclass
class Procs:
    fleet: Fleet
    proxy: Managed
    url: str

    def stop(self) -> None:
        self.proxy.stop()
        self.fleet.stop()


def start(args: argparse.Namespace, work: Path, spec: FleetSpec, sets: Sequence[str]) -> Procs:
    fleet = Fleet(spec, work, cores=args.engine_cores).start()
    port = free_port()
    lines = ["[server]", 'host = "127.0.0.1"', f"port = {port}", "", "[[pools]]",
             'name = "target"', f'model = "{MODEL}"']
    for i, url in enumerate(fleet.urls):
        lines += ["", "[[pools.engines]]", f'name = "e{i}"', f'url = "{url}"']
    (work / "kvproxy.toml").write_text("\n".join(lines) + "\n")
    argv = [sys.executable, "-m", "proxy", "--log-level", "WARNING", "serve", "--config",
            str(work / "kvproxy.toml"), *(a for s in sets for a in ("--set", s))]
    proxy = Managed("kvproxy", argv, work / "kvproxy.log", cores=args.proxy_cores).start()
    url = f"http://127.0.0.1:{port}"
    try:
        proxy.wait_http(url + "/ready", timeout_s=60)
    except RuntimeError:
        proxy.stop()
        fleet.stop()
        raise
    return Procs(fleet, proxy, url)


# --- reading the proxy process and the engines -------------------------------------------------


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for {pid}")


def upstream_sockets(pid: int, ports: set[int]) -> int:
    """Established TCP connections of ``pid`` whose remote port is an engine's."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = fd.readlink().name
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    count = 0
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            remote_port = int(cols[2].rsplit(":", 1)[1], 16)
            if cols[3] == "01" and cols[9] in inodes and remote_port in ports:
                count += 1
    return count


async def metric_sums(http: aiohttp.ClientSession, url: str, names: Sequence[str]
                      ) -> dict[str, float]:
    async with http.get(url + "/metrics") as resp:
        return parse_counters(await resp.text(), names)


async def leftovers(http: aiohttp.ClientSession, procs: Procs) -> dict[str, float]:
    """What should be back to 0 once the load is over."""
    gauges = await metric_sums(http, procs.url, ("kvproxy_inflight_requests",
                                                 "kvproxy_engine_inflight"))
    running = 0.0
    for url in procs.fleet.urls:
        running += (await metric_sums(http, url, ("vllm:num_requests_running",)))[
            "vllm:num_requests_running"]
    ports = {int(u.rsplit(":", 1)[1]) for u in procs.fleet.urls}
    # The scraper keeps one metrics connection per engine open: those are not leftovers.
    return {"proxy_inflight_requests": gauges["kvproxy_inflight_requests"],
            "proxy_engine_inflight": gauges["kvproxy_engine_inflight"],
            "engines_running": running,
            "upstream_connections": float(upstream_sockets(procs.proxy.pid, ports)),
            "of_which_metrics_scrapes": float(len(ports))}


async def settle(http: aiohttp.ClientSession, procs: Procs) -> dict[str, object]:
    """Leftovers right after the load, and again after the upstream keep-alive timeout."""
    now = await leftovers(http, procs)
    # aiohttp closes an idle pooled connection within two keep-alive timeouts.
    await asyncio.sleep(2 * KEEPALIVE_S + 5)
    later = await leftovers(http, procs)
    return {"right_after": now, f"after_{2 * KEEPALIVE_S + 5:.0f}s": later,
            "rss_mib": rss_mib(procs.proxy.pid)}


@dataclass
class RssSampler:
    pid: int
    interval_s: float
    samples: list[tuple[float, int, float]] = field(default_factory=list)  # (t, done, MiB)
    done: int = 0

    async def run(self, stop: asyncio.Event) -> None:
        t0 = time.monotonic()
        while not stop.is_set():
            self.samples.append((time.monotonic() - t0, self.done, rss_mib(self.pid)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)


def slope(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of y over x (0 for fewer than two distinct x)."""
    n = len(points)
    mx = sum(x for x, _ in points) / max(n, 1)
    my = sum(y for _, y in points) / max(n, 1)
    var = sum((x - mx) ** 2 for x, _ in points)
    return 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in points) / var


def rss_summary(samples: Sequence[tuple[float, int, float]]) -> dict[str, float]:
    half = samples[len(samples) // 2 :]
    per_10k = [(float(done) / 10_000, mib) for _, done, mib in samples]
    return {"start_mib": samples[0][2], "peak_mib": max(s[2] for s in samples),
            "end_mib": samples[-1][2], "samples": float(len(samples)),
            "slope_mib_per_10k_requests": slope(per_10k),
            "slope_mib_per_10k_requests_second_half": slope(per_10k[len(per_10k) // 2 :]),
            "slope_mib_per_min_second_half": slope([(t / 60, m) for t, _, m in half])}


# --- churn: many short streams, some abandoned by their client ----------------------------------


@dataclass
class Tally:
    ok: int = 0
    aborted: int = 0
    errors: int = 0
    statuses: dict[int, int] = field(default_factory=dict)


async def one_request(http: aiohttp.ClientSession, url: str, i: int, abort: bool,
                      max_tokens: int, tally: Tally) -> None:
    body = {"model": MODEL, "prompt": f"soak request {i}: tell me about caches", "stream": True,
            "max_tokens": max_tokens, "ignore_eos": True}
    try:
        async with http.post(url + "/v1/completions", json=body) as resp:
            tally.statuses[resp.status] = tally.statuses.get(resp.status, 0) + 1
            if abort and resp.status == 200:
                await resp.content.readany()  # the first events, then the client goes away
                resp.close()
                tally.aborted += 1
            elif resp.status == 200 and b"[DONE]" in await resp.read():
                tally.ok += 1
            else:
                tally.errors += 1
    except (aiohttp.ClientError, TimeoutError):
        tally.errors += 1


async def churn_load(args: argparse.Namespace, procs: Procs, sampler: RssSampler) -> Tally:
    tally = Tally()
    rng = random.Random(args.seed)
    deadline = time.monotonic() + args.max_s
    counter = iter(range(args.requests))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def worker() -> None:
            for i in counter:
                if time.monotonic() > deadline:
                    return
                await one_request(http, procs.url, i, rng.random() < args.abort_share,
                                  args.max_tokens, tally)
                sampler.done += 1

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return tally


async def churn(args: argparse.Namespace, work: Path) -> dict[str, object]:
    spec = FleetSpec(engines=args.engines, profile="llama8b-h100", model=MODEL,
                     time_scale=args.fast_scale)
    procs = start(args, work, spec, tuple(args.proxy_set))
    try:
        sampler = RssSampler(procs.proxy.pid, args.sample_s)
        stop = asyncio.Event()
        sampling = asyncio.create_task(sampler.run(stop), name="soak-rss")
        t0 = time.monotonic()
        tally = await churn_load(args, procs, sampler)
        elapsed = time.monotonic() - t0
        stop.set()
        await sampling
        async with aiohttp.ClientSession() as http:
            after = await settle(http, procs)
        return {"settings": _settings(args, spec), "elapsed_s": elapsed,
                "requests_done": sampler.done, "requests_per_s": sampler.done / elapsed,
                "cut_short": sampler.done < args.requests, "completed": tally.ok,
                "aborted": tally.aborted, "errors": tally.errors,
                "statuses": {str(k): v for k, v in tally.statuses.items()},
                "rss": rss_summary(sampler.samples), "after": after,
                "rss_series": [[round(t, 1), d, round(m, 2)] for t, d, m in sampler.samples]}
    finally:
        procs.stop()


# --- idle: thousands of open streams from stalled engines ---------------------------------------


@dataclass
class IdleStreams:
    opened: int = 0
    completed: int = 0
    aborted: int = 0
    errors: int = 0
    all_open: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)


async def idle_stream(http: aiohttp.ClientSession, url: str, i: int, abort: bool,
                      state: IdleStreams, total: int) -> None:
    body = {"model": MODEL, "prompt": f"idle stream {i}", "stream": True, "max_tokens": 8,
            "ignore_eos": True}
    try:
        async with http.post(url + "/v1/completions", json=body) as resp:
            first = await resp.content.readany() if resp.status == 200 else b""
            if not first:
                state.errors += 1
                return
            state.opened += 1
            if state.opened == total:
                state.all_open.set()
            if abort:
                await state.release.wait()
                resp.close()
                state.aborted += 1
            elif b"[DONE]" in first + await resp.read():
                state.completed += 1
            else:
                state.errors += 1
    except (aiohttp.ClientError, TimeoutError):
        state.errors += 1


async def health_latencies(url: str, window_s: float, every_s: float) -> list[float]:
    out: list[float] = []
    end = time.monotonic() + window_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < end:
            t = time.perf_counter()
            async with http.get(url + "/health") as resp:
                await resp.read()
            out.append((time.perf_counter() - t) * 1000)
            await asyncio.sleep(every_s)
    return out


async def open_streams(args: argparse.Namespace, procs: Procs, http: aiohttp.ClientSession,
                       state: IdleStreams) -> list[asyncio.Task[None]]:
    tasks = []
    gap = args.ramp_s / args.streams
    for i in range(args.streams):
        abort = i % 2 == 1  # every other stream is abandoned by its client, the rest complete
        tasks.append(asyncio.create_task(
            idle_stream(http, procs.url, i, abort, state, args.streams), name=f"idle-{i}"))
        await asyncio.sleep(gap)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(state.all_open.wait(), args.stall_s / 2)
    return tasks


async def stall_engines(http: aiohttp.ClientSession, procs: Procs, stall_s: float) -> None:
    for url in procs.fleet.urls:
        async with http.post(url + "/admin/faults",
                             json={"stall_after_tokens": 1, "stall_s": stall_s}) as resp:
            assert resp.status == 200, await resp.text()


async def idle(args: argparse.Namespace, work: Path) -> dict[str, object]:
    spec = FleetSpec(engines=args.engines, profile="llama8b-h100", model=MODEL,
                     time_scale=args.fast_scale, max_num_seqs=1024)
    sets = (f"upstream.idle_timeout_s={args.stall_s + 60}",
            f"upstream.first_byte_timeout_s={args.stall_s + 60}",
            "upstream.max_connections_per_engine=1024", *args.proxy_set)
    procs = start(args, work, spec, sets)
    try:
        return await _idle_run(args, procs, spec)
    finally:
        procs.stop()


async def _idle_run(args: argparse.Namespace, procs: Procs, spec: FleetSpec) -> dict[str, object]:
    timeout = aiohttp.ClientTimeout(total=args.stall_s + 120)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as http:
        await asyncio.gather(*(one_request(http, procs.url, i, False, 8, Tally())
                               for i in range(50)))  # warm the proxy's code paths first
        health_before = await health_latencies(procs.url, 3.0, 0.05)
        rss_before = rss_mib(procs.proxy.pid)
        await stall_engines(http, procs, args.stall_s)
        state = IdleStreams()
        t0 = time.monotonic()
        tasks = await open_streams(args, procs, http, state)
        open_s = time.monotonic() - t0
        rss_open = rss_mib(procs.proxy.pid)
        ports = {int(u.rsplit(":", 1)[1]) for u in procs.fleet.urls}
        conns_open = upstream_sockets(procs.proxy.pid, ports)
        health_open = await health_latencies(procs.url, args.window_s, 0.05)
        rss_peak = max(rss_open, rss_mib(procs.proxy.pid))
        state.release.set()
        await asyncio.wait_for(asyncio.gather(*tasks), args.stall_s + 120)
        after = await settle(http, procs)
    return {"settings": _settings(args, spec), "streams": args.streams, "opened": state.opened,
            "seconds_to_open_all": open_s, "completed": state.completed,
            "aborted": state.aborted, "errors": state.errors,
            "rss_before_mib": rss_before, "rss_all_open_mib": rss_open, "rss_peak_mib": rss_peak,
            "rss_per_stream_kib": (rss_peak - rss_before) * 1024 / max(state.opened, 1),
            "upstream_connections_while_open": conns_open,
            "health_ms_idle": _latency(health_before), "health_ms_streams_open":
            _latency(health_open), "after": after}


def _latency(ms: Sequence[float]) -> dict[str, float]:
    return {"n": float(len(ms)), "p50": percentile(ms, 50), "p99": percentile(ms, 99),
            "max": max(ms)}


def _settings(args: argparse.Namespace, spec: FleetSpec) -> dict[str, object]:
    return {**{k: v for k, v in vars(args).items() if k not in ("out", "scenario")},
            "fleet": spec.settings()}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.splitlines()[0])
    p.add_argument("scenario", choices=("churn", "idle", "all"))
    p.add_argument("--requests", type=int, default=100_000, help="churn: requests (100000)")
    p.add_argument("--abort-share", type=float, default=0.3, help="churn: client aborts (0.3)")
    p.add_argument("--concurrency", type=int, default=64, help="churn: streams at once (64)")
    p.add_argument("--max-tokens", type=int, default=16, help="churn: tokens per stream (16)")
    p.add_argument("--max-s", type=float, default=690.0, help="churn: time limit (690 s)")
    p.add_argument("--streams", type=int, default=2000, help="idle: streams held open (2000)")
    p.add_argument("--ramp-s", type=float, default=20.0, help="idle: seconds to open them (20)")
    p.add_argument("--stall-s", type=float, default=75.0, help="idle: engines' stall (75 s)")
    p.add_argument("--window-s", type=float, default=20.0, help="idle: /health probing (20 s)")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--fast-scale", type=float, default=200.0, help="engines' time scale (200)")
    p.add_argument("--sample-s", type=float, default=2.0, help="RSS sampling interval (2 s)")
    p.add_argument("--proxy-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a kvproxy --set override (repeatable), e.g. routing.index_blocks=0")
    p.add_argument("--proxy-cores", default="0")
    p.add_argument("--engine-cores", default="1")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--label", default=None,
                   help="store the churn run under churn-LABEL (e.g. a run with --proxy-set)")
    p.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    return p


async def run(args: argparse.Namespace) -> dict[str, object]:
    result: dict[str, object] = (machine.read_json(args.out) if args.out.exists() else {})
    for name, scenario in (("churn", churn), ("idle", idle)):
        if args.scenario in (name, "all"):
            key = f"{name}-{args.label}" if args.label and name == "churn" else name
            with tempfile.TemporaryDirectory(prefix=f"kvproxy-soak-{name}-") as work:
                stamp = {"command": machine.command_line(), "started_at": machine.now_utc(),
                         "machine": machine.environment(), "versions": machine.own_versions()}
                result[key] = {**stamp, **await scenario(args, Path(work)),
                                "finished_at": machine.now_utc()}
            machine.write_json(args.out, result)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = asyncio.run(run(args))
    report = RESULTS / "soak.md" if args.out.resolve() == (RESULTS / "soak.json").resolve() \
        else args.out.with_suffix(".md")
    report.write_text(soak_markdown(result))
    print(f"wrote {args.out} and {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
