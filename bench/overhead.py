"""Overhead benchmark: the same engines called directly and through each router, interleaved.

Usage: ``python -m bench.overhead [--quick] [options]`` (see ``--help``); writes
``bench/results/overhead.json`` and then the report.

Rules:
- One engine process and every router run for the whole benchmark; at each concurrency, rounds
  of short slices alternate over the paths (direct first), so that the machine's drifts fall on
  every path alike. ``direct`` is the client itself round-robining over the engines.
- Prompts are unique (no prefix-cache effect on any path); every request streams the same number
  of tokens. In each slice the streams start spread over ``RAMP_S``, not in one burst.
- A steady state at every level (``level_plan``): before a level's rounds, one wave of its
  streams goes to ``direct`` (each stream one request, not recorded) and the median request's
  length sets that level's ramp (at least one request long, so the streams' phases cover a whole
  request) and its slice (``--steady-waves`` requests past the ramp). Where a request outlasts
  a fixed slice (at 2,048 streams one takes about 10 s), a slice would otherwise time one wave
  of requests, not a rate anything sustains.
- Router CPU per request: the CPU time of the router's whole process tree (``/proc/<pid>/stat``
  of the parent and of its live workers, for ``+wN`` routers) read as each of its slices starts
  and ends, summed over its slices and divided by the requests they completed. CPU between its
  slices is not counted; its background work during a slice (kvproxy's scraping) is, since a
  slice cannot tell it apart from serving. At every level kvproxy's slices also run the sampler
  (``bench.proxywatch``: ``/metrics`` every 0.25 s, for the lag and scrape-age goals), whose
  renders fall in its CPU window: ``cpu_metrics_renders_per_request`` says how many per request,
  and the report says so. The CPU fit (``bench.fit``) runs no sampler, so its a and b are clean.
- The relay test puts kvproxy (and any other router named in ``--relay-routers``, one after
  another) alone on one core in front of a source that streams as fast as it
  can (``bench.firehose``), with the source and the client on the other core: "paced" (events
  one at a time, as tokens arrive) and "burst" (reads coalesce several events).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp

from bench import fit, gcwatch, machine, proxywatch, report
from bench.fleet import Fleet, FleetSpec
from bench.loadgen import Endpoint, closed_loop, make_session, request_body, run_async
from bench.peers import Router, launch_ready, parse_router_list
from bench.procs import Managed, free_port, pinned
from bench.prompts import random_tokens
from bench.report import RESULTS, report_args
from bench.stats import (
    RequestRecord,
    engine_counts,
    percentile,
    share_max_over_mean,
    summarize,
    tokens_between,
)
from bench.targets import DEFAULT_KVPROXY, round_ratios

RELAY_ROUTER = "kvproxy/round_robin"  # the one the relay target is judged on
# By default the relay test also runs the peer the CPU goals compare with, where it is installed:
# the relay goal is then read beside the peer's own rate on the same machine.
RELAY_ROUTERS = f"{RELAY_ROUTER},vllm-router/round_robin"
RAMP_S = 4.0  # streams start spread over this, not in one burst (a steady state, not waves)
STEADY_WAVES = 2.0  # a level's slice runs this many requests' lengths past its ramp
# kvproxy's default policy first: the targets judge it (and round-robin, the proxy's own cost).
DEFAULT_ROUTERS = (f"{DEFAULT_KVPROXY},kvproxy/round_robin,vllm-router/round_robin,"
                   "sglang-router/round_robin,litellm/least-busy")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.overhead",
                                description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer, shorter slices")
    p.add_argument("--concurrency", default="64,256,1024,2048")
    p.add_argument("--slice-s", type=float, default=None, help="seconds per slice (6; quick 3)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per concurrency (3; quick 2)")
    p.add_argument("--routers", default=DEFAULT_ROUTERS)
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--profile", default="llama70b-h100x4")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--engine-cores", default="1")
    p.add_argument("--router-cores", default="0")
    p.add_argument("--loadgen-cores", default=None,
                   help="cores of the load generator (default: the engines' cores, never the "
                        "router's)")
    p.add_argument("--ramp-s", type=float, default=RAMP_S)
    p.add_argument("--steady-waves", type=float, default=STEADY_WAVES,
                   help="each level's slice runs this many request lengths (measured on direct "
                        "before the level) past a ramp of at least one; 0 keeps --slice-s and "
                        "--ramp-s at every level")
    p.add_argument("--fit-tokens", default="16,256",
                   help="answer lengths for the CPU fit a + b*tokens ('' to skip)")
    p.add_argument("--fit-concurrency", type=int, default=64)
    p.add_argument("--no-relay", action="store_true", help="skip the relay-rate test")
    p.add_argument("--relay-only", action="store_true",
                   help="only the relay-rate test (no fleet, no slices, no fit)")
    p.add_argument("--relay-routers", default=RELAY_ROUTERS,
                   help="routers of the relay test, one after another (e.g. also floor/tcp); "
                        "one not installed is listed as unavailable")
    p.add_argument("--relay-events", type=int, default=2000)
    p.add_argument("--relay-s", type=float, default=8.0)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--no-report", action="store_true")
    return p


class Paths:
    """The endpoints of one run and the request bodies they get."""

    def __init__(self, engine_urls: list[str], model: str, prompt_tokens: int,
                 output_tokens: int) -> None:
        self.direct = [Endpoint(name="direct", base_url=u, model=model) for u in engine_urls]
        self.rng = random.Random(1)
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens

    def body(self, endpoint: Endpoint) -> bytes:
        return request_body(endpoint, random_tokens(self.rng, self.prompt_tokens),
                            self.output_tokens)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        routers = parse_router_list(args.routers)
    except ValueError as exc:
        parser.error(str(exc))
    slice_s = args.slice_s or (3.0 if args.quick else 6.0)
    rounds = args.rounds or (2 if args.quick else 3)
    if args.steady_waves <= 0 and slice_s <= args.ramp_s and not args.relay_only:
        # Latency and the steady rate are taken past the ramp: such slices would have neither.
        parser.error(f"with --steady-waves 0, --slice-s ({slice_s}) must exceed --ramp-s "
                     f"({args.ramp_s}): latency is measured on requests sent after the ramp")
    levels = [int(c) for c in args.concurrency.split(",")]
    fit_tokens = [int(t) for t in args.fit_tokens.split(",")] if args.fit_tokens else []
    # Room for the longest answer asked for, the fit's included (else the engines refuse those).
    longest = max([args.output_tokens, *fit_tokens])
    spec = FleetSpec(engines=args.engines, profile=args.profile, time_scale=args.time_scale,
                     max_model_len=args.prompt_tokens + longest + 64)
    result: dict[str, object] = {
        "benchmark": "overhead", "command": machine.command_line(),
        "started_at": machine.now_utc(), "machine": machine.environment(),
        "versions": machine.own_versions(),
        "settings": {"fleet": spec.settings(), "concurrency": levels, "slice_s": slice_s,
                     "rounds": rounds, "prompt_tokens": args.prompt_tokens,
                     "output_tokens": args.output_tokens, "engine_cores": args.engine_cores,
                     "router_cores": args.router_cores,
                     "loadgen_cores": _loadgen_cores(args) or "unpinned", "ramp_s": args.ramp_s,
                     "steady_waves": args.steady_waves,
                     # Latency percentiles leave out the requests sent during a slice's ramp.
                     "latency_after_ramp": True,
                     "fit_tokens": args.fit_tokens, "fit_concurrency": args.fit_concurrency},
        "unavailable": {}, "levels": {},
    }
    work = args.out / "raw" / "overhead"
    if not args.relay_only:
        _measure_fleet(args, spec, routers, levels, fit_tokens, rounds, slice_s, work, result)
    if not args.no_relay:
        by_router = {}
        unavailable = result["unavailable"]
        assert isinstance(unavailable, dict)
        for r in parse_router_list(args.relay_routers):
            reason = r.unavailable()
            if reason:
                unavailable.setdefault(r.name, reason)
                continue
            by_router[r.name] = relay_rate(args, work, r)
        result["relay"] = by_router.get(RELAY_ROUTER, {})
        result["relay_by_router"] = by_router
    result["finished_at"] = machine.now_utc()
    machine.write_json(args.out / "overhead.json", result)
    if not args.no_report and not args.relay_only:
        report.main(report_args(args.out))
    return 0


def _measure_fleet(args: argparse.Namespace, spec: FleetSpec, routers: list[Router],
                   levels: list[int], fit_tokens: list[int], rounds: int, slice_s: float,
                   work: Path, result: dict[str, object]) -> None:
    """The interleaved slices and the CPU fit, with the engines and every router running."""
    with running(args, spec, routers, work, result) as (paths, started):
        result["load_before"] = os.getloadavg()
        with pinned(_loadgen_cores(args)):
            plans: dict[str, object] = {}
            result["levels"] = run_async(measure(paths, started, levels, rounds, slice_s,
                                                 args.ramp_s, args.steady_waves, plans))
            result["level_plans"] = plans
            if args.fit_tokens:
                result["fit"] = run_async(fit.measure_fit(
                    paths, started, fit_tokens, args.fit_concurrency, rounds, slice_s,
                    args.ramp_s))
        result["load_after"] = os.getloadavg()


@contextmanager
def running(args: argparse.Namespace, spec: FleetSpec, routers: list[Router], work: Path,
            result: dict[str, object],
            ) -> Iterator[tuple[Paths, list[tuple[Router, Managed, Endpoint]]]]:
    """The engines (on ``args.engine_cores``) and every router that starts (on
    ``args.router_cores``; one that does not is noted in ``result``), all stopped on the way
    out whatever happened."""
    fleet = Fleet(spec, work, cores=args.engine_cores or None)
    started: list[tuple[Router, Managed, Endpoint]] = []
    try:
        fleet.start()
        started = start_routers(routers, fleet, spec.model, work, args, result)
        yield Paths(fleet.urls, spec.model, args.prompt_tokens, args.output_tokens), started
    finally:
        for _, proc, _ in started:
            proc.stop()
        fleet.stop()


def start_routers(routers: list[Router], fleet: Fleet, model: str, work: Path,
                  args: argparse.Namespace,
                  result: dict[str, object]) -> list[tuple[Router, Managed, Endpoint]]:
    versions = result["versions"]
    unavailable = result["unavailable"]
    assert isinstance(versions, dict) and isinstance(unavailable, dict)
    out: list[tuple[Router, Managed, Endpoint]] = []
    for router in routers:
        reason = router.unavailable()
        if reason:
            unavailable[router.name] = reason
            continue
        versions[router.router] = router.version()
        try:
            proc, endpoint = launch_ready(router, fleet.urls, model, work / router.router,
                                          args.router_cores or None)
            out.append((router, proc, endpoint))
        except Exception as exc:  # one peer's failure is reported, the others still run
            unavailable[router.name] = f"{type(exc).__name__}: {exc}"[:2000]
    return out


def _loadgen_cores(args: argparse.Namespace) -> str | None:
    return args.loadgen_cores or args.engine_cores or None


LATENCY_KEYS = ("ttft_p50", "ttft_p90", "ttft_p99", "itl_p50", "itl_p99", "e2e_p50", "e2e_p99")


def after_ramp(recs: list[RequestRecord], ramp_s: float) -> list[RequestRecord]:
    """The records of one slice sent at or after its ramp's end: the cut the steady tokens/s
    makes. Before it only some streams are open (stream k starts at k x ramp / streams), so
    those requests meet a lighter load than the level's."""
    if not recs:
        return []
    origin = min(r.sent_at for r in recs)  # stream 0 starts at once
    return [r for r in recs if r.sent_at >= origin + ramp_s]


def steady_tokens(recs: list[RequestRecord], ramp_s: float,
                  slice_s: float) -> tuple[float, float]:
    """Tokens delivered between the ramp's end and the slice's deadline, and that window's
    length (0, 0 where the slice is no longer than its ramp)."""
    if not recs or slice_s <= ramp_s:
        return 0.0, 0.0
    origin = min(r.sent_at for r in recs)
    return tokens_between(recs, origin + ramp_s, origin + slice_s), slice_s - ramp_s


def round_figures(recs: list[RequestRecord], ramp_s: float,
                  slice_s: float) -> dict[str, float | None]:
    """One path's figures in one round: TTFT p50 and p99 past the ramp, steady tokens/s, and
    the requests sent, completed and failed (all of them, the ramp's included)."""
    late = [r.ttft for r in after_ramp(recs, ramp_s) if r.ok and r.ttft is not None]
    tokens, window = steady_tokens(recs, ramp_s, slice_s)
    completed = sum(1 for r in recs if r.ok)
    return {"ttft_p50": percentile(late, 50), "ttft_p99": percentile(late, 99),
            "steady_tok_s": tokens / window if window else None,
            "sent": float(len(recs)), "completed": float(completed),
            "failed": float(len(recs) - completed)}


def level_summary(records: list[RequestRecord], latency_recs: list[RequestRecord],
                  span: float) -> dict[str, float]:
    """Counts and throughput over every request; latency percentiles over ``latency_recs``
    (those sent past their slice's ramp), with how many completed requests that is."""
    summary = summarize(records, duration_s=span)
    late = summarize(latency_recs, duration_s=span)
    summary.update({k: late[k] for k in LATENCY_KEYS})
    summary["latency_requests"] = late["completed"]
    return summary


def level_plan(slice_s: float, ramp_s: float, wave_s: float | None,
               waves: float) -> tuple[float, float]:
    """A level's ramp and slice, where one request takes ``wave_s`` (None: not measured): the
    ramp at least one request long, the slice ``waves`` requests past it; never shorter than
    the ``slice_s`` and ``ramp_s`` asked for. ``waves`` 0 keeps those as they are."""
    if waves <= 0 or wave_s is None or not wave_s > 0:
        return ramp_s, slice_s
    ramp = max(ramp_s, wave_s)
    return ramp, max(slice_s, ramp + waves * wave_s)


async def measure(paths: Paths, started: list[tuple[Router, Managed, Endpoint]],
                  levels: list[int], rounds: int, slice_s: float,
                  ramp_s: float = RAMP_S, waves: float = 0.0,
                  plans: dict[str, object] | None = None) -> dict[str, object]:
    out: dict[str, object] = {}
    async with make_session() as session:
        await _warm(session, paths, started)
        for conc in levels:
            wave_s = await _pilot(session, paths, conc, ramp_s) if waves > 0 else None
            level_ramp, level_slice = level_plan(slice_s, ramp_s, wave_s, waves)
            if plans is not None:
                plans[str(conc)] = {"wave_s": wave_s, "ramp_s": level_ramp,
                                    "slice_s": level_slice}
            print(f"== {conc} streams (request {wave_s or 0:.1f} s: ramp {level_ramp:.1f} s, "
                  f"slice {level_slice:.1f} s)", flush=True)
            out[str(conc)] = await measure_level(session, paths, started, conc, rounds,
                                                 level_slice, level_ramp)
    return out


async def _pilot(session: aiohttp.ClientSession, paths: Paths, conc: int,
                 ramp_s: float) -> float | None:
    """One wave of ``conc`` streams to ``direct``, each one request: the median request's
    length in seconds (None if none completed)."""
    direct = paths.direct

    def pick(n: int) -> tuple[Endpoint, bytes]:
        target = direct[n % len(direct)]
        return target, paths.body(target)

    recs, _ = await closed_loop(session, pick, concurrency=conc, duration_s=ramp_s,
                                run_start=time.perf_counter(), ramp_s=ramp_s)
    lengths = [r.e2e for r in recs if r.ok and r.e2e is not None]
    return percentile(lengths, 50) if lengths else None


async def _warm(session: aiohttp.ClientSession, paths: Paths,
                started: list[tuple[Router, Managed, Endpoint]]) -> None:
    for endpoint in [*paths.direct, *(e for _, _, e in started)] * 2:
        body = request_body(endpoint, "warm up " * 8, 4)
        async with session.post(endpoint.url, data=body, headers=dict(endpoint.headers)) as r:
            await r.read()


async def measure_level(session: aiohttp.ClientSession, paths: Paths,
                        started: list[tuple[Router, Managed, Endpoint]], conc: int, rounds: int,
                        slice_s: float, ramp_s: float = RAMP_S) -> dict[str, object]:
    names = ["direct", *(r.name for r, _, _ in started)]
    records: dict[str, list[RequestRecord]] = {n: [] for n in names}
    spans = dict.fromkeys(names, 0.0)
    cpu = dict.fromkeys(names, 0.0)
    # Each round's figures per path: the judged ratios' spread over rounds (bench.targets).
    per_round: dict[str, list[dict[str, float | None]]] = {n: [] for n in names}
    # Requests sent at or after their slice's ramp: the latency percentiles' population.
    latency_recs: dict[str, list[RequestRecord]] = {n: [] for n in names}
    watches = {n: proxywatch.Watch() for n in names if n.startswith("kvproxy/")}
    lag: dict[str, dict[float, float]] = {}
    gcs = {n: gcwatch.Tally() for n in watches}
    overflows: dict[str, int] = {}
    busy: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    # Tokens delivered between the last stream's start and the slice's deadline, and that
    # window's length: the rate with every stream running, without the ramp and the drain.
    steady = dict.fromkeys(names, 0.0)
    steady_s = dict.fromkeys(names, 0.0)
    start = time.perf_counter()
    for _ in range(rounds):
        for name in names:
            recs, span, used = await _slice(session, paths, started, name, conc, slice_s, start,
                                            ramp_s, watches.get(name), lag, gcs.get(name),
                                            overflows, busy[name])
            records[name] += recs
            latency_recs[name] += after_ramp(recs, ramp_s)
            spans[name] += span
            cpu[name] += used
            tokens, window = steady_tokens(recs, ramp_s, slice_s)
            steady[name] += tokens
            steady_s[name] += window
            per_round[name].append(round_figures(recs, ramp_s, slice_s))
    level: dict[str, object] = {}
    for name in names:
        ok = sum(1 for r in records[name] if r.ok)
        per_engine = engine_counts(records[name])
        entry: dict[str, object] = {
            "summary": level_summary(records[name], latency_recs[name], spans[name]),
            # A closed loop's span ends with its slowest request, so the balance over engines
            # and the longest request say what a throughput below direct's is made of.
            "e2e_max_s": max((r.e2e for r in records[name] if r.e2e is not None), default=None),
            # Output tokens per second from the end of the ramp to the deadline: steady only
            # where a slice outlasts several requests (see bench/README.md).
            "steady_tok_s": steady[name] / steady_s[name] if steady_s[name] else None,
            "engine_requests": per_engine,
            "share_max_over_mean": share_max_over_mean(per_engine),
            # Connections the kernel dropped at a full accept queue during this router's slices
            # (machine-wide: the router's listener, or an engine's when the router is direct).
            "listen_overflows": overflows.get(name),
            # Each core's busy fraction over this path's slices (mean of the slices): where the
            # engines' and load generator's core is near 1, every path's throughput is that
            # core's, and the ratios to direct say more about it than about the router.
            "cores_busy": {core: sum(v) / len(v) for core, v in sorted(busy[name].items())},
            "cpu_ms_per_request": cpu[name] * 1000.0 / ok if name != "direct" and ok else None,
            "rounds": per_round[name],
            # The rounds where both figures exist (``rounds`` keeps them all).
            "round_ttft_p50_ratios": [
                v for v in round_ratios({"rounds": per_round[name]},
                                        {"rounds": per_round["direct"]}, "ttft_p50")
                if not math.isnan(v)] if name != "direct" else None,
        }
        if name in watches:
            # The sampler's /metrics renders fall inside this path's CPU windows (the fit runs
            # none): its CPU per request above carries this many renders per request.
            renders = watches[name].samples + watches[name].missed
            entry["cpu_metrics_renders_per_request"] = renders / ok if ok else None
            entry["proxy"] = {
                **watches[name].summary(),
                "loop_lag_p99_s": proxywatch.histogram_quantile(0.99, {}, lag.get(name, {})),
                "loop_lag_p50_s": proxywatch.histogram_quantile(0.5, {}, lag.get(name, {})),
                "gc": gcs[name].summary(spans[name]),
            }
        level[name] = entry
    return level


async def _slice(session: aiohttp.ClientSession, paths: Paths,
                 started: list[tuple[Router, Managed, Endpoint]], name: str, conc: int,
                 slice_s: float, start: float, ramp_s: float = RAMP_S,
                 watch: proxywatch.Watch | None = None,
                 lag: dict[str, dict[float, float]] | None = None,
                 gcs: gcwatch.Tally | None = None,
                 overflows: dict[str, int] | None = None,
                 busy: dict[str, list[float]] | None = None,
                 ) -> tuple[list[RequestRecord], float, float]:
    proc = next((p for r, p, _ in started if r.name == name), None)
    endpoint = next((e for r, _, e in started if r.name == name), None)

    def pick(n: int) -> tuple[Endpoint, bytes]:
        target = endpoint or paths.direct[n % len(paths.direct)]
        return target, paths.body(target)

    watching = watch is not None and endpoint is not None and lag is not None
    stop = asyncio.Event()
    if watching:
        assert endpoint is not None and watch is not None and lag is not None
        text_before = await proxywatch.metrics_text(session, endpoint.base_url)
        before = proxywatch.lag_buckets(text_before)
        sampler = asyncio.create_task(proxywatch.watch(session, endpoint.base_url, watch, stop),
                                      name="proxy-watch")
    cpu0 = proc.tree_cpu_seconds() if proc else 0.0
    dropped0 = machine.listen_overflows()
    ticks0 = machine.core_times()
    recs, span = await closed_loop(session, pick, concurrency=conc, duration_s=slice_s,
                                   run_start=start, ramp_s=ramp_s)
    cpu1 = proc.tree_cpu_seconds() if proc else 0.0
    dropped1 = machine.listen_overflows()
    if busy is not None:
        for core, share in machine.cores_busy(ticks0, machine.core_times()).items():
            busy.setdefault(core, []).append(share)
    if overflows is not None and dropped0 is not None and dropped1 is not None:
        overflows[name] = overflows.get(name, 0) + dropped1 - dropped0
    if watching:
        assert endpoint is not None and lag is not None
        stop.set()
        await sampler
        text_after = await proxywatch.metrics_text(session, endpoint.base_url)
        after = proxywatch.lag_buckets(text_after)
        if gcs is not None:
            gcs.add(text_before, text_after)
        total = lag.setdefault(name, {})
        for bound, count in after.items():  # only this slice's observations, summed over slices
            total[bound] = total.get(bound, 0.0) + count - before.get(bound, 0.0)
    return recs, span, cpu1 - cpu0


# -- relay rate ----------------------------------------------------------------------------------

RELAY_MODES = {
    # name: (streams, pause between a stream's events in ms)
    "paced": (64, 1.0),  # events arrive one by one, as tokens do
    "burst": (16, 0.0),  # as fast as the socket takes them: reads coalesce several events
}


def relay_rate(args: argparse.Namespace, work: Path, router: Router) -> dict[str, object]:
    """``router`` alone on its core relaying a fast SSE source, in each mode; events/s and CPU."""
    out: dict[str, object] = {}
    for mode, (streams, interval_ms) in RELAY_MODES.items():
        out[mode] = _relay_mode(args, work, streams, interval_ms, router)
        print(f"   relay {router.name} {mode}: {out[mode]}", flush=True)
    return out


def _relay_mode(args: argparse.Namespace, work: Path, streams: int, interval_ms: float,
                router: Router) -> dict[str, object]:
    port = free_port()
    argv = [sys.executable, "-m", "bench.firehose", "--port", str(port),
            "--interval-ms", str(interval_ms)]
    source = Managed("firehose", argv, work / "firehose.log",
                     cores=args.engine_cores or None).start()
    proxy: Managed | None = None
    old_affinity = os.sched_getaffinity(0)
    try:
        source.wait_http(f"http://127.0.0.1:{port}/health")
        proxy, endpoint, ready = router.launch([f"http://127.0.0.1:{port}"], "firehose",
                                               work / "relay", args.router_cores or None)
        proxy.wait_http(ready, timeout_s=60)
        if args.engine_cores:
            os.sched_setaffinity(0, {int(c) for c in args.engine_cores.split(",")})
        cpu0 = proxy.tree_cpu_seconds()
        events, span = run_async(_firehose_load(endpoint, args, streams))
        cpu_used = proxy.tree_cpu_seconds() - cpu0
    except Exception as exc:
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"[:1000]}
    finally:
        os.sched_setaffinity(0, old_affinity)
        if proxy is not None:
            proxy.stop()
        source.stop()
    return {"events": events, "duration_s": span, "events_per_s": events / span,
            "proxy_cpu_s": cpu_used, "proxy_cpu_util": cpu_used / span,
            "events_per_cpu_s": events / cpu_used if cpu_used > 0 else None,
            "streams": streams, "interval_ms": interval_ms,
            "events_per_request": args.relay_events, "proxy_cores": args.router_cores,
            "source_and_client_cores": args.engine_cores}


async def _firehose_load(endpoint: Endpoint, args: argparse.Namespace,
                         streams: int) -> tuple[int, float]:
    total = 0
    sent = iter(range(1 << 62))
    headers = {"Content-Type": "application/json", **dict(endpoint.headers)}
    async with make_session() as session:

        async def stream(stop_at: float) -> None:
            nonlocal total
            while time.perf_counter() < stop_at:
                # A unique prompt each time: identical deterministic requests may be coalesced
                # by a response cache's single flight, which is not what is measured here.
                body = request_body(endpoint, f"relay {next(sent)}", args.relay_events)
                # The type said, as a client must: the Rust routers refuse a body without it (415).
                async with session.post(endpoint.url, data=body, headers=headers) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"the router answered {resp.status} in the relay test: "
                                           f"{(await resp.read())[:200]!r}")
                    async for chunk in resp.content.iter_any():
                        total += chunk.count(b"data: ")
                        if time.perf_counter() >= stop_at:
                            return

        t0 = time.perf_counter()
        stop_at = t0 + args.relay_s
        await asyncio.gather(*(stream(stop_at) for _ in range(streams)))
        return total, time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())
