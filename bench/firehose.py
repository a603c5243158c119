"""A minimal OpenAI-shaped SSE source that streams as fast as it can, for the relay-rate test.

Usage: ``python -m bench.firehose --port P [--interval-ms MS]``. Every chat or completion
request gets ``max_tokens`` content events, one write each (as an engine emits one event per
token), optionally paced, then a usage event and ``[DONE]``. ``/metrics`` reports an idle vLLM
engine so a router scrapes it happily.

Rules: precomputed bytes, no per-event JSON encoding: the point is to find the router's limit,
not the source's.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import orjson
from aiohttp import web

_EVENT = (b'data: {"id":"chatcmpl-firehose","object":"chat.completion.chunk","created":0,'
          b'"model":"firehose","choices":[{"index":0,"delta":{"content":" tok"},'
          b'"finish_reason":null}]}\n\n')
_METRICS = """\
vllm:num_requests_running{model_name="firehose",engine="0"} 0
vllm:num_requests_waiting{model_name="firehose",engine="0"} 0
vllm:kv_cache_usage_perc{model_name="firehose",engine="0"} 0.0
vllm:prefix_cache_queries_total{model_name="firehose",engine="0"} 0
vllm:prefix_cache_hits_total{model_name="firehose",engine="0"} 0
vllm:cache_config_info{block_size="16",num_gpu_blocks="100000",engine="0"} 1
"""


async def _generate(request: web.Request) -> web.StreamResponse:
    body = orjson.loads(await request.read())
    count = int(body.get("max_tokens") or 16)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "X-Engine-Id": "firehose"})
    await resp.prepare(request)
    interval = request.app[INTERVAL]
    for _ in range(count):
        await resp.write(_EVENT)
        if interval > 0:
            await asyncio.sleep(interval)
    usage = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": count,
                                      "total_tokens": count + 1}}
    await resp.write(b"data: " + orjson.dumps(usage) + b"\n\ndata: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(text=_METRICS, content_type="text/plain")


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "firehose", "object": "model"}]})


INTERVAL = web.AppKey("interval", float)


def build_app(interval_s: float = 0.0) -> web.Application:
    app = web.Application()
    app[INTERVAL] = interval_s
    app.router.add_post("/v1/chat/completions", _generate)
    app.router.add_post("/v1/completions", _generate)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/health", _ok)
    app.router.add_get("/v1/models", _ok)
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.firehose")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--interval-ms", type=float, default=0.0,
                   help="pause between a stream's events (0: as fast as the socket takes them)")
    args = p.parse_args(argv)
    try:
        import uvloop  # noqa: PLC0415 - optional

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    web.run_app(build_app(args.interval_ms / 1000.0), host=args.host, port=args.port, print=None,
                access_log=None, loop=loop_factory() if loop_factory else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
