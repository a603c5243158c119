"""Workers benchmark: ``kvproxy serve --workers N`` against one worker on prefix-sharing traffic.

Usage: ``python -m bench.workers [--workloads rag,chat] [--workers 2] [--repeat 2] [--idle-s 20]
[--rate-factor 1]``; writes ``bench/results/workers.{json,md}`` (raw records under
``bench/results/workers/raw/``).

Rules:
- What is asked of the workers (they share routing state through their parent): CPU per request
  at most ``CPU_GOAL`` times one worker's, and a hit rate within ``HIT_GOAL`` of one worker's on a
  workload with prefix reuse. Both are met on a workload only when every round meets them (with
  two rounds the median is their mean, so one round well over the goal could hide behind a
  better one); otherwise the verdict names the rounds that missed. The median over rounds is
  printed beside it, and every round's ratio is shown.
- Each workload is prepared exactly as the routing suite prepares it (its quick slice at
  round-robin's knee), and each arm is ``bench.routing``'s run: fresh engines, the same prompts
  and schedule, the proxy as its own process (here its process tree: parent and workers).
- Arms interleaved: in every round, one worker and then N, workload after workload.
- The workers are pinned with the single process to the router cores (default core 0): the
  figure is CPU per request, not throughput. Saturation throughput with more workers needs more
  cores than a 2-core machine has; it is not measured here.
- Idle CPU, measured too: in every round each arm also runs ``--idle-s`` seconds with no traffic
  in front of fresh engines (after one warm-up request), CPU per process of its tree. CPU per
  request net of idle takes that rate times the replay's duration off the replay's CPU: what the
  requests themselves cost. The goal is judged on the raw figure; the net one says how much of
  the difference is a cost per second rather than per request.
- ``--rate-factor`` scales the replay's request rate (1: the knee) for runs that separate a cost
  per second from a cost per request; results written with another factor say so.
- A third arm (``--per-worker-arm``, on by default): one worker at 1/N of the rate, the load each
  of the N workers carries. An event loop's CPU per request falls as its load rises (each wake-up
  serves more events), so N workers each at 1/N of the load pay more per request than one process
  at all of it even if they shared nothing. N workers ÷ this arm is the cost of being N processes
  at equal load per process (sharing, relaying, the parent); it has no goal of its own and is
  reported beside the goal's ratio, never instead of it.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from bench import machine
from bench.fleet import Fleet
from bench.markdown import table
from bench.peers import Router, launch_ready
from bench.procs import cpu_seconds, descendants
from bench.prompts import PromptMapper
from bench.report import RESULTS
from bench.routing import Plan, print_run, run_async, run_one
from bench.routing import _cores as cores_arg
from bench.routing import _warm_up as warm_up
from bench.routing import build_parser as routing_parser
from bench.suite import prepare
from bench.workloads import by_name

CPU_GOAL = 1.10
HIT_GOAL = 0.05
_SETTLE_S = 2.0  # after the warm-up request, before idle CPU is measured


def _args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m bench.workers",
                                description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="rag,chat", help="suite workloads with prefix reuse")
    p.add_argument("--workers", type=int, default=2, help="N, compared with 1 (2)")
    p.add_argument("--policy", default="expected_ttft")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--idle-s", type=float, default=20.0,
                   help="idle CPU measured this long per arm and round (0: not measured)")
    p.add_argument("--rate-factor", type=float, default=1.0,
                   help="the replay's request rate times this (1: round-robin's knee)")
    p.add_argument("--per-worker-arm", action=argparse.BooleanOptionalAction, default=True,
                   help="also run one worker at 1/N of the rate (the load of each of N workers)")
    p.add_argument("--router-cores", default="0")
    p.add_argument("--engine-cores", default="1")
    p.add_argument("--out", type=Path, default=RESULTS)
    own = p.parse_args(argv)
    if own.workers < 2:
        p.error("--workers must be at least 2 (it is compared with one worker)")
    if own.rate_factor <= 0 or own.idle_s < 0:
        p.error("--rate-factor must be > 0 and --idle-s >= 0")
    suite = routing_parser().parse_args(
        ["--suite", "--quick", "--router-cores", own.router_cores,
         "--engine-cores", own.engine_cores, "--out", str(own.out / "workers")])
    return own, suite


def _per_request(run: dict[str, object], idle_cpu_per_s: float = 0.0) -> float:
    """CPU seconds per completed request; net of ``idle_cpu_per_s`` over the replay's duration
    when given."""
    summary = run["summary"]
    assert isinstance(summary, dict)
    cpu = float(str(run["router_cpu_s"]))
    idle = idle_cpu_per_s * float(str(run.get("duration_s", 0.0)))
    return (cpu - idle) / max(1.0, float(summary["completed"]))


def idle_cpu(router: Router, plan: Plan, seconds: float) -> dict[str, object]:
    """CPU per second of ``router``'s process tree with no traffic, per process, in front of
    fresh engines; both stopped whatever happens."""
    work = plan.args.out / "raw" / f"idle-{router.name.replace('/', '-')}"
    fleet = Fleet(plan.spec, work, cores=cores_arg(plan.args.engine_cores))
    proc = None
    try:
        fleet.start()
        proc, endpoint = launch_ready(router, fleet.urls, plan.spec.model, work,
                                      cores_arg(plan.args.router_cores))
        run_async(warm_up(endpoint))
        time.sleep(_SETTLE_S)
        pids = [proc.pid, *sorted(descendants(proc.pid))]
        before, started = [cpu_seconds(p) for p in pids], time.monotonic()
        time.sleep(seconds)
        after, elapsed = [cpu_seconds(p) for p in pids], time.monotonic() - started
    finally:
        if proc is not None:
            proc.stop()
        fleet.stop()
    children = [f"child {i}" for i in range(1, len(pids))]
    roles = ["parent", *children] if children else ["proxy"]
    per = {role: (b - a) / elapsed for role, a, b in zip(roles, before, after, strict=True)}
    return {"router": router.name, "seconds": elapsed, "cpu_s_per_s": sum(per.values()),
            "processes": per}


def _idle_rate(idle: Sequence[dict[str, object]], router: str, rnd: int) -> float | None:
    for i in idle:
        if i["router"] == router and i["round"] == rnd:
            return float(str(i["cpu_s_per_s"]))
    return None


PER_WORKER = "per_worker_load"  # the ``arm`` of one worker's runs at 1/N of the rate


def judge(runs: list[dict[str, object]], one: str, many: str,
          idle: Sequence[dict[str, object]] = ()) -> list[dict[str, object]]:
    """Per workload: the ratios N workers / one worker, round by round (net of idle CPU too,
    when measured in that round), and the verdicts (on the raw figures). Where one worker also
    ran at 1/N of the rate (``arm`` ``PER_WORKER``), N workers / that run as ``load_ratio``."""
    out = []
    for name in dict.fromkeys(str(r["workload"]) for r in runs):
        pairs: list[dict[str, object]] = []
        for rnd in sorted({int(str(r["round"])) for r in runs}):
            got = {(r["router"], r.get("arm")): r for r in runs
                   if r["workload"] == name and r["round"] == rnd and r.get("status") == "ok"}
            a, b = got.get((one, None)), got.get((many, None))
            if a is None or b is None:
                continue
            pair = _pair(a, b, rnd, _idle_rate(idle, one, rnd), _idle_rate(idle, many, rnd))
            light = got.get((one, PER_WORKER))
            if light is not None:
                pair |= {"cpu_ms_per_worker_load": 1e3 * _per_request(light),
                         "load_ratio": _per_request(b) / _per_request(light)}
            pairs.append(pair)
        cpu, hit, net, load = (_median(pairs, k)
                               for k in ("cpu_ratio", "hit_ratio", "net_ratio", "load_ratio"))
        cpu_missed = [int(str(p["round"])) for p in pairs
                      if not float(str(p["cpu_ratio"])) <= CPU_GOAL]
        hit_missed = [int(str(p["round"])) for p in pairs
                      if not abs(float(str(p["hit_ratio"])) - 1.0) <= HIT_GOAL]
        # No round at all is no evidence: not met rather than vacuously met.
        out.append({"workload": name, "rounds": pairs, "cpu_ratio": cpu, "hit_ratio": hit,
                    "net_ratio": net, "load_ratio": load,
                    "cpu_met": bool(pairs) and not cpu_missed, "cpu_missed": cpu_missed,
                    "hit_met": bool(pairs) and not hit_missed, "hit_missed": hit_missed})
    return out


def rejudge(result: dict[str, object]) -> dict[str, object]:
    """``result`` with its verdicts judged again from its runs and idle CPU, under this
    module's rules (results written under an older rule carry verdicts of that rule)."""
    runs = result["runs"]
    idle = result.get("idle")
    assert isinstance(runs, list)
    settings = result.get("settings")
    policy = str(settings.get("policy")) if isinstance(settings, dict) else ""
    workers = settings.get("workers") if isinstance(settings, dict) else None
    one = Router("kvproxy", policy)
    many = Router("kvproxy", policy, int(str(workers)))
    return {**result, "verdicts": judge(runs, one.name, many.name,
                                        idle if isinstance(idle, list) else [])}


def _pair(a: dict[str, object], b: dict[str, object], rnd: int, idle_a: float | None,
          idle_b: float | None) -> dict[str, object]:
    pair: dict[str, object] = {
        "round": rnd, "cpu_ms_one": 1e3 * _per_request(a), "cpu_ms_many": 1e3 * _per_request(b),
        "cpu_ratio": _per_request(b) / _per_request(a),
        "hit_one": a["hit_rate"], "hit_many": b["hit_rate"],
        "hit_ratio": float(str(b["hit_rate"])) / float(str(a["hit_rate"]))}
    if idle_a is not None and idle_b is not None:
        net_a, net_b = _per_request(a, idle_a), _per_request(b, idle_b)
        pair |= {"idle_ms_s_one": 1e3 * idle_a, "idle_ms_s_many": 1e3 * idle_b,
                 "net_ms_one": 1e3 * net_a, "net_ms_many": 1e3 * net_b,
                 "net_ratio": net_b / net_a if net_a > 0 else float("nan")}
    return pair


def _median(pairs: Sequence[dict[str, object]], key: str) -> float:
    values = [float(str(p[key])) for p in pairs if key in p]
    return statistics.median(values) if values else float("nan")


def markdown(result: dict[str, object]) -> str:
    env = result["machine"]
    assert isinstance(env, dict)
    verdicts = result["verdicts"]
    assert isinstance(verdicts, list)
    lines = [
        "# Workers benchmark: `kvproxy serve --workers N` against one worker", "",
        f"- command: `{result['command']}`",
        f"- run: {result['started_at']} → {result.get('finished_at', '(unfinished)')}",
        f"- machine: {env['cpu_model']} ({env['nproc']} cores), Python {env['python']}, load "
        f"average at start {' '.join(f'{x:.2f}' for x in env['load_avg_at_start'])}",
        f"- settings: `{result['settings']}`", "",
        "Each workload is the routing suite's quick slice at round-robin's knee, replayed through "
        "one kvproxy process and through one with N workers (routing state shared through their "
        "parent), interleaved in every round, on fresh simulated engines. CPU is the proxy's "
        "process tree over the replay divided by completed requests; all workers are pinned to "
        "the router cores, so this is CPU per request, not throughput.", "",
        f"Goals: CPU per request ≤ {CPU_GOAL:.2f}x one worker's; hit rate within "
        f"{HIT_GOAL:.0%} of one worker's, met only where every round meets it (the verdict "
        "prints the median over rounds and names any round that missed). Judged on the raw CPU per "
        "request; the net column takes each arm's idle CPU per second (no traffic, same "
        "engines, measured in the same round) times the replay's duration off first. The "
        "per-worker-load columns, where run: one worker at 1/N of the rate (the load each of "
        "the N workers carries), and N workers ÷ that: the cost of being N processes at equal "
        "load per process (no goal; an event loop's CPU per request falls as its load rises).",
        ""]
    lines.append(table(["workload", "round", "CPU ms/req, 1 worker", "CPU ms/req, N workers",
                        "CPU ratio", "net ms/req, 1", "net ms/req, N", "net ratio",
                        "hit rate, 1", "hit rate, N", "hit ratio", "ms/req, 1 at 1/N rate",
                        "N ÷ 1 at 1/N rate"], _rows(verdicts)))
    idle = result.get("idle")
    if isinstance(idle, list) and idle:
        lines += ["", "Idle CPU (ms per second, no traffic), per process of each arm:", "",
                  table(["router", "round", "total", "per process"], _idle_rows(idle))]
    lines += ["", "## Verdicts", ""]
    for v in verdicts:
        lines.append(f"- `{v['workload']}`: CPU per request {v['cpu_ratio']:.2f}x one worker's "
                     f"(median; {_met(v, 'cpu')}; net of idle "
                     f"{_fmt(v.get('net_ratio'))}x{_at_load(v.get('load_ratio'))}), hit rate "
                     f"{v['hit_ratio']:.2f}x (median; {_met(v, 'hit')})")
    return "\n".join(lines) + "\n"


def _met(verdict: dict[str, object], goal: str) -> str:
    """``met`` when every round met the goal, else the rounds (counted from 1) that did not."""
    if verdict[f"{goal}_met"]:
        return "met"
    missed = verdict.get(f"{goal}_missed")
    if not isinstance(missed, list) or not missed:
        return "NOT met"  # results from before the rule named rounds, or no round at all
    word = "round" if len(missed) == 1 else "rounds"
    return f"NOT met in {word} " + ", ".join(str(int(str(r)) + 1) for r in missed)


def _at_load(ratio: object) -> str:
    """The verdict's clause on the per-worker-load arm; none for results without that arm."""
    if not isinstance(ratio, int | float) or math.isnan(ratio):
        return ""
    return f"; against one worker at 1/N of the rate {_fmt(ratio)}x"


def _fmt(value: object, digits: int = 2) -> str:
    x = float(str(value)) if isinstance(value, (int, float)) else float("nan")
    return "—" if x != x else f"{x:.{digits}f}"


def _rows(verdicts: Sequence[dict[str, object]]) -> list[list[object]]:
    rows: list[list[object]] = []
    for v in verdicts:
        for p in v["rounds"]:  # type: ignore[attr-defined]
            rows.append([v["workload"], p["round"] + 1, f"{p['cpu_ms_one']:.2f}",
                         f"{p['cpu_ms_many']:.2f}", f"{p['cpu_ratio']:.2f}",
                         _fmt(p.get("net_ms_one")), _fmt(p.get("net_ms_many")),
                         _fmt(p.get("net_ratio")), f"{p['hit_one']:.3f}",
                         f"{p['hit_many']:.3f}", f"{p['hit_ratio']:.2f}",
                         _fmt(p.get("cpu_ms_per_worker_load")), _fmt(p.get("load_ratio"))])
    return rows


def _idle_rows(idle: Sequence[dict[str, object]]) -> list[list[object]]:
    rows: list[list[object]] = []
    for i in idle:
        per = i["processes"]
        assert isinstance(per, dict)
        rows.append([f"`{i['router']}`", int(str(i["round"])) + 1,
                     f"{1e3 * float(str(i['cpu_s_per_s'])):.1f}",
                     ", ".join(f"{role} {1e3 * x:.1f}" for role, x in per.items())])
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    own, suite_args = _args(argv)
    one, many = Router("kvproxy", own.policy), Router("kvproxy", own.policy, own.workers)
    workloads = by_name(own.workloads)
    result: dict[str, object] = {
        "benchmark": "workers", "command": machine.command_line(),
        "started_at": machine.now_utc(), "machine": machine.environment(),
        "settings": {"workloads": own.workloads, "workers": own.workers, "policy": own.policy,
                     "repeat": own.repeat, "router_cores": own.router_cores,
                     "engine_cores": own.engine_cores, "slices": "suite quick",
                     "idle_s": own.idle_s, "rate_factor": own.rate_factor,
                     "per_worker_arm": own.per_worker_arm},
        "runs": [], "idle": [], "verdicts": []}
    runs: list[dict[str, object]] = result["runs"]  # type: ignore[assignment]
    idle: list[dict[str, object]] = result["idle"]  # type: ignore[assignment]
    prepared = [_at_rate(prepare(w, suite_args, [one, many]).plan, own.rate_factor)
                for w in workloads]  # fmt: skip
    arms: list[tuple[Router, str | None, float]] = [(one, None, 1.0), (many, None, 1.0)]
    if own.per_worker_arm:
        arms.insert(1, (one, PER_WORKER, 1.0 / own.workers))
    for rnd in range(max(1, own.repeat)):
        if own.idle_s > 0:
            for router in (one, many):
                idle.append({"round": rnd, **idle_cpu(router, prepared[0], own.idle_s)})
                print(f"== idle {router.name} (round {rnd + 1}): "
                      f"{1e3 * float(str(idle[-1]['cpu_s_per_s'])):.1f} ms/s", flush=True)
        for plan in prepared:
            for router, arm, factor in arms:
                name = str(plan.args.trace)
                shown = router.name if arm is None else f"{router.name} at 1/{own.workers} rate"
                print(f"== {name} / {shown} (round {rnd + 1})", flush=True)
                run = run_one(router, _at_rate(plan, factor), PromptMapper(),
                              label=f"{name}-" if arm is None else f"{name}-{arm}-")
                runs.append({"workload": name, "round": rnd, **run}
                            | ({} if arm is None else {"arm": arm}))
                print_run(runs[-1])
                machine.write_json(own.out / "workers.json", result)
    result["finished_at"] = machine.now_utc()
    result["verdicts"] = judge(runs, one.name, many.name, idle)
    machine.write_json(own.out / "workers.json", result)
    (own.out / "workers.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def _at_rate(plan: Plan, factor: float) -> Plan:
    """``plan`` replayed at ``factor`` times its request rate."""
    if factor == 1.0:
        return plan
    args = argparse.Namespace(**{**vars(plan.args), "rate_scale": plan.args.rate_scale * factor})
    return replace(plan, args=args)


if __name__ == "__main__":
    sys.exit(main())
