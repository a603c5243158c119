"""A request for a path (or method) the proxy does not serve leaves no reference cycle behind.

aiohttp answers such a request by raising an exception from a route that refers to itself: each
one left a cycle holding the whole request, which the served process's tuned collector (high
thresholds, ``gc.freeze``) frees only in rare full collections, so memory climbed with every 404.
"""

from __future__ import annotations

import gc

from aiohttp import web

from .stack import Stack

UNKNOWN = "/v1/nowhere"


async def test_unknown_paths_and_methods_are_answered_without_leaving_cycles(stack: Stack) -> None:
    async def stray(rounds: int) -> None:
        for i in range(rounds):
            async with stack.http.get(f"{stack.url}{UNKNOWN}/{i}") as resp:
                assert resp.status == 404
                assert (await resp.json())["error"]["code"] == "not_found"
            async with stack.http.get(stack.url + "/v1/chat/completions") as resp:
                assert resp.status == 405
                assert resp.headers["Allow"] == "POST"
                assert (await resp.json())["error"]["code"] == "method_not_allowed"

    await stray(2)  # first-use caches (routes, codecs) are not what this test looks for
    gc.collect()
    gc.disable()
    try:
        await stray(20)
        gc.set_debug(gc.DEBUG_SAVEALL)  # what the next collection finds unreachable, kept to see
        gc.collect()
        stray_requests = [
            o for o in gc.garbage
            if isinstance(o, web.BaseRequest)
            and (o.path.startswith(UNKNOWN) or o.path == "/v1/chat/completions")
        ]  # fmt: skip
        refusals = web.HTTPNotFound | web.HTTPMethodNotAllowed
        raised = [o for o in gc.garbage if isinstance(o, refusals)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        gc.collect()
    assert stray_requests == []
    assert raised == []
