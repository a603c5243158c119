"""``kvproxy-sidecar vllm``: run one vLLM engine from a profile and serve its control surface.

Rules:
- Arguments override the profile, which overrides the built-in defaults.
- uvloop is chosen here and nowhere else.
- The adaptive speculation loop (``[speculation]``, see ``adaptive``) runs here, as a named task
  of this process, when the profile turns it on.
- SIGTERM/SIGINT drain: not ready at once, wait for the engine's requests (bounded), stop vLLM,
  exit 0. A second signal stops at once. A rollout in progress (the loop's, or one a
  ``POST /speculation`` runs in its handler) is abandoned by the supervisor, which starts no
  engine once stopping began; the pool lease is released after the engine is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shlex
import signal
import sys
from pathlib import Path

import aiohttp
import uvloop
from aiohttp import web

from engine_sidecar.vllm import adaptive
from engine_sidecar.vllm.profile import (
    Profile,
    ProfileError,
    build_command,
    build_env,
    describe,
    load_profile,
    registry_key_parts,
    resolve_python,
    with_overrides,
)
from engine_sidecar.vllm.registry import heartbeat, registry_key
from engine_sidecar.vllm.server import build_app
from engine_sidecar.vllm.supervisor import Supervisor

log = logging.getLogger("kvproxy.sidecar")
_REPO_ROOT = Path(__file__).resolve().parents[2]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", required=True, help="sidecar profile (TOML), see profiles/")
    parser.add_argument("--host", help="address the sidecar listens on")
    parser.add_argument("--port", type=int, help="port of the sidecar's /metrics, /ready")
    parser.add_argument("--vllm-host", help="address vLLM listens on")
    parser.add_argument("--vllm-port", type=int, help="port vLLM listens on")
    parser.add_argument("--advertise-host", help="host the proxy uses to reach vLLM")
    parser.add_argument("--python", help="interpreter that has vLLM installed "
                        "(default: $KVPROXY_VLLM_PYTHON, .venv-vllm, this interpreter)")
    parser.add_argument("--model", help="model path or name (overrides engine.model)")
    parser.add_argument("--served-model-name", help="name clients use (engine.served_model_name)")
    parser.add_argument("--redis-url", help="register the engine in Redis with a TTL heartbeat")
    parser.add_argument("--print-command", action="store_true",
                        help="print the vLLM command line and exit")
    parser.add_argument("--log-level", default="INFO")


def _profile_from(args: argparse.Namespace) -> Profile:
    profile = load_profile(args.profile, os.environ)
    return with_overrides(
        profile,
        engine={"model": args.model, "served_model_name": args.served_model_name},
        sidecar={"host": args.host, "port": args.port, "vllm_host": args.vllm_host,
                 "vllm_port": args.vllm_port, "advertise_host": args.advertise_host,
                 "python": args.python, "redis_url": args.redis_url},
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        profile = _profile_from(args)
        adaptive.settings_from(profile)
    except (ProfileError, OSError) as exc:
        print(f"kvproxy-sidecar vllm: {exc}", file=sys.stderr)
        return 2
    python = resolve_python(profile.sidecar.python, os.environ, _REPO_ROOT, sys.executable)
    cmd = build_command(profile, python)
    if args.print_command:
        # Quoted for a shell: a JSON --speculative-config or a path with a space pastes intact.
        print(shlex.join(cmd))
        return 0
    env = build_env(profile, os.environ)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(serve(profile, cmd, env))


async def serve(profile: Profile, cmd: list[str], env: dict[str, str]) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, stop)
    async with aiohttp.ClientSession() as session:
        sup = Supervisor(profile, cmd, env, session)
        built = adaptive.build(profile, sup, session)
        controller = built[0] if built else None
        runner = web.AppRunner(build_app(sup, controller), access_log=None)
        await runner.setup()
        side = profile.sidecar
        await web.TCPSite(runner, side.host, side.port).start()
        log.info("sidecar on http://%s:%d, engine %s", side.host, side.port, profile.engine_url)
        sup.start()
        beat = _start_heartbeat(profile, sup)
        loop_task = None if controller is None else asyncio.create_task(
            controller.run(), name="speculation-controller")
        try:
            await stop.wait()
            log.info("draining: waiting up to %.0f s for in-flight requests",
                     side.drain_timeout_s)
            await _stop_heartbeat(loop_task)
            await _drain(sup, beat)
        finally:
            # Also on the way out of an error: a registration must not outlive its sidecar's
            # wish to serve (the key's TTL is only the backstop for a killed process).
            await _stop_heartbeat(beat)
            await _stop_heartbeat(loop_task)
            await sup.close()
            if built is not None:
                await built[1].close()
            await runner.cleanup()
    return 0


def _on_signal(stop: asyncio.Event) -> None:
    if stop.is_set():
        log.warning("second signal: stopping at once")
        raise SystemExit(1)
    stop.set()


async def _drain(sup: Supervisor, beat: asyncio.Task[None] | None) -> None:
    await _stop_heartbeat(beat)
    await sup.drain_and_stop()


async def _stop_heartbeat(beat: asyncio.Task[None] | None) -> None:
    if beat is not None and not beat.done():
        beat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beat


def _start_heartbeat(profile: Profile, sup: Supervisor) -> asyncio.Task[None] | None:
    url = profile.sidecar.redis_url
    if not url:
        return None
    key = registry_key(*registry_key_parts(profile))

    def snapshot() -> dict[str, object]:
        state = sup.sidecar_state()
        return {**describe(sup.profile), "ready": state.ready, "draining": state.draining}

    return asyncio.create_task(heartbeat(url, key, snapshot, profile.sidecar.heartbeat_ttl_s),
                               name="sidecar-registry-heartbeat")
