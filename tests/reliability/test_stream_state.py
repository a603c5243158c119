"""What an open stream keeps alive: only what the relay still needs. Everything kept is scanned by
the garbage collector as long as the stream is open (``bench.perstream``), so the parsed request,
routing's objects and generator-based context managers must be gone once the bytes flow."""

from __future__ import annotations

import asyncio
import gc
from types import CoroutineType, GeneratorType

import aiohttp

from proxy.core.inbound import Inbound
from proxy.server.splice import Splice

from .rogue import RogueEngine
from .shell import CHAT, chat, proxy_for

# Frames that would mean a per-stream level of nesting or a generator context manager is back.
_GONE = {"track", "cuttable", "_answer", "chat_completions", "completions"}


def _alive(kind: type) -> list[object]:
    return [o for o in gc.get_objects() if type(o) is kind]


def _frames() -> set[str]:
    names = {o.cr_code.co_name for o in gc.get_objects() if isinstance(o, CoroutineType)}
    return names | {o.gi_code.co_name for o in gc.get_objects() if isinstance(o, GeneratorType)}


async def test_an_open_stream_keeps_no_request_parse_nor_routing_state(rogue: RogueEngine) -> None:
    rogue.behaviour.tokens = 6
    rogue.behaviour.chunk_delay_s = 0.5  # the stream stays open while the test looks
    async with proxy_for(rogue) as proxy, aiohttp.ClientSession() as http, http.post(
        proxy.url + CHAT, json=chat(stream=True)
    ) as resp:
        assert resp.status == 200
        async with asyncio.timeout(5):
            await resp.content.readany()  # past the first byte: the splice runs
        gc.collect()
        assert len(_alive(Splice)) == 1  # the stream is open: the check below sees its state
        assert _alive(Inbound) == []
        assert _frames() & _GONE == set()
        assert "_relay" in _frames()  # and the relay's own frames are seen by this check
        async with asyncio.timeout(10):
            await resp.read()
        await asyncio.sleep(0.05)  # the relay's own ending has run
        gc.collect()
        # The engine connection is back in the pool, holding its last body reader: that reader
        # must not keep the ended stream's splice (and through it the client's connection) alive.
        assert _alive(Splice) == []


def _bodies_with(content: str) -> list[dict[str, object]]:
    """The proxy's parsed chat bodies alive whose first message is ``content`` (the message dicts
    hold only strings, so the collector does not track them; the body and its list it does). The
    rogue engine's own parse of what the proxy sent is left out: it has the ``stream_options``
    the proxy adds to ask for usage, which the client's body has not."""
    found = []
    for o in gc.get_objects():
        if type(o) is not dict or "stream_options" in o:
            continue
        if isinstance(messages := o.get("messages"), list) and messages:
            first = messages[0]
            if isinstance(first, dict) and first.get("content") == content:
                found.append(o)
    return found


async def test_an_open_stream_keeps_no_parsed_body(rogue: RogueEngine) -> None:
    """The front door's visit (and the cache fill it hands the relay) live as long as the stream;
    neither keeps the parsed body, which holds the whole prompt."""
    rogue.behaviour.tokens = 6
    rogue.behaviour.chunk_delay_s = 0.5
    prompt = "a prompt held by nobody once the bytes flow " * 50
    async with proxy_for(rogue) as proxy, aiohttp.ClientSession() as http, http.post(
        proxy.url + CHAT, json=chat(prompt, stream=True, temperature=0)
    ) as resp:
        assert resp.status == 200
        assert resp.headers.get("X-Cache") == "MISS"  # a fill is recording this stream
        async with asyncio.timeout(5):
            await resp.content.readany()
        gc.collect()
        assert len(_alive(Splice)) == 1
        assert _bodies_with(prompt) == []
        async with asyncio.timeout(10):
            await resp.read()
