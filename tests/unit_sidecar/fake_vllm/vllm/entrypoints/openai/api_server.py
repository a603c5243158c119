"""A stand-in for vLLM's OpenAI server, for testing the sidecar's supervision without vLLM.

Accepts the flags the sidecar passes and serves /health, /v1/completions and /metrics with the
metric names vLLM uses. ``max_tokens`` >= 1000 makes a request take ``max_tokens / 1000`` seconds
so drain behaviour can be observed. Env FAKE_VLLM_CRASH_MARKER: if that file exists at start-up,
it is removed and the server exits with status 3 (a crash on first start). Env
FAKE_VLLM_START_LOG: a file each start appends its ``time.monotonic()`` to, before the crash check
(how far apart the supervisor's restarts were). Env FAKE_VLLM_CONTROL: a JSON file read at each
start, ``{"scheduled": how, "unscheduled": how}`` for a start whose ``--speculative-config`` has a
``num_speculative_tokens_per_batch_size`` or not, where ``how`` is "ok" (the default), "exit"
(status 4 at once) or seconds to wait before serving (a slow load). Like vLLM's engine core, a
child process runs beside the server; ``GET /child`` tells its pid.
"""

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

from aiohttp import web

state = {"running": 0, "requests": 0}


async def health(request):
    return web.Response(text="")


async def completions(request):
    body = await request.json()
    state["running"] += 1
    state["requests"] += 1
    try:
        if body.get("max_tokens", 1) >= 1000:
            await asyncio.sleep(body["max_tokens"] / 1000)
    finally:
        state["running"] -= 1
    return web.json_response({"object": "text_completion", "choices": [{"text": "ok"}]})


async def metrics(request):
    name = request.app["name"]
    n = state["requests"]
    labels = f'engine="0",model_name="{name}"'
    text = (
        f"vllm:num_requests_running{{{labels}}} {state['running']}.0\n"
        f"vllm:num_requests_waiting{{{labels}}} 0.0\n"
        f"vllm:kv_cache_usage_perc{{{labels}}} 0.0\n"
        f"vllm:spec_decode_num_drafts_total{{{labels}}} {10 * n}.0\n"
        f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {30 * n}.0\n"
        f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {18 * n}.0\n"
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="0"}} {8 * n}.0\n'
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="1"}} {6 * n}.0\n'
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="2"}} {4 * n}.0\n'
    )
    return web.Response(text=text)


async def child(request):
    return web.json_response({"pid": request.app["child"].pid})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--served-model-name", default="fake")
    parser.add_argument("--speculative-config", default="{}")
    args, _ = parser.parse_known_args()
    if start_log := os.environ.get("FAKE_VLLM_START_LOG"):
        with open(start_log, "a") as f:
            f.write(f"{time.monotonic()}\n")
    marker = os.environ.get("FAKE_VLLM_CRASH_MARKER")
    if marker and os.path.exists(marker):
        os.remove(marker)
        sys.exit(3)
    if control := os.environ.get("FAKE_VLLM_CONTROL"):
        with open(control) as f:
            ways = json.load(f)
        scheduled = "num_speculative_tokens_per_batch_size" in json.loads(args.speculative_config)
        how = ways.get("scheduled" if scheduled else "unscheduled", "ok")
        if how == "exit":
            sys.exit(4)
        if how != "ok":
            time.sleep(float(how))
    app = web.Application()
    app["name"] = args.served_model_name
    app["child"] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    app.router.add_get("/child", child)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", metrics)
    # Like vLLM, a stopped server ends what still runs rather than finishing it.
    web.run_app(app, host=args.host, port=args.port, print=None, shutdown_timeout=0.1)


main()
