"""Workers benchmark: ``kvproxy serve --workers N`` against one worker on prefix-sharing traffic.

Usage: ``python -m bench.workers [--workloads rag,chat] [--workers 2] [--repeat 2]``; writes
``bench/results/workers.{json,md}`` (raw records under ``bench/results/workers/raw/``).

Rules:
- What is asked of the workers (they share routing state through their parent): CPU per request
  at most ``CPU_GOAL`` times one worker's, and a hit rate within ``HIT_GOAL`` of one worker's on a
  workload with prefix reuse. Both are judged per workload on the median over rounds, with every
  round's ratio shown.
- Each workload is prepared exactly as the routing suite prepares it (its quick slice at
  round-robin's knee), and each arm is ``bench.routing``'s run: fresh engines, the same prompts
  and schedule, the proxy as its own process (here its process tree: parent and workers).
- Arms interleaved: in every round, one worker and then N, workload after workload.
- The workers are pinned with the single process to the router cores (default core 0): the
  figure is CPU per request, not throughput. Saturation throughput with more workers needs more
  cores than a 2-core machine has; it is not measured here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from bench import machine
from bench.markdown import table
from bench.peers import Router
from bench.prompts import PromptMapper
from bench.report import RESULTS
from bench.routing import build_parser as routing_parser
from bench.routing import print_run, run_one
from bench.suite import prepare
from bench.workloads import by_name

CPU_GOAL = 1.10
HIT_GOAL = 0.05


def _args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m bench.workers",
                                description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="rag,chat", help="suite workloads with prefix reuse")
    p.add_argument("--workers", type=int, default=2, help="N, compared with 1 (2)")
    p.add_argument("--policy", default="expected_ttft")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--router-cores", default="0")
    p.add_argument("--engine-cores", default="1")
    p.add_argument("--out", type=Path, default=RESULTS)
    own = p.parse_args(argv)
    if own.workers < 2:
        p.error("--workers must be at least 2 (it is compared with one worker)")
    suite = routing_parser().parse_args(
        ["--suite", "--quick", "--router-cores", own.router_cores,
         "--engine-cores", own.engine_cores, "--out", str(own.out / "workers")])
    return own, suite


def _per_request(run: dict[str, object]) -> float:
    summary = run["summary"]
    assert isinstance(summary, dict)
    cpu = run["router_cpu_s"]
    assert isinstance(cpu, float)
    return cpu / max(1.0, float(summary["completed"]))


def judge(runs: list[dict[str, object]], one: str, many: str) -> list[dict[str, object]]:
    """Per workload: the ratios N workers / one worker, round by round, and the verdicts."""
    out = []
    for name in dict.fromkeys(str(r["workload"]) for r in runs):
        pairs = []
        for rnd in sorted({int(str(r["round"])) for r in runs}):
            got = {r["router"]: r for r in runs if r["workload"] == name and r["round"] == rnd
                   and r.get("status") == "ok"}
            if one in got and many in got:
                a, b = got[one], got[many]
                pairs.append({"round": rnd,
                              "cpu_ms_one": 1e3 * _per_request(a),
                              "cpu_ms_many": 1e3 * _per_request(b),
                              "cpu_ratio": _per_request(b) / _per_request(a),
                              "hit_one": a["hit_rate"], "hit_many": b["hit_rate"],
                              "hit_ratio": float(str(b["hit_rate"])) / float(str(a["hit_rate"]))})
        cpu = statistics.median(p["cpu_ratio"] for p in pairs) if pairs else float("nan")
        hit = statistics.median(p["hit_ratio"] for p in pairs) if pairs else float("nan")
        out.append({"workload": name, "rounds": pairs, "cpu_ratio": cpu, "hit_ratio": hit,
                    "cpu_met": cpu <= CPU_GOAL, "hit_met": abs(hit - 1.0) <= HIT_GOAL})
    return out


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
        f"{HIT_GOAL:.0%} of one worker's (median over rounds).", ""]
    rows = []
    for v in verdicts:
        for p in v["rounds"]:
            rows.append([v["workload"], p["round"] + 1, f"{p['cpu_ms_one']:.2f}",
                         f"{p['cpu_ms_many']:.2f}", f"{p['cpu_ratio']:.2f}",
                         f"{p['hit_one']:.3f}", f"{p['hit_many']:.3f}", f"{p['hit_ratio']:.2f}"])
    lines.append(table(["workload", "round", "CPU ms/req, 1 worker", "CPU ms/req, N workers",
                        "CPU ratio", "hit rate, 1", "hit rate, N", "hit ratio"], rows))
    lines += ["", "## Verdicts", ""]
    for v in verdicts:
        lines.append(f"- `{v['workload']}`: CPU per request {v['cpu_ratio']:.2f}x one worker's "
                     f"({'met' if v['cpu_met'] else 'NOT met'}), hit rate {v['hit_ratio']:.2f}x "
                     f"({'met' if v['hit_met'] else 'NOT met'})")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    own, suite_args = _args(argv)
    one, many = Router("kvproxy", own.policy), Router("kvproxy", own.policy, own.workers)
    workloads = by_name(own.workloads)
    result: dict[str, object] = {
        "benchmark": "workers", "command": machine.command_line(),
        "started_at": machine.now_utc(), "machine": machine.environment(),
        "settings": {"workloads": own.workloads, "workers": own.workers, "policy": own.policy,
                     "repeat": own.repeat, "router_cores": own.router_cores,
                     "engine_cores": own.engine_cores, "slices": "suite quick"},
        "runs": [], "verdicts": []}
    runs: list[dict[str, object]] = result["runs"]  # type: ignore[assignment]
    prepared = [prepare(w, suite_args, [one, many]) for w in workloads]
    for rnd in range(max(1, own.repeat)):
        for prep in prepared:
            for router in (one, many):
                print(f"== {prep.workload.name} / {router.name} (round {rnd + 1})", flush=True)
                run = run_one(router, prep.plan, PromptMapper(), label=f"{prep.workload.name}-")
                runs.append({"workload": prep.workload.name, "round": rnd, **run})
                print_run(runs[-1])
                machine.write_json(own.out / "workers.json", result)
    result["finished_at"] = machine.now_utc()
    result["verdicts"] = judge(runs, one.name, many.name)
    machine.write_json(own.out / "workers.json", result)
    (own.out / "workers.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
