"""The workers benchmark's judgement: ratios per round and verdicts per workload."""

from __future__ import annotations

from bench.peers import Router, parse_router_list
from bench.workers import judge, markdown


def _run(workload: str, rnd: int, router: str, cpu_s: float, done: float,
         hit: float) -> dict[str, object]:
    return {"workload": workload, "round": rnd, "router": router, "status": "ok",
            "router_cpu_s": cpu_s, "hit_rate": hit, "summary": {"completed": done}}


def test_ratios_are_per_round_and_judged_on_the_median() -> None:
    one, many = "kvproxy/expected_ttft", "kvproxy/expected_ttft+w2"
    runs = [_run("rag", 0, one, 1.0, 100, 0.80), _run("rag", 0, many, 1.05, 100, 0.78),
            _run("rag", 1, one, 1.0, 100, 0.80), _run("rag", 1, many, 1.30, 100, 0.60),
            _run("rag", 2, one, 1.0, 100, 0.80), _run("rag", 2, many, 1.08, 100, 0.79),
            _run("chat", 0, one, 2.0, 200, 0.5), _run("chat", 0, many, 3.0, 200, 0.5)]
    rag, chat = judge(runs, one, many)
    assert [round(p["cpu_ratio"], 2) for p in rag["rounds"]] == [1.05, 1.30, 1.08]
    assert round(rag["cpu_ratio"], 2) == 1.08 and rag["cpu_met"]
    assert round(rag["hit_ratio"], 4) == round(0.78 / 0.80, 4) and rag["hit_met"]
    assert chat["cpu_ratio"] == 1.5 and not chat["cpu_met"] and chat["hit_met"]
    text = markdown({"command": "x", "started_at": "t", "settings": {}, "verdicts": [rag, chat],
                     "machine": {"cpu_model": "c", "nproc": 2, "python": "3",
                                 "load_avg_at_start": [0.1, 0.2, 0.3]}})
    assert "`chat`: CPU per request 1.50x one worker's (NOT met)" in text
    assert "| rag | 2 | 10.00 | 13.00 | 1.30 |" in text


def test_a_worker_count_is_a_router_name() -> None:
    [router] = parse_router_list("kvproxy/expected_ttft+w2")
    assert router == Router("kvproxy", "expected_ttft", 2)
