"""Saturation benchmark: the request rate at which each router's TTFT p50 doubles.

Usage: ``python -m bench.saturation [--routers ...] [--rates 50,70,...] [--rounds 2]``; writes
``bench/results/saturation.{json,md}`` (``--out`` elsewhere).

Rules:
- Open loop: requests arrive as a Poisson process at a fixed rate for ``--step-s`` seconds,
  whether or not earlier ones have finished (a closed loop slows its own senders down and cannot
  show a saturated server). Prompts are unique (no prefix-cache effect on any path) and every
  answer streams ``--output-tokens`` tokens.
- A ladder of rates. Each rate is run on every path in turn (``direct`` first: the client itself
  round-robining over the engines) before the next rate, so the machine's drifts fall on every
  path alike. The first ``--warm-s`` of a step are not judged (its queues are filling).
- A path's baseline is its TTFT p50 at the ladder's first rate. It saturates at the first rate
  whose TTFT p50 is at least ``DOUBLING`` times its baseline, or where more than ``MAX_FAILED`` of
  its requests fail; it is not run at higher rates (they could only be worse). Its saturation
  throughput is interpolated in log-rate between that rate and the one below, where its p50
  ratio crosses ``DOUBLING``: requests/s offered, and output tokens/s delivered there. A path that
  never saturates is reported as at least the ladder's top.
- ``direct`` saturates where the engines and the load generator do (both on ``--engine-cores``).
  A router's figure says something about the router only where it is below direct's; at or
  above it, the router was not what saturated, and the verdict says so.
- Router CPU per request at every step (the router's process tree, workers included), so a
  ratio of saturation rates can be read beside what each request cost.
- ``--rounds`` repeats the whole ladder; each round is judged on its own, the summary gives every
  round and the median.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from bench import machine
from bench.fleet import FleetSpec
from bench.loadgen import Endpoint, make_session, request_body, run_async, send_one
from bench.markdown import table
from bench.overhead import Paths, running
from bench.peers import Router, parse_router_list
from bench.procs import Managed, pinned, tree_cpu_seconds
from bench.report import RESULTS
from bench.stats import RequestRecord, percentile
from bench.workloads import poisson_arrivals

DOUBLING = 2.0
MAX_FAILED = 0.01
DEFAULT_ROUTERS = ("kvproxy/expected_ttft,kvproxy/expected_ttft+w2,vllm-router/round_robin,"
                   "sglang-router/round_robin")
DEFAULT_RATES = "50,100,200,350,500,700,1000,1400,2000"
BELOW_DIRECT = 0.9  # a router's rate over direct's below this is its own limit, if also busy
BUSY_CORES = 0.8  # of the router's cores, at the step where it saturated


@dataclass(frozen=True)
class Step:
    """One path at one rate: what was judged (requests sent after the warm-up)."""

    rate: float
    ttft_p50_s: float
    ttft_p90_s: float
    judged: int
    failed: int
    tokens_per_s: float  # output tokens delivered per second over the judged window
    cpu_ms_per_request: float | None = None
    sent_per_s: float = math.nan  # what the load generator managed to send (the rate asked for
    # is an offer: a sender that falls behind shows it here)

    @property
    def cpu_cores(self) -> float | None:
        """The router's CPU over the step, in cores (None for ``direct``)."""
        if self.cpu_ms_per_request is None or self.sent_per_s != self.sent_per_s:
            return None
        return self.cpu_ms_per_request * self.sent_per_s / 1e3

    @property
    def failed_share(self) -> float:
        return self.failed / self.judged if self.judged else 1.0


def step_of(rate: float, records: Sequence[RequestRecord], warm_s: float, window_s: float,
            cpu_s: float | None = None) -> Step:
    """The figures of the requests sent at or after ``warm_s`` (over ``window_s`` seconds)."""
    judged = [r for r in records if r.sent_at >= warm_s]
    ok = [r for r in judged if r.ok and r.ttft is not None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tokens = sum(r.output_tokens or 0 for r in ok)
    return Step(rate=rate,
                ttft_p50_s=percentile(ttfts, 50) if ttfts else math.nan,
                ttft_p90_s=percentile(ttfts, 90) if ttfts else math.nan,
                judged=len(judged), failed=len(judged) - len(ok),
                tokens_per_s=tokens / window_s if window_s > 0 else math.nan,
                cpu_ms_per_request=(1e3 * cpu_s / len(records)
                                    if cpu_s is not None and records else None),
                sent_per_s=len(judged) / window_s if window_s > 0 else math.nan)


def saturated(step: Step, baseline_s: float) -> bool:
    p50 = step.ttft_p50_s
    return (step.failed_share > MAX_FAILED or p50 != p50
            or p50 >= DOUBLING * baseline_s)


def saturation(steps: Sequence[Step]) -> dict[str, object]:
    """Where a path's TTFT p50 doubles (``steps`` in rising rate, the first the baseline):
    requests/s and tokens/s interpolated in log-rate between the last step below and the first
    at or above, or the top step's with ``reached`` False when no step saturated."""
    if not steps:
        return {"reached": False, "rate": None, "tokens_per_s": None, "baseline_s": None}
    baseline = steps[0].ttft_p50_s
    for i, step in enumerate(steps):
        if i == 0 or not saturated(step, baseline):
            continue
        below = steps[i - 1]
        lo_ratio = below.ttft_p50_s / baseline
        hi_ratio = step.ttft_p50_s / baseline
        if step.failed_share > MAX_FAILED or hi_ratio != hi_ratio or hi_ratio <= lo_ratio:
            frac = 0.0  # failing or unmeasurable: the rate below is all it is known to take
        else:
            frac = min(1.0, max(0.0, (DOUBLING - lo_ratio) / (hi_ratio - lo_ratio)))
        rate = below.rate if frac == 0.0 else math.exp(
            math.log(below.rate) + frac * (math.log(step.rate) - math.log(below.rate)))
        tokens = below.tokens_per_s + frac * (step.tokens_per_s - below.tokens_per_s)
        return {"reached": True, "rate": rate, "tokens_per_s": tokens, "baseline_s": baseline,
                "at_step": step.rate, "cpu_cores": step.cpu_cores}
    top = steps[-1]
    return {"reached": False, "rate": top.rate, "tokens_per_s": top.tokens_per_s,
            "baseline_s": baseline}


def verdicts(rounds: Sequence[dict[str, dict[str, object]]],
             router_cores: int = 1) -> dict[str, dict[str, object]]:
    """Per path: every round's saturation, the median rate, each round's rate over direct's,
    and the reading: a router saturated first only where it is clearly below direct
    (``BELOW_DIRECT``) *and* used most of its cores there (``BUSY_CORES``); below direct with
    its cores idle, what saturated was the engines' and load generator's core, which every path
    shares, so the router's own limit is not separable in that run."""
    names = list(dict.fromkeys(n for r in rounds for n in r))
    out: dict[str, dict[str, object]] = {}
    for name in names:
        per = [r[name] for r in rounds if name in r]
        rates = [float(str(p["rate"])) for p in per if p.get("rate") is not None]
        over_direct = []
        for r in rounds:
            own, direct = r.get(name), r.get("direct")
            if own and direct and own.get("rate") and direct.get("rate"):
                over_direct.append(float(str(own["rate"])) / float(str(direct["rate"])))
        busy = [float(str(p["cpu_cores"])) / router_cores for p in per
                if p.get("cpu_cores") is not None]
        reached = all(bool(p.get("reached")) for p in per)
        out[name] = {"rounds": per, "median_rate": statistics.median(rates) if rates else None,
                     "all_reached": reached, "over_direct": over_direct, "busy_share": busy,
                     "reading": _reading(name, over_direct, busy, reached)}
    return out


def _reading(name: str, over: Sequence[float], busy: Sequence[float], reached: bool) -> str:
    if name == "direct":
        return "the engines' and load generator's limit"
    if not reached:
        return "did not saturate in the ladder"
    if not over or min(over) >= BELOW_DIRECT:
        return "not below direct: the router was not the limit"
    if busy and min(busy) >= BUSY_CORES:
        return "the router saturated first (its cores busy)"
    shown = ", ".join(f"{b:.2f}" for b in busy) or "unknown"
    return (f"below direct with its cores {shown} busy: the shared engine core saturated, "
            "the router's own limit is not separable here")


# -- the shell ----------------------------------------------------------------------------------


async def _open_loop(session: aiohttp.ClientSession, paths: Paths, endpoint: Endpoint | None,
                     rate: float, step_s: float, rng: random.Random) -> list[RequestRecord]:
    offsets = poisson_arrivals(rng, rate, step_s)
    targets = [endpoint or paths.direct[i % len(paths.direct)] for i in range(len(offsets))]
    bodies = [paths.body(t) for t in targets]
    tasks: list[asyncio.Task[RequestRecord]] = []
    start = time.perf_counter()
    for i, (offset, target, body) in enumerate(zip(offsets, targets, bodies, strict=True)):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(
            send_one(session, target, body, index=i, run_start=start, timeout_s=60.0)))
    return list(await asyncio.gather(*tasks))


async def _ladder(paths: Paths, started: list[tuple[Router, Managed, Endpoint]],
                  rates: Sequence[float], step_s: float, warm_s: float,
                  rnd: int) -> dict[str, list[Step]]:
    names = ["direct", *(r.name for r, _, _ in started)]
    steps: dict[str, list[Step]] = {n: [] for n in names}
    done: set[str] = set()
    rng = random.Random(1000 + rnd)
    async with make_session() as session:
        for endpoint in [*paths.direct, *(e for _, _, e in started)]:
            async with session.post(endpoint.url, data=request_body(endpoint, "warm up", 4),
                                    headers=dict(endpoint.headers)) as resp:
                await resp.read()
        for rate in rates:
            for name in names:
                if name in done:
                    continue
                proc = next((p for r, p, _ in started if r.name == name), None)
                endpoint = next((e for r, _, e in started if r.name == name), None)
                cpu0 = tree_cpu_seconds(proc.pid) if proc else None
                records = await _open_loop(session, paths, endpoint, rate, step_s, rng)
                cpu = tree_cpu_seconds(proc.pid) - cpu0 if proc and cpu0 is not None else None
                step = step_of(rate, records, warm_s, step_s - warm_s, cpu)
                steps[name].append(step)
                cpu_text = ("" if step.cpu_ms_per_request is None
                            else f", {step.cpu_ms_per_request:.2f} ms CPU/req")
                print(f"   {name} @ {rate:g}/s (sent {step.sent_per_s:.0f}/s): "
                      f"TTFT p50 {1e3 * step.ttft_p50_s:.1f} ms, "
                      f"p90 {1e3 * step.ttft_p90_s:.1f} ms, "
                      f"{step.failed}/{step.judged} failed{cpu_text}", flush=True)
                if len(steps[name]) > 1 and saturated(step, steps[name][0].ttft_p50_s):
                    done.add(name)
                await asyncio.sleep(0.5)  # what is left of the step's streams drains
    return steps


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.saturation",
                                description=__doc__.splitlines()[0])
    p.add_argument("--routers", default=DEFAULT_ROUTERS)
    p.add_argument("--rates", default=DEFAULT_RATES, help="requests/s, rising; the first is the "
                   "baseline")
    p.add_argument("--step-s", type=float, default=6.0, help="seconds of arrivals per step")
    p.add_argument("--warm-s", type=float, default=1.5, help="not judged at a step's start")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--profile", default="llama70b-h100x4")
    p.add_argument("--time-scale", type=float, default=4.0,
                   help="engines this much faster than the profile, so the routers' CPU, not "
                   "the simulated GPUs, is what saturates first")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--engine-cores", default="1", help="the engines and the load generator")
    p.add_argument("--router-cores", default="0")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--rejudge", type=Path, default=None, metavar="JSON",
                   help="judge a results file again (its steps, today's rules) and print it")
    return p


def step_from(data: dict[str, object]) -> Step:
    """A step as written to the results file (JSON has no NaN: null comes back as NaN)."""
    def num(key: str) -> float:
        value = data.get(key)
        return math.nan if value is None else float(str(value))

    cpu = data.get("cpu_ms_per_request")
    return Step(rate=num("rate"), ttft_p50_s=num("ttft_p50_s"), ttft_p90_s=num("ttft_p90_s"),
                judged=int(str(data["judged"])), failed=int(str(data["failed"])),
                tokens_per_s=num("tokens_per_s"),
                cpu_ms_per_request=None if cpu is None else float(str(cpu)),
                sent_per_s=num("sent_per_s"))


def rejudge(result: dict[str, object]) -> dict[str, object]:
    """``result`` with its saturation and verdicts computed again from its steps."""
    rounds = result["rounds"]
    settings = result["settings"]
    assert isinstance(rounds, list) and isinstance(settings, dict)
    result["saturation"] = [{name: saturation([step_from(s) for s in steps])
                             for name, steps in rnd.items()} for rnd in rounds]
    cores = len(str(settings.get("router_cores", "0")).split(","))
    result["verdicts"] = verdicts(result["saturation"], cores)  # type: ignore[arg-type]
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rejudge is not None:
        print(markdown(rejudge(machine.read_json(args.rejudge))))
        return 0
    try:
        routers = parse_router_list(args.routers)
        rates = [float(x) for x in args.rates.split(",")]
    except ValueError as exc:
        parser.error(str(exc))
    if len(rates) < 2 or any(b <= a for a, b in itertools.pairwise(rates)) or rates[0] <= 0:
        parser.error("--rates needs at least two positive rates, rising")
    if not 0 <= args.warm_s < args.step_s:
        parser.error("--warm-s must be at least 0 and below --step-s")
    spec = FleetSpec(engines=args.engines, profile=args.profile, time_scale=args.time_scale,
                     max_model_len=args.prompt_tokens + args.output_tokens + 64)
    result: dict[str, object] = {
        "benchmark": "saturation", "command": machine.command_line(),
        "started_at": machine.now_utc(), "machine": machine.environment(),
        "versions": machine.own_versions(),
        "settings": {"fleet": spec.settings(), "rates": rates, "step_s": args.step_s,
                     "warm_s": args.warm_s, "rounds": args.rounds,
                     "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
                     "engine_cores": args.engine_cores, "router_cores": args.router_cores},
        "unavailable": {}, "rounds": [], "saturation": []}
    work = args.out / "raw" / "saturation"
    with running(args, spec, routers, work, result) as (paths, started), \
            pinned(args.engine_cores or None):
        for rnd in range(max(1, args.rounds)):
            print(f"== round {rnd + 1}", flush=True)
            steps = run_async(_ladder(paths, started, rates, args.step_s, args.warm_s, rnd))
            result["rounds"].append(  # type: ignore[attr-defined]
                {n: [s.__dict__ for s in v] for n, v in steps.items()})
            result["saturation"].append(  # type: ignore[attr-defined]
                {n: saturation(v) for n, v in steps.items()})
            machine.write_json(args.out / "saturation.json", result)
    result["finished_at"] = machine.now_utc()
    result["verdicts"] = verdicts(result["saturation"],  # type: ignore[arg-type]
                                  len(args.router_cores.split(",")))
    machine.write_json(args.out / "saturation.json", result)
    text = markdown(result)
    (args.out / "saturation.md").write_text(text)
    print(text)
    return 0


def markdown(result: dict[str, object]) -> str:
    env, settings = result["machine"], result["settings"]
    assert isinstance(env, dict) and isinstance(settings, dict)
    verdict = result.get("verdicts") or {}
    assert isinstance(verdict, dict)
    lines = [
        "# Saturation: the request rate at which TTFT p50 doubles", "",
        f"- command: `{result['command']}`",
        f"- run: {result['started_at']} → {result.get('finished_at', '(unfinished)')}",
        f"- machine: {env['cpu_model']} ({env['nproc']} cores), Python {env['python']}, load "
        f"average at start {' '.join(f'{x:.2f}' for x in env['load_avg_at_start'])}",
        f"- settings: `{settings}`", "",
        f"Open-loop Poisson arrivals; a path saturates at the first rate whose TTFT p50 is "
        f"{DOUBLING:g}x its p50 at the first rate (or more than {MAX_FAILED:.0%} fail), "
        "interpolated in log-rate. `direct` is the engines and the load generator's own limit: "
        "a router at or above it was not what saturated.", ""]
    rows = []
    for name, v in verdict.items():
        per = v["rounds"]
        rounds_text = ", ".join(_sat_text(p) for p in per)
        over = v["over_direct"]
        rows.append([f"`{name}`", rounds_text,
                     "—" if v["median_rate"] is None else f"{v['median_rate']:.0f}",
                     ", ".join(_tok_text(p) for p in per),
                     "—" if name == "direct" or not over else ", ".join(f"{x:.2f}" for x in over),
                     ", ".join(f"{b:.2f}" for b in v.get("busy_share", [])) or "—",
                     v.get("reading", "")])
    lines.append(table(["path", "saturation req/s, per round", "median", "tokens/s there",
                        "÷ direct", "router cores busy there", "reading"], rows))
    unavailable = result.get("unavailable")
    if isinstance(unavailable, dict) and unavailable:
        lines += ["", "Not run: " + "; ".join(f"`{k}`: {v}" for k, v in unavailable.items())]
    return "\n".join(lines) + "\n"


def _sat_text(p: dict[str, object]) -> str:
    rate = p.get("rate")
    if rate is None:
        return "—"
    return f"{float(str(rate)):.0f}" if p.get("reached") else f"≥ {float(str(rate)):.0f}"


def _tok_text(p: dict[str, object]) -> str:
    tokens = p.get("tokens_per_s")
    return "—" if tokens is None else f"{float(str(tokens)):.0f}"


if __name__ == "__main__":
    sys.exit(main())
