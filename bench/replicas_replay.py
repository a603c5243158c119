"""Offline replay of N kvproxy replicas routing as one: the replica benchmark's decisions without
HTTP, wall clock or CPU contention, to tell what in the decisions makes N replicas worse than one.

Usage: ``python -m bench.replicas_replay --workloads mooncake [--replicas 1,4] [--seeds 3]
[--set routing.KEY=VALUE]``. Prints, per workload and arm, TTFT percentiles (engine seconds),
the hit rate, and how often replicas *herd*: two decisions of different replicas within one
sharing interval that picked the same engine, against what the same picks would give if
spread at random.

Rules:
- Engines, arrivals and the proxy's own state are ``bench.replay``'s (the simulator's scheduler
  in simulated time; ``EngineState`` and the pure policy as the proxy runs them). The replica
  benchmark's slice and load: the leading ``--slice-fraction`` of the quick slice at the knee.
- Requests go to replicas in turn (HAProxy's round-robin). Each replica scrapes every
  ``--scrape-s`` on its own phase and, when sharing, publishes and merges every
  ``--interval-s`` on its own phase exactly as ``proxy.tenancy.shared_routing`` does (the
  outbox's dispatches into the others' policies, in-flight counts and prefill backlogs through
  ``PeerTable``), with no transport delay beyond the intervals. Phases are drawn from ``--seeds``
  seeds; each arm is run once per seed and the medians are printed.
- Deterministic: the same arguments give the same figures.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from bench.replay import KvproxyRouter, replay
from bench.stats import percentile
from bench.workloads import by_name
from proxy.core.config import RoutingConfig
from proxy.core.costmodel import queued_tokens
from proxy.core.routeview import RouteKey
from proxy.core.sharing import NO_BACKLOG, Message
from proxy.core.sharing_state import Outbox, PeerTable
from proxy.core.spread import Blindness


@dataclass
class _Clocks:
    next_scrape: float
    next_sync: float


class Replica(KvproxyRouter):
    """One replica: ``bench.replay``'s proxy plus the sharing round of ``shared_routing``."""

    def __init__(self, idx: int, policy: str, n: int, cfg: RoutingConfig, rng: random.Random,
                 seed: int = 0, *, interval_s: float = 0.075, spread: bool = False) -> None:
        super().__init__(policy, n, cfg)
        self.idx = idx
        self.outbox = Outbox(1024)
        self.peers = PeerTable(2.0)
        self.seq = 0
        self.rng = rng
        self.seed = seed
        self.blind = Blindness()
        self.spread = spread

    def route_key(self, chain: tuple[int, ...], tokens: float, now: float) -> RouteKey:
        key = super().route_key(chain, tokens, now)
        unseen = self.blind.unseen() if self.spread else 0.0
        return replace(key, unseen=unseen, draw=self.rng.random())

    def dispatched(self, chain: tuple[int, ...], engine: str) -> None:
        self.outbox.dispatched("target", engine, chain)

    def message(self) -> Message:
        self.seq += 1
        return Message(str(self.idx), self.seq, tuple(self.outbox.take()),
                       {s.name: float(s.dispatched_since_snapshot) for s in self.states},
                       {s.name: float(s.open_requests) for s in self.states},
                       {s.name: s.backlog for s in self.states})

    def merge(self, msgs: Sequence[Message], now: float) -> None:
        for msg in msgs:
            for d in msg.dispatches:
                self.policy.observe(RouteKey(chain=d.chain), d.engine)
            self.peers.heard(msg, now)
        self.blind.merged(self.peers.live(now), sum(len(m.dispatches) for m in msgs))
        pending, opened = self.peers.totals(now)
        prefill = self.peers.prefill_totals(now)
        for st in self.states:
            st.remote_backlog = prefill.get(st.name, NO_BACKLOG)
            st.remote_pending = pending.get(st.name, 0.0)
            st.remote_open = opened.get(st.name, 0.0)


class ReplicaSet:
    """N replicas behind a round-robin balancer, as one ``bench.replay`` router."""

    def __init__(self, replicas: int, shared: bool, cfg: RoutingConfig, *, scrape_s: float,
                 interval_s: float, seed: int, policy: str = "expected_ttft",
                 engines: int = 8, spread: bool = False) -> None:
        self.name = f"{replicas}-{'shared' if shared else 'alone'}"
        rng = random.Random(seed)
        self.replicas = [Replica(i, policy, engines, cfg, random.Random(seed * 1000 + i), seed,
                                 interval_s=interval_s, spread=spread)
                         for i in range(replicas)]
        self.clocks = [_Clocks(rng.uniform(0, scrape_s), rng.uniform(0, interval_s))
                       for _ in range(replicas)]
        self.shared, self.scrape_s, self.interval_s = shared and replicas > 1, scrape_s, interval_s
        self.bus: list[Message] = []
        self.read = [0] * replicas
        self.owner: dict[int, int] = {}
        self.picks: list[tuple[float, int, int]] = []  # (time, replica, engine)
        self._turn = 0
        self.engines: Sequence[Any] = ()
        self.errors: list[tuple[float, float, float]] = []
        self._first = True

    def scrape(self, engines: Sequence[Any], now: float) -> None:
        self.engines = engines
        for r, (rep, clk) in enumerate(zip(self.replicas, self.clocks, strict=True)):
            if self._first or now >= clk.next_scrape:
                rep.scrape(engines, now)
                clk.next_scrape = max(clk.next_scrape, now) + self.scrape_s
            if self.shared and now >= clk.next_sync:
                self.bus.append(rep.message())
                rep.merge([m for m in self.bus[self.read[r]:] if m.sender != str(r)], now)
                self.read[r] = len(self.bus)
                clk.next_sync = max(clk.next_sync, now) + self.interval_s
        self._first = False

    def pick(self, rid: int, text: str, now: float) -> tuple[int, dict[str, Any]]:
        r = self._turn % len(self.replicas)
        self._turn += 1
        rep = self.replicas[r]
        truth = [_true_queue(s) for s in self.engines]
        views = [st.view(now, True) for st in rep.states]
        mean = getattr(rep.policy, "mean_prompt", 0.0) or len(text) / 4
        belief = [queued_tokens(v, mean) for v in views]
        e, info = rep.pick(rid, text, now)
        diff = [b - t for b, t in zip(belief, truth, strict=True)]
        self.errors.append((sum(map(abs, diff)) / len(diff), sum(diff) / len(diff),
                            truth[e] - min(truth)))
        rep.dispatched(rep.last_chain, f"e{e}")
        self.owner[rid] = r
        self.picks.append((now, r, e))
        return e, info

    def first_token(self, rid: int, now: float) -> None:
        self.replicas[self.owner[rid]].first_token(rid, now)

    def done(self, rid: int, now: float) -> None:
        self.replicas[self.owner.pop(rid)].done(rid, now)

    def herding(self, window: float, engines: int) -> tuple[float, float]:
        """Of the pairs of decisions by different replicas less than ``window`` apart, the share
        that picked the same engine, and what picks spread uniformly would give (1/engines)."""
        pairs = same = 0
        picks = self.picks
        for i, (t, r, e) in enumerate(picks):
            for t2, r2, e2 in picks[i + 1:]:
                if t2 - t >= window:
                    break
                if r2 != r:
                    pairs += 1
                    same += e2 == e
        return (same / pairs if pairs else float("nan")), 1.0 / engines


def _true_queue(sched: Any) -> float:
    """Prompt tokens an engine has still to compute (running and waiting)."""
    waiting = list(sched._fifo) + list(sched._heap)
    return float(sum(max(0, r.prompt_len - r.num_computed) for r in [*sched.running, *waiting]))


def _cfg(sets: Sequence[str]) -> RoutingConfig:
    cfg = RoutingConfig()
    for item in sets:
        key, _, value = item.partition("=")
        field = key.removeprefix("routing.")
        cur = getattr(cfg, field)
        cfg = replace(cfg, **{field: type(cur)(value) if not isinstance(cur, bool)
                              else value.lower() in ("1", "true", "yes")})
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replicas_replay",
                                description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="mooncake,unique,rag")
    p.add_argument("--arms", default="1-alone,4-shared,4-alone")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--slice-fraction", type=float, default=0.5)
    p.add_argument("--scrape-s", type=float, default=0.6, help="engine seconds (200 ms x 3)")
    p.add_argument("--interval-s", type=float, default=0.075, help="engine seconds (25 ms x 3)")
    p.add_argument("--tick-s", type=float, default=0.025, help="engine seconds between checks")
    p.add_argument("--set", action="append", default=[], metavar="routing.KEY=VALUE")
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--profile", default="llama70b-h100x4-kv8")
    args = p.parse_args(argv)
    from bench.replicas import build_parser as bench_parser  # noqa: PLC0415
    from bench.replicas import prepare_all  # noqa: PLC0415

    bargs = bench_parser().parse_args(["--slice-fraction", str(args.slice_fraction)])
    cfg = _cfg(args.set)
    for prep in prepare_all(bargs, by_name(args.workloads)):
        reqs, scale = prep.plan.reqs, prep.calibration.knee_scale
        print(f"== {prep.workload.name}: {len(reqs)} requests at x{scale:.2f}", flush=True)
        for arm in args.arms.split(","):
            n, _, mode = arm.partition("-")
            rows = []
            for seed in range(args.seeds):
                router = ReplicaSet(int(n), mode.startswith("shared"), cfg,
                                    scrape_s=args.scrape_s, interval_s=args.interval_s,
                                    seed=seed, engines=args.engines, spread="spread" in mode)
                out = replay(reqs, router, engines=args.engines, profile=args.profile,
                             rate_scale=scale, scrape_s=args.tick_s)
                ttft = list(out.ttft.values())
                same, uniform = router.herding(args.interval_s * 2, args.engines)
                err = router.errors
                rows.append((percentile(ttft, 50), percentile(ttft, 90), out.hit_rate, same,
                             max(out.per_engine) / (sum(out.per_engine) / args.engines),
                             statistics.mean(x[0] for x in err), statistics.mean(x[1] for x in err),
                             statistics.mean(x[2] for x in err)))
            med = [statistics.median(c) for c in zip(*rows, strict=True)]
            spread = [f"{min(r[1] for r in rows):.2f}-{max(r[1] for r in rows):.2f}"]
            print(f"  {arm:9s} p50 {med[0]:.2f}  p90 {med[1]:.2f} [{spread[0]}]  hit "
                  f"{med[2]:.3f}  same-engine pairs {med[3]:.3f} (uniform {uniform:.3f})  "
                  f"busiest/mean {med[4]:.2f}  queue error abs {med[5]:.0f} bias {med[6]:+.0f} "
                  f"regret {med[7]:.0f} tokens", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
