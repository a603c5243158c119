"""Routing benchmark: one trace slice replayed through every router in front of fresh engines.

Usage: ``python -m bench.routing [--quick] [options]`` (see ``--help``); writes
``bench/results/routing.json`` (raw records under ``bench/results/raw/``) and then the report.

Rules:
- Every run gets a fresh engine process (cold KV caches), the same slice, the same prompts, the
  same schedule; only the router differs. Runs are sequential, never overlapping.
- Load and speed are separate knobs. ``--rate-scale R`` multiplies the trace's arrival rate (the
  load on the fleet); ``--time-scale S`` runs the engines S times faster than real time and the
  arrivals with them. Arrival times are therefore divided by ``R * S``, and every latency is
  reported multiplied by S: in the engines' time, the time a real fleet would see.
- The hit rate is the engines' own: prefix-cache hit and query counters summed over engines,
  differenced over the run. The ideal is computed from the same (capped) slice.
- A router that cannot start or fails its run is recorded with its error; the others still run.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import traceback
from collections.abc import Coroutine
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import orjson

from bench import machine, report
from bench.fleet import Fleet, FleetSpec, GaugeSampler, deltas, fleet_hit_rate, requests_per_engine
from bench.loadgen import Endpoint, make_session, replay, request_body, run_async, send_one
from bench.peers import Router, all_routers, parse_router_list
from bench.procs import Managed
from bench.prompts import PromptMapper, workload
from bench.report import RESULTS, report_args
from bench.stats import bootstrap_ci, engine_counts, share_max_over_mean, summarize
from bench.traces import Caps, apply_caps, describe, hit_rate

T = TypeVar("T")

FULL_SLICE_S = 600.0
QUICK_SLICE_S = 300.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a few-minute run: shorter slice, "
                   "kvproxy's policies plus each peer's best-known policy")
    p.add_argument("--trace", default="mooncake_conversation.jsonl",
                   help="a file in ../shared/traces, a path, or 'synthetic' (tenants x system "
                   "prompts x documents x questions)")
    p.add_argument("--start-s", type=float, default=0.0, help="slice start, trace seconds")
    p.add_argument("--duration-s", type=float, default=None, help="slice length, trace seconds")
    p.add_argument("--rate-scale", type=float, default=3.5,
                   help="multiply the trace's arrival rate (load) by this (3.5)")
    p.add_argument("--time-scale", type=float, default=3.0,
                   help="engines and arrivals run this many times faster than real time (3)")
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--profile", default="llama70b-h100x4")
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--max-input-tokens", type=int, default=16384)
    p.add_argument("--max-output-tokens", type=int, default=256)
    p.add_argument("--output-scale", type=float, default=0.25)
    p.add_argument("--routers", default=None, help="comma list, e.g. kvproxy/*,vllm-router/"
                   "cache_aware (default: every kvproxy policy and every installed peer policy)")
    p.add_argument("--engine-cores", default="1", help="taskset cores for the engines ('' = none)")
    p.add_argument("--router-cores", default="0", help="taskset cores for the router ('' = none)")
    p.add_argument("--request-timeout-s", type=float, default=180.0, help="wall-clock, per request")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--no-report", action="store_true")
    return p


def quick_routers() -> list[Router]:
    return parse_router_list("kvproxy/*,vllm-router/cache_aware,sglang-router/cache_aware,"
                             "litellm/least-busy")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    duration = args.duration_s or (QUICK_SLICE_S if args.quick else FULL_SLICE_S)
    time_scale = args.time_scale
    compression = args.rate_scale * time_scale
    if args.routers:
        routers = parse_router_list(args.routers)
    else:
        routers = quick_routers() if args.quick else all_routers()

    caps = Caps(max_input_tokens=args.max_input_tokens, max_output_tokens=args.max_output_tokens,
                output_scale=args.output_scale)
    reqs = apply_caps(workload(args.trace, start_s=args.start_s, duration_s=duration), caps)
    spec = FleetSpec(engines=args.engines, profile=args.profile, time_scale=time_scale,
                     num_gpu_blocks=args.num_gpu_blocks,
                     max_model_len=args.max_input_tokens + args.max_output_tokens + 64)
    raw_dir = args.out / "raw"
    result: dict[str, object] = {
        "benchmark": "routing",
        "command": machine.command_line(),
        "started_at": machine.now_utc(),
        "machine": machine.environment(),
        "versions": machine.own_versions(),
        "settings": {
            "trace": args.trace, "slice_start_s": args.start_s, "slice_duration_s": duration,
            "rate_scale": args.rate_scale, "time_scale": time_scale,
            "compression": compression, "caps": asdict(caps),
            "fleet": spec.settings(), "engine_cores": args.engine_cores,
            "router_cores": args.router_cores, "loadgen_cores": "unpinned",
            "request_timeout_s": args.request_timeout_s, "api": "chat", "quick": args.quick,
        },
        "trace": {**describe(reqs), "ideal_hit_rate": hit_rate(reqs),
                  "round_robin_infinite_hit_rate": hit_rate(reqs, args.engines)},
        "runs": [],
    }
    print(f"slice: {len(reqs)} requests over {duration:.0f} trace s; ideal hit rate "
          f"{result['trace']['ideal_hit_rate']:.3f}; {len(routers)} routers", flush=True)  # type: ignore[index]
    runs: list[dict[str, object]] = result["runs"]  # type: ignore[assignment]
    mapper = PromptMapper()
    for router in routers:
        print(f"== {router.name}", flush=True)
        run = run_one(router, spec, reqs, mapper, args, compression, time_scale, raw_dir)
        runs.append(run)
        _print_run(run)
        machine.write_json(args.out / "routing.json", result)  # partial results survive a crash
    result["finished_at"] = machine.now_utc()
    machine.write_json(args.out / "routing.json", result)
    if not args.no_report:
        report.main(report_args(args.out))
    return 0


def _cores(text: str) -> str | None:
    return text or None


def run_one(router: Router, spec: FleetSpec, reqs: list, mapper: PromptMapper,  # type: ignore[type-arg]
            args: argparse.Namespace, compression: float, time_scale: float,
            raw_dir: Path) -> dict[str, object]:
    run: dict[str, object] = {"router": router.name, "version": router.version()}
    reason = router.unavailable()
    if reason:
        run.update(status="unavailable", error=reason)
        return run
    work = raw_dir / router.name.replace("/", "-")
    fleet = Fleet(spec, work, cores=_cores(args.engine_cores))
    proc: Managed | None = None
    try:
        fleet.start()
        proc, endpoint, ready = router.launch(fleet.urls, spec.model, work,
                                              _cores(args.router_cores))
        proc.wait_http(ready, timeout_s=90, headers=dict(endpoint.headers))
        run_async(_warm_up(endpoint))
        before = fleet.scrape()
        cpu0 = proc.cpu_seconds()
        sampler = GaugeSampler(fleet.urls)
        res = run_async(_sampled(sampler, replay(endpoint, reqs, mapper, compression=compression,
                                                 timeout_s=args.request_timeout_s)))
        cpu1 = proc.cpu_seconds()
        after = fleet.scrape()
        if not proc.alive():
            raise RuntimeError(f"router exited during the run: {proc.log_tail()}")
    except Exception as exc:
        run.update(status="error", error=f"{type(exc).__name__}: {exc}"[:2000])
        traceback.print_exc()
        return run
    finally:
        if proc is not None:
            proc.stop()
        fleet.stop()
    delta = deltas(before, after)
    per_engine = requests_per_engine(delta)
    _write_raw(raw_dir / f"routing-{router.name.replace('/', '-')}.jsonl", res.records)
    summary = summarize(res.records, duration_s=res.duration_s, time_scale=time_scale)
    ttfts = [r.ttft * time_scale for r in res.records if r.ok and r.ttft is not None]
    summary["ttft_p90_ci"] = list(bootstrap_ci(ttfts, 90))  # type: ignore[assignment]
    run.update(
        status="ok",
        summary=summary,
        hit_rate=fleet_hit_rate(delta),
        engine_requests=per_engine,
        share_max_over_mean=share_max_over_mean(per_engine),
        header_engines=len(engine_counts(res.records)),
        engine_load=sampler.summary(),
        preemptions=sum(d.get("vllm:num_preemptions_total", 0.0) for d in delta.values()),
        router_cpu_s=cpu1 - cpu0,
        duration_s=res.duration_s,
        max_lag_s=res.max_lag_s,
        errors=_error_sample(res.records),
    )
    return run


async def _sampled(sampler: GaugeSampler, work: Coroutine[Any, Any, T]) -> T:
    stop = asyncio.Event()
    task = asyncio.create_task(sampler.run(stop), name="gauge-sampler")
    try:
        return await work
    finally:
        stop.set()
        await task


async def _warm_up(endpoint: Endpoint) -> None:
    """One short request, so connection set-up is not in the first measured TTFT."""
    body = request_body(endpoint, "warm up " * 8, 4)
    async with make_session() as session:
        rec = await send_one(session, endpoint, body, index=-1, run_start=time.perf_counter())
    if not rec.ok:
        raise RuntimeError(f"warm-up request failed: status {rec.status} {rec.error}")


def _error_sample(records: list) -> list[str]:  # type: ignore[type-arg]
    seen: dict[str, int] = {}
    for r in records:
        if r.error:
            key = f"{r.status}: {r.error[:160]}"
            seen[key] = seen.get(key, 0) + 1
    return [f"{n}x {k}" for k, n in sorted(seen.items(), key=lambda kv: -kv[1])[:5]]


def _write_raw(path: Path, records: list) -> None:  # type: ignore[type-arg]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        for r in records:
            fh.write(orjson.dumps(asdict(r)) + b"\n")


def _print_run(run: dict[str, object]) -> None:
    if run.get("status") != "ok":
        print(f"   {run.get('status')}: {run.get('error')}", flush=True)
        return
    s = run["summary"]
    assert isinstance(s, dict)
    print(f"   ttft p50/p90/p99 {s['ttft_p50']:.2f}/{s['ttft_p90']:.2f}/{s['ttft_p99']:.2f} s  "
          f"hit {run['hit_rate']:.3f}  share {run['share_max_over_mean']:.2f}  "
          f"done {s['completed']:.0f}/{s['requests']:.0f} shed {s['shed']:.0f}  "
          f"lag {run['max_lag_s']:.2f}s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
