"""Overcommit benchmark: the KV overcommit guard vs KV thresholds only vs no admission control.

Usage: ``python -m bench.overcommit [--duration-s 40] [--repeat 3] [options]`` (see ``--help``);
writes ``bench/results/overcommit.json`` and ``overcommit.md``, then regenerates the benchmarks
page.

Rules:
- Engines: simulated, profile ``llama70b-h100`` (70B FP8 on one H100 at 0.95 memory
  utilisation: about 20k tokens of KV), ``max_num_seqs`` high, so that an engine admits requests
  on their prompt's blocks alone and runs out of KV as their outputs grow: it preempts, as vLLM
  does when overcommitted. FCFS scheduling (vLLM's default): a preemption hits whoever came last.
- Traffic: open loop, one schedule from ``--seed`` for every arm: a base Poisson rate with
  periodic bursts, each request critical / standard / sheddable by the given mix, its prompt drawn
  from the same generator. Clients do not know how long the answer will be: each sends a
  ``max_tokens`` cap drawn from ``--max-tokens`` ("none": omitted), and the engine ends the answer
  at its natural length (greedy, so the same prompt gives the same length in every arm), drawn
  uniformly from ``--output-tokens``. ``--exact-max-tokens`` sends the answer's exact length as
  ``max_tokens`` instead (forced with ``ignore_eos``), which hands the proxy a perfect forecast.
- Rounds: ``--repeat`` rounds, each running every arm once, one after the other (arms interleaved
  across rounds, so slow drift of the machine hits every arm alike). Each arm run has a fresh
  engine process and a fresh proxy: ``guard``
  (default config), ``paced`` (the guard with ``pressure.pace_standard = true``: standard work
  that only the commitment forecast refuses goes through after its hold), ``threshold``
  (``pressure.enabled = false``: today's KV thresholds only) and
  ``none`` (guard off, thresholds above any usage: no shedding at all).
- Clients: every arm's clients retry a refused request (503, 429) as the OpenAI SDKs do
  (``bench.clients``): at most ``--client-retries`` times (default 2, the SDKs' default), after
  its ``Retry-After``; a request still refused after its retries is lost. ``--client-retries 0``
  is the open loop of earlier runs, where every refusal is lost.
- Objectives, fixed before any run with them and the same for every arm (``bench.slo``): TTFT at
  most 1 s for critical, 5 s for standard, 20 s for sheddable requests, counted from the client's
  first send (waits before retries included), and TPOT at most 100 ms; all wall-clock at the
  client, as every latency of this benchmark. ``--slo-ttft-s`` and ``--slo-tpot-ms`` change them.
- Figures: preemptions from the engines' own ``vllm:num_preemptions_total``; TTFT per class of
  completed requests; goodput = output tokens of the requests that met their objectives per
  second of the schedule's arrival window (first to last scheduled arrival), the same denominator
  for every arm; raw throughput over own span = output tokens of completed requests per second of
  the arm's own span (first send to last answer); per class: completed, within objectives,
  retried, lost to shedding (503 after the retries) and failed.
- Why goodput shares one denominator: every arm gets the same open-loop arrival schedule, so the
  work offered is the same and only what each arm makes of it differs. Runs before 2026-11-24
  divided each arm's good tokens by that arm's own span, so an arm that served one more request,
  late, after everything else scored lower although it did strictly more good work within
  objectives. Over the arrival window, the ratio of two arms' goodputs is the ratio of their
  tokens served within objectives. The old figure (good tokens over the arm's own span) is kept
  in the results as ``goodput_own_span_tokens_per_s`` and shown in the report beside the others.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson

from bench import machine
from bench.clients import send_retrying
from bench.fleet import Fleet, FleetSpec
from bench.loadgen import Endpoint, make_session, request_body, run_async
from bench.procs import Managed, free_port
from bench.prompts import random_tokens
from bench.report import RESULTS
from bench.slo import Objectives, meets
from bench.stats import RequestRecord, percentile
from proxy.core.config import PressureConfig

CLASSES = ("critical", "standard", "sheddable")
ARMS: dict[str, list[str]] = {
    "guard": [],
    "paced": ["[pressure]", "pace_standard = true"],
    "threshold": ["[pressure]", "enabled = false"],
    "none": ["[pressure]", "enabled = false", "[admission.sheddable]", "shed_above = 2.0",
             "admit_below = 2.0", "[admission.standard]", "shed_above = 2.0", "admit_below = 2.0"],
}


@dataclass(frozen=True)
class Arrival:
    at: float
    cls: str
    prompt: str
    output_tokens: int  # the natural length with --exact-max-tokens; else set by the engine
    max_tokens: int | None  # the client's cap (None: not sent)
    forced: bool = False  # --exact-max-tokens: the answer is forced to ``output_tokens``


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.overcommit",
                                description=__doc__.splitlines()[0])
    p.add_argument("--duration-s", type=float, default=40.0, help="arrivals for this long")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--profile", default="llama70b-h100")
    p.add_argument("--time-scale", type=float, default=2.0)
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="default: the profile's")
    p.add_argument("--base-rps", type=float, default=3.0)
    p.add_argument("--burst-rps", type=float, default=14.0)
    p.add_argument("--burst-s", type=float, default=3.0)
    p.add_argument("--period-s", type=float, default=10.0, help="one burst per period")
    p.add_argument("--mix", default="0.2,0.4,0.4", help="critical,standard,sheddable shares")
    p.add_argument("--prompt-tokens", default="256,1024")
    p.add_argument("--output-tokens", default="256,768",
                   help="MIN,MAX of the answers' natural length (the engines' --output-len)")
    p.add_argument("--max-tokens", default="none,1024,2048",
                   help="caps the clients send, one drawn per request ('none': omitted)")
    p.add_argument("--exact-max-tokens", action="store_true",
                   help="send each answer's exact length as max_tokens (a perfect forecast)")
    p.add_argument("--client-retries", type=int, default=2,
                   help="retries of a refused request, after its Retry-After (0: none)")
    p.add_argument("--slo-ttft-s", default="1,5,20",
                   help="TTFT objectives of critical,standard,sheddable requests (seconds)")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0, help="TPOT objective (ms)")
    p.add_argument("--repeat", type=int, default=1, help="rounds of all arms, interleaved")
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--no-report", action="store_true")
    return p


def schedule(args: argparse.Namespace) -> list[Arrival]:
    """The arrivals of one run: Poisson at the base rate, at the burst rate during bursts."""
    rng = random.Random(args.seed)
    # Caps come from a generator of their own: arrivals, classes and prompts stay those of the seed.
    caps_rng = random.Random(f"{args.seed}-max-tokens")
    caps = [None if c.strip() == "none" else int(c) for c in args.max_tokens.split(",")]
    shares = [float(x) for x in args.mix.split(",")]
    p_lo, p_hi = (int(x) for x in args.prompt_tokens.split(","))
    o_lo, o_hi = (int(x) for x in args.output_tokens.split(","))
    out: list[Arrival] = []
    t = 0.0
    while True:
        bursting = (t % args.period_s) >= args.period_s - args.burst_s
        t += rng.expovariate(args.burst_rps if bursting else args.base_rps)
        if t >= args.duration_s:
            return out
        cls = rng.choices(CLASSES, weights=shares)[0]
        prompt = random_tokens(rng, rng.randint(p_lo, p_hi))
        length = rng.randint(o_lo, o_hi)
        cap = length if args.exact_max_tokens else caps_rng.choice(caps)
        out.append(Arrival(t, cls, prompt, length, cap, forced=args.exact_max_tokens))


def guard_marks() -> dict[str, object]:
    """The guard arm's committed-KV marks (the proxy's defaults), recorded with the results."""
    cfg = PressureConfig()
    return {"committed_sheddable": asdict(cfg.committed_sheddable),
            "committed_standard": asdict(cfg.committed_standard)}


def proxy_toml(arm: str, urls: list[str], model: str, port: int) -> str:
    lines = ["[server]", 'host = "127.0.0.1"', f"port = {port}", ""]
    lines += ARMS[arm]
    lines += ["", "[[pools]]", 'name = "target"', f'model = "{model}"']
    for i, url in enumerate(urls):
        lines += ["", "[[pools.engines]]", f'name = "e{i}"', f'url = "{url}"']
    return "\n".join(lines) + "\n"


def objectives(args: argparse.Namespace) -> Objectives:
    bounds = [float(x) for x in args.slo_ttft_s.split(",")]
    if len(bounds) != len(CLASSES):
        raise SystemExit("--slo-ttft-s takes one bound per class: critical,standard,sheddable")
    return Objectives(ttft_s=dict(zip(CLASSES, bounds, strict=True)),
                      tpot_s=args.slo_tpot_ms / 1000.0)


async def drive(url: str, model: str, arrivals: list[Arrival], args: argparse.Namespace,
                ) -> tuple[list[tuple[str, RequestRecord]], float]:
    endpoint = Endpoint(name="kvproxy", base_url=url, model=model)
    async with make_session() as session:
        start = time.perf_counter()

        async def one(i: int, a: Arrival) -> tuple[str, RequestRecord]:
            await asyncio.sleep(max(0.0, start + a.at - time.perf_counter()))
            body = client_body(endpoint, a)
            rec = await send_retrying(session, endpoint, body, index=i, run_start=start,
                                      max_retries=args.client_retries, seed=args.seed,
                                      timeout_s=args.timeout_s, headers={"X-Priority": a.cls})
            return a.cls, rec

        done = await asyncio.gather(*(one(i, a) for i, a in enumerate(arrivals)))
        span = max((r.sent_at + (r.e2e or 0.0) for _, r in done), default=0.0)
    return list(done), span


def client_body(endpoint: Endpoint, a: Arrival) -> bytes:
    """The request as a chat client sends it: a cap on the answer, not its length."""
    if a.forced:
        return request_body(endpoint, a.prompt, a.output_tokens)  # forced to exactly this length
    body = orjson.loads(request_body(endpoint, a.prompt, 1))
    for key in ("min_tokens", "ignore_eos", "max_tokens"):
        body.pop(key)
    if a.max_tokens is not None:
        body["max_tokens"] = a.max_tokens
    return bytes(orjson.dumps(body))


def run_arm(arm: str, spec: FleetSpec, arrivals: list[Arrival], args: argparse.Namespace,
            work: Path) -> dict[str, object]:
    fleet = Fleet(spec, work / arm)
    proxy: Managed | None = None
    try:
        fleet.start()
        port = free_port()
        cfg = work / arm / "kvproxy.toml"
        cfg.write_text(proxy_toml(arm, fleet.urls, spec.model, port))
        proxy = Managed(f"kvproxy-{arm}", [sys.executable, "-m", "proxy", "serve", "--config",
                                           str(cfg)], work / arm / "kvproxy.log").start()
        proxy.wait_http(f"http://127.0.0.1:{port}/ready")
        time.sleep(1.0)  # a few scrapes, so that every engine is fresh
        done, span = run_async(drive(f"http://127.0.0.1:{port}", spec.model, arrivals, args))
        counters = fleet.scrape()
    finally:
        if proxy is not None:
            proxy.stop()
        fleet.stop()
    preemptions = sum(c.get("vllm:num_preemptions_total", 0.0) for c in counters.values())
    return summarize_arm(done, span, preemptions, objectives(args), arrival_window(arrivals))


def arrival_window(arrivals: list[Arrival]) -> float:
    """Seconds from the first to the last scheduled arrival: goodput's common denominator."""
    return arrivals[-1].at - arrivals[0].at if len(arrivals) > 1 else 0.0


def summarize_arm(done: list[tuple[str, RequestRecord]], span: float, preemptions: float,
                  slo: Objectives, window: float) -> dict[str, object]:
    """One arm's figures; goodput over the schedule's arrival ``window`` (the same for every
    arm), raw throughput and the old goodput over the arm's own ``span``."""
    per_class = {cls: summarize_class([r for c, r in done if c == cls], cls, slo)
                 for cls in CLASSES}

    def total(key: str) -> float:
        return sum(v[key] for v in per_class.values())

    def per_s(tokens: float, seconds: float) -> float:
        return tokens / seconds if seconds > 0 else 0.0

    return {"preemptions": preemptions, "span_s": span, "arrival_window_s": window,
            "completed": total("completed"), "within_slo": total("within_slo"),
            "good_tokens": total("good_tokens"),
            "throughput_tokens_per_s": per_s(total("output_tokens"), span),
            "goodput_tokens_per_s": per_s(total("good_tokens"), window),
            "goodput_own_span_tokens_per_s": per_s(total("good_tokens"), span),
            "classes": per_class}


def summarize_class(recs: list[RequestRecord], cls: str, slo: Objectives) -> dict[str, float]:
    ok = [r for r in recs if r.ok]
    good = [r for r in ok if meets(r, cls, slo)]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    return {
        "sent": len(recs), "completed": len(ok), "within_slo": len(good),
        "retried": sum(1 for r in recs if r.retries > 0),
        "retries": sum(r.retries for r in recs),
        "shed": sum(1 for r in recs if r.status == 503),  # lost: still refused after retries
        "failed": sum(1 for r in recs if not r.ok and r.status != 503),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "output_tokens": sum(r.output_tokens for r in ok),
        "good_tokens": sum(r.output_tokens for r in good),
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    spec = FleetSpec(engines=args.engines, profile=args.profile, model="llama-70b",
                     time_scale=args.time_scale, num_gpu_blocks=args.num_gpu_blocks,
                     max_num_seqs=512, max_model_len=4096,
                     extra_args=("--output-len", args.output_tokens))
    arrivals = schedule(args)
    result: dict[str, object] = {
        "benchmark": "overcommit", "command": machine.command_line(),
        "started_at": machine.now_utc(), "machine": machine.environment(),
        "versions": machine.own_versions(),
        "settings": {"fleet": spec.settings(), **{k: v for k, v in vars(args).items()
                                                  if k not in ("out", "no_report")},
                     "requests": len(arrivals), "scheduling_policy": "fcfs",
                     "objectives": objectives(args).as_dict(), "guard": guard_marks(),
                     "arrival_window_s": arrival_window(arrivals),
                     "goodput_denominator": "arrival_window"},
        "rounds": [],
    }
    work = args.out / "raw" / "overcommit"
    for n in range(args.repeat):
        done: dict[str, object] = {}
        for arm in arms:
            print(f"round {n + 1}/{args.repeat}, arm {arm}: {len(arrivals)} requests over "
                  f"{args.duration_s:g} s", flush=True)
            done[arm] = run_arm(arm, spec, arrivals, args, work)
        result["rounds"].append(done)  # type: ignore[attr-defined]
    result["finished_at"] = machine.now_utc()
    machine.write_json(args.out / "overcommit.json", result)
    from bench.report_overcommit import write_overcommit  # noqa: PLC0415

    print(write_overcommit(args.out) or "")
    if not args.no_report:
        from bench import report  # noqa: PLC0415

        report.main(report.report_args(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
