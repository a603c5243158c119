"""The issue's targets, checked against results: computed verdicts, never typed ones.

Rules: a target whose inputs are missing (a run failed, a router was not installed) is reported
as "not measured", never as met.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from proxy.core.config import RoutingConfig

KVPROXY = "kvproxy/prefix_affinity"  # the routing benchmark's targets (issue 3) name this policy
# The suite judges kvproxy as users run it: with the default policy.
DEFAULT_KVPROXY = f"kvproxy/{RoutingConfig().policy}"
ROUND_ROBIN = "kvproxy/round_robin"
# The 64-stream target judges kvproxy as users run it (the default policy), and round-robin,
# which places requests as the direct path does: the proxy's own cost.
OVERHEAD_ROUTERS = (DEFAULT_KVPROXY, ROUND_ROBIN)
OVERHEAD_STREAMS = 64


def router_p90(runs: Sequence[Mapping[str, object]], name: str) -> float:
    for run in runs:
        if run.get("router") == name and run.get("status") == "ok":
            summary = run["summary"]
            assert isinstance(summary, Mapping)
            value = summary.get("ttft_p90")
            return float(value) if isinstance(value, int | float) else math.nan
    return math.nan


def router_hit(runs: Sequence[Mapping[str, object]], name: str) -> float:
    for run in runs:
        if run.get("router") == name and run.get("status") == "ok":
            value = run.get("hit_rate")
            return float(value) if isinstance(value, int | float) else math.nan
    return math.nan


def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("**met**" if ok else "**not met**")


def _check(value: float, limit: float, *, below: bool) -> bool | None:
    if math.isnan(value) or math.isnan(limit):
        return None
    return value <= limit if below else value >= limit


def best_peer_p90(runs: Sequence[Mapping[str, object]]) -> dict[str, tuple[str, float]]:
    """For each peer router, its policy with the lowest TTFT p90."""
    best: dict[str, tuple[str, float]] = {}
    for run in runs:
        name = str(run.get("router", ""))
        peer = name.split("/", 1)[0]
        if peer == "kvproxy" or run.get("status") != "ok":
            continue
        p90 = router_p90(runs, name)
        if not math.isnan(p90) and (peer not in best or p90 < best[peer][1]):
            best[peer] = (name, p90)
    return best


def routing_targets(runs: Sequence[Mapping[str, object]], ideal: float) -> str:
    ours, rr = router_p90(runs, KVPROXY), router_p90(runs, ROUND_ROBIN)
    hit = router_hit(runs, KVPROXY)
    lines = [
        f"- `{KVPROXY}` TTFT p90 ≤ 0.5 x `{ROUND_ROBIN}`'s: {ours:.3f} s vs {rr:.3f} s "
        f"(ratio {ours / rr if rr else math.nan:.3f}) — "
        f"{_verdict(_check(ours, 0.5 * rr, below=True))}",
        f"- `{KVPROXY}` hit rate ≥ 0.9 x ideal: {hit:.3f} vs {ideal:.3f} "
        f"(fraction {hit / ideal if ideal else math.nan:.3f}) — "
        f"{_verdict(_check(hit, 0.9 * ideal, below=False))}",
    ]
    best = best_peer_p90(runs)
    if not best:
        lines.append("- better TTFT p90 than every peer's best policy — not measured (no peer ran)")
    for peer, (name, p90) in sorted(best.items()):
        ok = _check(ours, p90, below=True)
        if ok is not None and ours == p90:
            ok = False
        lines.append(f"- better TTFT p90 than {peer}'s best (`{name}`, {p90:.3f} s): "
                     f"{ours:.3f} s — {_verdict(ok)}")
    return "\n".join(lines)


def failures(entry: Mapping[str, object]) -> tuple[int, int]:
    """(requests not completed, requests sent) of one path at one level: failed, shed and
    rate-limited alike, since the percentiles are taken over completed requests only."""
    summary = entry.get("summary", {})
    if not isinstance(summary, Mapping):
        return 0, 0
    sent, done = _num(summary.get("requests")), _num(summary.get("completed"))
    if math.isnan(sent) or math.isnan(done):
        return 0, 0
    return int(sent - done), int(sent)


def judged(pooled: float, rounds: Sequence[float] | None, limit: float, *, below: bool,
           failed: tuple[int, int] = (0, 0)) -> str:
    """A ratio's pooled value, its range over rounds, and the verdict: met only where the pooled
    value and every round meet the goal and no request of the judged path failed."""
    known = [v for v in rounds or () if not math.isnan(v)]
    spread = ("rounds: not recorded" if not rounds else
              f"rounds {min(known):.3f}-{max(known):.3f}" if known else "rounds: n/a")
    if rounds and len(known) < len(rounds):  # such a round counts as missed below
        spread += f", {len(rounds) - len(known)} without a figure"
    text = f"{pooled:.3f} ({spread})"
    if failed[0] > 0:
        return f"{text} — {_lost(failed)}"
    ok = _check(pooled, limit, below=below)
    if ok and not rounds:  # results from before rounds were kept: the rounds are unknown
        return f"{text} — met pooled, not judged per round"
    if not ok:
        return f"{text} — {_verdict(ok)}"
    missed = [str(k) for k, v in enumerate(rounds, 1) if _check(v, limit, below=below) is not True]
    if missed:
        return f"{text} — **not met in round(s) {', '.join(missed)}**"
    return f"{text} — **met**"


def _lost(failed: tuple[int, int]) -> str:
    """The verdict of every goal of a path that lost requests (``failures``)."""
    return f"**not met ({failed[0]} of {failed[1]} requests failed)**"


def _round_values(entry: Mapping[str, object], key: str) -> list[float]:
    rounds = entry.get("rounds")
    if not isinstance(rounds, list):
        return []
    return [_num(r.get(key)) if isinstance(r, Mapping) else math.nan for r in rounds]


def round_ratios(ours: Mapping[str, object], theirs: Mapping[str, object],
                 key: str) -> list[float]:
    """``key``'s ratio in each round (rounds interleave, so the k-th of each path are one
    round); NaN where either figure is missing, so that such a round is never counted met."""
    a, b = _round_values(ours, key), _round_values(theirs, key)
    if not a or len(a) != len(b):
        return []
    return [_ratio(x, y) for x, y in zip(a, b, strict=True)]


def overhead_targets(levels: Mapping[str, Mapping[str, Mapping[str, object]]]) -> str:
    """The 64-stream TTFT target, for kvproxy's default policy and for its round-robin.

    Round-robin places requests as the direct path does (the client round-robins too), so its
    ratio is the proxy's own cost; the default policy's ratio also carries its placement.
    """
    lines = []
    paths = levels.get(str(OVERHEAD_STREAMS), {})
    direct = paths.get("direct", {})
    for router in OVERHEAD_ROUTERS:
        ours = paths.get(router, {})
        s, d = ours.get("summary", {}), direct.get("summary", {})
        assert isinstance(s, Mapping) and isinstance(d, Mapping)
        value = _ratio(s.get("ttft_p50"), d.get("ttft_p50"))
        rounds = round_ratios(ours, direct, "ttft_p50")
        older = ours.get("round_ttft_p50_ratios")  # results from before ``rounds`` was kept
        if not rounds and isinstance(older, list):
            rounds = [_num(v) for v in older]
        lines.append(f"- through `{router}`, TTFT p50 ≤ 1.05 x direct at {OVERHEAD_STREAMS} "
                     f"streams: " + judged(value, rounds, 1.05, below=True,
                                           failed=failures(ours)))
    lines += _reference_losses(str(OVERHEAD_STREAMS), {"direct": direct})
    lines.append("  (`kvproxy/round_robin` places requests as the direct path does, so its ratio "
                 "is the proxy's own cost; the default policy's ratio also reflects where it "
                 "places requests.)")
    return "\n".join(lines)


CPU_PEER = "vllm-router/round_robin"
RELAY_PACED_TARGET = 150_000.0
HIGH_STREAMS = 1024  # issue 16's latency goals hold from here up
LAG_P99_TARGET_S = 0.020


ENGINE_CORE_SATURATED = 0.9


def high_concurrency_targets(levels: Mapping[str, Mapping[str, Mapping[str, object]]],
                             router: str = DEFAULT_KVPROXY, peer: str = CPU_PEER,
                             engine_cores: Sequence[str] = ()) -> str:
    """Issue 16's goals at 1,024 streams and more, for kvproxy's default policy in the same
    run as ``peer``: TTFT p50 ≤ 1.1 x and p99 ≤ 1.25 x the peer's, steady tokens/s ≥ 0.98 x
    direct's, event-loop lag p99 ≤ 20 ms, no engine seen stale. Where the engines' cores
    (``engine_cores``, which the load generator shares) were busy ``ENGINE_CORE_SATURATED`` or
    more in direct's slices, the throughput verdict says so: every path's rate was then that
    core's."""
    lines = []
    for conc_text in sorted(levels, key=int):
        if int(conc_text) < HIGH_STREAMS:
            continue
        paths = levels[conc_text]
        ours, theirs = paths.get(router, {}), paths.get(peer, {})
        direct = paths.get("direct", {})
        s, t = ours.get("summary", {}), theirs.get("summary", {})
        assert isinstance(s, Mapping) and isinstance(t, Mapping)
        p50 = _ratio(s.get("ttft_p50"), t.get("ttft_p50"))
        p99 = _ratio(s.get("ttft_p99"), t.get("ttft_p99"))
        steady = _ratio(ours.get("steady_tok_s"), direct.get("steady_tok_s"))
        watch = ours.get("proxy", {})
        assert isinstance(watch, Mapping)
        lag = _num(watch.get("loop_lag_p99_s"))
        stale, samples = _num(watch.get("stale_samples")), _num(watch.get("samples"))
        fresh = None if math.isnan(stale) or not samples > 0 else stale == 0
        head = f"- `{router}` at {conc_text} streams"
        busy = direct.get("cores_busy", {})
        saturated = max((_num(busy.get(c)) for c in engine_cores
                         if isinstance(busy, Mapping) and c in busy), default=math.nan)
        caveat = ("" if not saturated >= ENGINE_CORE_SATURATED else
                  f" (the engines' and load generator's core was {saturated:.2f} busy in "
                  f"direct's slices: every path's throughput was that core's)")
        failed = failures(ours)
        lag_verdict = (_lost(failed) if failed[0] else
                       _verdict(_check(lag, LAG_P99_TARGET_S, below=True)))
        fresh_verdict = _lost(failed) if failed[0] else _verdict(fresh)
        lines += [
            f"{head}: TTFT p50 x `{peer}`'s ≤ 1.1: "
            + judged(p50, round_ratios(ours, theirs, "ttft_p50"), 1.1, below=True, failed=failed)
            + "; TTFT p99 x ≤ 1.25: "
            + judged(p99, round_ratios(ours, theirs, "ttft_p99"), 1.25, below=True,
                     failed=failed),
            f"{head}: steady tokens/s x direct's ≥ 0.98: "
            + judged(steady, round_ratios(ours, direct, "steady_tok_s"), 0.98, below=False,
                     failed=failed)
            + f"{caveat}; event-loop lag p99 {lag * 1000:.1f} ms ≤ "
            f"{LAG_P99_TARGET_S * 1000:.0f} ms — {lag_verdict}; samples with a stale "
            f"engine {stale:.0f} of {samples:.0f} — {fresh_verdict}",
        ]
        lines += _reference_losses(conc_text, {peer: theirs, "direct": direct})
    return "\n".join(lines)


def _reference_losses(conc_text: str, references: Mapping[str, Mapping[str, object]]) -> list[str]:
    """A note under a level's verdicts for each path the ratios compare with that lost requests:
    its percentiles are over the completed ones, so the ratio to it is read with that in mind."""
    out = []
    for name, entry in references.items():
        lost, sent = failures(entry)
        if lost:
            out.append(f"  (`{name}` at {conc_text} streams: {lost} of {sent} requests failed; "
                       f"its figures are over the completed ones)")
    return out


def _ratio(a: object, b: object) -> float:
    x, y = _num(a), _num(b)
    return x / y if y > 0 else math.nan


def cpu_targets(fit: object, relay: object, relay_by_router: object = None) -> str:
    """Issue 16's CPU targets: every kvproxy router's b ≤ vllm-router's b and a ≤ 2 x its a (raw,
    and net of idle CPU), and the paced relay rate; the floor references (``bench.floor``) the
    same way, to show which goals an aiohttp relay can reach at all. Where the relay test also
    ran vllm-router or a floor, kvproxy's rate over theirs, and whether they reach the goal."""
    routers = fit.get("routers", {}) if isinstance(fit, Mapping) else {}
    peer = routers.get(CPU_PEER, {})
    lines = []
    for name, r in routers.items():
        # A floor reference is judged too: a goal it misses is below what aiohttp itself costs.
        if not name.startswith(("kvproxy/", "floor/")):
            continue
        for suffix, label in (("", "raw"), ("_net", "net of idle")):
            b_key, a_key = f"b{suffix}_us_per_token", f"a{suffix}_ms"
            b, peer_b = _num(r.get(b_key)), _num(peer.get(b_key))
            a, peer_a = _num(r.get(a_key)), _num(peer.get(a_key))
            lines.append(f"- `{name}` ({label}): b {b:.1f} us ≤ {CPU_PEER}'s {peer_b:.1f} us — "
                         f"{_verdict(_check(b, peer_b, below=True))}; a {a:.3f} ms ≤ 2 x "
                         f"{peer_a:.3f} ms — {_verdict(_check(a, 2 * peer_a, below=True))}")
    paced = relay.get("paced", {}) if isinstance(relay, Mapping) else {}
    rate = _num(paced.get("events_per_cpu_s") if isinstance(paced, Mapping) else None)
    met = _check(rate, RELAY_PACED_TARGET, below=False)
    lines.append(f"- relay, paced: {rate:.0f} events per proxy CPU-second ≥ "
                 f"{RELAY_PACED_TARGET:.0f} — {_verdict(met)}")
    others = relay_by_router if isinstance(relay_by_router, Mapping) else {}
    for name, rates in others.items():
        if name.startswith("kvproxy/") or not isinstance(rates, Mapping):
            continue
        theirs = rates.get("paced", {})
        other = _num(theirs.get("events_per_cpu_s") if isinstance(theirs, Mapping) else None)
        if math.isnan(other) or other <= 0:
            continue
        reach = "reaches" if other >= RELAY_PACED_TARGET else "does not reach"
        lines.append(f"  - `{name}` in the same test: {other:.0f} (it {reach} the goal); "
                     f"kvproxy ÷ `{name}`: {rate / other:.2f}")
    return "\n".join(lines)


def _num(value: object) -> float:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if number else math.nan  # type: ignore[arg-type]
