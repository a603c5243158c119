"""Benchmark: adaptive speculative decoding against static choices on simulated engines.

``python -m bench.speculation`` runs one workload (a load ramp, batch 1 -> 64 -> 1 per engine, and
a domain shift, acceptance per position ~0.8 -> ~0.3 -> ~0.8) against a pool of simulated engines
once per arm: speculation off, static K = 2, 4, 8, a vLLM-style static batch-size schedule, and the
adaptive loop (``engine_sidecar.speculation``: the same controller, rollout and lease code as the
sidecars, acting on the engines through the simulator's restart). Every arm sees the same users
sending the same requests (seeded per user), on a virtual clock (``bench.vclock``): simulated
seconds cost only the CPU their Python work takes, and the result does not depend on the host.

Two *oracle* arms (names starting ``oracle``) are bounds, not choices: they switch every
engine's schedule at the phase boundaries of the domain shift, instantly and for free, knowing the
trace. They answer whether any loop could meet the tail goal without losing tokens; the goals
compare the adaptive loop with the static arms only.

Measured per phase: ITL p50/p99 (per output token: the gap between two stream chunks divided by
the tokens in the later chunk, so a step that yields three tokens counts three tokens of a third
of the gap each), TTFT p90 (by arrival phase), output tokens/s; and requests lost (a stream that
did not end with its full ``max_tokens``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench import machine, vclock
from bench.report_speculation import write_report
from engine_sidecar.sim import speculation as simspec
from engine_sidecar.sim.adaptive import attach_controller
from engine_sidecar.sim.config import SimEngineConfig
from engine_sidecar.sim.engine import RequestStream, Sampling, SimEngine
from engine_sidecar.sim.speculation import SimSpecConfig
from engine_sidecar.speculation import schedule as sch
from engine_sidecar.speculation.controller import Controller, ControllerSettings
from engine_sidecar.speculation.lease import LocalLease
from engine_sidecar.speculation.policy import PolicySettings

RESULTS = Path(__file__).resolve().parent / "results"
ENGINES = 2
MAX_NUM_SEQS = 256
PROMPT_TOKENS = 256
OUTPUT_TOKENS = (64, 256)
CLASSES = {"in-domain": (0.8,), "shifted": (0.3,)}
VLLM_STYLE = ((1, 8, 6), (9, 32, 4), (33, MAX_NUM_SEQS, 3))
# The oracles' schedules: in-domain, what the loop lands on at low load (K 2 at batch 33-64, the
# best static choice at high load), or the same with K 1 from batch 57, where the high-load
# phases run; shifted, K 1 up to batch 32 and speculation off above.
IN_DOMAIN = ((1, 8, 6), (9, 16, 5), (17, 32, 4), (33, 64, 2), (65, MAX_NUM_SEQS, 1))
IN_DOMAIN_K1_HIGH = ((1, 8, 6), (9, 16, 5), (17, 32, 4), (33, 56, 2), (57, MAX_NUM_SEQS, 1))
SHIFTED_OFF_HIGH = ((1, 32, 1), (33, MAX_NUM_SEQS, 0))


@dataclass(frozen=True)
class Phase:
    name: str
    start: float
    end: float
    users_from: int  # concurrent users per engine at the start, and at the end
    users_to: int
    workload: str

    def users(self, t: float) -> int:
        f = (t - self.start) / (self.end - self.start)
        return round(self.users_from + (self.users_to - self.users_from) * f)


def phases(scale: float) -> list[Phase]:
    """Low load, ramp to 64, high load, domain shift, ramp down, low load, shift back."""
    spec = [("low, in-domain", 1, 1, 4, "in-domain"), ("ramp up", 1, 64, 1, "in-domain"),
            ("high, in-domain", 64, 64, 4, "in-domain"), ("high, shifted", 64, 64, 4, "shifted"),
            ("ramp down", 64, 1, 1, "shifted"), ("low, shifted", 1, 1, 4, "shifted"),
            ("low, back in-domain", 1, 1, 4, "in-domain")]
    out, t = [], 0.0
    for name, a, b, minutes, workload in spec:
        out.append(Phase(name, t, t + minutes * 60 * scale, a, b, workload))
        t += minutes * 60 * scale
    return out


@dataclass(frozen=True)
class Arm:
    name: str
    max_k: int
    schedule: tuple[tuple[int, int, int], ...] | None = None
    adaptive: bool = False
    # An oracle: at the start of phase i, every engine runs schedule s at once (no restart).
    switches: tuple[tuple[int, tuple[tuple[int, int, int], ...]], ...] = ()


def _oracle(name: str, in_domain: tuple[tuple[int, int, int], ...]) -> Arm:
    return Arm(name, 8, in_domain, switches=((3, SHIFTED_OFF_HIGH), (6, in_domain)))


ARMS = (Arm("off", 0), Arm("K=2", 2), Arm("K=4", 4), Arm("K=8", 8),
        Arm("vLLM-style schedule", 8, VLLM_STYLE),
        Arm("adaptive", 8, ((1, MAX_NUM_SEQS, 4),), adaptive=True),
        _oracle("oracle: K 2 at batch 33-64; off above 32 when shifted", IN_DOMAIN),
        _oracle("oracle: K 1 from batch 57; off above 32 when shifted", IN_DOMAIN_K1_HIGH))


@dataclass
class PhaseStats:
    itl: array[float] = field(default_factory=lambda: array("d"))
    itl_weight: array[float] = field(default_factory=lambda: array("d"))
    ttft: array[float] = field(default_factory=lambda: array("d"))
    tokens: int = 0


@dataclass
class ArmResult:
    arm: str
    phases: list[PhaseStats]
    sent: int = 0
    completed: int = 0
    lost: int = 0
    reconfigurations: int = 0
    decisions: list[str] = field(default_factory=list)


class Run:
    def __init__(self, arm: Arm, plan: list[Phase], seed: int, restart_s: float) -> None:
        self.arm, self.plan, self.seed = arm, plan, seed
        self.result = ArmResult(arm.name, [PhaseStats() for _ in plan])
        spec = SimSpecConfig.build(schedule=arm.schedule, classes=CLASSES, restart_s=restart_s)
        self.engines = [SimEngine(SimEngineConfig(
            name=f"engine-{i}", profile="llama70b-h100", max_num_seqs=MAX_NUM_SEQS,
            num_speculative_tokens=arm.max_k, acceptance=(0.8,), seed=seed + i, spec=spec))
            for i in range(ENGINES)]
        self.controllers: list[Controller] = []

    def phase_at(self, t: float) -> int:
        for i, p in enumerate(self.plan):
            if t < p.end:
                return i
        return len(self.plan) - 1

    def pick(self) -> SimEngine | None:
        open_ = [e for e in self.engines if not e.draining]
        return min(open_, key=lambda e: len(e._streams)) if open_ else None

    async def user(self, index: int, stop: asyncio.Event) -> None:
        rng = random.Random(self.seed * 100_003 + index)
        loop = asyncio.get_running_loop()
        n = 0
        while not stop.is_set():
            prompt = array("I", (rng.randrange(1000, 30000) for _ in range(PROMPT_TOKENS)))
            max_tokens = rng.randint(*OUTPUT_TOKENS)
            engine = self.pick()
            if engine is None:
                await asyncio.sleep(0.05)
                continue
            n += 1
            now = loop.time()
            workload = self.plan[self.phase_at(now)].workload
            stream = engine.submit(f"u{index}-{n}", prompt, Sampling(
                max_tokens=max_tokens, ignore_eos=True, seed=rng.getrandbits(32),
                workload=workload))
            await self._consume(stream, now, max_tokens)

    async def _consume(self, stream: RequestStream, sent: float, max_tokens: int) -> None:
        loop = asyncio.get_running_loop()
        self.result.sent += 1
        last, got = None, 0
        while words := await stream.next_words():
            now = loop.time()
            st = self.result.phases[self.phase_at(now)]
            st.tokens += len(words)
            if last is None:
                self.result.phases[self.phase_at(sent)].ttft.append(now - sent)
            else:
                st.itl.append((now - last) / len(words))
                st.itl_weight.append(len(words))
            last, got = now, got + len(words)
        if got == max_tokens:
            self.result.completed += 1
        else:
            self.result.lost += 1

    async def conductor(self) -> None:
        loop = asyncio.get_running_loop()
        users: list[tuple[asyncio.Event, asyncio.Task[None]]] = []
        end = self.plan[-1].end
        while (now := loop.time()) < end:
            want = self.plan[self.phase_at(now)].users(now) * ENGINES
            while len(users) < want:
                stop = asyncio.Event()
                users.append((stop, asyncio.create_task(self.user(len(users), stop))))
            while len(users) > want:
                users.pop()[0].set()
            await asyncio.sleep(1.0)
        for stop, _ in users:
            stop.set()
        await asyncio.gather(*(task for _, task in users))

    def start_controllers(self) -> list[asyncio.Task[None]]:
        settings = controller_settings(self.arm.max_k)
        lease = LocalLease(max_out=1)
        context = PROMPT_TOKENS + sum(OUTPUT_TOKENS) // 4
        self.controllers = [attach_controller(e, settings, lease, context_tokens=context)
                            for e in self.engines]
        return [asyncio.create_task(c.run(), name=f"controller:{c.name}")
                for c in self.controllers]

    async def switch(self) -> None:
        loop = asyncio.get_running_loop()
        for phase, raw in self.arm.switches:
            await asyncio.sleep(max(0.0, self.plan[phase].start - loop.time()))
            schedule = sch.validate([list(r) for r in raw], max_k=self.arm.max_k)
            for e in self.engines:  # what no real engine can do: the oracle's free switch
                e.schedule = schedule
                e.scheduler.k_lookup = simspec.lookup(schedule, MAX_NUM_SEQS, self.arm.max_k)

    async def run(self) -> ArmResult:
        for e in self.engines:
            e.start()
        tasks = self.start_controllers() if self.arm.adaptive else []
        if self.arm.switches:
            tasks.append(asyncio.create_task(self.switch(), name="oracle-switches"))
        await self.conductor()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for e in self.engines:
            await e.close()
        self.result.reconfigurations = sum(c.stats.reconfigurations["ok"]
                                           for c in self.controllers)
        return self.result


def controller_settings(max_k: int) -> ControllerSettings:
    """The adaptive arm's loop: the product's defaults except for faster polling and a shorter
    minimum interval, scaled to four-minute phases (the same since the first run)."""
    return ControllerSettings(
        policy=PolicySettings(max_k=max_k, max_batch=MAX_NUM_SEQS, min_interval_s=60.0,
                              confirmations=2),
        poll_s=2.0, eval_s=10.0, window_s=40.0)


def _describe(settings: ControllerSettings) -> dict[str, object]:
    p, s = settings.policy, settings
    return {"poll_s": s.poll_s, "eval_s": s.eval_s, "window_s": s.window_s,
            "margin": p.margin, "min_interval_s": p.min_interval_s,
            "confirmations": p.confirmations, "tie": p.tie, "horizon_s": p.horizon_s,
            "restart_cost_s": p.restart_cost_s, "spare_load": p.spare_load,
            "followup_margin": p.followup_margin, "followup_drafts": p.followup_drafts,
            "shift_threshold": s.shift.threshold, "shift_min": s.shift.min_shift}


def run_arm(arm: Arm, plan: list[Phase], seed: int, restart_s: float) -> ArmResult:
    return vclock.run(Run(arm, plan, seed, restart_s).run())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.speculation", description=__doc__)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply every phase's length (1.0: 4-minute phases)")
    parser.add_argument("--restart-s", type=float, default=30.0,
                        help="simulated seconds an engine restart takes after its drain")
    parser.add_argument("--arms", default=",".join(a.name for a in ARMS))
    parser.add_argument("--out", type=Path, default=RESULTS / "speculation")
    parser.add_argument("--decisions", action="store_true",
                        help="print the adaptive loop's decision log (kvproxy.speculation)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.decisions:
        logging.getLogger("kvproxy.speculation").setLevel(logging.INFO)
    plan = phases(args.scale)
    wanted = set(args.arms.split(","))
    results = [run_arm(a, plan, args.seed, args.restart_s) for a in ARMS if a.name in wanted]
    settings = {"seed": args.seed, "scale": args.scale, "restart_s": args.restart_s,
                "engines": ENGINES, "profile": "llama70b-h100", "prompt_tokens": PROMPT_TOKENS,
                "output_tokens": list(OUTPUT_TOKENS), "classes": CLASSES,
                "vllm_style_schedule": VLLM_STYLE,
                "adaptive_loop": _describe(controller_settings(8))}
    write_report(args.out, plan, results, settings, machine.environment(),
                 machine.command_line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
