"""The overcommit benchmark's clients, objectives and report: retries as the SDKs make them,
goodput bound by latency objectives, verdicts computed from the results."""

import asyncio
import math
import random
import time

import orjson
import pytest
from aiohttp import web

from bench.clients import retry_delay, send_retrying
from bench.loadgen import Endpoint, make_session, parse_retry_after
from bench.overcommit import Arrival, arrival_window, summarize_arm
from bench.report_overcommit import overcommit_markdown
from bench.slo import Objectives, meets, tpot
from bench.stats import RequestRecord

SLO = Objectives(ttft_s={"critical": 1.0, "standard": 5.0, "sheddable": 20.0}, tpot_s=0.1)


def test_retry_after_is_honoured_within_sixty_seconds():
    rng = random.Random(0)
    assert retry_delay(0, 2.0, rng) == 2.0
    assert retry_delay(1, 60.0, rng) == 60.0
    for bad in (None, 0.0, -1.0, 61.0, math.nan):
        first = retry_delay(0, bad, rng)
        assert 0.375 <= first <= 0.5  # 0.5 s less up to 25 % jitter
    assert 6.0 <= retry_delay(10, None, rng) <= 8.0  # the backoff is capped


def test_retry_after_header_parsing():
    assert parse_retry_after(" 2 ") == 2.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") is None


def _sse(tokens: int) -> bytes:
    chunk = b'data: {"choices":[{"index":0,"delta":{"content":" a"}}]}\n\n'
    usage = orjson.dumps({"choices": [], "usage": {"completion_tokens": tokens}})
    return chunk * tokens + b"data: " + usage + b"\n\ndata: [DONE]\n\n"


async def _serve(refusals: int, status: int = 503):
    seen = {"n": 0}

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        seen["n"] += 1
        if seen["n"] <= refusals:
            return web.json_response({"error": "busy"}, status=status,
                                     headers={"Retry-After": "1"})
        return web.Response(body=_sse(3), content_type="text/event-stream")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}", seen


async def _send(refusals: int, max_retries: int, status: int = 503):
    runner, url, seen = await _serve(refusals, status)
    try:
        async with make_session() as session:
            start = time.perf_counter()
            rec = await asyncio.wait_for(send_retrying(
                session, Endpoint("e", url, "m"), b"{}", index=0, run_start=start,
                max_retries=max_retries, seed=1, timeout_s=10.0), timeout=20.0)
    finally:
        await runner.cleanup()
    return rec, seen["n"]


def test_a_refusal_is_retried_after_retry_after_and_ttft_counts_the_wait():
    rec, calls = asyncio.run(_send(refusals=1, max_retries=2))
    assert rec.ok and calls == 2 and rec.retries == 1
    assert rec.sent_at < 0.5  # the first send, not the retry's
    assert rec.ttft is not None and rec.ttft >= 1.0  # Retry-After: 1 s, waited


def test_a_request_still_refused_after_its_retries_is_lost():
    rec, calls = asyncio.run(_send(refusals=5, max_retries=1, status=429))
    assert rec.status == 429 and not rec.ok
    assert calls == 2 and rec.retries == 1


def test_no_retries_is_the_open_loop():
    rec, calls = asyncio.run(_send(refusals=1, max_retries=0))
    assert rec.status == 503 and calls == 1 and rec.retries == 0


def _rec(ttft: float, tokens: int = 11, gap: float = 0.05, status: int = 200,
         retries: int = 0) -> RequestRecord:
    if status != 200:
        return RequestRecord(index=0, status=status, error="busy", retries=retries)
    itl = [gap] * (tokens - 1)
    return RequestRecord(index=0, status=200, ttft=ttft, itl=itl, e2e=ttft + sum(itl),
                         output_tokens=tokens, retries=retries)


def test_objectives_bound_ttft_per_class_and_tpot():
    assert tpot(_rec(0.1, tokens=11, gap=0.05)) == pytest.approx(0.05)
    assert meets(_rec(0.9), "critical", SLO)
    assert not meets(_rec(1.1), "critical", SLO)
    assert meets(_rec(4.0), "standard", SLO)
    assert not meets(_rec(0.1, gap=0.2), "sheddable", SLO)  # too slow per token
    assert not meets(_rec(0.1, status=503), "sheddable", SLO)
    assert meets(_rec(0.1, tokens=1), "critical", SLO)  # no TPOT for one token


def test_goodput_counts_only_tokens_within_objectives():
    done = [("critical", _rec(0.5)), ("critical", _rec(3.0, retries=1)),
            ("standard", _rec(0.5, status=503, retries=2)), ("sheddable", _rec(30.0))]
    arm = summarize_arm(done, 10.0, 4.0, SLO, 5.0)
    assert arm["throughput_tokens_per_s"] == pytest.approx(3.3)  # 33 completed tokens over 10 s
    # One request within bounds (11 tokens): over the arrival window, and over the own span.
    assert arm["goodput_tokens_per_s"] == pytest.approx(2.2)
    assert arm["goodput_own_span_tokens_per_s"] == pytest.approx(1.1)
    crit = arm["classes"]["critical"]  # type: ignore[index]
    assert crit["retried"] == 1 and crit["within_slo"] == 1 and crit["completed"] == 2
    std = arm["classes"]["standard"]  # type: ignore[index]
    assert std["shed"] == 1 and std["retries"] == 2


def _arm(preemptions: float, p99: float, goodput: float, throughput: float) -> dict:
    arm = summarize_arm([("critical", _rec(p99))], 1.0, preemptions, SLO, 1.0)
    arm["goodput_tokens_per_s"] = goodput
    arm["throughput_tokens_per_s"] = throughput
    return arm


def test_report_judges_goodput_and_shows_raw_throughput_beside_it():
    data = {"settings": {"objectives": SLO.as_dict(), "client_retries": 2},
            "rounds": [{"guard": _arm(0, 0.1, 100.0, 90.0),
                        "threshold": _arm(30, 1.0, 95.0, 100.0)}]}
    text = overcommit_markdown(data, notes="A person's reading.")
    goodput = next(ln for ln in text.splitlines() if ln.startswith("| goodput"))
    raw = next(ln for ln in text.splitlines() if ln.startswith("| raw throughput"))
    assert goodput.endswith("| met |") and "1.05" in goodput
    assert "0.90" in raw and "not met" in raw
    assert "critical 1.0 s" in text and "100 ms" in text and "at most 2 times" in text
    assert "## Notes on this run (written by hand)" in text


def test_report_of_results_without_objectives_says_so():
    old = _arm(0, 0.1, 0.0, 0.0)
    del old["throughput_tokens_per_s"]
    old["goodput_tokens_per_s"] = 50.0  # the old name of raw throughput
    text = overcommit_markdown({"settings": {}, "rounds": [{"guard": old, "threshold": old}]})
    assert "did not retry" in text
    assert "not measured" in text


def test_goodput_shares_the_arrival_window_so_one_more_late_answer_never_lowers_it():
    """Two arms with the same answers within objectives, one serving one more request late, after
    everything else: over the common window the later one scores no lower (it did more)."""
    base = [("critical", _rec(0.5)), ("standard", _rec(1.0))]
    late = [*base, ("sheddable", _rec(30.0))]  # beyond its 20 s objective, ends last
    first = summarize_arm(base, 12.0, 0.0, SLO, 10.0)
    second = summarize_arm(late, 42.0, 0.0, SLO, 10.0)
    assert second["goodput_tokens_per_s"] == first["goodput_tokens_per_s"]
    assert second["goodput_own_span_tokens_per_s"] < first["goodput_own_span_tokens_per_s"]


def test_arrival_window_runs_from_first_to_last_scheduled_arrival():
    arrivals = [Arrival(0.4, "critical", "p", 1, None), Arrival(3.4, "standard", "p", 1, None)]
    assert arrival_window(arrivals) == pytest.approx(3.0)
    assert arrival_window(arrivals[:1]) == 0.0


def test_report_states_the_common_denominator_and_shows_the_old_figure():
    data = {"settings": {"objectives": SLO.as_dict(), "client_retries": 2,
                         "goodput_denominator": "arrival_window", "arrival_window_s": 39.5},
            "rounds": [{"guard": _arm(0, 0.1, 100.0, 90.0),
                        "threshold": _arm(30, 1.0, 95.0, 100.0)}]}
    text = overcommit_markdown(data)
    assert "arrival window (39.5 s" in text and "goodput over own span (old measure)" in text
    assert "raw throughput over own span" in text
