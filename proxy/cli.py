"""Command line: ``kvproxy serve`` and ``kvproxy demo``.

Rules: this is the only place that picks the event loop (uvloop) and configures logging. A bad
configuration stops start-up with exit status 2 and a message naming the field; a clean shutdown
after SIGTERM or Ctrl-C exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

import uvloop

from proxy.config import Config, load_config
from proxy.demo import run_demo
from proxy.errors import ConfigError
from proxy.lifecycle import run_server

EXIT_CONFIG = 2
EXIT_START = 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvproxy", description="KV-cache-aware OpenAI-compatible routing proxy for vLLM"
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the proxy from a TOML configuration")
    serve.add_argument("--config", metavar="FILE.toml", help="configuration file")
    _add_listen(serve, default_port=None)
    serve.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one setting (repeatable), e.g. --set routing.policy=least_load",
    )
    demo = sub.add_parser("demo", help="proxy plus simulated draft and target engines, one process")
    _add_listen(demo, default_port=8000)
    demo.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="simulated engines run this many times faster than real hardware (default 1)",
    )
    return parser


def _add_listen(parser: argparse.ArgumentParser, default_port: int | None) -> None:
    parser.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=default_port, help="port to listen on")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if args.command == "serve":
            return _run(run_server(_serve_config(args)))
        return _run(_demo(args))
    except ConfigError as exc:
        print(f"kvproxy: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as exc:
        # Most often the port is taken; a traceback would hide the one line that matters.
        print(f"kvproxy: cannot start: {exc}", file=sys.stderr)
        return EXIT_START


def _run(coro: Coroutine[Any, Any, None]) -> int:
    uvloop.run(coro)
    return 0


def _serve_config(args: argparse.Namespace) -> Config:
    overrides = list(args.overrides)
    if args.host is not None:
        overrides.append(f"server.host={args.host}")
    if args.port is not None:
        overrides.append(f"server.port={args.port}")
    cfg = load_config(args.config, os.environ, overrides)
    if not cfg.pools:
        raise ConfigError("pools", "no pools configured: add [[pools]] with engines to the file")
    return cfg


async def _demo(args: argparse.Namespace) -> None:
    await run_demo(host=args.host or "127.0.0.1", port=args.port, time_scale=args.time_scale)


if __name__ == "__main__":
    sys.exit(main())
