"""Offline replay of routing decisions: a suite workload through one routing policy on the
simulator's engine model, in simulated time (no HTTP, no sleeping, no timing noise).

Usage: ``python -m bench.replay --workloads chat [--quick] [--policies expected_ttft,cache_aware]
[--rate-scale X] [--log decisions.jsonl] [--calibration]``. Prints, per workload and policy, TTFT
percentiles (engine seconds), ITL p99 (a step's duration over the tokens it gave a request, as the
suite's client measures between events), the engines' hit rate, requests per engine (busiest / mean)
and what the decisions cost in cache: how often the pick held less of the prompt than the engine
holding the most of it really did (from the engines' own block pools), and why, and the hit rate
over ``bench.traces.oracle_hit_rate``, and the workload's idle floor (``bench.idle_floor``: the TTFT
no router can beat), and, for the cost model, how its prediction came true: each request's real TTFT
over the TTFT the model predicted at the engine it picked (``real/predicted``, median and 10th/90th
percentiles; ``--calibration`` adds the table by predicted bin). The log (``--log``) holds every
decision with each engine's estimate (wait, cost, held tokens, TTFT), the pick's prediction and the
TTFT it came to. A policy may carry variants: ``expected_ttft+plain``, ``expected_ttft+unbounded``,
``expected_ttft+drain``, ``expected_ttft+nodecode`` (no charge for the streams a prefill stalls)
(``VARIANTS``).

Rules:
- Engines are ``bench.calibrate``'s discrete-event model: the simulator's own scheduler, KV block
  pool and step-time profile. Arrivals are the suite's (same slice, caps and prompts); the load is
  the workload's calibrated knee unless ``--rate-scale`` is given.
- kvproxy's policies run as the proxy runs them: the pure policy (``proxy.core.routing``) over
  ``EngineView``s built by the proxy's own ``EngineState`` from snapshots taken every
  ``--scrape-s`` engine seconds (the benchmark's 200 ms at its time scale 3 by default), with
  dispatch, first byte and completion reported as the proxy's shell does. What it leaves out:
  admission, network and the proxy's own CPU time, so a difference here is a decision's.
- ``cache_aware`` is a model of sglang-router's policy of that name at its defaults (cache
  threshold 0.3, balance thresholds 64 and 1.5), for comparison: its tree matches characters,
  approximated here by 16-character blocks. It is a model, not the peer: the peer's figures
  come from ``bench.routing``.
- Deterministic: the same arguments give the same figures.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from bench.idle_floor import floor_percentiles, idle_floors
from bench.prompts import PromptMapper
from bench.stats import percentile
from bench.traces import Caps, TraceRequest, apply_caps, oracle_hit_rate
from bench.workloads import by_name
from proxy.core.config import RoutingConfig
from proxy.core.costmodel import ExpectedTTFT
from proxy.core.engine_state import EngineState
from proxy.core.holdings import ApproxHoldings, held_depth
from proxy.core.prefix import canonical_chat, prefix_chain
from proxy.core.routeview import EngineView, RouteKey
from proxy.core.routing import Policy, make_policy
from proxy.core.telemetry import EngineSnapshot

ARRIVE, STEP, SCRAPE = 0, 1, 2


class Router(Protocol):
    name: str

    def pick(self, rid: int, text: str, now: float) -> tuple[int, dict[str, Any]]: ...
    def first_token(self, rid: int, now: float) -> None: ...
    def done(self, rid: int, now: float) -> None: ...
    def scrape(self, engines: Sequence[Any], now: float) -> None: ...


# Variants of a kvproxy policy (``--policies expected_ttft+abandon``): ``abandon`` turns
# ``routing.charge_abandoned`` on and ``plain`` off (else the config's default stands);
# ``unbounded`` charges provisional holdings too (the rule before its bound: every holding counts
# as settled at dispatch; an experiment of the replay only); ``drain`` counts each engine's
# queued prompt work as draining at the profile's prefill rate since its dispatch (the views'
# ``prefill`` capped at that backlog; an experiment of the replay only: the proxy's engine state
# has no such rule).
# ``precise`` models precise mode with events that arrive at once: the policy's held and
# settled tokens of every engine come from the engine's own block pool (what its KV events
# would report), with the blocks of recent dispatches counted as held for ``provisional_s``
# (engine seconds) as ``proxy.core.kvindex`` counts them; ``provisional_s`` from the replay's
# ``--provisional-s``.
VARIANTS = ("abandon", "plain", "unbounded", "drain", "precise", "nodecode")


class UnboundedHoldings(ApproxHoldings):
    """Every recorded holding counts as settled: the abandoned charge without its bound."""

    def settled_tokens(self, key: RouteKey, engines: Sequence[str]) -> dict[str, float]:
        return self.held_tokens(key, engines)


def _policy(cfg: RoutingConfig, unbounded: bool) -> Policy:
    if unbounded:
        return ExpectedTTFT(cfg, UnboundedHoldings(cfg.index_blocks))
    return make_policy(cfg)


class KvproxyRouter:
    """A kvproxy policy behind the proxy's own engine state (see the module rules)."""

    def __init__(self, policy: str, n: int, cfg: RoutingConfig) -> None:
        self.name = f"kvproxy/{policy}"
        base, *variants = policy.split("+")
        unknown = set(variants) - set(VARIANTS)
        if unknown:
            raise ValueError(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
        charge = cfg.charge_abandoned or bool({"abandon", "unbounded"} & set(variants))
        self.cfg = cfg = RoutingConfig(**{**cfg.__dict__, "policy": base,
                                          "charge_abandoned": charge and "plain" not in variants,
                                          "decode_charge": 0.0 if "nodecode" in variants
                                          else cfg.decode_charge})
        self.drain = "drain" in variants
        self.policy: Policy = _policy(cfg, "unbounded" in variants)
        self.states = [EngineState(f"e{i}", "target", "", stale_after_s=1e9) for i in range(n)]
        self.tickets: dict[int, tuple[int, int]] = {}
        self.backlog = [(0.0, 0.0)] * n  # per engine: (prompt tokens left, as of when)
        self.last_chain: tuple[int, ...] = ()  # the last pick's prefix chain
        self.precise = "precise" in variants
        self.provisional_s = 15.0
        self.pending: list[dict[bytes, float]] = [{} for _ in range(n)]
        self.exact: tuple[list[bytes], list[int]] | None = None  # (hashes, settled blocks)

    def see(self, hashes: list[bytes], settled: list[int]) -> None:
        """Precise variant: the request's block hashes and each engine's settled blocks."""
        self.exact = (hashes, settled)

    def _held(self, e: int, hashes: list[bytes], settled: int, now: float) -> int:
        pending = self.pending[e]
        depth = settled
        while depth < len(hashes) and pending.get(hashes[depth], -1.0) > now:
            depth += 1
        return depth

    def _left(self, e: int, now: float) -> float:
        tokens, since = self.backlog[e]
        return max(0.0, tokens - (now - since) * self.cfg.prefill_tokens_per_s)

    def _views(self, now: float) -> list[EngineView]:
        views = [st.view(now, True) for st in self.states]
        if not self.drain:
            return views
        return [replace(v, prefill=min(v.prefill, self._left(i, now)))
                for i, v in enumerate(views)]

    def scrape(self, engines: Sequence[Any], now: float) -> None:
        for st, sched in zip(self.states, engines, strict=True):
            snap = EngineSnapshot(taken_at=now, kv_usage=sched.pool.usage,
                                  running=float(len(sched.running)),
                                  waiting=float(sched.num_waiting), block_size=16)
            st.on_scrape_ok(snap, now)

    def route_key(self, chain: tuple[int, ...], tokens: float, now: float) -> RouteKey:
        key = RouteKey(chain=chain, prompt_tokens=tokens,
                       block_tokens=self.cfg.block_chars / self.cfg.chars_per_token)
        if not self.precise or self.exact is None:
            return key
        hashes, settled = self.exact
        held = {f"e{e}": 16.0 * self._held(e, hashes, s, now) for e, s in enumerate(settled)}
        return replace(key, held=held,
                       settled={f"e{e}": 16.0 * s for e, s in enumerate(settled)})

    def pick(self, rid: int, text: str, now: float) -> tuple[int, dict[str, Any]]:
        cfg = self.cfg
        chain = prefix_chain(text, model="m", tenant="t", block_chars=cfg.block_chars,
                             max_blocks=cfg.max_blocks)
        self.last_chain = chain
        key = self.route_key(chain, len(text) / cfg.chars_per_token, now)
        views = self._views(now)
        info: dict[str, Any] = {}
        if isinstance(self.policy, ExpectedTTFT):
            info["est"] = {e.name: (round(e.wait_s, 3), round(e.cost_s, 3), e.held,
                                    round(e.ttft_s, 4))
                           for e in self.policy.estimates(key, views)}
            info["views"] = {v.name: (v.running, v.waiting, v.load, v.pending, v.prefill)
                             for v in views}
        ranked = self.policy.rank(key, views)
        name = ranked[0]
        prefill = self.policy.uncached_tokens(key, name)
        info["believed_held"] = key.tokens - prefill
        if "est" in info:
            info["predicted"] = info["est"][name][3]  # the pick's own TTFT estimate
        if isinstance(self.policy, ExpectedTTFT):
            self.policy.dispatched(rid, key, name)
        else:
            self.policy.observe(key, name)
        e = int(name[1:])
        if self.precise and self.exact is not None:
            hashes, settled = self.exact
            for h in hashes[settled[e]:]:
                self.pending[e][h] = now + self.provisional_s
        self.backlog[e] = (self._left(e, now) + prefill, now)
        self.tickets[rid] = (e, self.states[e].on_dispatch(now, prefill))
        return e, info

    def first_token(self, rid: int, now: float) -> None:
        e, ticket = self.tickets[rid]
        self.states[e].on_first_byte(ticket)
        if isinstance(self.policy, ExpectedTTFT):
            self.policy.first_byte(rid, f"e{e}")

    def done(self, rid: int, now: float) -> None:
        e, ticket = self.tickets.pop(rid)
        self.states[e].on_complete(ticket, now)
        self.states[e].on_settle(ticket)


class CacheAware:
    """A model of sglang-router's ``cache_aware`` policy (see the module rules)."""

    BLOCK = 16

    def __init__(self, n: int, threshold: float = 0.3, abs_t: int = 64, rel_t: float = 1.5) -> None:
        self.name = "model/cache_aware"
        self.n, self.threshold, self.abs_t, self.rel_t = n, threshold, abs_t, rel_t
        self.trees: list[dict[int, float]] = [{} for _ in range(n)]  # block -> last access
        self.load = [0] * n
        self.where: dict[int, int] = {}

    def scrape(self, engines: Sequence[Any], now: float) -> None:
        return None

    def pick(self, rid: int, text: str, now: float) -> tuple[int, dict[str, Any]]:
        chain = prefix_chain(text, model="m", tenant="t", block_chars=self.BLOCK,
                             max_blocks=1 << 20)
        lo, hi = min(self.load), max(self.load)
        if hi - lo > self.abs_t and hi > lo * self.rel_t:
            e = self.load.index(lo)
        else:
            depth = [held_depth(t, chain) for t in self.trees]
            best = max(depth)
            if best * self.BLOCK / max(1, len(text)) > self.threshold:
                e = max((i for i in range(self.n) if depth[i] == best),
                        key=lambda i: self.trees[i].get(chain[best - 1], 0.0))
            else:
                e = min(range(self.n), key=lambda i: len(self.trees[i]))
        tree = self.trees[e]
        for h in chain:
            tree[h] = now
        self.load[e] += 1
        self.where[rid] = e
        return e, {}

    def first_token(self, rid: int, now: float) -> None:
        return None

    def done(self, rid: int, now: float) -> None:
        self.load[self.where.pop(rid)] -= 1


@dataclass
class Outcome:
    ttft: dict[int, float] = field(default_factory=dict)
    itl: list[float] = field(default_factory=list)
    per_engine: list[int] = field(default_factory=list)
    hit_rate: float = 0.0
    decisions: list[dict[str, Any]] = field(default_factory=list)


def replay(reqs: Sequence[TraceRequest], router: Router, *, engines: int, profile: str,
           rate_scale: float, scrape_s: float) -> Outcome:
    """Every request of ``reqs`` routed by ``router`` onto simulated engines (module rules)."""
    from engine_sidecar.sim.kvcache import BlockPool  # noqa: PLC0415 - the simulator's model
    from engine_sidecar.sim.profiles import PROFILES  # noqa: PLC0415
    from engine_sidecar.sim.scheduler import Scheduler, SimRequest  # noqa: PLC0415
    from engine_sidecar.sim.tokenizer import WordStream, chat_prompt, encode  # noqa: PLC0415

    prof = PROFILES[profile]
    scheds = [Scheduler(BlockPool(prof.num_gpu_blocks(16), 16), max_num_seqs=256,
                        max_num_batched_tokens=8192, policy="fcfs", spec_acceptance=(),
                        rng=random.Random(i)) for i in range(engines)]
    mapper, out = PromptMapper(), Outcome(per_engine=[0] * engines)
    events: list[tuple[float, int, int]] = [(r.arrival_s / rate_scale, ARRIVE, i)
                                            for i, r in enumerate(reqs)]
    events.append((-1e-9, SCRAPE, 0))  # the first snapshot before the first arrival
    heapq.heapify(events)
    plans: list[Any] = [None] * engines
    arrived: dict[int, float] = {}
    last_token: dict[int, float] = {}
    end = reqs[-1].arrival_s / rate_scale if reqs else 0.0

    def kick(e: int, now: float) -> None:
        if plans[e] is not None or not scheds[e].has_work:
            return
        plan = scheds[e].schedule()
        if plan.items:
            plans[e] = plan
            heapq.heappush(events, (now + prof.step_time(plan.batched_tokens,
                                                         plan.context_tokens, plan.attn_work,
                                                         plan.draft_len), STEP, e))

    while events:
        now, kind, x = heapq.heappop(events)
        if kind == SCRAPE:
            router.scrape(scheds, now)
            if now < end or arrived.keys() - out.ttft.keys():
                heapq.heappush(events, (now + scrape_s, SCRAPE, 0))
            continue
        if kind == ARRIVE:
            req = reqs[x]
            content = mapper.prompt(req)
            ids = encode(chat_prompt([{"role": "user", "content": content}]))
            if isinstance(router, KvproxyRouter) and router.precise:
                sim0 = scheds[0].pool.chain(array("I", ids))
                router.see(sim0, [len(s.pool.lookup(sim0)) for s in scheds])
            e, info = router.pick(x, canonical_chat([{"role": "user", "content": content}]), now)
            sim = SimRequest(request_id=str(x), token_ids=array("I", ids), prompt_len=len(ids),
                             target_len=req.output_tokens, finish_reason="length", priority=0,
                             seq=x, words=WordStream(x))
            out.decisions.append(_audit(x, req, e, info, sim, scheds, now))
            arrived[x] = now
            out.per_engine[e] += 1
            scheds[e].add(sim)
            kick(e, now)
            continue
        for o in scheds[x].complete(plans[x]):
            rid = int(o.request.request_id)
            if rid in last_token and o.new_words:
                out.itl.append((now - last_token[rid]) / len(o.new_words))
            last_token[rid] = now
            if rid not in out.ttft:
                out.ttft[rid] = now - arrived[rid]
                router.first_token(rid, now)
            if o.finished:
                router.done(rid, now)
        plans[x] = None
        kick(x, now)
    stats = [s.stats for s in scheds]
    queries = sum(s.prefix_queries for s in stats)
    out.hit_rate = sum(s.prefix_hits for s in stats) / queries if queries else float("nan")
    return out


def _audit(rid: int, req: TraceRequest, e: int, info: dict[str, Any], sim: Any,
           scheds: Sequence[Any], now: float) -> dict[str, Any]:
    """What each engine really holds of the prompt at the decision (16-token blocks), next to
    the pick."""
    hashes = scheds[0].pool.chain(sim.token_ids, sim.root)
    held = [len(s.pool.lookup(hashes)) * 16 for s in scheds]
    conv = req.hash_ids[-1] >> 12 if len(req.hash_ids) > 1 else -1
    return {"rid": rid, "t": round(now, 3), "conv": conv, "tokens": sim.prompt_len, "pick": e,
            "held": held, **info}


# Predicted-TTFT bins of the calibration table (engine seconds).
CALIBRATION_BINS = (0.0, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, float("inf"))


def calibration(out: Outcome) -> list[dict[str, Any]]:
    """The cost model against what happened: per bin of the pick's predicted TTFT, the
    requests, their predicted and real TTFT (medians) and the real one over the predicted
    (median, and its 10th and 90th percentiles). Empty for a policy that predicts nothing."""
    pairs = [(x["predicted"], out.ttft[x["rid"]]) for x in out.decisions
             if "predicted" in x and x["rid"] in out.ttft and x["predicted"] > 0.0]
    rows = []
    for lo, hi in itertools.pairwise(CALIBRATION_BINS):
        got = [(p, t) for p, t in pairs if lo <= p < hi]
        if not got:
            continue
        ratios = [t / p for p, t in got]
        rows.append({"from_s": lo, "to_s": hi, "n": len(got),
                     "predicted_p50": percentile([p for p, _ in got], 50),
                     "real_p50": percentile([t for _, t in got], 50),
                     "ratio_p10": percentile(ratios, 10), "ratio_p50": percentile(ratios, 50),
                     "ratio_p90": percentile(ratios, 90)})
    return rows


def summarise(name: str, out: Outcome, reqs: Sequence[TraceRequest]) -> dict[str, Any]:
    ttft = list(out.ttft.values())
    d = out.decisions
    lost = [x for x in d if max(x["held"]) - x["held"][x["pick"]] >= 512]
    # The policy did not believe the better engine held more (always so for the peer's model,
    # which logs no beliefs).
    unknown = [x for x in lost if _believed_at_best(x) <= x.get("believed_held", 0)]
    per = out.per_engine
    return {
        "router": name, "n": len(ttft),
        "p50": percentile(ttft, 50), "p90": percentile(ttft, 90), "p99": percentile(ttft, 99),
        "itl_p99": percentile(out.itl, 99) if out.itl else float("nan"),
        "hit": out.hit_rate, "max/mean": max(per) / (sum(per) / len(per)),
        "moved_off_history": len(lost) / max(1, len(d)),
        "tokens_lost": sum(max(x["held"]) - x["held"][x["pick"]] for x in lost),
        "moved_index_blind": len(unknown),
        **_calibrated(out),
    }


def _calibrated(out: Outcome) -> dict[str, float]:
    """Real TTFT over the pick's predicted one, every request (median and the middle 80 %)."""
    ratios = [out.ttft[x["rid"]] / x["predicted"] for x in out.decisions
              if x.get("predicted", 0.0) > 0.0 and x["rid"] in out.ttft]
    if not ratios:
        return {}
    return {"real/predicted": percentile(ratios, 50), "real/predicted_p10": percentile(ratios, 10),
            "real/predicted_p90": percentile(ratios, 90)}


def _believed_at_best(x: dict[str, Any]) -> float:
    est = x.get("est")
    if not est:
        return 0.0
    best = max(range(len(x["held"])), key=lambda i: x["held"][i])
    return float(est[f"e{best}"][2])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="chat")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--policies", default="expected_ttft,prefix_affinity,least_load,cache_aware")
    p.add_argument("--rate-scale", type=float, default=None, help="default: the calibrated knee")
    p.add_argument("--load", type=float, default=1.0, help="multiply the rate scale by this")
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--profile", default="llama70b-h100x4-kv8")
    p.add_argument("--scrape-s", type=float, default=0.6, help="engine seconds between scrapes")
    p.add_argument("--provisional-s", type=float, default=15.0,
                   help="engine seconds a dispatch's blocks count as held (+precise)")
    p.add_argument("--log", type=Path, default=None, help="write every decision here (jsonl)")
    p.add_argument("--calibration", action="store_true",
                   help="print the cost model's predicted TTFT against the real one, by bin")
    p.add_argument("--decode-charge", type=float, default=RoutingConfig().decode_charge,
                   help="routing.decode_charge for kvproxy's policies (+nodecode: 0)")
    args = p.parse_args(argv)
    from bench.suite import calibrate  # noqa: PLC0415

    for w in by_name(args.workloads):
        caps = Caps(max_input_tokens=w.max_input_tokens, max_output_tokens=256, output_scale=0.25)
        reqs = apply_caps(w.requests(args.quick), caps)
        scale = args.rate_scale or calibrate(reqs, engines=args.engines, profile=args.profile,
                                             num_gpu_blocks=None).knee_scale
        scale *= args.load
        from engine_sidecar.sim.profiles import PROFILES  # noqa: PLC0415

        kv_tokens = PROFILES[args.profile].num_gpu_blocks(16) * 16
        oracle = oracle_hit_rate(reqs, args.engines, kv_tokens)
        floor = floor_percentiles(idle_floors(reqs, args.profile))
        print(f"== {w.name}: {len(reqs)} requests, rate scale {scale:.2f}, "
              f"oracle hit rate {oracle:.3f}; idle floor TTFT p50 {floor['ttft_p50']:.3f} "
              f"p90 {floor['ttft_p90']:.3f} p99 {floor['ttft_p99']:.3f}", flush=True)
        for pol in args.policies.split(","):
            router: Router = (CacheAware(args.engines) if pol == "cache_aware"
                              else KvproxyRouter(pol, args.engines, RoutingConfig(
                                  decode_charge=args.decode_charge)))
            if isinstance(router, KvproxyRouter):
                router.provisional_s = args.provisional_s
            out = replay(reqs, router, engines=args.engines, profile=args.profile,
                         rate_scale=scale, scrape_s=args.scrape_s)
            s = summarise(router.name, out, reqs)
            s["hit/oracle"] = s["hit"] / oracle if oracle else float("nan")
            print("  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                            for k, v in s.items()), flush=True)
            if args.calibration:
                for row in calibration(out):
                    print(f"    predicted {row['from_s']:g}-{row['to_s']:g} s: n {row['n']}  "
                          f"predicted p50 {row['predicted_p50']:.3f}  real p50 "
                          f"{row['real_p50']:.3f}  real/predicted p10/p50/p90 "
                          f"{row['ratio_p10']:.2f}/{row['ratio_p50']:.2f}/{row['ratio_p90']:.2f}",
                          flush=True)
            if args.log:
                with (args.log.parent / f"{args.log.stem}-{w.name}-{pol}.jsonl").open("w") as f:
                    for x in out.decisions:  # each decision with the TTFT it came to
                        f.write(json.dumps({**x, "ttft": out.ttft.get(x["rid"])}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
