"""The routing workload suite: every router over every workload, each at round-robin's knee.

Usage: ``python -m bench.routing --suite [--quick] [--repeat N] [--workloads rag,chat]
[--routers ...]``; writes ``bench/results/suite.json`` (raw records under
``bench/results/suite/raw/``) and then the reports (``bench/results/suite.md`` and the suite
section of ``docs/benchmarks.md``). The workloads are described in ``bench.workloads``.

Rules:
- Each workload is calibrated on its own, without wall clock (``bench.calibrate``'s discrete-event
  round-robin): the *light* load is the rate scale at which round-robin keeps the fleet busy about
  a quarter of the time (estimated from the workload's own rate), and the *knee* is the load
  above it at which round-robin's TTFT p90 reaches ``KNEE_FACTOR`` times its light-load p90,
  bracketed in x1.5 steps and bisected to within about 5 %. (The busy fraction is no
  criterion: with continuous batching an engine that always has a stream to decode is "busy"
  long before requests queue.) Every router then replays the workload at that knee. The
  calibration points are kept in the results so the report can show them.
- A run is exactly ``bench.routing``'s run (fresh engines, same prompts and schedule, the router as
  its own process); only the slice, the input cap and the load change per workload.
- Rounds, then workloads, then routers: with ``--repeat N`` every round runs the whole suite, so
  a slow drift of the machine touches every router; each round is judged on its own.
- The cache ceiling per workload is ``bench.traces.oracle_hit_rate`` over the fleet's KV size;
  the latency floor is ``bench.idle_floor`` (what no router can beat, on the engines' own model).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import machine, report
from bench.calibrate import simulate_round_robin
from bench.fleet import FleetSpec
from bench.idle_floor import RULE as FLOOR_RULE
from bench.idle_floor import floor_percentiles, idle_floors
from bench.peers import Router, parse_router_list
from bench.prompts import PromptMapper
from bench.routing import Plan, loadgen_cores, print_run, run_one
from bench.traces import Caps, TraceRequest, apply_caps, describe, hit_rate, oracle_hit_rate
from bench.workloads import Workload, by_name

KNEE_FACTOR = 2.5
LIGHT_BUSY = 0.25
BRACKET_STEP = 1.5
BRACKET_POINTS = 12
BISECT_STEPS = 3
KNEE_RULE = (f"the load (found to within 5 %) where round-robin's TTFT p90 reaches "
             f"{KNEE_FACTOR:g}x its value at a light load (busy fraction {LIGHT_BUSY:g})")
SUITE_QUICK_ROUTERS = ("kvproxy/*,vllm-router/cache_aware,sglang-router/cache_aware,"
                       "litellm/least-busy")


@dataclass(frozen=True)
class Calibration:
    light: dict[str, float]
    knee: dict[str, float]
    points: list[dict[str, float]]  # every point simulated above the light load, by rate scale

    @property
    def knee_scale(self) -> float:
        return self.knee["rate_scale"]


def calibrate(reqs: Sequence[TraceRequest], *, engines: int, profile: str,
              num_gpu_blocks: int | None) -> Calibration:
    """Round-robin's knee for ``reqs`` (see the module rules): bracketed in x1.5 steps up from
    the light load, then bisected (geometrically) to within a factor 1.5 ** (1/8), about 5 %.
    Should the limit never be reached in ``BRACKET_POINTS`` steps, the last step is the knee."""
    def point(scale: float) -> dict[str, float]:
        return simulate_round_robin(reqs, engines=engines, profile=profile,
                                    num_gpu_blocks=num_gpu_blocks, rate_scale=scale)

    unit = point(1.0)
    # Busy fraction grows less than linearly with load (bigger batches amortise the weights),
    # so this scale keeps the fleet at least LIGHT_BUSY busy, never idle.
    light = point(LIGHT_BUSY / max(unit["busy_fraction"], 1e-6))
    limit = KNEE_FACTOR * light["ttft_p90"]
    points = [light]
    # (``not >=`` so that a NaN p90, from a slice where nothing completed, counts as below.)
    while len(points) == 1 or (not points[-1]["ttft_p90"] >= limit
                               and len(points) <= BRACKET_POINTS):
        points.append(point(points[-1]["rate_scale"] * BRACKET_STEP))
    below, above = points[-2], points[-1]
    for _ in range(BISECT_STEPS if above["ttft_p90"] >= limit else 0):
        mid = point(math.sqrt(below["rate_scale"] * above["rate_scale"]))
        points.append(mid)
        below, above = (below, mid) if mid["ttft_p90"] >= limit else (mid, above)
    return Calibration(light, above, sorted(points[1:], key=lambda p: p["rate_scale"]))


@dataclass(frozen=True)
class Prepared:
    """One workload ready to replay: its slice, calibration and a ``bench.routing`` plan."""

    workload: Workload
    plan: Plan
    calibration: Calibration
    kv_tokens: int

    def describe(self) -> dict[str, object]:
        plan = self.plan
        reqs, engines = plan.reqs, plan.spec.engines
        return {
            "name": self.workload.name, "title": self.workload.title,
            "slice_s": plan.duration_s,
            "max_input_tokens": self.workload.max_input_tokens,
            "rate_scale": self.calibration.knee_scale,
            "compression": plan.compression,
            "fleet": plan.spec.settings(),
            "trace": {**describe(reqs), "ideal_hit_rate": hit_rate(reqs),
                      "round_robin_infinite_hit_rate": hit_rate(reqs, engines),
                      "oracle_hit_rate": oracle_hit_rate(reqs, engines, self.kv_tokens)},
            "kv_tokens_per_engine": self.kv_tokens,
            "calibration": {"rule": KNEE_RULE, **asdict(self.calibration)},
            "idle_floor": {"rule": FLOOR_RULE,
                           **floor_percentiles(idle_floors(reqs, plan.spec.profile))},
        }


def kv_tokens(profile: str, num_gpu_blocks: int | None) -> int:
    from engine_sidecar.sim.profiles import PROFILES  # noqa: PLC0415 - the simulator's model

    return (num_gpu_blocks or PROFILES[profile].num_gpu_blocks(16)) * 16


def prepare(w: Workload, args: argparse.Namespace, routers: list[Router],
            knee: float | None = None) -> Prepared:
    """``w`` ready to replay at round-robin's knee, or at the load ``knee`` when given (no
    calibration: for short checks)."""
    caps = Caps(max_input_tokens=w.max_input_tokens, max_output_tokens=args.max_output_tokens,
                output_scale=args.output_scale)
    reqs = apply_caps(w.requests(args.quick), caps)
    cal = Calibration({}, {"rate_scale": knee}, []) if knee is not None else calibrate(
        reqs, engines=args.engines, profile=args.profile, num_gpu_blocks=args.num_gpu_blocks)
    duration = w.quick_s if args.quick else w.full_s
    wargs = argparse.Namespace(**{**vars(args), "rate_scale": cal.knee_scale, "trace": w.name,
                                  "max_input_tokens": w.max_input_tokens,
                                  "duration_s": duration, "start_s": 0.0,
                                  "out": args.out / "suite"})
    spec = FleetSpec(engines=args.engines, profile=args.profile, time_scale=args.time_scale,
                     num_gpu_blocks=args.num_gpu_blocks,
                     max_model_len=w.max_input_tokens + args.max_output_tokens + 64)
    plan = Plan(wargs, reqs, spec, routers, duration, caps)
    return Prepared(w, plan, cal, kv_tokens(args.profile, args.num_gpu_blocks))


def suite_routers(args: argparse.Namespace) -> list[Router]:
    from bench.peers import all_routers  # noqa: PLC0415

    if args.routers:
        return parse_router_list(args.routers)
    return parse_router_list(SUITE_QUICK_ROUTERS) if args.quick else all_routers()


def skeleton(args: argparse.Namespace, routers: list[Router]) -> dict[str, object]:
    return {
        "benchmark": "routing-suite",
        "command": machine.command_line(),
        "started_at": machine.now_utc(),
        "machine": machine.environment(),
        "versions": machine.own_versions(),
        "settings": {
            "quick": args.quick, "repeat": args.repeat, "time_scale": args.time_scale,
            "engines": args.engines, "profile": args.profile,
            "num_gpu_blocks": args.num_gpu_blocks, "max_output_tokens": args.max_output_tokens,
            "output_scale": args.output_scale, "engine_cores": args.engine_cores,
            "router_cores": args.router_cores,
            "loadgen_cores": loadgen_cores(args) or "unpinned",
            "request_timeout_s": args.request_timeout_s, "api": "chat",
            "routers": [r.name for r in routers], "knee_factor": KNEE_FACTOR,
            "tokenizing_fleet": any(r.precise for r in routers),
        },
        "workloads": [],
        "runs": [],
    }


def resolve(args: argparse.Namespace) -> tuple[list[Router], list[Workload]]:
    """The routers and workloads named on the command line (ValueError for an unknown name)."""
    return suite_routers(args), by_name(args.workloads)


def main(args: argparse.Namespace, routers: list[Router], workloads: list[Workload]) -> int:
    out: Path = args.out
    result = skeleton(args, routers)
    prepared = [prepare(w, args, routers) for w in workloads]
    result["workloads"] = [p.describe() for p in prepared]
    for p in prepared:
        cal, wall = p.calibration, p.plan.reqs[-1].arrival_s / p.plan.compression
        print(f"{p.workload.name}: {len(p.plan.reqs)} requests, knee x{cal.knee_scale:.2f} "
              f"(light p90 {cal.light['ttft_p90']:.2f} s), {wall:.0f} s of wall clock", flush=True)
    machine.write_json(out / "suite.json", result)
    runs: list[dict[str, object]] = result["runs"]  # type: ignore[assignment]
    for rnd in range(max(1, args.repeat)):
        for prep in prepared:
            mapper = PromptMapper()
            for router in routers:
                name = prep.workload.name
                print(f"== {name} / {router.name} (round {rnd + 1})", flush=True)
                run = run_one(router, prep.plan, mapper, label=f"{name}-")
                runs.append({"workload": name, "round": rnd, **run})
                print_run(runs[-1])
                machine.write_json(out / "suite.json", result)
    result["finished_at"] = machine.now_utc()
    machine.write_json(out / "suite.json", result)
    if not args.no_report:
        report.main(report.report_args(out))
    return 0
