"""``kvproxy serve --workers 2`` as real processes on loopback before simulated engine processes:
both workers serve, route as one (no Redis: through the parent's hub), ``/metrics`` is the whole
proxy's, a dead worker comes back, and SIGTERM to the parent drains every worker."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from integration.stack import TARGET_MODEL
from prometheus_client.parser import text_string_to_metric_families

from .procs import EngineProcess, start_engine

PREFIX = "".join(f"shared manual section {i:04d} " * 8 for i in range(64))


@dataclass
class Parent:
    proc: asyncio.subprocess.Process
    url: str
    log: list[str] = field(default_factory=list)

    def workers(self) -> dict[int, tuple[int, str]]:
        """index -> (pid, own-metrics socket) of the live workers, from their command lines."""
        out: dict[int, tuple[int, str]] = {}
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        for pid in map(int, children.split()):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except FileNotFoundError:
                continue
            if b"--worker-seat" not in argv:
                continue  # one that has just died (a zombie has no command line)
            seat = argv[argv.index(b"--worker-seat") + 1].decode()
            directory, index, _ = seat.rsplit(":", 2)
            out[int(index)] = (pid, f"{directory}/worker-{index}.sock")
        return out


@pytest.fixture
async def engines() -> AsyncIterator[list[EngineProcess]]:
    started: list[EngineProcess] = []
    try:
        for i in range(3):
            started.append(await start_engine(f"w{i}", TARGET_MODEL, "--time-scale", "20",
                                              "--seed", str(i)))  # fmt: skip
        yield started
    finally:
        for engine in started:
            await engine.stop()


@pytest.fixture
async def parent(engines: list[EngineProcess], tmp_path: Path,
                 request: pytest.FixtureRequest) -> AsyncIterator[Parent]:
    config = tmp_path / "kvproxy.toml"
    # More lines of [server] and [routing], where a test asks; [telemetry] replaced.
    extra: dict[str, list[str]] = getattr(request, "param", {})
    telemetry = extra.get("telemetry", ["interval_s = 0.1", "timeout_s = 0.09",
                                        "stale_after_s = 0.6"])
    lines = ["[server]", "drain_timeout_s = 10.0", *extra.get("server", []), "[telemetry]",
             *telemetry,
             # A bound no burst here reaches: the test is about what workers know, not spilling.
             "[routing]", "min_load_bound = 16", *extra.get("routing", []),
             "[[pools]]", 'name = "target"', f'model = "{TARGET_MODEL}"']
    for i, engine in enumerate(engines):
        lines += ["[[pools.engines]]", f'name = "w{i}"', f'url = "{engine.url}"']
    config.write_text("\n".join(lines) + "\n")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "serve", "--config", str(config), "--port", "0",
        "--workers", "2", stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    log: list[str] = []
    try:
        async with asyncio.timeout(60):
            while True:
                line = (await proc.stderr.readline()).decode()
                assert line, f"kvproxy exited before serving: {log}"
                log.append(line)
                found = re.search(r"listening on (http://\S+) \(2 workers\)", line)
                if found:
                    break
    except BaseException:
        proc.kill()
        await proc.wait()
        raise
    running = Parent(proc, found.group(1), log)
    reader = asyncio.get_running_loop().create_task(_keep_log(proc.stderr, log))
    try:
        await _all_engines_healthy(running, len(engines))
        yield running
    finally:
        await _stop(proc)
        reader.cancel()


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(20):
                await proc.wait()
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def _all_engines_healthy(parent: Parent, engines: int) -> None:
    """Every worker has scraped every engine (each worker scrapes for itself)."""
    async with asyncio.timeout(20):
        for _, path in parent.workers().values():
            await wait_metric(path, "kvproxy_engine_health", engines, state="healthy")


async def _keep_log(stream: asyncio.StreamReader, log: list[str]) -> None:
    while line := await stream.readline():
        log.append(line.decode())


def chat(content: str, **extra: object) -> dict[str, object]:
    return {"model": TARGET_MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 8, **extra}


def total(text: str, name: str, **labels: str) -> float:
    found = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and labels.items() <= s.labels.items():
                found += s.value
    return found


async def own_metrics(socket_path: str) -> str:
    connector = aiohttp.UnixConnector(path=socket_path)
    async with (
        aiohttp.ClientSession(connector=connector) as http,
        http.get("http://worker/metrics") as resp,
    ):
        return await resp.text()


async def wait_metric(path: str, name: str, at_least: float, **labels: str) -> None:
    """Until one worker's own exposition shows ``name`` at ``at_least`` (callers bound it)."""
    while total(await own_metrics(path), name, **labels) < at_least:  # noqa: ASYNC110
        await asyncio.sleep(0.05)


async def post(url: str, body: dict[str, object]) -> int:
    # A connection of its own each time, so SO_REUSEPORT spreads them over the workers.
    async with aiohttp.ClientSession() as http, http.post(url + "/v1/chat/completions",
                                                          json=body) as resp:
        await resp.read()
        return resp.status


async def test_both_workers_serve_and_metrics_count_them_all(parent: Parent) -> None:
    seats = parent.workers()
    assert len(seats) == 2
    async with asyncio.timeout(5):  # each hears the other: every dispatch below is merged
        for _, path in seats.values():
            await wait_metric(path, "kvproxy_sharing_peers", 1)
    statuses = [await post(parent.url, chat(f"hello {i}")) for i in range(24)]
    assert statuses == [200] * 24
    own = [total(await own_metrics(path), "kvproxy_requests_total") for _, path in seats.values()]
    assert all(n > 0 for n in own), f"one worker served nothing: {own}"
    async with aiohttp.ClientSession() as http, http.get(parent.url + "/metrics") as resp:
        merged = await resp.text()
    assert total(merged, "kvproxy_requests_total", status="200") == 24
    assert total(merged, "kvproxy_sharing_live") == 1.0
    # Each worker settles the prompts its sibling served: their first bytes reach it too.
    async with asyncio.timeout(5):
        for _, path in seats.values():
            await wait_metric(path, "kvproxy_sharing_merged_total", 1, kind="confirmations")
    for _, path in seats.values():
        text = await own_metrics(path)
        assert total(text, "kvproxy_sharing_dropped_total", reason="unknown_confirmation") == 0


# What the workers know of each other's dispatches, under the affinity policy: the default cost
# model may also spread such a burst for load, which is its own decision, not what is tested.
@pytest.mark.parametrize("parent", [{"routing": ['policy = "prefix_affinity"']}], indirect=True)
async def test_a_burst_sharing_a_new_prefix_lands_on_one_engine(parent: Parent) -> None:
    seats = parent.workers()
    async with aiohttp.ClientSession() as http:
        # The first request of the prefix: a stream far longer than the test (it is closed
        # below), still open on one worker and engine.
        stream = await http.post(parent.url + "/v1/chat/completions",
                                 json=chat(PREFIX + " first", stream=True, max_tokens=3000,
                                           ignore_eos=True))  # fmt: skip
        assert stream.status == 200
        await stream.content.readline()
        home = await _busy_engine(seats)
        # Both workers have seen that engine busy (their own scrapes show it running).
        async with asyncio.timeout(5):
            for _, path in seats.values():
                await wait_metric(path, "kvproxy_engine_running", 1, engine=home)
        statuses = await asyncio.gather(*(post(parent.url, chat(PREFIX + f" q{i}"))
                                          for i in range(8)))  # fmt: skip
        assert statuses == [200] * 8
        stream.close()
        async with http.get(parent.url + "/metrics") as resp:
            merged = await resp.text()
    used = {e: total(merged, "kvproxy_requests_total", engine=e, status="200")
            for e in ("w0", "w1", "w2")}  # fmt: skip
    assert used[home] == 8, f"the burst was split across engines: {used}"


async def _busy_engine(seats: dict[int, tuple[int, str]]) -> str:
    for _, path in seats.values():
        text = await own_metrics(path)
        for engine in ("w0", "w1", "w2"):
            if total(text, "kvproxy_engine_inflight", engine=engine) >= 1:
                return engine
    raise AssertionError("no worker has the stream open")


async def test_a_dead_worker_is_restarted(parent: Parent) -> None:
    before = parent.workers()
    pid = before[0][0]
    os.kill(pid, signal.SIGKILL)
    async with asyncio.timeout(15):
        while (seat := parent.workers().get(0)) is None or seat[0] == pid:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
    assert any("worker 0" in line and "restarting" in line for line in parent.log)
    statuses = [await post(parent.url, chat(f"after restart {i}")) for i in range(8)]
    assert statuses == [200] * 8


@pytest.mark.parametrize("parent", [{"server": ["worker_stuck_after_s = 2.0"]}], indirect=True)
async def test_a_stopped_worker_is_killed_and_replaced_and_a_quiet_one_is_left_alone(
    parent: Parent,
) -> None:
    before = parent.workers()
    stopped, quiet = before[1][0], before[0][0]
    os.kill(stopped, signal.SIGSTOP)  # alive, its port still open: its connections would hang
    try:
        async with asyncio.timeout(20):
            while (seat := parent.workers().get(1)) is None or seat[0] == stopped:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped, signal.SIGCONT)  # only if the parent did not kill it
    assert any("worker 1" in line and "has sent nothing" in line for line in parent.log)
    async with asyncio.timeout(20):
        while True:  # the replacement serves once its own socket answers and it knows the fleet
            try:
                await _all_engines_healthy(parent, 3)
                break
            except aiohttp.ClientError:
                await asyncio.sleep(0.1)
    statuses = [await post(parent.url, chat(f"after the stuck worker {i}")) for i in range(8)]
    assert statuses == [200] * 8
    await asyncio.sleep(2.5)  # past the limit again, with no traffic at all
    assert parent.workers()[0][0] == quiet  # idle but beating: never taken for stuck
    assert not any("worker 0" in line and "has sent nothing" in line for line in parent.log)


async def test_sigterm_drains_an_open_stream_and_the_parent_exits_0(parent: Parent) -> None:
    async with aiohttp.ClientSession() as http:
        resp = await http.post(parent.url + "/v1/chat/completions",
                               json=chat("drain me", stream=True, max_tokens=150,
                                         ignore_eos=True))  # fmt: skip
        assert resp.status == 200
        await resp.content.readline()
        parent.proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            body = await resp.read()
    assert body.rstrip().endswith(b"data: [DONE]")
    async with asyncio.timeout(30):
        assert await parent.proc.wait() == 0


async def _metrics_served(engines: list[EngineProcess]) -> list[int]:
    async with aiohttp.ClientSession() as http:
        out = []
        for engine in engines:
            async with http.get(engine.url + "/admin/state") as resp:
                out.append(int((await resp.json())["metrics_served"]))
        return out


async def test_each_engine_is_scraped_as_often_as_by_one_proxy(
    parent: Parent, engines: list[EngineProcess]
) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()  # before the first count is read: the window holds every scrape counted
    before = await _metrics_served(engines)
    await asyncio.sleep(2.0)
    after, took = await _metrics_served(engines), loop.time() - started
    # One proxy scrapes every 0.1 s at most (a round never starts early); two workers scraping
    # each for itself would double that. Half as many again is allowed: while a stalled worker
    # 0's relays are late, worker 1 scrapes for itself. Slow rounds only lower the count.
    most = 1.5 * took / 0.1 + 2
    assert all(b - a <= most for a, b in zip(before, after, strict=True)), (before, after, most)
    seats = parent.workers()
    relayed = [total(await own_metrics(seats[i][1]), "kvproxy_scrape_relayed_total",
                     result=result) for i, result in ((0, "sent"), (1, "applied"))]  # fmt: skip
    assert all(n > 0 for n in relayed), relayed


async def _scraped_by(path: str) -> float:
    return total(await own_metrics(path), "kvproxy_scrape_duration_seconds_count")


async def _relayed_or_zero(path: str) -> float:
    """What a worker has sent its siblings; 0 while it is still starting (no socket yet)."""
    try:
        return total(await own_metrics(path), "kvproxy_scrape_relayed_total", result="sent")
    except aiohttp.ClientError:
        return 0.0


async def _assert_healthy(path: str, engines: int) -> None:
    text = await own_metrics(path)
    healthy = total(text, "kvproxy_engine_health", state="healthy")
    assert healthy == engines, [line for line in text.splitlines() if "engine_health{" in line]


async def _quiet_window(path: str) -> float:
    """Until a worker makes no scrape of its own for 1 s (five intervals); its scrape count then.
    Bounded by the caller."""
    while True:
        settled = await _scraped_by(path)
        await asyncio.sleep(1.0)
        if await _scraped_by(path) == settled:
            return settled


async def _applied(path: str) -> float:
    return total(await own_metrics(path), "kvproxy_scrape_relayed_total", result="applied")


# Scrapes every 0.2 s, each given 0.19 s, stale after 3 s: seven processes share the machine, and
# what is shown is who scrapes, not how fast.
@pytest.mark.parametrize("parent", [{"telemetry": ["interval_s = 0.2", "timeout_s = 0.19",
                                                   "stale_after_s = 3.0"]}], indirect=True)
async def test_a_sibling_takes_over_the_scrapes_of_a_dead_worker_and_nothing_goes_stale(
    parent: Parent, engines: list[EngineProcess]
) -> None:
    seats = parent.workers()
    other = seats[1][1]
    # Worker 1 follows worker 0's scrapes: it makes none of its own while they arrive.
    async with asyncio.timeout(15):
        quiet = await _quiet_window(other)
    os.kill(seats[0][0], signal.SIGKILL)
    async with asyncio.timeout(15):
        # Worker 1 takes the engines over (its own scrapes resume) and keeps every one healthy
        # until worker 0 is back.
        while True:
            await _assert_healthy(other, len(engines))
            seat = parent.workers().get(0)
            if (seat is not None and seat[0] != seats[0][0]
                    and await _scraped_by(other) > quiet):
                break
            await asyncio.sleep(0.05)
    applied = await _applied(other)
    # The new worker 0 scrapes again and worker 1 goes back to following it.
    async with asyncio.timeout(15):
        while await _relayed_or_zero(seat[1]) < 1:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        await _quiet_window(other)
    assert await _applied(other) > applied  # what it follows: the new worker 0's scrapes
    await _assert_healthy(other, len(engines))


async def test_a_second_proxy_on_the_same_port_refuses_to_start(
    parent: Parent, tmp_path: Path
) -> None:
    # SO_REUSEPORT would let it join the first one's port and take a share of its clients.
    port = parent.url.rsplit(":", 1)[1]
    config = tmp_path / "second.toml"
    config.write_text("[[pools]]\nname = \"target\"\nmodel = \"m\"\n[[pools.engines]]\n"
                      "name = \"x\"\nurl = \"http://127.0.0.1:9\"\n")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "serve", "--config", str(config), "--port", port,
        "--workers", "2", stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "TMPDIR": str(scratch)})
    async with asyncio.timeout(60):
        _, err = await proc.communicate()
    assert proc.returncode == 1
    assert b"in use" in err.lower()
    assert list(scratch.iterdir()) == []  # no private directory left behind


def _gone(pids: list[int]) -> bool:
    return not any(Path(f"/proc/{pid}").exists() for pid in pids)


async def test_workers_whose_parent_was_killed_leave_nothing_behind(
    engines: list[EngineProcess], tmp_path: Path,
) -> None:
    config = tmp_path / "kvproxy.toml"
    lines = ["[server]", "drain_timeout_s = 2.0", "[[pools]]", 'name = "target"',
             f'model = "{TARGET_MODEL}"']
    for i, engine in enumerate(engines):
        lines += ["[[pools.engines]]", f'name = "w{i}"', f'url = "{engine.url}"']
    config.write_text("\n".join(lines) + "\n")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "serve", "--config", str(config), "--port", "0",
        "--workers", "2", stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "TMPDIR": str(scratch)})
    assert proc.stderr is not None
    try:
        async with asyncio.timeout(60):
            while b"(2 workers)" not in await proc.stderr.readline():
                pass
        running = Parent(proc, "")
        children = [pid for pid, _ in running.workers().values()]
        assert len(children) == 2 and len(list(scratch.iterdir())) == 1
        proc.kill()  # no signal passed on, no clean-up by the parent
        await proc.wait()
        async with asyncio.timeout(30):
            while not _gone(children):  # noqa: ASYNC110
                await asyncio.sleep(0.1)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert list(scratch.iterdir()) == []  # the last worker out removed the directory


async def _worker_pid(parent: Parent, index: int) -> int:
    """The pid of worker ``index`` once one is running (after a restart's back-off)."""
    async with asyncio.timeout(10):
        while (worker := parent.workers().get(index)) is None:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    return worker[0]


async def test_a_stop_while_a_worker_waits_to_restart_is_prompt_and_clean(parent: Parent) -> None:
    # Worker 0 dies as soon as it is back, until the parent's back-off before restarting it has
    # doubled to 4 s. A SIGTERM in that wait ends it at once, not when the back-off runs out:
    # nothing of that worker is left to drain, so the stop is clean too.
    for backoff in ("0.5", "1.0", "2.0", "4.0"):
        pid = await _worker_pid(parent, 0)
        os.kill(pid, signal.SIGKILL)
        async with asyncio.timeout(10):
            while not any(f"(pid {pid})" in line and f"restarting it in {backoff} s" in line  # noqa: ASYNC110
                          for line in parent.log):  # fmt: skip
                await asyncio.sleep(0.01)
    stopped_at = time.monotonic()
    parent.proc.send_signal(signal.SIGTERM)
    async with asyncio.timeout(15):
        assert await parent.proc.wait() == 0
    assert time.monotonic() - stopped_at < 3.5  # inside the 4 s back-off: it did not run out
