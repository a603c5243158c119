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
from collections.abc import Coroutine, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import orjson

from bench import machine, report
from bench.fleet import Fleet, FleetSpec, GaugeSampler, deltas, fleet_hit_rate, requests_per_engine
from bench.loadgen import (
    Endpoint,
    ReplayResult,
    make_session,
    replay,
    request_body,
    run_async,
    send_one,
)
from bench.peers import Router, all_routers, launch_ready, parse_router_list
from bench.procs import Managed, free_port_range, pinned, tree_cpu_seconds
from bench.prompts import PromptMapper, workload
from bench.report import RESULTS, report_args
from bench.stats import RequestRecord, bootstrap_ci, engine_counts, share_max_over_mean, summarize
from bench.traces import Caps, TraceRequest, apply_caps, describe, hit_rate
from bench.wordtok import make_word_tokenizer

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
    p.add_argument("--rate-scale", type=float, default=3.25,
                   help="multiply the trace's arrival rate (load) by this (3.25)")
    p.add_argument("--time-scale", type=float, default=3.0,
                   help="engines and arrivals run this many times faster than real time (3)")
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--profile", default="llama70b-h100x4-kv8")
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--max-input-tokens", type=int, default=16384)
    p.add_argument("--max-output-tokens", type=int, default=256)
    p.add_argument("--output-scale", type=float, default=0.25)
    p.add_argument("--routers", default=None, help="comma list, e.g. kvproxy/*,vllm-router/"
                   "cache_aware (default: every kvproxy policy and every installed peer policy)")
    p.add_argument("--engine-cores", default="1", help="taskset cores for the engines ('' = none)")
    p.add_argument("--router-cores", default="0", help="taskset cores for the router ('' = none)")
    p.add_argument("--loadgen-cores", default=None,
                   help="cores of the load generator (default: unpinned; pinned beside the "
                        "engines it made every router's figures noisier, see the suite's notes)")
    p.add_argument("--request-timeout-s", type=float, default=180.0, help="wall-clock, per request")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the router list this many times, one round after another (noise)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--no-report", action="store_true")
    p.add_argument("--suite", action="store_true", help="the workload suite (bench.suite): every "
                   "router over every workload, each at round-robin's knee; --trace, --start-s, "
                   "--duration-s, --rate-scale and --max-input-tokens do not apply")
    p.add_argument("--workloads", default=None,
                   help="with --suite: a comma list of bench.workloads names (default: all)")
    return p


def quick_routers() -> list[Router]:
    return parse_router_list("kvproxy/*,vllm-router/cache_aware,sglang-router/cache_aware,"
                             "litellm/least-busy")


@dataclass(frozen=True)
class Plan:
    """Everything a run needs, decided once from the command line."""

    args: argparse.Namespace
    reqs: list[TraceRequest]
    spec: FleetSpec
    routers: list[Router]
    duration_s: float
    caps: Caps

    @property
    def compression(self) -> float:
        return float(self.args.rate_scale * self.args.time_scale)

    @property
    def time_scale(self) -> float:
        return float(self.args.time_scale)

    @property
    def tokenizing_fleet(self) -> bool:
        """With a precise-mode arm in the list, every arm's engines tokenize and publish KV
        events (only precise arms listen), so that all arms run on the same engines."""
        return any(r.precise for r in self.routers)


def make_plan(args: argparse.Namespace) -> Plan:
    duration = args.duration_s or (QUICK_SLICE_S if args.quick else FULL_SLICE_S)
    if args.routers:
        routers = parse_router_list(args.routers)
    else:
        routers = quick_routers() if args.quick else all_routers()
    caps = Caps(max_input_tokens=args.max_input_tokens, max_output_tokens=args.max_output_tokens,
                output_scale=args.output_scale)
    reqs = apply_caps(workload(args.trace, start_s=args.start_s, duration_s=duration), caps)
    spec = FleetSpec(engines=args.engines, profile=args.profile, time_scale=args.time_scale,
                     num_gpu_blocks=args.num_gpu_blocks,
                     max_model_len=args.max_input_tokens + args.max_output_tokens + 64)
    return Plan(args, reqs, spec, routers, duration, caps)


def result_skeleton(plan: Plan) -> dict[str, object]:
    args = plan.args
    return {
        "benchmark": "routing",
        "command": machine.command_line(),
        "started_at": machine.now_utc(),
        "machine": machine.environment(),
        "versions": machine.own_versions(),
        "settings": {
            "trace": args.trace, "slice_start_s": args.start_s,
            "slice_duration_s": plan.duration_s, "rate_scale": args.rate_scale,
            "time_scale": plan.time_scale, "compression": plan.compression,
            "caps": asdict(plan.caps), "fleet": plan.spec.settings(),
            "tokenizing_fleet": plan.tokenizing_fleet,
            "engine_cores": args.engine_cores, "router_cores": args.router_cores,
            "loadgen_cores": loadgen_cores(args) or "unpinned",
            "request_timeout_s": args.request_timeout_s,
            "api": "chat", "session_header": "X-Session-ID = first two block ids",
            "quick": args.quick,
        },
        "trace": {**describe(plan.reqs), "ideal_hit_rate": hit_rate(plan.reqs),
                  "round_robin_infinite_hit_rate": hit_rate(plan.reqs, args.engines)},
        "runs": [],
    }


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.suite:
        from bench import suite  # noqa: PLC0415 - bench.suite imports this module

        try:
            routers, workloads = suite.resolve(args)
        except ValueError as exc:  # an unknown router or workload name
            parser.error(str(exc))
        return suite.main(args, routers, workloads)
    try:
        plan = make_plan(args)
    except ValueError as exc:  # an unknown router name, a bad trace
        parser.error(str(exc))
    out: Path = plan.args.out
    result = result_skeleton(plan)
    runs: list[dict[str, object]] = []
    result["runs"] = runs
    print(f"slice: {len(plan.reqs)} requests over {plan.duration_s:.0f} trace s; ideal hit rate "
          f"{hit_rate(plan.reqs):.3f}; {len(plan.routers)} routers", flush=True)
    mapper = PromptMapper()
    # Rounds, not router after router: a slow drift of the machine then touches every router.
    for rnd in range(max(1, plan.args.repeat)):
        for router in plan.routers:
            print(f"== {router.name} (round {rnd + 1})", flush=True)
            runs.append({**run_one(router, plan, mapper), "round": rnd})
            print_run(runs[-1])
            machine.write_json(out / "routing.json", result)  # partial results survive a crash
    result["finished_at"] = machine.now_utc()
    machine.write_json(out / "routing.json", result)
    if not plan.args.no_report:
        report.main(report_args(out))
    return 0


def _cores(text: str) -> str | None:
    return text or None


def loadgen_cores(args: argparse.Namespace) -> str | None:
    """Where the replay runs: None leaves it to the kernel's scheduler."""
    return getattr(args, "loadgen_cores", None) or None


@dataclass
class Measured:
    """What one run produced before it is summarised."""

    result: ReplayResult
    before: dict[str, dict[str, float]]
    after: dict[str, dict[str, float]]
    router_cpu_s: float
    kv_config: dict[str, str]
    load: dict[str, float]


def run_one(router: Router, plan: Plan, mapper: PromptMapper,
            label: str = "") -> dict[str, object]:
    run: dict[str, object] = {"router": router.name, "version": router.version()}
    reason = router.unavailable()
    if reason:
        run.update(status="unavailable", error=reason)
        return run
    try:
        measured = measure(router, plan, mapper)
    except Exception as exc:  # one router's failure is recorded, the others still run
        run.update(status="error", error=f"{type(exc).__name__}: {exc}"[:2000])
        traceback.print_exc()
        return run
    raw = plan.args.out / "raw" / f"routing-{label}{router.name.replace('/', '-')}.jsonl"
    _write_raw(raw, measured.result.records)
    run.update(status="ok", **summarise(measured, plan.time_scale))
    return run


def measure(router: Router, plan: Plan, mapper: PromptMapper) -> Measured:
    """Fresh engines, the router in front, the replay; both stopped whatever happens."""
    work = plan.args.out / "raw" / router.name.replace("/", "-")
    spec, events = precise_fleet(plan.spec, work) if plan.tokenizing_fleet else (plan.spec, [])
    fleet = Fleet(spec, work, cores=_cores(plan.args.engine_cores))
    proc: Managed | None = None
    try:
        fleet.start()
        proc, endpoint = launch_ready(router, fleet.urls, plan.spec.model, work,
                                      _cores(plan.args.router_cores),
                                      events=events if router.precise else ())
        run_async(_warm_up(endpoint))
        before, cpu0, kv_config = fleet.scrape(), tree_cpu_seconds(proc.pid), fleet.kv_config()
        sampler = GaugeSampler(fleet.urls)
        with pinned(loadgen_cores(plan.args)):
            res = run_async(_sampled(sampler, replay(
                endpoint, plan.reqs, mapper, compression=plan.compression,
                timeout_s=plan.args.request_timeout_s)))
        cpu_used = tree_cpu_seconds(proc.pid) - cpu0
        after = fleet.scrape()
        if not proc.alive():
            raise RuntimeError(f"router exited during the run: {proc.log_tail()}")
        return Measured(res, before, after, cpu_used, kv_config, sampler.summary())
    finally:
        if proc is not None:
            proc.stop()
        fleet.stop()


def precise_fleet(spec: FleetSpec, work: Path) -> tuple[FleetSpec, list[str]]:
    """The fleet for a precise-mode run: engines tokenizing with ``bench.wordtok`` (the same
    token counts as without) and connecting their KV-event publishers to the endpoints the proxy
    binds on loopback, one port per engine; returns the spec and those endpoints."""
    tokenizer = make_word_tokenizer(work / "tokenizer")
    base = free_port_range(spec.engines)
    extra = ("--tokenizer", str(tokenizer), "--kv-events-endpoint", f"tcp://127.0.0.1:{base}")
    events = [f"tcp://127.0.0.1:{base + k}" for k in range(spec.engines)]
    return replace(spec, extra_args=spec.extra_args + extra), events


def summarise(m: Measured, time_scale: float) -> dict[str, object]:
    delta = deltas(m.before, m.after)
    per_engine = requests_per_engine(delta)
    records = m.result.records
    summary: dict[str, object] = dict(
        summarize(records, duration_s=m.result.duration_s, time_scale=time_scale))
    ttfts = [r.ttft * time_scale for r in records if r.ok and r.ttft is not None]
    summary["ttft_p90_ci"] = list(bootstrap_ci(ttfts, 90))
    return {
        "summary": summary,
        "hit_rate": fleet_hit_rate(delta),
        "engine_requests": per_engine,
        "share_max_over_mean": share_max_over_mean(per_engine),
        "header_engines": len(engine_counts(records)),
        "engine_load": m.load,
        "engine_kv_config": m.kv_config,
        "preemptions": sum(d.get("vllm:num_preemptions_total", 0.0) for d in delta.values()),
        "router_cpu_s": m.router_cpu_s,
        "duration_s": m.result.duration_s,
        "max_lag_s": m.result.max_lag_s,
        "errors": _error_sample(records),
    }


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


def _error_sample(records: Sequence[RequestRecord]) -> list[str]:
    seen: dict[str, int] = {}
    for r in records:
        if r.error:
            key = f"{r.status}: {r.error[:160]}"
            seen[key] = seen.get(key, 0) + 1
    return [f"{n}x {k}" for k, n in sorted(seen.items(), key=lambda kv: -kv[1])[:5]]


def _write_raw(path: Path, records: Sequence[RequestRecord]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        for r in records:
            fh.write(orjson.dumps(asdict(r)) + b"\n")


def print_run(run: dict[str, object]) -> None:
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
