"""Engine telemetry that cannot latch, be redirected or be lied to, against real servers.

Two set-ups: a proxy whose scraper the test drives round by round on a clock it moves by hand
(``stepped``: the frozen-metrics race, reproduced deterministically), and a proxy scraping a rogue
engine beside a simulated one in real time (``make_mixed``: what a hostile ``/metrics`` does to
the rogue, and does not do to its neighbour).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest
from integration.stack import TARGET_MODEL, Stack, chat_body, proxy_config, sim

from engine_sidecar.sim.cluster import start_cluster
from proxy.core.config import TelemetryConfig
from proxy.fleet.scraper import Scraper
from proxy.server.app import build_app
from proxy.server.keys import SCRAPER_TASK, SHELL
from proxy.server.lifecycle import ProxyServer

from .rogue import HEALTHY_METRICS, RogueEngine

# What the rogue says once it has served a request: its counters moved.
COUNTED_ONE = HEALTHY_METRICS + 'vllm:request_success_total{model_name="m"} 1\n'
# The rogue's text with other figures: KV usage 0.75, 3 running.
BUSY_METRICS = HEALTHY_METRICS.replace("} 0.1\n", "} 0.75\n").replace(
    'running{model_name="m",engine="0"} 0', 'running{model_name="m",engine="0"} 3'
)
CAP = 64 * 1024  # telemetry.max_metrics_bytes in the mixed proxy
STALE_S = 1.0  # telemetry.stale_after_s in the mixed proxy


class HandClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Stepped:
    """A proxy in front of the rogue alone, scraped only when the test says so."""

    server: ProxyServer
    scraper: Scraper
    clock: HandClock
    http: aiohttp.ClientSession

    async def scrape(self) -> None:
        await self.scraper.scrape_all()

    async def row(self) -> dict[str, Any]:
        async with self.http.get(self.server.url + "/admin/engines") as resp:
            body = await resp.json()
        rows: dict[str, Any] = body["engines"][0]
        return rows

    async def chat(self, content: str) -> aiohttp.ClientResponse:
        resp = await self.http.post(
            self.server.url + "/v1/chat/completions", json=chat_body(content)
        )
        await resp.read()
        return resp

    def failures(self, reason: str) -> float:
        value = self.server.app[SHELL].metrics.registry.get_sample_value(
            "kvproxy_scrape_failures_total", {"engine": "rogue", "reason": reason}
        )
        return value or 0.0


@contextlib.asynccontextmanager
async def stepped(rogue: RogueEngine, **telemetry: Any) -> AsyncIterator[Stepped]:
    cfg = proxy_config(
        [rogue.url], ["rogue"], ["target"],
        telemetry=TelemetryConfig(interval_s=1.0, timeout_s=0.9, stale_after_s=1.0, **telemetry),
    )  # fmt: skip
    clock = HandClock()
    server = ProxyServer(cfg, app=build_app(cfg, clock=clock))
    await server.start()
    http = aiohttp.ClientSession()
    try:
        task = server.app[SCRAPER_TASK]
        task.cancel()  # the test scrapes, on its own clock
        with contextlib.suppress(asyncio.CancelledError):
            await task
        ctx = server.app[SHELL]
        assert ctx.scrape_session is not None
        scraper = Scraper(ctx.fleet, ctx.scrape_session, cfg.telemetry, ctx.metrics, clock)
        yield Stepped(server, scraper, clock, http)
    finally:
        await http.close()
        await server.stop()


async def until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():  # noqa: ASYNC110 (polls what the rogue received)
            await asyncio.sleep(0.005)


# --- 1. an idle engine never latches STALE ------------------------------------------------------


async def test_a_scrape_racing_a_finishing_request_does_not_latch_stale(
    rogue: RogueEngine,
) -> None:
    """The engine has finished a request and counted it; a scrape sees that text before the
    proxy has read the answer. Every later idle scrape repeats the text: that is no proof of a
    frozen exporter, and the engine must stay healthy."""
    async with stepped(rogue) as p:
        await p.scrape()
        assert (await p.row())["health"] == "healthy"
        rogue.behaviour.completions = "hold"
        p.clock.advance(0.1)
        request = asyncio.create_task(p.chat("finish me across a scrape"))
        await until(lambda: bool(rogue.requests_to("/v1/chat/completions")))
        rogue.behaviour.metrics_body = COUNTED_ONE.encode()  # the engine is done with it
        p.clock.advance(0.1)
        await p.scrape()  # sees the new text; the proxy has not read the answer yet
        p.clock.advance(0.1)
        rogue.release.set()
        assert (await request).status == 200
        for _ in range(12):  # idle from now on: the text repeats, well past stale_after_s
            p.clock.advance(0.3)
            await p.scrape()
            row = await p.row()
            assert row["health"] == "healthy", row
            assert row["health_reason"] is None
            assert row["snapshot_age_s"] < 1.0
        assert row["completed"] == 1
        assert p.failures("frozen") == 0


async def test_a_proven_frozen_text_fails_the_scrape_and_the_engine_recovers_when_idle(
    rogue: RogueEngine,
) -> None:
    async with stepped(rogue, unhealthy_after_failures=1) as p:
        await p.scrape()
        p.clock.advance(0.1)
        # Dispatched after that text was fetched, answered well before the next scrape (more
        # than the interval an exporter gets to count it): yet its text does not move.
        assert (await p.chat("counted")).status == 200
        p.clock.advance(1.1)
        await p.scrape()
        row = await p.row()
        assert p.failures("frozen") == 1
        assert row["health"] == "unhealthy" and row["routable"] is False
        assert row["health_reason"].startswith("frozen metrics")
        # Probed again: a round without such a request, and the repeat is believed.
        p.clock.advance(0.2)
        await p.scrape()
        row = await p.row()
        assert row["health"] == "healthy" and row["health_reason"] is None
        # And so is a text that moves, however busy the engine was.
        assert (await p.chat("again")).status == 200
        rogue.behaviour.metrics_body = COUNTED_ONE.encode()
        p.clock.advance(0.2)
        await p.scrape()
        assert (await p.row())["health"] == "healthy"
        assert p.failures("frozen") == 1


async def test_a_repeated_text_is_not_parsed_again_and_a_change_after_it_is_seen(
    rogue: RogueEngine,
) -> None:
    """An idle engine's text repeats byte for byte: its snapshot is reused, restamped, without a
    parse. The first different text after such repeats is parsed and seen at once."""
    async with stepped(rogue) as p:
        for _ in range(4):
            p.clock.advance(0.3)
            await p.scrape()
            row = await p.row()
            assert row["health"] == "healthy" and row["snapshot_age_s"] == 0.0
            assert row["snapshot"]["kv_usage"] == pytest.approx(0.1)
        assert p.scraper.parses == 1
        rogue.behaviour.metrics_body = BUSY_METRICS.encode()
        p.clock.advance(0.3)
        await p.scrape()
        snap = (await p.row())["snapshot"]
        assert snap["kv_usage"] == pytest.approx(0.75) and snap["running"] == 3
        assert p.scraper.parses == 2
        # The same size, other bytes: a digit changed in place is still a change.
        rogue.behaviour.metrics_body = rogue.behaviour.metrics_body.replace(b"} 3", b"} 4")
        p.clock.advance(0.3)
        await p.scrape()
        assert (await p.row())["snapshot"]["running"] == 4
        assert p.scraper.parses == 3


async def test_idle_simulated_engines_stay_healthy_after_serving(make_stack: Any) -> None:
    # Time-outs generous for a busy test machine: only frozen-metrics verdicts are at issue.
    telemetry = TelemetryConfig(interval_s=0.2, timeout_s=0.19, stale_after_s=STALE_S)
    stack: Stack = await make_stack(telemetry=telemetry)
    for batch in range(5):
        answers = await asyncio.gather(
            *(stack.post("/v1/chat/completions", chat_body(f"q {batch} {i}")) for i in range(8))
        )
        assert all(resp.status == 200 for resp in answers)
    rows = await stack.admin()
    assert sum(row["completed"] for row in rows.values()) == 40
    start = await stack.metric("kvproxy_scrape_duration_seconds_count", engine="t0")

    async def many_rounds_all_healthy() -> bool:
        rows = await stack.admin()
        for row in rows.values():
            assert row["health"] == "healthy", row
            assert row["health_reason"] is None
        done = await stack.metric("kvproxy_scrape_duration_seconds_count", engine="t0")
        return done - start >= 15  # rounds: three times stale_after_s

    await stack.wait_for(many_rounds_all_healthy, timeout_s=30.0)
    assert await stack.metric("kvproxy_scrape_failures_total", reason="frozen") == 0


# --- a rogue engine beside a simulated one -----------------------------------------------------


MixedFactory = Callable[..., Awaitable[Stack]]


@pytest.fixture
async def make_mixed(rogue: RogueEngine) -> AsyncIterator[MixedFactory]:
    """``await make_mixed()``: a proxy over the rogue ("rogue") and a simulated engine ("sim0"),
    scraping in real time; set the rogue's behaviour first, so its figures are never good."""
    cleanups: list[Callable[[], Awaitable[None]]] = []

    async def make() -> Stack:
        cluster = await start_cluster(
            [sim(TARGET_MODEL, "sim0", scheduling_policy="priority")], host="127.0.0.1", port=0
        )
        cleanups.append(cluster.close)
        # Time-outs generous for a busy test machine: a slow round must not pass for a lie.
        telemetry = TelemetryConfig(
            interval_s=0.2, timeout_s=0.19, stale_after_s=STALE_S, max_metrics_bytes=CAP
        )
        cfg = proxy_config(
            [rogue.url, cluster.urls[0]], ["rogue", "sim0"], ["target"] * 2, telemetry=telemetry
        )
        server = ProxyServer(cfg)
        await server.start()
        cleanups.append(server.stop)
        http = aiohttp.ClientSession()
        cleanups.append(http.close)
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk", max_retries=0)
        cleanups.append(client.close)
        stack = Stack(cluster, server, http, client, ["sim0"])
        await stack.wait_health("sim0", "healthy")
        return stack

    yield make
    for cleanup in reversed(cleanups):
        await cleanup()


async def rogue_fails(stack: Stack, reason: str, times: int = 3) -> None:
    """Until the rogue's scrapes failed ``times`` times for ``reason``."""

    async def failed() -> bool:
        got = await stack.metric("kvproxy_scrape_failures_total", engine="rogue", reason=reason)
        return got >= times

    await stack.wait_for(failed, timeout_s=10.0)


async def assert_only_sim0_trusted(stack: Stack, rogue: RogueEngine) -> None:
    """The rogue's figures were never believed; the simulated engine is healthy, fresh, serving."""
    rows = await stack.admin()
    assert rows["rogue"]["snapshot"] is None
    assert rows["rogue"]["routable"] is False
    assert rows["sim0"]["health"] == "healthy" and rows["sim0"]["fresh"] is True
    assert rows["sim0"]["snapshot_age_s"] < STALE_S
    for i in range(6):
        resp = await stack.post("/v1/chat/completions", chat_body(f"after {i}"))
        assert resp.status == 200 and resp.headers["X-Engine"] == "sim0"
    assert rogue.requests_to("/v1/chat/completions") == []


# --- 2. redirects are never followed ------------------------------------------------------------


@pytest.mark.parametrize("status", [302, 307])
async def test_a_redirecting_metrics_endpoint_is_a_failure(
    make_mixed: MixedFactory, rogue: RogueEngine, status: int
) -> None:
    other = RogueEngine()
    await other.start()
    try:
        # The other server claims an empty, idle engine: the most attractive figures there are.
        other.behaviour.metrics_body = HEALTHY_METRICS.replace("} 0.1", "} 0.0").encode()
        rogue.behaviour.metrics_status = status
        rogue.behaviour.metrics_headers = {"Location": other.url + "/metrics"}
        stack = await make_mixed()
        await rogue_fails(stack, f"http_{status}")
        await stack.wait_health("rogue", "unhealthy")
        row = (await stack.admin())["rogue"]
        assert row["health_reason"] == f"metrics answered HTTP {status}"
        await assert_only_sim0_trusted(stack, rogue)
        assert other.seen == []  # not one scrape reached it
    finally:
        await other.stop()


# --- 3. /metrics is not trusted ------------------------------------------------------------------


async def test_non_utf8_metrics_fail_the_scrape_once_logged_without_traceback(
    make_mixed: MixedFactory, rogue: RogueEngine, caplog: pytest.LogCaptureFixture
) -> None:
    rogue.behaviour.metrics_body = HEALTHY_METRICS.encode() + b"# \xff\xfe not UTF-8\n"
    stack = await make_mixed()
    await rogue_fails(stack, "decode", times=10)
    row = (await stack.admin())["rogue"]
    assert row["health"] == "unhealthy" and row["health_reason"] == "metrics are not UTF-8 text"
    await assert_only_sim0_trusted(stack, rogue)
    ours = [r for r in caplog.records if r.name.startswith("proxy.")]
    assert all(r.exc_info is None for r in ours)
    # Ten failed rounds, yet a bounded number of lines: the failure and the health change.
    assert len([r for r in ours if "rogue" in r.getMessage()]) <= 2


async def test_an_endless_metrics_body_is_cut_at_the_cap(
    make_mixed: MixedFactory, rogue: RogueEngine
) -> None:
    size = 64 * 1024 * 1024
    rogue.behaviour.metrics_stream_bytes = size  # chunked: no length to refuse it by
    stack = await make_mixed()
    await rogue_fails(stack, "too_large")
    async with stack.http.get(stack.url + "/health") as resp:
        assert resp.status == 200  # the proxy stays responsive
    await assert_only_sim0_trusted(stack, rogue)
    # What left the rogue bounds what the proxy read: the cap plus socket buffers, not 64 MiB.
    assert rogue.metrics_bytes_sent and max(rogue.metrics_bytes_sent) < size // 4
    assert (await stack.admin())["rogue"]["health_reason"] == f"metrics larger than {CAP} bytes"


async def test_a_declared_oversized_body_is_refused_unread(
    make_mixed: MixedFactory, rogue: RogueEngine
) -> None:
    padding = b"# " + b"x" * 1021 + b"\n"
    rogue.behaviour.metrics_body = HEALTHY_METRICS.encode() + padding * 1024  # ~1 MiB
    stack = await make_mixed()
    await rogue_fails(stack, "too_large")
    await assert_only_sim0_trusted(stack, rogue)


@pytest.mark.parametrize(
    "replace",
    [
        ("kv_cache_usage_perc{model_name=\"m\",engine=\"0\"} 0.1", "kv_cache_usage_perc 7"),
        ("kv_cache_usage_perc{model_name=\"m\",engine=\"0\"} 0.1", "kv_cache_usage_perc -5"),
        ("num_requests_running{model_name=\"m\",engine=\"0\"} 0", "num_requests_running -1e6"),
        ("num_requests_waiting{model_name=\"m\",engine=\"0\"} 0", "num_requests_waiting 1e12"),
        ("num_requests_waiting{model_name=\"m\",engine=\"0\"} 0", "num_requests_waiting +Inf"),
    ],
    ids=["kv_7", "kv_negative", "running_negative", "waiting_absurd", "waiting_infinite"],
)
async def test_out_of_range_figures_are_not_believed(
    make_mixed: MixedFactory, rogue: RogueEngine, replace: tuple[str, str]
) -> None:
    body = HEALTHY_METRICS.replace(*replace)
    assert body != HEALTHY_METRICS
    rogue.behaviour.metrics_body = body.encode()
    stack = await make_mixed()
    await rogue_fails(stack, "out_of_range")
    await stack.wait_health("rogue", "unhealthy")
    assert (await stack.admin())["rogue"]["health_reason"].startswith("vllm:")
    await assert_only_sim0_trusted(stack, rogue)


async def test_a_rogue_engine_never_costs_its_neighbour_a_scrape(
    make_mixed: MixedFactory, rogue: RogueEngine
) -> None:
    """Every kind of bad /metrics in turn on one engine, while the other is scraped each round."""
    stack = await make_mixed()
    bodies = (b"\xff\xfe\n", b"vllm:kv_cache_usage_perc -1\n", b"<html>nope</html>")
    for body in bodies:
        rogue.behaviour.metrics_body = body
        await scrape_rounds(stack, 3)
        row = (await stack.admin())["sim0"]
        assert row["health"] == "healthy" and row["snapshot_age_s"] < STALE_S
    failures = "kvproxy_scrape_failures_total"
    for reason in ("decode", "out_of_range", "unparsable"):
        assert await stack.metric(failures, engine="rogue", reason=reason) >= 3
    # (A scrape of sim0 may time out on a busy machine; that is not the rogue's doing.)
    for reason in ("decode", "out_of_range", "unparsable", "internal"):
        assert await stack.metric(failures, engine="sim0", reason=reason) == 0


async def scrape_rounds(stack: Stack, rounds: int) -> None:
    """Until the simulated engine has been scraped ``rounds`` more times."""
    name = "kvproxy_scrape_duration_seconds_count"
    start = await stack.metric(name, engine="sim0")

    async def done() -> bool:
        return await stack.metric(name, engine="sim0") - start >= rounds

    await stack.wait_for(done, timeout_s=10.0)
