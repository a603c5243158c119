"""The routing benchmark repeated: how much its figures and verdicts move from run to run.

Input: a ``routing.json`` written by ``python -m bench.routing --repeat N --out DIR`` (the
results folder's ``noise/`` subfolder is read by ``bench.report``). Every run there carries its
``round``; each round is judged on its own with the same target checks as the main report.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from bench.markdown import fmt, table
from bench.targets import KVPROXY, ROUND_ROBIN, best_peer_p90, router_hit, router_p90

Run = Mapping[str, object]


def _rounds(runs: Sequence[Run]) -> list[list[Run]]:
    out: dict[int, list[Run]] = {}
    for run in runs:
        round_no = run.get("round", 0)
        out.setdefault(round_no if isinstance(round_no, int) else 0, []).append(run)
    return [out[k] for k in sorted(out)]


def noise_markdown(data: Mapping[str, object]) -> str:
    runs = data.get("runs")
    assert isinstance(runs, list)
    rounds = _rounds(runs)
    routers = list(dict.fromkeys(str(r.get("router")) for r in runs))
    rows = []
    for name in routers:
        p90s = [v for v in (router_p90(rr, name) for rr in rounds) if not math.isnan(v)]
        hits = [v for v in (router_hit(rr, name) for rr in rounds) if not math.isnan(v)]
        rows.append([f"`{name}`", " / ".join(fmt(v, 2) for v in p90s),
                     fmt(statistics.median(p90s), 2) if p90s else "n/a",
                     " / ".join(fmt(v, 3) for v in hits)])
    ideal = float(data["trace"]["ideal_hit_rate"])  # type: ignore[index]
    ratio, hit, beat = [], [], []
    for rr in rounds:
        ours, rr_p90 = router_p90(rr, KVPROXY), router_p90(rr, ROUND_ROBIN)
        if not math.isnan(ours) and not math.isnan(rr_p90):
            ratio.append(ours / rr_p90)
        if not math.isnan(ours):
            hit.append(router_hit(rr, KVPROXY) / ideal)
            peers = best_peer_p90(rr)
            if peers:
                beat.append(all(ours < p90 for _, p90 in peers.values()))
    n = len(rounds)
    return "\n".join([
        f"`{data.get('command')}` ({data.get('started_at')} → {data.get('finished_at')}), "
        f"{n} rounds on the same slice, settings and machine as above; each round runs every "
        f"router once, so the spread below is run-to-run noise.", "",
        table(("router", "TTFT p90 s per round", "median", "hit rate per round"), rows), "",
        f"- `{KVPROXY}` p90 / `{ROUND_ROBIN}` p90 per round: "
        f"{' / '.join(fmt(v, 3) for v in ratio) or 'n/a'} — ≤ 0.5 in "
        f"{sum(v <= 0.5 for v in ratio)} of {len(ratio)} rounds",
        f"- `{KVPROXY}` hit rate / ideal per round: {' / '.join(fmt(v, 3) for v in hit) or 'n/a'}"
        f" — ≥ 0.9 in {sum(v >= 0.9 for v in hit)} of {len(hit)} rounds",
        f"- `{KVPROXY}` p90 below every peer's best in {sum(beat)} of {len(beat)} rounds",
    ])
