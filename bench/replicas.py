"""The replica benchmark: the routing suite's quick workloads through 1, 2 and 4 kvproxy replicas
behind a real HAProxy, with the routing state shared through Redis and without.

Usage: ``python -m bench.replicas [--repeat N] [--workloads rag,chat] [--arms ...] [--direct]``
(see ``--help``); writes ``bench/results/replicas.json`` (raw records under
``bench/results/replicas/raw/``), then ``replicas.md`` and the replica section of
``docs/benchmarks.md``.

Rules:
- An *arm* is a way to put kvproxy in front of the engines: ``haproxy-N-shared`` (N replicas behind
  HAProxy, each with ``[redis] url`` and ``[sharing] enabled``), ``haproxy-N-alone`` (the same
  Redis, sharing disabled: only the routing-state sharing differs), ``haproxy-1`` (one replica
  behind HAProxy: the baseline every ratio divides by) and ``direct-1`` (one replica called
  directly: what HAProxy itself costs).
- Every arm gets the same workloads (``bench.workloads``, seeded), each at the same load
  (round-robin's knee, ``bench.suite``'s calibration), the same fleet spec and prompts; every run
  gets fresh engines (cold caches), fresh replicas and its own Redis key prefix. Rounds, then
  workloads, then arms: the arms of one workload run back to back, so a drift of the machine
  touches them alike, and each round is judged on its own.
- HAProxy runs in HTTP mode with ``balance roundrobin``: every request is balanced on its own, also
  on kept-alive client connections. Its config is written here; it binds loopback ports only.
- Replicas and HAProxy share the router core(s), the engines their own: N replicas get no more CPU
  than one (on an otherwise idle machine; where other processes compete for that core, the
  scheduler gives N processes a larger share than one). Every process (engines, redis-server,
  replicas, HAProxy) is started here and stopped here by its PID, whatever happens.
- ``--compare-tree DIR`` adds every arm once more with the replicas run from another source tree
  (``ARM@compared``, judged against ``haproxy-1@compared``): a change measured before and after
  in one interleaved run. ``--proxy-set`` passes settings to every replica.
- Evidence that the balancer spread the load: each replica's ``kvproxy_requests_total`` over the
  run and HAProxy's own per-server request counts from its stats page.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from bench import machine, report
from bench.fleet import Fleet, GaugeSampler
from bench.front import HAPROXY, POLICY, Arm, Front, Redis, parse_arms, start_front
from bench.loadgen import Endpoint, make_session, replay, request_body, run_async, send_one
from bench.prompts import PromptMapper
from bench.routing import Measured, Plan, _sampled, _write_raw, print_run, summarise
from bench.suite import Prepared, prepare
from bench.workloads import Workload, by_name

DEFAULT_ARMS = "haproxy-1,haproxy-2-shared,haproxy-2-alone,haproxy-4-shared,haproxy-4-alone"
DEFAULT_WORKLOADS = "mooncake,rag,chat,bursts,unique,longdoc"
QUICK_WORKLOADS = "rag,chat,longdoc"


async def warm_up(endpoint: Endpoint, replicas: int) -> None:
    """One short request per replica (round-robin gives each one), so that connection set-up is
    not in the first measured TTFTs."""
    async with make_session() as session:
        for i in range(replicas):
            body = request_body(endpoint, f"warm up {i} " * 8, 4)
            rec = await send_one(session, endpoint, body, index=-1 - i,
                                 run_start=time.perf_counter())
            if not rec.ok:
                raise RuntimeError(f"warm-up request failed: status {rec.status} {rec.error}")


# The replicas' decisions made in Redis or locally, and the script's round trip (histogram).
_DECISIONS = "kvproxy_shared_decision"


def _cores(text: str) -> str | None:
    return text or None


def measure(arm: Arm, plan: Plan, mapper: PromptMapper, redis: Redis, run_id: str,
            work: Path) -> tuple[Measured, dict[str, object]]:
    """Fresh engines, the arm's front, the replay; everything stopped whatever happens."""
    args = plan.args
    fleet = Fleet(plan.spec, work, cores=_cores(args.engine_cores))
    front: Front | None = None
    try:
        fleet.start()
        front = start_front(arm, fleet.urls, plan.spec.model, redis.url,
                            f"kvproxy:bench:{run_id}:", work, _cores(args.router_cores),
                            args.request_timeout_s + 30, args.proxy_set)
        run_async(warm_up(front.endpoint, arm.replicas))
        before, cpu0, kv_config = fleet.scrape(), front.cpu_seconds(), fleet.kv_config()
        reps0, hap0 = front.replica_requests(), front.balancer_requests()
        dec0 = front.replica_samples(_DECISIONS)
        sampler = GaugeSampler(fleet.urls)
        res = run_async(_sampled(sampler, replay(
            front.endpoint, plan.reqs, mapper, compression=plan.compression,
            timeout_s=args.request_timeout_s)))
        cpu_used = front.cpu_seconds() - cpu0
        after = fleet.scrape()
        dead = [p.name for p in front.procs if not p.alive()]
        if dead:
            raise RuntimeError(f"exited during the run: {', '.join(dead)}")
        reps = [b - a for a, b in zip(reps0, front.replica_requests(), strict=True)]
        hap = {k: v - hap0.get(k, 0.0) for k, v in front.balancer_requests().items()}
        dec = {k: v - dec0.get(k, 0.0) for k, v in front.replica_samples(_DECISIONS).items()}
        extra: dict[str, object] = {"replica_requests": reps, "haproxy_requests": hap,
                                    "shared_decisions": {k: v for k, v in dec.items() if v}}
        return Measured(res, before, after, cpu_used, kv_config, sampler.summary()), extra
    finally:
        if front is not None:
            front.stop()
        fleet.stop()


def run_arm(arm: Arm, prep: Prepared, mapper: PromptMapper, redis: Redis, rnd: int,
            out: Path) -> dict[str, object]:
    name = prep.workload.name
    run: dict[str, object] = {"workload": name, "arm": arm.name, "replicas": arm.replicas,
                              "haproxy": arm.haproxy, "sharing": arm.sharing, "round": rnd}
    work = out / "replicas" / "raw" / f"{name}-{arm.name}"
    work.mkdir(parents=True, exist_ok=True)
    try:
        measured, extra = measure(arm, prep.plan, mapper, redis, f"{name}-{arm.name}-{rnd}",
                                  work)
    except Exception as exc:  # one arm's failure is recorded, the others still run
        run.update(status="error", error=f"{type(exc).__name__}: {exc}"[:2000])
        traceback.print_exc()
        return run
    _write_raw(work / "records.jsonl", measured.result.records)
    run.update(status="ok", **summarise(measured, prep.plan.time_scale), **extra)
    return run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.replicas",
                                description=__doc__.splitlines()[0])
    p.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma list (default {DEFAULT_ARMS})")
    p.add_argument("--direct", action="store_true", help="also the direct-1 arm (no HAProxy)")
    p.add_argument("--compare-tree", type=Path, default=None,
                   help="also every arm with the replicas run from this source tree (e.g. a "
                   "`git archive` of the code before a change), interleaved, named ARM@compared")
    p.add_argument("--workloads", default=None,
                   help=f"bench.workloads names (default {DEFAULT_WORKLOADS}; --quick: "
                   f"{QUICK_WORKLOADS})")
    p.add_argument("--quick", action="store_true",
                   help=f"only {QUICK_WORKLOADS}: a few minutes a round")
    p.add_argument("--slice-fraction", type=float, default=0.5,
                   help="replay this leading fraction of each workload's quick slice (0.5), "
                   "at the load calibrated on the whole slice")
    p.add_argument("--rate-scale", type=float, default=None,
                   help="skip the calibration: every workload at this load (for short checks)")
    p.add_argument("--repeat", type=int, default=1, help="rounds of every arm over every workload")
    p.add_argument("--time-scale", type=float, default=3.0)
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--profile", default="llama70b-h100x4-kv8")
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--max-output-tokens", type=int, default=256)
    p.add_argument("--output-scale", type=float, default=0.25)
    p.add_argument("--engine-cores", default="1", help="taskset cores for the engines ('' = none)")
    p.add_argument("--router-cores", default="0",
                   help="taskset cores for the replicas, HAProxy and Redis ('' = none)")
    p.add_argument("--request-timeout-s", type=float, default=180.0, help="wall-clock, per request")
    p.add_argument("--proxy-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a kvproxy setting for every replica (repeatable), e.g. "
                   "sharing.interval_s=0.005")
    p.add_argument("--out", type=Path, default=report.RESULTS)
    p.add_argument("--no-report", action="store_true")
    return p


def prepare_all(args: argparse.Namespace, workloads: Sequence[Workload]) -> list[Prepared]:
    """Each workload's plan (``bench.suite.prepare``: calibrated at round-robin's knee unless
    ``--rate-scale`` is given), cut to the leading ``--slice-fraction`` of its quick slice."""
    out = []
    for w in workloads:
        prep = prepare(w, argparse.Namespace(**{**vars(args), "quick": True}), [],
                       knee=args.rate_scale)
        plan = prep.plan
        cut = plan.duration_s * args.slice_fraction
        reqs = [r for r in plan.reqs if r.arrival_s - plan.reqs[0].arrival_s < cut] or plan.reqs[:1]
        pargs = argparse.Namespace(**{**vars(plan.args),
                                      "rate_scale": prep.calibration.knee_scale})
        out.append(replace(prep, plan=replace(plan, args=pargs, reqs=reqs, duration_s=cut)))
    return out


def skeleton(args: argparse.Namespace, arms: Sequence[Arm]) -> dict[str, object]:
    return {
        "benchmark": "replicas", "command": machine.command_line(),
        "started_at": machine.now_utc(), "machine": machine.environment(),
        "versions": {**machine.own_versions(), "haproxy": haproxy_version()},
        "settings": {
            "arms": [a.name for a in arms], "policy": POLICY, "repeat": args.repeat,
            "slice_fraction": args.slice_fraction, "rate_scale_override": args.rate_scale,
            "time_scale": args.time_scale, "engines": args.engines, "profile": args.profile,
            "num_gpu_blocks": args.num_gpu_blocks, "max_output_tokens": args.max_output_tokens,
            "output_scale": args.output_scale, "engine_cores": args.engine_cores,
            "router_cores": args.router_cores, "loadgen_cores": "unpinned",
            "request_timeout_s": args.request_timeout_s, "balance": "roundrobin (HTTP mode)",
            "proxy_set": list(args.proxy_set),
        },
        "workloads": [], "runs": [],
    }


def haproxy_version() -> str:
    try:
        out = subprocess.run([HAPROXY, "-v"], check=False, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"
    first = out.stdout.splitlines()[0] if out.stdout else ""
    m = re.search(r"version (\S+)", first)
    return m.group(1) if m else "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        arms = parse_arms(("direct-1," if args.direct else "") + args.arms)
        if args.compare_tree is not None:
            tree = str(args.compare_tree.resolve())
            arms = [x for a in arms for x in (a, replace(a, tree=tree))]
        workloads = by_name(args.workloads or (QUICK_WORKLOADS if args.quick
                                               else DEFAULT_WORKLOADS))
    except ValueError as exc:
        parser.error(str(exc))
    if not 0 < args.slice_fraction <= 1:
        parser.error("--slice-fraction must be in (0, 1]")
    if any(a.haproxy for a in arms) and not Path(HAPROXY).exists():
        parser.error(f"{HAPROXY} is missing: scripts/setup.sh --haproxy")
    return run(args, arms, workloads)


def run(args: argparse.Namespace, arms: Sequence[Arm], workloads: Sequence[Workload]) -> int:
    out: Path = args.out
    result = skeleton(args, arms)
    prepared = prepare_all(args, workloads)
    result["workloads"] = [p.describe() for p in prepared]
    for p in prepared:
        print(f"{p.workload.name}: {len(p.plan.reqs)} requests at x{p.calibration.knee_scale:.2f}, "
              f"{p.plan.reqs[-1].arrival_s / p.plan.compression:.0f} s of wall clock", flush=True)
    runs: list[dict[str, object]] = result["runs"]  # type: ignore[assignment]
    redis = Redis(out / "replicas" / "raw", _cores(args.router_cores)).start()
    try:
        for rnd in range(max(1, args.repeat)):
            for prep in prepared:
                mapper = PromptMapper()
                for arm in arms:
                    print(f"== {prep.workload.name} / {arm.name} (round {rnd + 1})", flush=True)
                    runs.append(run_arm(arm, prep, mapper, redis, rnd, out))
                    _print(runs[-1])
                    machine.write_json(out / "replicas.json", result)
    finally:
        redis.stop()
    result["finished_at"] = machine.now_utc()
    result["load_avg_at_end"] = list(os.getloadavg())
    machine.write_json(out / "replicas.json", result)
    if not args.no_report:
        report.main(report.report_args(out))
    return 0


def _print(run: dict[str, object]) -> None:
    print_run({**run, "share_max_over_mean": run.get("share_max_over_mean", float("nan"))})
    if run.get("status") == "ok":
        print(f"   replicas {run['replica_requests']}  haproxy {run['haproxy_requests']}",
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
