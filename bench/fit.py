"""Router CPU per request as a + b * tokens: a per request, b per streamed token.

Rules: at one concurrency, every router gets interleaved slices with answers of each length in
``tokens`` (16 and 256 by default); its CPU per completed request at each length gives the line
through them (two lengths: exact; more: least squares). Direct requests are not measured here:
they cost a router nothing.
"""

from __future__ import annotations

import copy
import math
import time
from typing import TYPE_CHECKING

from bench.loadgen import make_session

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
    cpu: dict[str, dict[int, float]] = {}
    done: dict[str, dict[int, int]] = {}
    print(f"== CPU fit at {conc} streams, answers of {tokens} tokens", flush=True)
    async with make_session() as session:
        start = time.perf_counter()
        for _ in range(rounds):
            for router, _, _ in started:
                for t in tokens:
                    recs, _, used = await _slice(session, variants[t], started, router.name, conc,
                                                 slice_s, start, ramp_s)
                    cpu.setdefault(router.name, {}).setdefault(t, 0.0)
                    cpu[router.name][t] += used
                    done.setdefault(router.name, {}).setdefault(t, 0)
                    done[router.name][t] += sum(1 for r in recs if r.ok)
    out: dict[str, object] = {}
    for name, per in cpu.items():
        ms = {t: per[t] * 1000.0 / done[name][t] for t in per if done[name][t]}
        a, b = line([(float(t), v) for t, v in ms.items()])
        out[name] = {"cpu_ms_per_request": {str(t): v for t, v in ms.items()},
                     "a_ms": a, "b_us_per_token": b * 1000.0}
    return {"concurrency": conc, "tokens": tokens, "routers": out}
