"""Routing decision micro-benchmark: CPU time of one routing decision, per policy.

Usage: ``python -m bench.decision [--quick]``; writes ``bench/results/decision.{json,md}``.

Rules:
- Pure CPU, one process, no network: what the request path spends in ``proxy.core`` to pick an
  engine. One decision is what ``server.pick.rank`` does: the prompt's prefix chain (hashing,
  reported apart), ``rank`` over the pool's views, ``uncached_tokens`` for the pick and its retry
  target, and ``observe``.
- The index is warmed first with conversations like the benchmark traces' (a shared system
  prompt, then per conversation a growing history), so lookups hit a full index; the measured
  prompts are new turns of those conversations and new conversations, alternately.
- Best of several repetitions (the machine is shared; the minimum is the least disturbed), in
  microseconds per decision; the load average is reported with it.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench import machine, tokencost
from bench.report import RESULTS
from proxy.core.config import RoutingConfig
from proxy.core.prefix import prefix_chain
from proxy.core.routing import EngineView, Policy, RouteKey, make_policy

POLICIES = ("expected_ttft", "prefix_affinity", "least_load")
CFG = RoutingConfig()


def _text(rng: random.Random, chars: int) -> str:
    return rng.randbytes(chars // 2 + 1).hex()[:chars]


def _key(text: str) -> RouteKey:
    chain = prefix_chain(text, model="m", tenant="t", block_chars=CFG.block_chars,
                         max_blocks=CFG.max_blocks)
    return RouteKey(chain=chain, tenant="t", model="m",
                    prompt_tokens=len(text) / CFG.chars_per_token,
                    block_tokens=CFG.block_chars / CFG.chars_per_token)


def _views(n: int, rng: random.Random) -> list[EngineView]:
    views = []
    for i in range(n):
        running, waiting = float(rng.randint(0, 64)), float(rng.randint(0, 8))
        views.append(EngineView(f"e{i}", True, True, running + waiting, rng.random(),
                                prefill=float(rng.randint(0, 20_000)), running=running,
                                waiting=waiting, pending=rng.randint(0, 4)))
    return views


def _prompts(rng: random.Random, prompt_chars: int, count: int) -> list[str]:
    system = _text(rng, 2048)
    return [system + _text(rng, prompt_chars) for _ in range(count)]


def decide(policy: Policy, text: str, views: list[EngineView]) -> str:
    key = _key(text)
    ranked = policy.rank(key, views)
    for name in ranked[:2]:
        policy.uncached_tokens(key, name)
    policy.observe(key, ranked[0])
    return ranked[0]


def measure(name: str, engines: int, prompt_chars: int, decisions: int,
            reps: int) -> dict[str, float]:
    rng = random.Random(7)
    policy = make_policy(replace(CFG, policy=name))
    views = _views(engines, rng)
    warm = _prompts(rng, prompt_chars, 4 * decisions)
    for text in warm:
        decide(policy, text, views)
    # Half follow-up turns of warmed conversations, half new conversations.
    prompts = [t + _text(rng, 300) for t in warm[:decisions // 2]]
    prompts += _prompts(rng, prompt_chars, decisions - len(prompts))
    keys = [_key(t) for t in prompts]
    best_total = best_hash = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for text in prompts:
            _key(text)
        best_hash = min(best_hash, time.perf_counter() - t0)
        t0 = time.perf_counter()
        for key in keys:
            ranked = policy.rank(key, views)
            for n in ranked[:2]:
                policy.uncached_tokens(key, n)
            policy.observe(key, ranked[0])
        best_total = min(best_total, time.perf_counter() - t0)
    return {"policy_us": 1e6 * best_total / decisions, "chain_us": 1e6 * best_hash / decisions}


def run(quick: bool) -> dict[str, object]:
    decisions, reps = (200, 3) if quick else (1000, 5)
    env = machine.environment()  # its load average is the one at the start
    rows = []
    for engines in (8, 64):
        for prompt_chars in (2_000, 32_000, 128_000):
            for name in POLICIES:
                figures = measure(name, engines, prompt_chars, decisions, reps)
                rows.append({"policy": name, "engines": engines,
                             "prompt_tokens": prompt_chars // 4 + 512, **figures})
                print(f"{name:16} engines={engines:3} prompt~{prompt_chars // 4 + 512:6} tokens: "
                      f"policy {figures['policy_us']:8.1f} us, chain {figures['chain_us']:7.1f} us",
                      file=sys.stderr)
    tokenized = tokencost.run(decisions, reps)
    return {"benchmark": "decision", "when": machine.now_utc(), "command": machine.command_line(),
            "environment": env, "load_avg_at_end": list(os.getloadavg()),
            "decisions": decisions, "repetitions": reps, "rows": rows, "tokenized": tokenized}


def _loads(values: object) -> str:
    return " ".join(f"{v:.2f}" for v in values) if isinstance(values, list) else str(values)


def markdown(result: dict[str, object]) -> str:
    env = result["environment"]
    assert isinstance(env, dict)
    lines = [
        "# Routing decision CPU cost", "",
        f"{result['when']}, `{result['command']}`; {env['cpu_model']} ({env['nproc']} cores), "
        f"Python {env['python']}; load average {_loads(env['load_avg_at_start'])} at start, "
        f"{_loads(result['load_avg_at_end'])} at end (a shared machine: figures are the best of "
        f"{result['repetitions']} repetitions of {result['decisions']} decisions).", "",
        "µs per decision: `rank` + `uncached_tokens` for the pick and the retry target + "
        "`observe` (policy), and the prompt's prefix chain hashing (chain), which every "
        "prefix-aware policy needs. No tokenizer: tokens are estimated from characters "
        "(approximate routing, the default); precise routing's tokenization is below.", "",
        "| policy | engines | prompt tokens | policy µs | chain µs | total µs |",
        "|---|---|---|---|---|---|",
    ]
    rows = result["rows"]
    assert isinstance(rows, list)
    for r in rows:
        lines.append(f"| `{r['policy']}` | {r['engines']} | {r['prompt_tokens']:,} | "
                     f"{r['policy_us']:.1f} | {r['chain_us']:.1f} | "
                     f"{r['policy_us'] + r['chain_us']:.1f} |")
    tokenized = result.get("tokenized")
    if isinstance(tokenized, list):
        lines += ["", *tokencost.markdown(tokenized)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.decision",
                                description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer decisions and repetitions")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    result = run(args.quick)
    machine.write_json(args.out / "decision.json", result)
    (args.out / "decision.md").write_text(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
