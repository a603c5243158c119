"""``kvproxy serve`` as a real process: SIGTERM (or SIGHUP) drains open streams, then the process
exits 0."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest

MODEL = "target-model"


def _free_ports(n: int) -> int:
    """A port P such that P..P+n-1 were free a moment ago."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = int(probe.getsockname()[1])
        if base + n > 65535:
            continue
        if all(_is_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no block of free ports found")


def _is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@contextlib.asynccontextmanager
async def _process(args: list[str], log: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *args, stdout=out, stderr=asyncio.subprocess.STDOUT
        )
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _wait_ready(
    http: aiohttp.ClientSession, url: str, proc: asyncio.subprocess.Process
) -> None:
    async with asyncio.timeout(30):
        while True:
            assert proc.returncode is None, "process exited early"
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(url) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.1)


@pytest.fixture
async def engines(tmp_path: Path) -> AsyncIterator[list[str]]:
    port = _free_ports(2)
    args = ["-m", "engine_sidecar", "sim", "--engines", "2", "--port", str(port),
            "--model", MODEL, "--time-scale", "2", "--output-len", "40,40"]  # fmt: skip
    async with _process(args, tmp_path / "sim.log") as proc, aiohttp.ClientSession() as http:
        urls = [f"http://127.0.0.1:{port + i}" for i in range(2)]
        for url in urls:
            await _wait_ready(http, url + "/health", proc)
        yield urls
        proc.send_signal(signal.SIGTERM)
        await proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["sigterm", "sighup"])
async def test_a_stop_signal_drains_open_streams_then_exits_zero(
    engines: list[str], tmp_path: Path, sig: signal.Signals
) -> None:
    port = _free_ports(1)
    config = tmp_path / "kvproxy.toml"
    engine_tables = "".join(
        f'[[pools.engines]]\nname = "e{i}"\nurl = "{url}"\n' for i, url in enumerate(engines)
    )
    config.write_text(
        f'[server]\nport = {port}\ndrain_timeout_s = 20\n\n[[pools]]\nname = "target"\n'
        f'model = "{MODEL}"\n{engine_tables}'
    )
    url = f"http://127.0.0.1:{port}"
    args = ["-m", "proxy", "serve", "--config", str(config)]
    async with _process(args, tmp_path / "proxy.log") as proxy, aiohttp.ClientSession() as http:
        await _wait_ready(http, url + "/ready", proxy)
        # About 3 s of stream: still open while the drain is observed below.
        body = {"model": MODEL, "prompt": "drain me", "max_tokens": 100, "ignore_eos": True,
                "stream": True}
        async with http.post(url + "/v1/completions", json=body) as stream:
            assert stream.status == 200
            received = await stream.content.readany()
            proxy.send_signal(sig)
            await _expect_refusing(http, url)
            received += await stream.content.read()
        assert received.endswith(b"data: [DONE]\n\n")
        assert _tokens(received) == 100  # every token arrived: nothing was cut
        async with asyncio.timeout(20):
            assert await proxy.wait() == 0
    log = (tmp_path / "proxy.log").read_text()
    assert "draining" in log


def _tokens(sse: bytes) -> int:
    events = [e.removeprefix(b"data: ") for e in sse.split(b"\n\n") if e]
    texts = [orjson.loads(e)["choices"][0]["text"] for e in events if e != b"[DONE]"]
    words: list[str] = "".join(str(t) for t in texts).split()
    return len(words)


async def _expect_refusing(http: aiohttp.ClientSession, url: str) -> None:
    """While the stream is still open: /ready fails and new work is refused with 503."""
    async with asyncio.timeout(5):
        while True:
            async with http.get(url + "/ready") as ready:
                if ready.status == 503:
                    break
            await asyncio.sleep(0.02)
    body = {"model": MODEL, "prompt": "late", "max_tokens": 2}
    async with http.post(url + "/v1/completions", json=body) as late:
        assert late.status == 503
        assert late.headers["X-Kvproxy-Shed-Reason"] == "draining"
