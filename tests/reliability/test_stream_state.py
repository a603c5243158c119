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
