"""``kvproxy demo`` end to end: the real command in a subprocess, driven with the openai SDK.

The demo picks its own free port (``--port 0``); the test learns the URL only from what the demo
prints, as a user would, and stops it with SIGTERM as a supervisor would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shlex
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import pytest

REPO = Path(__file__).resolve().parents[2]
START_DEADLINE_S = 30.0  # generous: the machine may be busy
STOP_DEADLINE_S = 20.0  # drain_timeout_s is 10 and nothing is open when SIGTERM arrives

_LISTEN = re.compile(r"proxy listening on (http://\S+)\s+\(OpenAI base URL: (http://\S+)\)")
_POOL = re.compile(r"^\s*pool (\S+)\s+model (\S+)\s+engines: (.+)$")
_ALIAS = re.compile(r"^\s*alias '([^']+)' -> (\S+) pool")
_CURL = re.compile(r"^\s*curl -N (http://\S+) ")


@dataclass
class Demo:
    proc: asyncio.subprocess.Process
    banner: list[str]
    url: str  # the proxy, e.g. http://127.0.0.1:41234
    base_url: str  # what the banner offers as the OpenAI base URL
    pools: dict[str, str]  # pool name -> model
    alias: str
    alias_pool: str
    curl_url: str
    curl_body: dict[str, object]


@pytest.fixture
async def demo(tmp_path: Path) -> AsyncIterator[Demo]:
    stderr_path = tmp_path / "demo.stderr"
    with stderr_path.open("wb") as stderr:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", "demo", "--port", "0", "--time-scale", "50",
            cwd=REPO, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
        )  # fmt: skip
    try:
        try:
            banner = await asyncio.wait_for(_read_banner(proc), START_DEADLINE_S)
        except (TimeoutError, EOFError) as exc:
            raise AssertionError(
                f"demo printed no complete banner ({exc!r}); stderr:\n{stderr_path.read_text()}"
            ) from None
        yield _parse(proc, banner)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _read_banner(proc: asyncio.subprocess.Process) -> list[str]:
    assert proc.stdout is not None
    lines: list[str] = []
    while True:
        raw = await proc.stdout.readline()
        if not raw:
            raise EOFError(f"stdout closed after {lines!r}")
        lines.append(raw.decode().rstrip("\n"))
        if lines[-1].startswith("Ctrl-C stops the demo"):
            return lines


def _parse(proc: asyncio.subprocess.Process, banner: list[str]) -> Demo:
    text = "\n".join(banner)
    listen = _LISTEN.search(text)
    assert listen is not None, text
    pools = {m[1]: m[2] for line in banner if (m := _POOL.match(line))}
    aliases = [m for line in banner if (m := _ALIAS.match(line))]
    assert len(aliases) == 1, text
    curls = [m for line in banner if (m := _CURL.match(line))]
    assert len(curls) == 1, text
    # The curl example spans two lines joined by a trailing backslash; read it as a shell would.
    start = next(i for i, line in enumerate(banner) if _CURL.match(line))
    command = shlex.split(banner[start].rstrip("\\") + " " + banner[start + 1])
    body = json.loads(command[command.index("-d") + 1])
    return Demo(
        proc=proc,
        banner=banner,
        url=listen[1],
        base_url=listen[2],
        pools=pools,
        alias=aliases[0][1],
        alias_pool=aliases[0][2],
        curl_url=curls[0][1],
        curl_body=body,
    )


async def _wait_ready(http: aiohttp.ClientSession, url: str) -> None:
    async with asyncio.timeout(START_DEADLINE_S):
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(url + "/ready") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.05)


async def _stream_chat(client: openai.AsyncOpenAI, model: str) -> tuple[str, str | None, str]:
    """(content, finish_reason, model named in the chunks) of one streamed chat completion."""
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hello!"}],
        max_tokens=16,
        stream=True,
    )
    parts: list[str] = []
    finish: str | None = None
    served = ""
    async with stream:
        async for chunk in stream:
            served = chunk.model
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
    return "".join(parts), finish, served


async def test_demo_serves_alias_and_draft_then_stops_on_sigterm(demo: Demo) -> None:
    # The banner describes the documented fleet: a draft and a target pool, a tiering alias.
    assert demo.url.startswith("http://127.0.0.1:")
    assert not demo.url.endswith(":0"), "the banner shows port 0, not the port actually bound"
    assert demo.base_url == demo.url + "/v1"
    assert set(demo.pools) == {"draft", "target"}
    assert demo.alias_pool == "target"
    # The printed curl example targets this proxy's chat endpoint and the printed alias.
    assert demo.curl_url == demo.url + "/v1/chat/completions"
    assert demo.curl_body["model"] == demo.alias
    assert demo.curl_body["stream"] is True

    async with aiohttp.ClientSession() as http:
        await _wait_ready(http, demo.url)
    client = openai.AsyncOpenAI(
        base_url=demo.base_url, api_key="sk-demo", max_retries=0, timeout=20.0
    )
    try:
        listed = {m.id: m for m in (await client.models.list()).data}
        assert set(listed) == {*demo.pools.values(), demo.alias}
        # An idle demo serves standard alias traffic from the target pool, and the draft model
        # from the draft pool; chunks name the engine's model (the proxy does not rewrite it).
        asked = {demo.alias: demo.pools["target"], demo.pools["draft"]: demo.pools["draft"]}
        for model, engine_model in asked.items():
            content, finish, served = await _stream_chat(client, model)
            assert content.strip(), f"no content streamed for {model!r}"
            assert finish in ("stop", "length"), (model, finish)
            assert served == engine_model, (model, served)
    finally:
        await client.close()

    demo.proc.send_signal(signal.SIGTERM)
    assert demo.proc.stdout is not None
    async with asyncio.timeout(STOP_DEADLINE_S):
        await demo.proc.stdout.read()  # to EOF, so the pipe never blocks the exiting process
        code = await demo.proc.wait()
    assert code == 0
