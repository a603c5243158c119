"""Choosing the routing benchmark's load: round-robin on the simulator's model, without wall clock.

Usage: ``python -m bench.calibrate [--rate-scales 1,2,3,3.25,3.5,4] [routing options]``; writes
``bench/results/calibration.json`` (shown in the routing report).

Rules:
- It drives the engine simulator's own scheduler, KV block pool and step-time profile in a
  discrete-event loop (no HTTP, no sleeping), with the same slice, caps and prompts as
  ``bench.routing``, so a sweep of the load takes seconds instead of a run per point.
- Only round-robin is modelled: it is the reference the load is chosen for, and it needs no
  router state. The routers themselves are measured by ``bench.routing``, never here.
- Busy fraction is the share of the slice's time an engine spent in steps; above ~1 the queue
  grows for the whole slice.
"""

from __future__ import annotations

import argparse
import heapq
import random
import sys
from array import array
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from bench import machine
from bench.prompts import PromptMapper, workload
from bench.stats import percentile
from bench.traces import Caps, TraceRequest, apply_caps, hit_rate, oracle_hit_rate


def simulate_round_robin(reqs: Sequence[TraceRequest], *, engines: int, profile: str,
                         num_gpu_blocks: int | None, rate_scale: float) -> dict[str, float]:
    """TTFT percentiles (engine seconds), hit rate and busy fraction of a round-robin fleet."""
    from engine_sidecar.sim.kvcache import BlockPool  # noqa: PLC0415 - the simulator's model
    from engine_sidecar.sim.profiles import PROFILES  # noqa: PLC0415
    from engine_sidecar.sim.scheduler import Scheduler, SimRequest  # noqa: PLC0415
    from engine_sidecar.sim.tokenizer import WordStream, chat_prompt, encode  # noqa: PLC0415

    prof = PROFILES[profile]
    blocks = num_gpu_blocks or prof.num_gpu_blocks(16)
    scheds = [Scheduler(BlockPool(blocks, 16), max_num_seqs=256, max_num_batched_tokens=8192,
                        policy="fcfs", spec_acceptance=(), rng=random.Random(i))
              for i in range(engines)]
    mapper = PromptMapper()
    events: list[tuple[float, int, int]] = [(r.arrival_s / rate_scale, 0, i)
                                            for i, r in enumerate(reqs)]
    heapq.heapify(events)
    plans: list[object | None] = [None] * engines
    busy = [0.0] * engines
    arrived: dict[int, float] = {}
    ttft: dict[int, float] = {}

    def kick(e: int, now: float) -> None:
        if plans[e] is not None or not scheds[e].has_work:
            return
        plan = scheds[e].schedule()
        if not plan.items:
            return
        dt = prof.step_time(plan.batched_tokens, plan.context_tokens, plan.attn_work,
                            plan.draft_len)
        plans[e] = plan
        busy[e] += dt
        heapq.heappush(events, (now + dt, 1, e))

    while events:
        now, kind, x = heapq.heappop(events)
        if kind == 0:
            req, e = reqs[x], x % engines
            ids = encode(chat_prompt([{"role": "user", "content": mapper.prompt(req)}]))
            sim = SimRequest(request_id=str(x), token_ids=array("I", ids), prompt_len=len(ids),
                             target_len=req.output_tokens, finish_reason="length", priority=0,
                             seq=x, words=WordStream(x))
            arrived[x] = now
            scheds[e].add(sim)
            kick(e, now)
            continue
        for out in scheds[x].complete(plans[x]):  # type: ignore[arg-type]
            rid = int(out.request.request_id)
            ttft.setdefault(rid, now - arrived[rid])
        plans[x] = None
        kick(x, now)
    span = reqs[-1].arrival_s / rate_scale if reqs else 0.0
    stats = [s.stats for s in scheds]
    queries = sum(s.prefix_queries for s in stats)
    values = list(ttft.values())
    return {
        "rate_scale": rate_scale,
        "ttft_p50": percentile(values, 50), "ttft_p90": percentile(values, 90),
        "ttft_p99": percentile(values, 99),
        "hit_rate": sum(s.prefix_hits for s in stats) / queries if queries else float("nan"),
        "busy_fraction": sum(busy) / engines / span if span > 0 else float("nan"),
        "preemptions": float(sum(s.preemptions for s in stats)),
    }


def main(argv: Sequence[str] | None = None) -> int:
    from bench.routing import build_parser as routing_parser  # noqa: PLC0415 - shared options

    p = argparse.ArgumentParser(prog="python -m bench.calibrate", parents=[routing_parser()],
                                add_help=False, description=__doc__.splitlines()[0],
                                conflict_handler="resolve")
    p.add_argument("--rate-scales", default="1,2,3,3.25,3.5,4")
    args = p.parse_args(argv)
    duration = args.duration_s or 600.0
    caps = Caps(max_input_tokens=args.max_input_tokens, max_output_tokens=args.max_output_tokens,
                output_scale=args.output_scale)
    reqs = apply_caps(workload(args.trace, start_s=args.start_s, duration_s=duration), caps)
    points = []
    for scale in (float(v) for v in args.rate_scales.split(",")):
        point = simulate_round_robin(reqs, engines=args.engines, profile=args.profile,
                                     num_gpu_blocks=args.num_gpu_blocks, rate_scale=scale)
        print(" ".join(f"{k} {v:.3f}" for k, v in point.items()), flush=True)
        points.append(point)
    from engine_sidecar.sim.profiles import PROFILES  # noqa: PLC0415

    kv_tokens = (args.num_gpu_blocks or PROFILES[args.profile].num_gpu_blocks(16)) * 16
    ceiling = {"kv_tokens_per_engine": kv_tokens, "ideal_hit_rate": hit_rate(reqs),
               "oracle_hit_rate": oracle_hit_rate(reqs, args.engines, kv_tokens)}
    print(" ".join(f"{k} {v:.3f}" for k, v in ceiling.items()), flush=True)
    out: Path = args.out
    machine.write_json(out / "calibration.json", {
        "command": machine.command_line(), "started_at": machine.now_utc(),
        "settings": {"trace": args.trace, "slice_start_s": args.start_s,
                     "slice_duration_s": duration, "engines": args.engines,
                     "profile": args.profile, "num_gpu_blocks": args.num_gpu_blocks,
                     "caps": asdict(caps)},
        "points": points,
        "cache_ceiling": ceiling,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())

