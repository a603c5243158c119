"""Router CPU per request as a + b * tokens: a per request, b per streamed token.

Rules: at one concurrency, every router gets interleaved slices with answers of each length in
``tokens`` (16 and 256 by default); its CPU per completed request at each length gives the line
through them (two lengths: exact; more: least squares). Direct requests are not measured here:
they cost a router nothing.

A router's CPU while it serves nothing (kvproxy scrapes every engine's ``/metrics`` five times a
second; a round-robin Rust router does nothing) is measured first, over ``IDLE_S`` with no
traffic, and reported as ``idle_cpu_ms_per_s``. It is part of the raw figures (``a_ms``,
``b_us_per_token``), where it leaks into b: a slice of long answers completes fewer requests per
second, so each carries more of it. ``a_net_ms`` and ``b_net_us_per_token`` are the same line with
the idle rate times each slice's span taken off first: the cost of serving requests alone.
``rounds`` holds the same fit made from each round's slices alone: the spread of a and b.
"""

from __future__ import annotations

import asyncio
import copy
import math
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from bench.loadgen import make_session

IDLE_S = 4.0

if TYPE_CHECKING:
    from bench.loadgen import Endpoint
    from bench.overhead import Paths
    from bench.peers import Router
    from bench.procs import Managed


def line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(a, b) of the least-squares line y = a + b x through ``points``; NaN when undefined."""
    n = len(points)
    if n < 2:
        return math.nan, math.nan
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return math.nan, math.nan
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - b * mx, b


async def measure_fit(paths: Paths, started: list[tuple[Router, Managed, Endpoint]],
                      tokens: list[int], conc: int, rounds: int, slice_s: float,
                      ramp_s: float) -> dict[str, object]:
    from bench.overhead import _slice  # noqa: PLC0415 - the module that imports this one

    variants = {t: copy.copy(paths) for t in tokens}
    for t, variant in variants.items():
        variant.output_tokens = t
    # (router, round, tokens) -> CPU seconds, slice seconds, requests completed
    slices: dict[tuple[str, int, int], tuple[float, float, int]] = {}
    print(f"== CPU fit at {conc} streams, answers of {tokens} tokens", flush=True)
    idle = await idle_rates(started)
    async with make_session() as session:
        start = time.perf_counter()
        for k in range(rounds):
            for router, _, _ in started:
                for t in tokens:
                    recs, span, used = await _slice(session, variants[t], started, router.name,
                                                    conc, slice_s, start, ramp_s)
                    slices[router.name, k, t] = (used, span, sum(1 for r in recs if r.ok))
    out = {}
    for router, _, _ in started:
        name, rate = router.name, idle.get(router.name, 0.0)
        fitted = _router_fit(*_summed(slices, name, range(rounds), tokens), rate)
        # One fit per round too: their range is the figure's noise.
        per_round = [_router_fit(*_summed(slices, name, [k], tokens), rate) for k in range(rounds)]
        for one in per_round:
            one.pop("idle_cpu_ms_per_s")
        fitted["rounds"] = per_round
        out[name] = fitted
    return {"concurrency": conc, "tokens": tokens, "idle_s": IDLE_S, "routers": out}


def _summed(slices: dict[tuple[str, int, int], tuple[float, float, int]], name: str,
            rounds: Iterable[int], tokens: list[int],
            ) -> tuple[dict[int, float], dict[int, float], dict[int, int]]:
    """CPU seconds, slice seconds and requests per answer length over ``rounds``."""
    cpu = dict.fromkeys(tokens, 0.0)
    spans = dict.fromkeys(tokens, 0.0)
    done = dict.fromkeys(tokens, 0)
    for k in rounds:
        for t in tokens:
            used, span, ok = slices[name, k, t]
            cpu[t] += used
            spans[t] += span
            done[t] += ok
    return cpu, spans, done


async def idle_rates(started: list[tuple[Router, Managed, Endpoint]]) -> dict[str, float]:
    """Each router's CPU seconds per second with no traffic at all, all measured at once."""
    before = {router.name: proc.tree_cpu_seconds() for router, proc, _ in started}
    t0 = time.perf_counter()
    await asyncio.sleep(IDLE_S)
    span = time.perf_counter() - t0
    return {router.name: (proc.tree_cpu_seconds() - before[router.name]) / span
            for router, proc, _ in started}


def _router_fit(cpu: dict[int, float], spans: dict[int, float], done: dict[int, int],
                idle: float) -> dict[str, object]:
    ms = {t: cpu[t] * 1000.0 / done[t] for t in cpu if done[t]}
    net = {t: max(0.0, cpu[t] - idle * spans[t]) * 1000.0 / done[t] for t in cpu if done[t]}
    a, b = line([(float(t), v) for t, v in ms.items()])
    a_net, b_net = line([(float(t), v) for t, v in net.items()])
    return {"cpu_ms_per_request": {str(t): v for t, v in ms.items()},
            "net_cpu_ms_per_request": {str(t): v for t, v in net.items()},
            "idle_cpu_ms_per_s": idle * 1000.0,
            "a_ms": a, "b_us_per_token": b * 1000.0,
            "a_net_ms": a_net, "b_net_us_per_token": b_net * 1000.0}
